// Regenerates kvtiny_reference.json with HF tokenizers, the reference implementation:
// with the npm package tokenizers@0.23.2 installed (NODE_PATH=.../node_modules), from the repo root:
//   node tests/data/tokenizer/gen_kvtiny_reference.js tests/data/tokenizer/kvtiny_reference.json
const {Tokenizer}=require('tokenizers');
const fs=require('fs');
const t=Tokenizer.fromFile('models/kvtiny/tokenizer.json');
const texts=[
 "Hello, World! It's 2024-06-01T12:34:56Z.",
 "I'M HERE, YOU'LL SEE, WE'VE DONE, SHE'D, THEY'RE, IT'S, don't, can't",
 "  leading and trailing spaces  ",
 "tabs\t\tand\nnewlines\r\n\r\nwindows \n \n",
 "\n\n\n", "   ", " ", "a", "",
 "x = [1, 2, 3]\nfor i in range(10):\n    print(i ** 2)  # comment\n\treturn {'k': None}\n",
 "naïve café — “quotes” … ½ ² ³ ① Ⅻ ٣٤٥",
 "日本語のテキスト、中文文本。한국어 텍스트",
 "emoji 🎉🎉 👨‍👩‍👧 flags 🇫🇷 ✓✓",
 "combining e\u0301 a\u0308 NBSP\u00a0here ideographic\u3000space zero\u200bwidth em\u2003space",
 "<|bos|>inside<|eos|> and <|pad|><|pad|> and <|bos without close |> <|eos|",
 "Ελληνικά Русский текст العربية עברית हिन्दी",
 "$100.00 + 50% = ???!!! ...--- *** ``` ~~~ ###",
 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
 " ".repeat(40) + "x" + " ".repeat(17) + "\n" + " ".repeat(9),
];
// Seeded random mixes of the categories the pre-tokenizer regex distinguishes.
let seed = 12345;
const rnd = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
const parts = [..."abcXYZ019 '\t\n\r.,!?-_()[]{}\"", "  ","   ","\n\n"," \n","\r\n","'s","'S","'LL","'ve",
  "'Re","don't","I'M"," 's", ..."ünïcødé✓日本語🎉\u00a0\u3000\u2003\u0301\u200b€£¥αβγДЖ٣٤", "<|bos|>","<|eos|>",
  "<|bos","|>"];
for (let k = 0; k < 12; ++k) {
  let s = "";
  for (let i = 0; i < 250; ++i) s += parts[Math.floor(rnd() * parts.length)];
  texts.push(s);
}
(async () => {
  const cases = [];
  for (const text of texts) {
    const e = await t.encode(text, null, {addSpecialTokens: false});
    cases.push({text, ids: e.getIds()});
  }
  const note = "Reference ids (no BOS, special tokens parsed) from HF tokenizers 0.23.2 for models/kvtiny/tokenizer.json";
  const body = cases.map(c => JSON.stringify(c)).join(",\n  ");
  fs.writeFileSync(process.argv[2], `{"note": ${JSON.stringify(note)},\n "cases": [\n  ${body}\n ]}\n`);
})();

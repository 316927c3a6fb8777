// Prints the peer table (markdown) from the JSON bench/peers/run.sh wrote.
// usage: node table.mjs OUT_DIR MODEL "THREADS"
import {readFileSync} from "node:fs";
import {basename} from "node:path";

const [dir, model, threadsArg] = process.argv.slice(2);
const read = (f) => JSON.parse(readFileSync(`${dir}/${f}`, "utf8"));
const lines = (f) => readFileSync(`${dir}/${f}`, "utf8").split("\n").filter(Boolean).map(JSON.parse);
const fmt = (x, d = 1) => (x === undefined || x === null ? "-" : x.toFixed(d));
const sci = (x) => (x === 0 ? "0" : x < 1e-2 ? x.toExponential(1) : x.toPrecision(2));
const out = [];

out.push(`Model \`${basename(model)}\`, KV cache f16 on both sides for speed and greedy.`, "");
out.push("| threads | measure | llama.cpp | Cachet | Cachet / llama.cpp |");
out.push("| ---: | --- | ---: | ---: | ---: |");
const median = (v) => {
  const s = [...v].sort((a, b) => a - b), n = s.length;
  return n % 2 ? s[(n - 1) / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
};
let rounds = 0, nDecode = 0;
for (const t of threadsArg.trim().split(/\s+/)) {
  const l = lines(`llama_speed_t${t}.jsonl`);
  const c = lines(`cachet_speed_t${t}.jsonl`);
  rounds = l.length;
  nDecode = c[0].n_decode;
  // Medians over rounds; the ratio is the median of the rounds' ratios.
  const row = (name, get, d = 1) => {
    const a = l.map(get), b = c.map(get);
    const ratio = median(a.map((x, i) => b[i] / x));
    out.push(`| ${t} | ${name} | ${fmt(median(a), d)} | ${fmt(median(b), d)} | ${fmt(ratio, 2)} |`);
  };
  for (const n of ["512", "4096"]) row(`prefill ${n} tokens, tok/s`, (r) => r.prefill_tok_s[n]);
  for (const n of ["512", "4096"]) row(`decode at ${n} context, tok/s`, (r) => r.decode_tok_s[n]);
  row("peak RSS, MiB", (r) => r.peak_rss_bytes / 2 ** 20);
}
out.push("", `Speed: ${rounds} rounds alternating the engines; medians over rounds, ratio = median of`,
         `the rounds' ratios; decode = ${nDecode} tokens after the prefill.`);

out.push("", "| prompt tokens | same prompt ids | greedy tokens equal | first difference at |");
out.push("| ---: | --- | ---: | ---: |");
for (const g of lines("greedy.jsonl")) {
  const a = g.cachet.completion, b = g.llama.completion;
  const n = Math.max(a.length, b.length);
  let same = 0, first = -1;
  for (let i = 0; i < n; ++i) {
    if (a[i] === b[i]) ++same;
    else if (first < 0) first = i;
  }
  const ids = JSON.stringify(g.cachet.prompt) === JSON.stringify(g.llama.prompt);
  out.push(`| ${g.cachet.prompt.length} | ${ids ? "yes" : "no"} | ${same} / ${n} | ${first < 0 ? "-" : first} |`);
}

const llama = read("llama_kl.json");
const llamaBits = {f16: 16, q8_0: 8.5, q4_0: 4.5};
out.push("", `KV fidelity on ${llama.windows} text windows (identical token ids): KL of next-token`,
         "distributions against each engine's own f32-KV run of the same GGUF.", "");
out.push("| engine | KV (K:V) | bits/value | mean KL | p99 KL | top-1 agree | PPL |");
out.push("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
for (const [type, s] of Object.entries(llama.kl)) {
  out.push(`| llama.cpp | ${type} | ${llamaBits[type] ?? "-"} | ${sci(s.mean_kl)} | ${sci(s.p99_kl)} | ${fmt(s.top1_agree, 4)} | ${fmt(s.ppl, 3)} |`);
}
for (const [file, pages] of [["cachet_kl.jsonl", ""], ["cachet_kl_pt64.jsonl", ", 64-token pages"]]) {
  const kl = lines(file).filter((r) => r.status === "ok");
  const f32 = kl.find((r) => r.codec_k === "f32" && r.codec_v === "f32");
  // Bits per value from the bytes Cachet's pool holds (positions included), relative to f32.
  const bits = (r) => (f32 ? (32.25 * r.kv_bytes_prefill) / f32.kv_bytes_prefill : null);
  for (const r of kl) {
    if (r === f32) continue;
    const name = (r.codec_k === r.codec_v ? r.codec_k : `${r.codec_k}:${r.codec_v}`) + pages;
    out.push(`| Cachet | ${name} | ${fmt(bits(r), 2)} | ${sci(r.mean_kl)} | ${sci(r.p99_kl)} | ${fmt(r.top1_agree, 4)} | ${fmt(r.ppl, 3)} |`);
  }
}
out.push("", "Cachet's bits/value count every byte of its pages, the int32 token positions included (+0.25).");
console.log(out.join("\n"));

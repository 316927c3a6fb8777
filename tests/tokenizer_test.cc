#include "cachet/tokenizer.h"

#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

namespace cachet {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;

std::string ReadFile(const std::string& path, size_t max_bytes = std::string::npos) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str().substr(0, max_bytes);
}

void WriteFile(const fs::path& path, std::string_view text) {
  std::ofstream f(path, std::ios::binary);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (int k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

// A fresh directory under the system temp dir, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("cachet_tok_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

class TokenizerKvtiny : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto r = Tokenizer::Load(CACHET_SOURCE_DIR "/models/kvtiny");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    tok_ = std::move(r).value().release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  static const Tokenizer* tok_;
};
const Tokenizer* TokenizerKvtiny::tok_ = nullptr;

TEST_F(TokenizerKvtiny, LoadsVocabAndSpecialIds) {
  EXPECT_EQ(tok_->kind(), "bpe");
  EXPECT_EQ(tok_->vocab_size(), 8192);
  EXPECT_EQ(tok_->bos_id(), 0);
  EXPECT_EQ(tok_->eos_id(), 1);
  EXPECT_TRUE(tok_->add_bos());
  EXPECT_TRUE(tok_->IsSpecial(0));
  EXPECT_TRUE(tok_->IsSpecial(2));
  EXPECT_FALSE(tok_->IsSpecial(3));
  EXPECT_EQ(tok_->TokenBytes(0), "<|bos|>");
  EXPECT_EQ(tok_->TokenBytes(268), " the");  // "Ġthe" in the byte-level alphabet
  EXPECT_EQ(tok_->TokenBytes(223), " ");
  EXPECT_EQ(tok_->TokenBytes(-1), "");
  EXPECT_EQ(tok_->TokenBytes(8192), "");
}

TEST_F(TokenizerKvtiny, MatchesGoldenIds) {
  const json golden = json::parse(ReadFile(CACHET_TEST_DATA_DIR "/golden.json"));
  int text_cases = 0;
  for (const json& c : golden.at("cases")) {
    const Ids ids = c.at("ids").get<Ids>();
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids[0], tok_->bos_id());
    const Ids body(ids.begin() + 1, ids.end());
    const std::string decoded = tok_->Decode(body);
    if (c.at("kind") == "text") {
      ++text_cases;
      const std::string text = c.at("text").get<std::string>();
      EXPECT_EQ(tok_->EncodePrompt(text), ids) << text;
      EXPECT_EQ(decoded, text);
    } else {
      // Prompts built from a template: each word of the answer is readable in the decoded text.
      std::istringstream answer(c.at("answer").get<std::string>());
      for (std::string word; answer >> word;) {
        EXPECT_NE(decoded.find(word), std::string::npos) << c.at("kind") << ": " << word;
      }
    }
  }
  EXPECT_EQ(text_cases, 3);
}

// Ids from HF tokenizers (the reference implementation) for tricky whitespace, contractions,
// scripts, emoji, and special tokens embedded in text.
TEST_F(TokenizerKvtiny, MatchesReferenceImplementation) {
  const json ref = json::parse(ReadFile(CACHET_TEST_DATA_DIR "/tokenizer/kvtiny_reference.json"));
  ASSERT_GE(ref.at("cases").size(), 20u);
  for (const json& c : ref.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    EXPECT_EQ(tok_->Encode(text), c.at("ids").get<Ids>()) << text;
  }
}

TEST_F(TokenizerKvtiny, KnownPieces) {
  EXPECT_EQ(tok_->Encode("In the beginning God created"), (Ids{806, 268, 4160, 856, 1847}));
  // The Llama-3-style regex splits numbers into single digits.
  const Ids digits = tok_->Encode("1234567890");
  ASSERT_EQ(digits.size(), 10u);
  for (int i = 0; i < 10; ++i)
    EXPECT_EQ(tok_->TokenBytes(digits[i]), std::string(1, "1234567890"[i]));
  EXPECT_EQ(tok_->Encode(" the").size(), 1u);
  EXPECT_EQ(tok_->Encode("").size(), 0u);
  EXPECT_EQ(tok_->EncodePrompt(""), Ids{0});
}

TEST_F(TokenizerKvtiny, RoundTripsHaystackCorpus) {
  for (const char* name : {"bible", "pydocs", "fortunes"}) {
    const std::string text =
        ReadFile(std::string(CACHET_SOURCE_DIR "/data/haystack/") + name + ".txt", 100 << 10);
    ASSERT_GT(text.size(), 50000u) << name;
    const auto start = std::chrono::steady_clock::now();
    const Ids ids = tok_->Encode(text);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(tok_->Decode(ids) == text) << name;
    // An 8k-vocab English BPE averages a few bytes per token.
    const double bytes_per_token = static_cast<double>(text.size()) / ids.size();
    EXPECT_GT(bytes_per_token, 2.5) << name;
    EXPECT_LT(bytes_per_token, 6.0) << name;
    for (int32_t id : ids) ASSERT_FALSE(tok_->IsSpecial(id)) << name;
    std::printf("[ %s: %zu bytes -> %zu tokens, %.1f MB/s (first encode) ]\n", name, text.size(),
                ids.size(), text.size() / secs / 1e6);
  }
}

TEST_F(TokenizerKvtiny, ParsesSpecialTokensOnlyWhenAsked) {
  const std::string text = "<|bos|>hello<|eos|>";
  const Ids with = tok_->Encode(text, /*parse_special=*/true);
  ASSERT_GE(with.size(), 3u);
  EXPECT_EQ(with.front(), 0);
  EXPECT_EQ(with.back(), 1);
  EXPECT_EQ(Ids(with.begin() + 1, with.end() - 1), tok_->Encode("hello"));
  const Ids without = tok_->Encode(text, /*parse_special=*/false);
  for (int32_t id : without) {
    EXPECT_NE(id, 0);
    EXPECT_NE(id, 1);
  }
  EXPECT_EQ(tok_->Decode(without), text);
  EXPECT_EQ(tok_->Decode(with), text);
  EXPECT_EQ(tok_->EncodePrompt("hi<|eos|>").back(), 1);
}

TEST_F(TokenizerKvtiny, InvalidUtf8RoundTrips) {
  std::vector<std::string> inputs = {"\xff\xfe abc \xc3",
                                     "\xc3",
                                     "a\xe2\x82",
                                     "\xed\xa0\x80 surrogate",
                                     "over\xc0\xaflong",
                                     "\xf4\x90\x80\x80",
                                     "ok \xf0\x9f\x8e\x89 \x80\x80x",
                                     std::string("nul\0byte", 8)};
  std::mt19937 rng(42);
  for (int k = 0; k < 50; ++k) {
    std::string s(rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    inputs.push_back(s);
  }
  for (const std::string& s : inputs) {
    const Ids ids = tok_->Encode(s);
    EXPECT_TRUE(tok_->Decode(ids) == s);
  }
}

TEST_F(TokenizerKvtiny, ConcurrentEncodesAgree) {
  const std::string text = ReadFile(CACHET_SOURCE_DIR "/data/haystack/fortunes.txt", 20 << 10);
  auto fresh = Tokenizer::Load(CACHET_SOURCE_DIR "/models/kvtiny");  // cold piece cache
  ASSERT_TRUE(fresh.ok());
  const Ids want = tok_->Encode(text);
  std::vector<Ids> got(4);
  std::vector<std::thread> threads;
  for (Ids& ids : got) threads.emplace_back([&] { ids = fresh.value()->Encode(text); });
  for (std::thread& t : threads) t.join();
  for (const Ids& ids : got) EXPECT_TRUE(ids == want);
}

TEST_F(TokenizerKvtiny, StreamDecoderEmitsWholeCharacters) {
  const std::string text = "ünïcødé ✓ 日本語 🎉 done";
  const Ids ids = tok_->Encode(text);
  StreamDecoder stream(*tok_);
  std::string out;
  int held_back = 0;
  for (int32_t id : ids) {
    const std::string chunk = stream.Push(id);
    EXPECT_TRUE(IsValidUtf8(chunk)) << chunk;
    if (chunk.size() < tok_->TokenBytes(id).size()) ++held_back;
    out += chunk;
  }
  out += stream.Flush();
  EXPECT_EQ(out, text);
  EXPECT_GT(held_back, 0);  // the text does split characters across tokens
}

TEST_F(TokenizerKvtiny, StreamDecoderReplacesInvalidBytes) {
  StreamDecoder stream(*tok_);
  std::string out;
  for (int32_t id : tok_->Encode("a\xff"
                                 "b\xe2\x82"))
    out += stream.Push(id);
  EXPECT_EQ(out,
            "a\xEF\xBF\xBD"
            "b");  // the truncated "\xe2\x82" is held back
  EXPECT_EQ(stream.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.Flush(), "");
}

// A GPT-2-style tokenizer: ByteLevel with the built-in regex and add_prefix_space, BOS taken
// from the TemplateProcessing post-processor. Expected ids are worked out from the merge ranks.
constexpr char kGpt2Json[] = R"({
  "version": "1.0",
  "added_tokens": [{"id": 20, "content": "<|endoftext|>", "special": true, "lstrip": false,
                    "rstrip": false, "normalized": false, "single_word": false}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": {"type": "TemplateProcessing",
                     "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                {"Sequence": {"id": "A", "type_id": 0}}],
                     "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                     "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [20],
                                                           "tokens": ["<|endoftext|>"]}}},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "byte_fallback": false,
    "vocab": {"!": 0, "'": 1, "d": 2, "e": 3, "h": 4, "l": 5, "o": 6, "r": 7, "s": 8, "w": 9,
              "Ġ": 10, "he": 11, "ll": 12, "hell": 13, "hello": 14, "Ġh": 15, "Ġw": 16,
              "or": 17, "Ġwor": 18, "'s": 19, "<|endoftext|>": 20},
    "merges": ["h e", "l l", "Ġ w", "o r", "he ll", "' s", "hell o", "Ġ h", "Ġw or"]
  }
})";

TEST(TokenizerGpt2Style, ByteLevelRegexAndPrefixSpace) {
  TempDir dir;
  WriteFile(dir.path() / "tokenizer.json", kGpt2Json);
  auto r = Tokenizer::Load(dir.path().string());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Tokenizer& tok = *r.value();
  EXPECT_EQ(tok.vocab_size(), 21);
  EXPECT_EQ(tok.bos_id(), 20);
  EXPECT_TRUE(tok.add_bos());
  EXPECT_EQ(tok.eos_id(), -1);
  // " hello" | " world" | "'s" | "!": "h e" (rank 0) beats "Ġ h" (rank 7), so Ġ stays alone.
  EXPECT_EQ(tok.Encode("hello world's!"), (Ids{10, 14, 18, 5, 2, 19, 0}));
  EXPECT_EQ(tok.EncodePrompt("hello world's!"), (Ids{20, 10, 14, 18, 5, 2, 19, 0}));
  EXPECT_EQ(tok.Encode(" hello"), (Ids{10, 14}));  // already starts with a space
  // The prefix space is added to each stretch of text between special tokens.
  EXPECT_EQ(tok.Encode("hello<|endoftext|> world"), (Ids{10, 14, 20, 18, 5, 2}));
  // Bytes with no token (é) are dropped, as the reference does without unk/byte_fallback.
  EXPECT_EQ(tok.Encode("h\xc3\xa9llo"), (Ids{15, 12, 6}));
  EXPECT_EQ(tok.TokenBytes(10), " ");
  EXPECT_EQ(tok.TokenBytes(18), " wor");
  EXPECT_EQ(tok.Decode(Ids{10, 14, 18, 5, 2, 19, 0}), " hello world's!");
  EXPECT_TRUE(tok.IsSpecial(20));
  std::mt19937 rng(7);  // arbitrary bytes through the GPT-2 regex: no crash, ids in range
  for (int k = 0; k < 20; ++k) {
    std::string s(rng() % 200, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    for (int32_t id : tok.Encode(s)) ASSERT_TRUE(id >= 0 && id < tok.vocab_size());
  }
}

constexpr char kByteFallbackJson[] = R"({
  "added_tokens": [{"id": 0, "content": "<unk>", "special": true}],
  "normalizer": null,
  "pre_tokenizer": null,
  "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
  "model": {
    "type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
    "vocab": {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "h": 3, "e": 4, "l": 5, "o": 6, "he": 7,
              "ll": 8, "llo": 9, " ": 10, "<0x21>": 11},
    "merges": [["h", "e"], ["l", "l"], ["ll", "o"]]
  }
})";

TEST(TokenizerByteFallback, UnknownCharactersBecomeByteTokens) {
  TempDir dir;
  WriteFile(dir.path() / "tokenizer.json", kByteFallbackJson);
  auto r = Tokenizer::FromHfJson(dir.file("tokenizer.json"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Tokenizer& tok = *r.value();
  EXPECT_EQ(tok.Encode("hello\xc3\xa9"), (Ids{7, 9, 1, 2}));  // é -> <0xC3><0xA9>
  EXPECT_EQ(tok.Encode("hello \xc3\xa9!"), (Ids{7, 9, 10, 1, 2, 11}));
  EXPECT_EQ(tok.Encode("hiii"), (Ids{3, 0}));  // no byte token for 'i': fused <unk>
  EXPECT_EQ(tok.TokenBytes(1), "\xc3");
  EXPECT_EQ(tok.Decode(Ids{7, 9, 10, 1, 2, 11}), "hello \xc3\xa9!");
  EXPECT_EQ(tok.bos_id(), -1);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_TRUE(tok.IsSpecial(0));
}

// Loads `text` as dir/tokenizer.json and returns the error message (empty if it loaded).
std::string LoadError(const TempDir& dir, std::string_view text) {
  WriteFile(dir.path() / "tokenizer.json", text);
  auto r = Tokenizer::FromHfJson(dir.file("tokenizer.json"));
  return r.ok() ? std::string() : r.status().message();
}

TEST(TokenizerErrors, NameTheFileAndJsonPath) {
  TempDir dir;
  const std::string file = dir.file("tokenizer.json");
  std::string m = LoadError(dir, R"({"model": {"type": "BPE", "vocab": )");
  EXPECT_NE(m.find(file), std::string::npos) << m;
  EXPECT_NE(m.find("malformed JSON"), std::string::npos) << m;

  m = LoadError(dir, R"({"version": "1.0", "pre_tokenizer": null})");
  EXPECT_NE(m.find(file + ": model: missing"), std::string::npos) << m;

  m = LoadError(dir, R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "ByteLevel"}, {"type": "Metaspace", "replacement": "_"}]},
      "model": {"type": "BPE", "vocab": {}, "merges": []}})");
  EXPECT_NE(m.find(file + ": pre_tokenizer.pretokenizers[1].type: unsupported 'Metaspace'"),
            std::string::npos)
      << m;

  m = LoadError(dir, R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "ByteLevel"}, {"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated"}]},
      "model": {"type": "BPE", "vocab": {}, "merges": []}})");
  EXPECT_NE(m.find("pre_tokenizer.pretokenizers[1].type: unsupported 'Split after ByteLevel'"),
            std::string::npos)
      << m;

  m = LoadError(dir, R"({"model": {"type": "BPE", "vocab": [], "merges": []}})");
  EXPECT_NE(m.find("model.vocab: expected an object, got array"), std::string::npos) << m;
  m = LoadError(dir, R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})");
  EXPECT_NE(m.find("model.vocab[\"a\"]"), std::string::npos) << m;
  m = LoadError(dir, R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})");
  EXPECT_NE(m.find("model.merges[0]"), std::string::npos) << m;
  m = LoadError(dir, R"({"model": {"type": "Unigram", "vocab": []}})");
  EXPECT_NE(m.find("model.type: unsupported 'Unigram'"), std::string::npos) << m;
  m = LoadError(dir, R"({"normalizer": {"type": "NFKC"}, "model": {"vocab": {}, "merges": []}})");
  EXPECT_NE(m.find("normalizer.type: unsupported 'NFKC'"), std::string::npos) << m;
  m = LoadError(dir, R"({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a"},
      "behavior": "Isolated"}, "model": {"vocab": {}, "merges": []}})");
  EXPECT_NE(m.find("pre_tokenizer.pattern.Regex: bad regex"), std::string::npos) << m;
  m = LoadError(dir, "[1, 2]");
  EXPECT_NE(m.find(file), std::string::npos) << m;
  m = LoadError(dir, "");
  EXPECT_NE(m.find(file), std::string::npos) << m;

  // A bad tokenizer_config.json is named too.
  WriteFile(dir.path() / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  m = LoadError(dir, R"({"model": {"vocab": {"a": 0}, "merges": []}})");
  EXPECT_NE(m.find(dir.file("tokenizer_config.json") + ": bos_token"), std::string::npos) << m;
}

// Nesting and step counts a file could use to recurse the loader or the encoder off the stack (a
// few MB of JSON crashed them) are errors that name the JSON path; values shown in errors are cut
// short instead of dumped whole (json::dump recursed as deep as the value).
TEST(TokenizerErrors, DeepOrLongStructuresAreErrorsNotCrashes) {
  TempDir dir;
  const std::string file = dir.file("tokenizer.json");
  const std::string model = R"("model": {"vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]})";
  constexpr int kDeep = 200000;  // far beyond any stack when each level takes a frame
  auto nest = [](const std::string& open, const std::string& leaf, const std::string& close) {
    std::string s;
    s.reserve((open.size() + close.size()) * kDeep + leaf.size());
    for (int i = 0; i < kDeep; ++i) s += open;
    s += leaf;
    for (int i = 0; i < kDeep; ++i) s += close;
    return s;
  };

  std::string m = LoadError(
      dir, "{" + model + R"(, "decoder": )" +
               nest(R"({"type": "Sequence", "decoders": [)", R"({"type": "Fuse"})", "]}") + "}");
  EXPECT_NE(m.find(file + ": decoder.decoders[0]"), std::string::npos) << m;
  EXPECT_NE(m.find("nested more than 8 levels"), std::string::npos) << m;

  m = LoadError(dir, "{" + model + R"(, "pre_tokenizer": )" +
                         nest(R"({"type": "Sequence", "pretokenizers": [)",
                              R"({"type": "ByteLevel"})", "]}") +
                         "}");
  EXPECT_NE(m.find(file + ": pre_tokenizer.pretokenizers[0]"), std::string::npos) << m;
  EXPECT_NE(m.find("nested more than 8 levels"), std::string::npos) << m;

  // Flat, but one recursion level per step when encoding.
  std::string steps;
  for (int i = 0; i < 100000; ++i) {
    steps += std::string(i ? "," : "") +
             R"({"type": "Split", "pattern": {"String": "x"}, "behavior": "Isolated"})";
  }
  m = LoadError(dir, "{" + model + R"(, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" +
                         steps + "]}}");
  EXPECT_NE(m.find(file + ": pre_tokenizer.pretokenizers[64]: more than 64 pre-tokenizer steps"),
            std::string::npos)
      << m;

  // A post_processor nested too deep is ignored like any other it does not know: no BOS.
  WriteFile(dir.path() / "tokenizer.json",
            "{" + model + R"(, "post_processor": )" +
                nest(R"({"type": "Sequence", "processors": [)", R"({"type": "ByteLevel"})", "]}") +
                "}");
  auto r = Tokenizer::FromHfJson(file);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r.value()->bos_id(), -1);
  EXPECT_EQ(r.value()->Encode("ab"), (Ids{2}));

  // Values shown in errors.
  m = LoadError(dir, R"({"model": {"vocab": {"a": )" + nest("[", "", "]") + R"(}, "merges": []}})");
  EXPECT_NE(
      m.find(file + ": model.vocab[\"a\"]: expected a token id in [0, 2^24), got [[[[...]]]]"),
      std::string::npos)
      << m;
  m = LoadError(dir, R"({"model": {"vocab": {"a": 0}, "merges": [)" + nest("[", "1", "]") + "]}}");
  EXPECT_NE(m.find(file + ": model.merges[0]: expected \"left right\" or [left, right], got [[["),
            std::string::npos)
      << m;
  m = LoadError(dir, R"({"model": {"vocab": {"a": 0}, "merges": [[")" + std::string(100000, 'a') +
                         R"(", 5]]}})");
  EXPECT_NE(m.find("model.merges[0]"), std::string::npos) << m;
  EXPECT_LT(m.size(), 1000u) << "an error message as long as the value";
}

TEST(TokenizerErrors, MissingFiles) {
  TempDir dir;
  auto r = Tokenizer::Load(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(dir.path().string()), std::string::npos);
  EXPECT_EQ(Tokenizer::FromHfJson(dir.file("none.json")).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Tokenizer::FromSentencePiece(dir.file("none.model")).status().code(),
            StatusCode::kNotFound);
  WriteFile(dir.path() / "tokenizer.model", "not a protobuf");
  r = Tokenizer::Load(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(dir.file("tokenizer.model")), std::string::npos);
}

// Split steps with every behaviour, and a String pattern, against the reference's semantics.
TEST(TokenizerSplit, Behaviours) {
  TempDir dir;
  auto load = [&](const std::string& split) {
    // Character-level vocab without merges: ids show exactly how the text was split, since
    // each piece becomes its characters (and "ab" only when a piece is exactly "a" + "b").
    const std::string text = R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" +
                             split + R"(]}, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1,
        "-": 2, "ab": 3, "-a": 4, "b-": 5, "--": 6}, "merges": ["a b", "- a", "b -", "- -"]}})";
    WriteFile(dir.path() / "tokenizer.json", text);
    auto r = Tokenizer::FromHfJson(dir.file("tokenizer.json"));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return std::move(r).value();
  };
  auto split = [](const char* behavior, const char* pattern = R"({"Regex": "-"})") {
    return std::string(R"({"type": "Split", "pattern": )") + pattern + R"(, "behavior": ")" +
           behavior + "\"}";
  };
  // Without a split, "a b" (rank 0) wins everywhere it can.
  EXPECT_EQ(load("")->Encode("ab-ab"), (Ids{3, 2, 3}));
  EXPECT_EQ(load(split("Isolated"))->Encode("ab-ab"), (Ids{3, 2, 3}));
  EXPECT_EQ(load(split("Isolated", R"({"String": "-"})"))->Encode("ab-ab"), (Ids{3, 2, 3}));
  EXPECT_EQ(load(split("Removed"))->Encode("ab-ab"), (Ids{3, 3}));
  // "b-" | "ab": rank-2 "b -" applies only because the pieces are "ab-" and "ab".
  EXPECT_EQ(load(split("MergedWithPrevious"))->Encode("a-b"), (Ids{0, 2, 1}));
  EXPECT_EQ(load(split("MergedWithPrevious"))->Encode("b-a"), (Ids{5, 0}));
  EXPECT_EQ(load(split("MergedWithNext"))->Encode("b-a"), (Ids{1, 4}));
  EXPECT_EQ(load(split("Isolated"))->Encode("a--b"), (Ids{0, 2, 2, 1}));
  EXPECT_EQ(load(split("Contiguous"))->Encode("a--b"), (Ids{0, 6, 1}));
  // Empty matches split too (between "a" and "b"), as in the reference.
  EXPECT_EQ(load(split("Isolated", R"({"Regex": "-*"})"))->Encode("ab--ab"), (Ids{0, 1, 6, 0, 1}));
  // Chained Splits: "-" is split off, then "b" is split off each piece.
  EXPECT_EQ(load(split("Isolated") + "," + split("Isolated", R"({"Regex": "b"})"))->Encode("ab-ab"),
            (Ids{0, 1, 2, 0, 1}));
}

TEST(TokenizerSentencePiece, TrainedModelMatchesProcessor) {
  TempDir dir;
  const std::string corpus = dir.file("corpus.txt");
  WriteFile(corpus, ReadFile(CACHET_SOURCE_DIR "/data/haystack/bible.txt", 50 << 10));
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + corpus + " --model_prefix=" + dir.file("tokenizer") +
      " --vocab_size=500 --model_type=bpe --byte_fallback=true --character_coverage=1.0"
      " --normalization_rule_name=identity --num_threads=1 --minloglevel=2");
  ASSERT_TRUE(status.ok()) << status.ToString();
  fs::remove(corpus);

  auto r = Tokenizer::Load(dir.path().string());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Tokenizer& tok = *r.value();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(dir.file("tokenizer.model")).ok());

  EXPECT_EQ(tok.kind(), "sentencepiece");
  EXPECT_EQ(tok.vocab_size(), 500);
  EXPECT_EQ(tok.bos_id(), sp.bos_id());
  EXPECT_EQ(tok.eos_id(), sp.eos_id());
  EXPECT_TRUE(tok.add_bos());
  EXPECT_TRUE(tok.IsSpecial(sp.bos_id()));
  EXPECT_TRUE(tok.IsSpecial(sp.unk_id()));
  EXPECT_EQ(tok.TokenBytes(sp.bos_id()), "<s>");

  for (const std::string text :
       {"In the beginning God created the heaven and the earth.",
        "And the LORD said unto Moses, Go in unto Pharaoh.", "ünïcødé ✓ 日本語 🎉 (bytes)", "x"}) {
    const Ids ids = tok.Encode(text);
    const std::vector<int> want = sp.EncodeAsIds(text);
    EXPECT_EQ(ids, Ids(want.begin(), want.end())) << text;
    EXPECT_EQ(tok.Decode(ids), text);
    std::string bytes;
    for (int32_t id : ids) bytes += tok.TokenBytes(id);
    EXPECT_EQ(bytes, " " + text);  // the dummy-prefix space that Decode strips
    EXPECT_EQ(tok.EncodePrompt(text).front(), sp.bos_id());
  }
  // SentencePiece itself decides what invalid UTF-8 becomes; it must not crash.
  for (int32_t id : tok.Encode("\xff\xfe abc \xc3")) EXPECT_TRUE(id >= 0 && id < tok.vocab_size());
  // Characters unseen in training fall back to byte pieces.
  const Ids ids = tok.Encode("日");
  EXPECT_EQ(ids.size(), 4u);  // "▁" + 3 bytes
}

}  // namespace
}  // namespace cachet

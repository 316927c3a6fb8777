// libFuzzer target for the tokenizer.json loader (model/bpe_tokenizer.cc): the input up to its
// first '\0' is tokenizer.json's text, loaded as Tokenizer::FromHfJson loads the file; the rest
// is text to encode (without a '\0', a few fixed strings and the input's first bytes are). When
// it loads, each text is encoded with and without special tokens, every id must lie in
// [0, vocab_size) (a violation aborts), and the ids, ids out of range and ids read from the input
// are decoded, in one go and streamed. Build and run: scripts/fuzz.sh [seconds] tokenizer_json.
//
// With CACHET_FUZZ_SEED_DIR set, LLVMFuzzerInitialize first writes seed inputs there: handmade
// tokenizers (byte-level, byte fallback, every Split behaviour), and when run from the repository
// root (as scripts/fuzz.sh does), kvtiny's real tokenizer.json cut down to its first tokens and
// the merges among them (the whole file exceeds the fuzzer's input size).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/tokenizer.h"
#include "model/bpe_tokenizer.h"

namespace {

using nlohmann::json;
using namespace std::string_literals;

constexpr char kTokenizerJson[] = "models/kvtiny/tokenizer.json";  // from the repository root

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// kvtiny's tokenizer.json with the tokens below max_id and the first max_merges merges among them.
std::string CutDown(const json& real, int max_id, size_t max_merges) {
  json t = real;
  json vocab = json::object();
  for (auto& [k, v] : real["model"]["vocab"].items()) {
    if (v.is_number_integer() && v.get<int>() < max_id) vocab[k] = v;
  }
  json merges = json::array();
  for (const json& m : real["model"]["merges"]) {
    if (merges.size() >= max_merges) break;
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos) continue;
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2) {
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    }
    if (vocab.contains(a) && vocab.contains(b) && vocab.contains(a + b)) merges.push_back(m);
  }
  t["model"]["vocab"] = vocab;
  t["model"]["merges"] = merges;
  return t.dump();
}

void WriteSeeds(const std::string& dir) {
  const std::string seeds[] = {
      // Byte-level, GPT-2 style, with an added special token and a post_processor BOS.
      R"({"added_tokens": [{"id": 6, "content": "<|bos|>", "special": true},
          {"id": 7, "content": "<x>", "special": false, "lstrip": true, "rstrip": true}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": true, "use_regex": true},
        "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken":
          {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
          "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [6], "tokens": ["<|bos|>"]}}},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "\u0120": 2, "ab": 3, "\u0120a": 4,
          "\u0120ab": 5}, "merges": ["a b", "\u0120 a", ["\u0120a", "b"]]}})"
      "\0ab ab <|bos|>a <x> b\xff\xc3"s,
      // Byte fallback with an unknown token, fused.
      R"({"added_tokens": [{"id": 0, "content": "<unk>", "special": true}],
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
          "ignore_merges": false, "vocab": {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "h": 3, "e": 4,
          "l": 5, "o": 6, "he": 7, "ll": 8, "llo": 9, " ": 10, "<0x21>": 11},
          "merges": [["h", "e"], ["l", "l"], ["ll", "o"]]}})"
      "\0hello \xc3\xa9! hiii"s,
      // Split steps: a regex, a literal, inverted, every behaviour, then ByteLevel.
      R"J({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"Regex": "\\s+|\\p{N}"}, "behavior": "Isolated"},
          {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithNext"},
          {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Contiguous", "invert": true},
          {"type": "Split", "pattern": {"String": "b"}, "behavior": "MergedWithPrevious"},
          {"type": "Split", "pattern": {"Regex": "(?=c)"}, "behavior": "Removed"},
          {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
        "model": {"vocab": {"a": 0, "b": 1, "-": 2, "ab": 3, "-a": 4, "b-": 5, "--": 6, "c": 7},
          "merges": ["a b", "- a", "b -", "- -"], "ignore_merges": true}})J"
      "\0a-b--ab 12 cab-c"s,
  };
  int i = 0;
  for (const std::string& s : seeds) Write(dir + "/seed-" + std::to_string(i++), s);

  std::ifstream f(kTokenizerJson, std::ios::binary);
  if (!f) return;
  std::stringstream ss;
  ss << f.rdbuf();
  const json real = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (!real.is_object() || !real.contains("model") || !real["model"].contains("vocab")) return;
  Write(dir + "/seed-kvtiny-300", CutDown(real, 300, 60) + "\0In the beginning 1234 <|eos|>"s);
  Write(dir + "/seed-kvtiny-270", CutDown(real, 270, 20));
}

[[noreturn]] void Fail(const std::string& what, std::string_view text) {
  std::fprintf(stderr, "tokenizer_json_fuzz: %s (text: %.*s)\n", what.c_str(),
               static_cast<int>(text.size()), text.data());
  std::abort();
}

void Exercise(const cachet::Tokenizer& tok, std::string_view text) {
  const int32_t n = tok.vocab_size();
  for (bool special : {true, false}) {
    const std::vector<int32_t> ids = tok.Encode(text, special);
    for (int32_t id : ids) {
      if (id < 0 || id >= n) Fail("Encode gave id " + std::to_string(id), text);
    }
    (void)tok.Decode(ids);
    cachet::StreamDecoder stream(tok);
    for (int32_t id : ids) (void)stream.Push(id);
    (void)stream.Flush();
  }
  (void)tok.EncodePrompt(text);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("CACHET_FUZZ_SEED_DIR")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view json_text = input.substr(0, nul);
  auto tok = cachet::BpeTokenizerFromJsonText(json_text, "fuzz/tokenizer.json");
  if (!tok.ok()) {
    if (tok.status().message().find("fuzz/tokenizer.json") == std::string::npos) {
      Fail("an error that does not name the file: " + tok.status().ToString(), json_text);
    }
    return 0;
  }
  const cachet::Tokenizer& t = **tok;
  const int32_t n = t.vocab_size();
  for (int32_t id : {t.bos_id(), t.eos_id()}) {
    if (id < -1 || id >= n) Fail("special id " + std::to_string(id) + " out of range", "");
  }
  if (nul != std::string_view::npos) {
    Exercise(t, input.substr(nul + 1));
  } else {
    for (std::string_view s :
         {"Hello, world! It's 2024.\n\n  x", "\xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x99\x82",
          "\xff\xfe\xc3 \x80", ""}) {
      Exercise(t, s);
    }
    Exercise(t, input.substr(0, 128));
  }
  // Ids out of range, and ids read from the input's bytes.
  std::vector<int32_t> ids = {-1, n, n + 1, INT32_MIN, INT32_MAX, 0};
  for (size_t i = 0; i + 4 <= size && ids.size() < 32; i += 4) {
    int32_t v;
    std::memcpy(&v, data + i, 4);
    ids.push_back(n > 0 ? static_cast<int32_t>(static_cast<uint32_t>(v) % (uint32_t(n) + 2)) - 1
                        : v);
  }
  (void)t.Decode(ids);
  for (int32_t id : ids) {
    (void)t.TokenBytes(id);
    (void)t.IsSpecial(id);
  }
  return 0;
}

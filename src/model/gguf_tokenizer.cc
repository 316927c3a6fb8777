// Tokenizers from GGUF metadata (tokenizer.ggml.*).
//
// model "gpt2": byte-level BPE. tokens (in GPT-2's byte alphabet, as tokenizer.json's vocab),
// merges ("left right"), token_type (3 = control: a special added token, 4 = user-defined: a
// non-special added token); the pre-tokenizer is named by tokenizer.ggml.pre: "default"/"gpt2"
// (GPT-2 regex), "llama-bpe" (Llama-3 regex, ignore_merges), "qwen2" (Qwen2 regex, also what
// `cachet convert` writes for models whose tokenizer.json splits by that regex). The BPE itself is
// BpeTokenizer's, fed an in-memory tokenizer.json.
//
// model "llama": SentencePiece vocabularies (tokens, scores, token_type) encoded as llama.cpp's
// SPM tokenizer does: whitespace escaped to U+2581, a leading space at the start of the text and
// after each special token (tokenizer.ggml.add_space_prefix, default true), then characters
// merged greedily by the score of the merged piece (highest first, leftmost on ties); pieces not
// in the vocabulary fall back to <0xNN> byte tokens (or unk).
#include <algorithm>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "model/bpe_tokenizer.h"
#include "model/gguf_model.h"

namespace cachet {
namespace {

using json = nlohmann::json;
using tokenizer_internal::StringMap;
using tokenizer_internal::Utf8Scan;

enum TokenType : int {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6
};

constexpr char kLlama3Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581

struct Vocab {
  const std::vector<std::string>* tokens = nullptr;
  std::vector<int> types;  // kNormal when absent
  int32_t bos = -1, eos = -1, unk = -1;
  bool add_bos = false;
};

Result<Vocab> ReadVocab(const GgufFile& f, bool default_add_bos) {
  Vocab v;
  CACHET_ASSIGN_OR_RETURN(const GgufValue* tokens,
                          f.GetArray("tokenizer.ggml.tokens", GgufType::kString));
  v.tokens = &tokens->strs;
  const size_t n = tokens->strs.size();
  if (n == 0 || n > (size_t{1} << 24)) {
    return InvalidArgument(f.path() + ": metadata 'tokenizer.ggml.tokens' has " +
                           std::to_string(n) + " tokens");
  }
  v.types.assign(n, kNormal);
  if (f.Find("tokenizer.ggml.token_type")) {
    CACHET_ASSIGN_OR_RETURN(const GgufValue* types,
                            f.GetArray("tokenizer.ggml.token_type", GgufType::kI32));
    if (types->nums.size() != n) {
      return InvalidArgument(f.path() + ": metadata 'tokenizer.ggml.token_type' has " +
                             std::to_string(types->nums.size()) + " entries for " +
                             std::to_string(n) + " tokens");
    }
    for (size_t i = 0; i < n; ++i) {
      const double t = types->nums[i];  // any numeric array is read as doubles
      if (!(t >= -1e9 && t <= 1e9) || t != static_cast<double>(static_cast<int>(t))) {
        return InvalidArgument(f.path() + ": metadata 'tokenizer.ggml.token_type' entry " +
                               std::to_string(i) + " is not a token type (" + std::to_string(t) +
                               ")");
      }
      v.types[i] = static_cast<int>(t);
    }
  }
  for (auto [key, out] : {std::pair{"tokenizer.ggml.bos_token_id", &v.bos},
                          {"tokenizer.ggml.eos_token_id", &v.eos},
                          {"tokenizer.ggml.unknown_token_id", &v.unk}}) {
    if (!f.Find(key)) continue;
    CACHET_ASSIGN_OR_RETURN(int64_t id, f.GetInt(key));
    *out = id >= 0 && static_cast<size_t>(id) < n ? static_cast<int32_t>(id) : -1;
  }
  v.add_bos = default_add_bos;
  if (f.Find("tokenizer.ggml.add_bos_token")) {
    CACHET_ASSIGN_OR_RETURN(v.add_bos, f.GetBool("tokenizer.ggml.add_bos_token"));
  }
  return v;
}

Result<std::unique_ptr<Tokenizer>> Gpt2FromGguf(const GgufFile& f) {
  CACHET_ASSIGN_OR_RETURN(Vocab v, ReadVocab(f, /*default_add_bos=*/false));
  CACHET_ASSIGN_OR_RETURN(const GgufValue* merges,
                          f.GetArray("tokenizer.ggml.merges", GgufType::kString));
  std::string pre = "default";
  if (f.Find("tokenizer.ggml.pre")) {
    CACHET_ASSIGN_OR_RETURN(pre, f.GetString("tokenizer.ggml.pre"));
  }
  json root = json::object();
  json model = {{"type", "BPE"}, {"byte_fallback", false}};
  json pre_tok;
  if (pre == "default" || pre == "gpt2") {
    pre_tok = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  } else if (pre == "llama-bpe" || pre == "qwen2") {
    pre_tok = {{"type", "Sequence"},
               {"pretokenizers",
                json::array(
                    {{{"type", "Split"},
                      {"pattern", {{"Regex", pre == "qwen2" ? kQwen2Regex : kLlama3Regex}}},
                      {"behavior", "Isolated"},
                      {"invert", false}},
                     {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
    if (pre == "llama-bpe") model["ignore_merges"] = true;
  } else {
    return Unimplemented(f.path() + ": metadata 'tokenizer.ggml.pre' = '" + pre +
                         "' is not supported (supported: default, gpt2, llama-bpe, qwen2)");
  }
  json vocab = json::object();
  json added = json::array();
  for (size_t i = 0; i < v.tokens->size(); ++i) {
    const std::string& t = (*v.tokens)[i];
    vocab[t] = i;
    if (v.types[i] == kControl || v.types[i] == kUserDefined) {
      added.push_back({{"id", i}, {"content", t}, {"special", v.types[i] == kControl}});
    }
  }
  model["vocab"] = std::move(vocab);
  model["merges"] = merges->strs;
  root["model"] = std::move(model);
  root["pre_tokenizer"] = std::move(pre_tok);
  root["added_tokens"] = std::move(added);
  return BpeTokenizerFromJson(root, f.path() + " (tokenizer.ggml)", v.bos, v.eos, v.add_bos);
}

// "<0xNN>" -> NN, else -1.
int ByteTokenValue(std::string_view s) {
  if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
  int v = 0;
  for (char c : s.substr(3, 2)) {
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

class SpmTokenizer final : public Tokenizer {
 public:
  SpmTokenizer(const Vocab& v, std::vector<float> scores, bool add_space_prefix)
      : scores_(std::move(scores)), types_(v.types), add_space_prefix_(add_space_prefix) {
    const size_t n = v.tokens->size();
    pieces_ = *v.tokens;
    bytes_.resize(n);
    byte_ids_.fill(-1);
    for (size_t i = 0; i < n; ++i) {
      const std::string& p = pieces_[i];
      vocab_.emplace(p, static_cast<int32_t>(i));
      const int b = types_[i] == kByte ? ByteTokenValue(p) : -1;
      if (b >= 0) {
        bytes_[i] = std::string(1, static_cast<char>(b));
        if (byte_ids_[b] < 0) byte_ids_[b] = static_cast<int32_t>(i);
      } else if (types_[i] == kControl || types_[i] == kUnknown) {
        bytes_[i] = p;
      } else {
        std::string& s = bytes_[i];
        for (size_t k = 0; k < p.size();) {
          if (p.compare(k, kSpaceMark.size(), kSpaceMark) == 0) {
            s += ' ';
            k += kSpaceMark.size();
          } else {
            s += p[k++];
          }
        }
      }
      if ((types_[i] == kControl || types_[i] == kUserDefined) && !p.empty()) {
        specials_.push_back(static_cast<int32_t>(i));
      }
    }
    std::stable_sort(specials_.begin(), specials_.end(),
                     [&](int32_t a, int32_t b) { return pieces_[a].size() > pieces_[b].size(); });
    bos_id_ = v.bos;
    eos_id_ = v.eos;
    unk_id_ = v.unk;
    add_bos_ = v.add_bos && bos_id_ >= 0;
  }

  std::vector<int32_t> Encode(std::string_view text, bool parse_special) const override {
    std::vector<int32_t> out;
    bool prev_special = true;
    size_t done = 0;
    auto flush = [&](size_t end) {
      if (end > done) {
        std::string s;
        if (add_space_prefix_ && prev_special) s = kSpaceMark;
        for (char c : text.substr(done, end - done)) {
          if (c == ' ') {
            s += kSpaceMark;
          } else {
            s += c;
          }
        }
        EncodeText(s, &out);
        prev_special = false;
      }
    };
    for (size_t i = 0; i < text.size();) {
      int32_t hit = -1;
      for (int32_t id : specials_) {
        if ((parse_special || types_[id] == kUserDefined) &&
            text.substr(i).starts_with(pieces_[id])) {
          hit = id;
          break;
        }
      }
      if (hit < 0) {
        ++i;
        continue;
      }
      flush(i);
      out.push_back(hit);
      prev_special = true;
      i += pieces_[hit].size();
      done = i;
    }
    flush(text.size());
    return out;
  }

  std::string TokenBytes(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? bytes_[id] : std::string();
  }

  // Control tokens are dropped and the leading space the encoder adds is removed.
  std::string Decode(std::span<const int32_t> ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size() || types_[id] == kControl) continue;
      out += bytes_[id];
    }
    if (add_space_prefix_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(pieces_.size()); }
  bool IsSpecial(int32_t id) const override {
    return id >= 0 && id < vocab_size() && (types_[id] == kControl || types_[id] == kUnknown);
  }
  std::string_view kind() const override { return "sentencepiece"; }

 private:
  int32_t Lookup(std::string_view s) const {
    auto it = vocab_.find(s);
    return it == vocab_.end() ? -1 : it->second;
  }

  void EncodeText(const std::string& s, std::vector<int32_t>* out) const {
    struct Sym {
      size_t begin, len;
      int prev, next;
    };
    std::vector<Sym> syms;
    for (size_t i = 0; i < s.size();) {
      const size_t len = static_cast<size_t>(
          Utf8Scan(reinterpret_cast<const unsigned char*>(s.data()) + i, s.size() - i).len);
      syms.push_back(
          {i, len, static_cast<int>(syms.size()) - 1, static_cast<int>(syms.size()) + 1});
      i += len;
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    struct Bigram {
      int left, right;
      float score;
      size_t len;
      bool operator<(const Bigram& o) const {  // max-heap: higher score, then leftmost
        return score < o.score || (score == o.score && left > o.left);
      }
    };
    std::priority_queue<Bigram> queue;
    auto try_add = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const size_t len = syms[l].len + syms[r].len;
      const int32_t id = Lookup(std::string_view(s).substr(syms[l].begin, len));
      if (id < 0 || static_cast<size_t>(id) >= scores_.size()) return;
      queue.push({l, r, scores_[id], len});
    };
    for (size_t i = 1; i < syms.size(); ++i) try_add(static_cast<int>(i) - 1, static_cast<int>(i));
    while (!queue.empty()) {
      const Bigram b = queue.top();
      queue.pop();
      Sym& l = syms[b.left];
      Sym& r = syms[b.right];
      if (l.len == 0 || r.len == 0 || l.len + r.len != b.len) continue;  // stale
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    for (int i = 0; i >= 0; i = syms[i].next) {
      const std::string_view piece = std::string_view(s).substr(syms[i].begin, syms[i].len);
      const int32_t id = Lookup(piece);
      if (id >= 0) {
        out->push_back(id);
        continue;
      }
      for (unsigned char c : piece) {
        if (byte_ids_[c] >= 0) {
          out->push_back(byte_ids_[c]);
        } else if (unk_id_ >= 0) {
          out->push_back(unk_id_);
        }
      }
    }
  }

  std::vector<std::string> pieces_;
  std::vector<std::string> bytes_;
  std::vector<float> scores_;
  std::vector<int> types_;
  StringMap<int32_t> vocab_;
  std::array<int32_t, 256> byte_ids_{};
  std::vector<int32_t> specials_;  // control and user-defined tokens, longest first
  int32_t unk_id_ = -1;
  bool add_space_prefix_ = true;
};

Result<std::unique_ptr<Tokenizer>> SpmFromGguf(const GgufFile& f) {
  CACHET_ASSIGN_OR_RETURN(Vocab v, ReadVocab(f, /*default_add_bos=*/true));
  std::vector<float> scores(v.tokens->size(), 0.0f);
  if (f.Find("tokenizer.ggml.scores")) {
    CACHET_ASSIGN_OR_RETURN(const GgufValue* s,
                            f.GetArray("tokenizer.ggml.scores", GgufType::kF32));
    if (s->nums.size() != scores.size()) {
      return InvalidArgument(f.path() + ": metadata 'tokenizer.ggml.scores' has " +
                             std::to_string(s->nums.size()) + " entries for " +
                             std::to_string(scores.size()) + " tokens");
    }
    for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(s->nums[i]);
  }
  bool add_space_prefix = true;
  if (f.Find("tokenizer.ggml.add_space_prefix")) {
    CACHET_ASSIGN_OR_RETURN(add_space_prefix, f.GetBool("tokenizer.ggml.add_space_prefix"));
  }
  return std::unique_ptr<Tokenizer>(new SpmTokenizer(v, std::move(scores), add_space_prefix));
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufFile& f) {
  CACHET_ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model == "gpt2") return Gpt2FromGguf(f);
  if (model == "llama") return SpmFromGguf(f);
  return Unimplemented(f.path() + ": metadata 'tokenizer.ggml.model' = '" + model +
                       "' is not supported (supported: gpt2, llama)");
}

}  // namespace cachet

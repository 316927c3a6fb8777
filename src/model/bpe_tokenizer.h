// Private to src/model: the HF tokenizer.json BPE tokenizer and UTF-8 helpers shared with
// tokenizer.cc. Callers use Tokenizer::FromHfJson / Tokenizer::Load.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cachet/tokenizer.h"

namespace cachet {
namespace tokenizer_internal {

// One step of a UTF-8 scan. valid: `len` bytes form one well-formed character. Otherwise `len`
// bytes are a maximal ill-formed subpart (Unicode's "substitution of maximal subparts": one
// U+FFFD each), and `truncated` says they are a proper prefix of a character cut by the end of
// the input, which later bytes could still complete.
struct Utf8Step {
  int len;
  bool valid;
  bool truncated;
};

inline Utf8Step Utf8Scan(const unsigned char* p, size_t n) {
  const unsigned char c = p[0];
  if (c < 0x80) return {1, true, false};
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // > U+10FFFF
  } else {
    return {1, false, false};
  }
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= n) return {k, false, true};
    if (p[k] < lo || p[k] > hi) return {k, false, false};
    lo = 0x80, hi = 0xBF;
  }
  return {need + 1, true, false};
}

// A non-owning callable taking one piece, so that pre-tokenizer steps can recurse without
// instantiating a template per depth or allocating a std::function.
class PieceSink {
 public:
  template <class F>
  PieceSink(const F& f)  // NOLINT: implicit, like a function_ref
      : obj_(&f),
        call_([](const void* o, std::string_view s) { (*static_cast<const F*>(o))(s); }) {}
  void operator()(std::string_view s) const { call_(obj_, s); }

 private:
  const void* obj_;
  void (*call_)(const void*, std::string_view);
};

inline const unsigned char* U(std::string_view s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

// A merge's key: the pair of token ids.
inline uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Oniguruma allows concurrent searches on one regex, but not compiling or freeing regexes (even
// different ones) on several threads at once: both take this lock.
std::mutex& OnigMutex();

// Heterogeneous lookup so that string_view keys do not allocate.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

}  // namespace tokenizer_internal

class BpeLoader;

// tokenizer.json's text, loaded as Tokenizer::FromHfJson loads the file, except that no side file
// (tokenizer_config.json, config.json) is read: BOS comes from the post_processor alone. origin
// names the source in errors. For tests/fuzz/tokenizer_json_fuzz.cc.
Result<std::unique_ptr<Tokenizer>> BpeTokenizerFromJsonText(std::string_view text,
                                                            const std::string& origin);

// A BPE tokenizer from an in-memory object shaped like tokenizer.json (model, pre_tokenizer,
// added_tokens, decoder), with the given BOS/EOS ids (-1: none): how GGUF vocabularies are loaded.
// No file is read; origin names the source in errors.
Result<std::unique_ptr<Tokenizer>> BpeTokenizerFromJson(const nlohmann::json& root,
                                                        const std::string& origin, int32_t bos_id,
                                                        int32_t eos_id, bool add_bos);

// Byte-level (GPT-2 / Llama-3 / Qwen) or plain (optionally byte_fallback) BPE.
class BpeTokenizer final : public Tokenizer {
 public:
  ~BpeTokenizer() override;

  std::vector<int32_t> Encode(std::string_view text, bool parse_special = true) const override;
  std::string TokenBytes(int32_t id) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(token_bytes_.size()); }
  bool IsSpecial(int32_t id) const override;
  std::string_view kind() const override { return "bpe"; }

 private:
  friend class BpeLoader;
  enum class Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };
  // A pre-tokenizer step. ByteLevel is a Split by the GPT-2 regex (when use_regex) after an
  // optional prefix space; it must be last because later steps would see its alphabet.
  struct Step {
    void* regex = nullptr;  // OnigRegex, owned; null for a literal pattern or a plain ByteLevel
    std::string literal;
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
    bool byte_level = false;
    bool add_prefix_space = false;  // ByteLevel only
  };
  struct AddedToken {
    std::string content;
    int32_t id;
    bool special, lstrip, rstrip;
  };
  struct Merge {
    int32_t rank, id;
  };
  void PreTokenize(std::string_view text, size_t step, tokenizer_internal::PieceSink sink) const;
  void SplitStep(const Step& st, std::string_view text, tokenizer_internal::PieceSink emit) const;
  void EncodeSegment(std::string_view text, std::vector<int32_t>* out) const;
  void EncodePiece(std::string_view piece, std::vector<int32_t>* out) const;
  void Bpe(std::string_view piece, std::vector<int32_t>* out) const;
  void AppendUnknown(std::vector<int32_t>* out) const;

  bool byte_level_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  std::vector<Step> steps_;
  // Keys are raw bytes for byte-level models (vocab strings decoded from the GPT-2 alphabet),
  // else the vocab strings themselves.
  tokenizer_internal::StringMap<int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> rank, result
  std::array<int32_t, 256> byte_ids_{};   // byte-level: the byte's token; else its <0xNN>; or -1
  std::vector<std::string> token_bytes_;  // id -> raw bytes
  std::vector<uint8_t> special_;
  std::vector<AddedToken> added_;                      // longest first
  std::array<std::vector<int32_t>, 256> added_first_;  // first byte -> indexes into added_

  static constexpr size_t kMaxCacheEntries = 1 << 16;
  static constexpr size_t kMaxCachedPiece = 256;
  // Piece -> its ids, stored as a span of cache_ids_ so that a hit touches one node, not two.
  struct CacheSpan {
    uint32_t offset, size;
  };
  mutable std::mutex cache_mu_;
  mutable tokenizer_internal::StringMap<CacheSpan> cache_;
  mutable std::vector<int32_t> cache_ids_;
};

}  // namespace cachet

// HF tokenizer.json BPE: loading (every error names the file and the JSON path); encoding is in
// bpe_encode.cc.
//
// Supported: model.type "BPE" (vocab, merges as "a b" or ["a", "b"], byte_fallback, unk_token,
// fuse_unk, ignore_merges; dropout is ignored), normalizer null or "NFC" (input is assumed to be
// NFC already: no-op), pre_tokenizer null / Split / ByteLevel / Sequence of those with ByteLevel
// last, decoder null / ByteLevel / ByteFallback / Fuse / Sequence of those. Anything else is
// rejected with Unimplemented rather than silently encoding differently from the reference.
// Added tokens: longest match first; lstrip/rstrip strip ASCII whitespace only; single_word and
// normalized are ignored.
#include "model/bpe_tokenizer.h"

#include <oniguruma.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "util/json_excerpt.h"

namespace cachet {
namespace {

using json = nlohmann::json;
using tokenizer_internal::OnigMutex;
using tokenizer_internal::PairKey;
using tokenizer_internal::StringMap;
using tokenizer_internal::U;
using tokenizer_internal::Utf8Scan;
using tokenizer_internal::Utf8Step;

// GPT-2's pre-tokenizer, used by ByteLevel when use_regex is set.
constexpr char kGpt2Regex[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr int64_t kMaxId = 1 << 24;  // bounds allocations driven by a corrupt file
// Bounds on what a file can make the loader and the encoder recurse through (one stack frame
// each): Sequence nesting (pre-tokenizers, decoders, post-processors) and pre-tokenizer steps
// (encoding recurses once per step). Real tokenizers use 1-2 levels and at most a handful of steps.
constexpr int kMaxNesting = 8;
constexpr size_t kMaxPreTokenizerSteps = 64;

uint32_t DecodeCodepoint(const unsigned char* p, int len) {
  if (len == 1) return p[0];
  uint32_t cp = p[0] & (0x7F >> len);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return cp;
}

// GPT-2's bytes_to_unicode, inverted: printable Latin-1 code points stand for their own byte,
// U+0100 + k for the k-th remaining byte.
const std::array<int16_t, 324>& CodepointToByte() {
  static const std::array<int16_t, 324> table = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[printable ? b : 256 + extra++] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return table;
}

// Maps a vocab string in the byte-level alphabet back to raw bytes; false if it is not in it.
bool DecodeByteLevel(std::string_view s, std::string* out) {
  const auto& table = CodepointToByte();
  out->clear();
  for (size_t i = 0; i < s.size();) {
    const Utf8Step st = Utf8Scan(U(s) + i, s.size() - i);
    if (!st.valid) return false;
    const uint32_t cp = DecodeCodepoint(U(s) + i, st.len);
    if (cp >= table.size() || table[cp] < 0) return false;
    out->push_back(static_cast<char>(table[cp]));
    i += st.len;
  }
  return true;
}

// "<0xNN>" -> NN, else -1.
int ParseByteToken(std::string_view s) {
  if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
  int v = 0;
  for (char c : s.substr(3, 2)) {
    const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                  : (c >= 'A' && c <= 'F')                    ? c - 'A' + 10
                  : (c >= 'a' && c <= 'f')                    ? c - 'a' + 10
                                                              : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFound(path + ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return DataLoss(path + ": read error");
  return ss.str();
}

Result<json> ParseJsonText(std::string_view text, const std::string& origin) {
  try {
    return Result<json>(json::parse(text));
  } catch (const json::exception& e) {
    return DataLoss(origin + ": malformed JSON: " + e.what());
  }
}

Result<json> ParseJsonFile(const std::string& path) {
  CACHET_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseJsonText(text, path);
}

// Field `key` of `obj`, or null when absent; a JSON null counts as absent.
const json* Find(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

std::string Join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string Index(const std::string& path, size_t i) {
  return path + "[" + std::to_string(i) + "]";
}

// Typed accessors whose errors name the file and the JSON path.
class JsonFile {
 public:
  explicit JsonFile(std::string file) : file_(std::move(file)) {}
  const std::string& file() const { return file_; }

  Status Invalid(const std::string& path, const std::string& what) const {
    return InvalidArgument(file_ + ": " + path + ": " + what);
  }
  Status Unsupported(const std::string& path, const std::string& value) const {
    return Unimplemented(file_ + ": " + path + ": unsupported '" + value + "'");
  }
  Status WrongType(const std::string& path, const char* want, const json& got) const {
    return Invalid(path, std::string("expected ") + want + ", got " + got.type_name());
  }

  Result<const json*> Object(const json& obj, const char* key, const std::string& path) const {
    const json* v = Find(obj, key);
    if (!v) return Invalid(Join(path, key), "missing");
    if (!v->is_object()) return WrongType(Join(path, key), "an object", *v);
    return v;
  }
  Result<const json*> Array(const json& obj, const char* key, const std::string& path) const {
    const json* v = Find(obj, key);
    if (!v) return Invalid(Join(path, key), "missing");
    if (!v->is_array()) return WrongType(Join(path, key), "an array", *v);
    return v;
  }
  Result<std::string> String(const json& obj, const char* key, const std::string& path) const {
    const json* v = Find(obj, key);
    if (!v) return Invalid(Join(path, key), "missing");
    if (!v->is_string()) return WrongType(Join(path, key), "a string", *v);
    return v->get<std::string>();
  }
  Result<bool> Bool(const json& obj, const char* key, const std::string& path, bool dflt) const {
    const json* v = Find(obj, key);
    if (!v) return dflt;
    if (!v->is_boolean()) return WrongType(Join(path, key), "a boolean", *v);
    return v->get<bool>();
  }
  Result<int32_t> Id(const json& v, const std::string& path) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= kMaxId) {
      return Invalid(path, "expected a token id in [0, 2^24), got " + JsonExcerpt(v));
    }
    return static_cast<int32_t>(v.get<int64_t>());
  }

 private:
  std::string file_;
};

}  // namespace

std::mutex& tokenizer_internal::OnigMutex() {
  static std::mutex mu;
  return mu;
}

// Builds a BpeTokenizer from the parsed JSON; a class so that it can fill private fields.
class BpeLoader {
 public:
  explicit BpeLoader(const std::string& path) : f_(path), tok_(new BpeTokenizer) {}

  Result<std::unique_ptr<Tokenizer>> Load() {
    CACHET_ASSIGN_OR_RETURN(json root, ParseJsonFile(f_.file()));
    return LoadRoot(root);
  }

  // From tokenizer.json's text: as Load, but no side files are read (BOS from the
  // post_processor only).
  Result<std::unique_ptr<Tokenizer>> LoadText(std::string_view text) {
    side_files_ = false;
    CACHET_ASSIGN_OR_RETURN(json root, ParseJsonText(text, f_.file()));
    return LoadRoot(root);
  }

  // From an in-memory tokenizer.json-shaped object (GGUF metadata): no side files are read, the
  // special ids are given.
  Result<std::unique_ptr<Tokenizer>> LoadInMemory(const json& root, int32_t bos, int32_t eos,
                                                  bool add_bos) {
    side_files_ = special_ids_ = false;
    CACHET_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> t, LoadRoot(root));
    BpeTokenizer& b = static_cast<BpeTokenizer&>(*t);
    b.bos_id_ = bos >= 0 && bos < b.vocab_size() ? bos : -1;
    b.eos_id_ = eos >= 0 && eos < b.vocab_size() ? eos : -1;
    b.add_bos_ = add_bos && b.bos_id_ >= 0;
    return t;
  }

 private:
  Result<std::unique_ptr<Tokenizer>> LoadRoot(const json& root) {
    if (!root.is_object()) return f_.WrongType("(root)", "an object", root);
    CACHET_RETURN_IF_ERROR(LoadNormalizer(root));
    if (const json* pt = Find(root, "pre_tokenizer")) {
      CACHET_RETURN_IF_ERROR(AddPreTokenizer(*pt, "pre_tokenizer", 0));
    }
    CACHET_RETURN_IF_ERROR(LoadModel(root));
    CACHET_RETURN_IF_ERROR(LoadAddedTokens(root));
    if (const json* d = Find(root, "decoder")) {
      CACHET_RETURN_IF_ERROR(CheckDecoder(*d, "decoder", 0));
    }
    if (special_ids_) CACHET_RETURN_IF_ERROR(LoadSpecialIds(root));
    return std::unique_ptr<Tokenizer>(std::move(tok_));
  }

  Status LoadNormalizer(const json& root) {
    const json* n = Find(root, "normalizer");
    if (!n) return OkStatus();
    CACHET_ASSIGN_OR_RETURN(std::string type, f_.String(*n, "type", "normalizer"));
    // Text reaching the engine is assumed to be NFC already, so NFC is accepted as a no-op.
    if (type != "NFC") return f_.Unsupported("normalizer.type", type);
    return OkStatus();
  }

  Status AddPreTokenizer(const json& pt, const std::string& path, int depth) {
    if (!pt.is_object()) return f_.WrongType(path, "an object", pt);
    CACHET_ASSIGN_OR_RETURN(std::string type, f_.String(pt, "type", path));
    if (type == "Sequence") {
      if (depth >= kMaxNesting) {
        return f_.Invalid(
            path, "Sequence nested more than " + std::to_string(kMaxNesting) + " levels deep");
      }
      CACHET_ASSIGN_OR_RETURN(const json* list, f_.Array(pt, "pretokenizers", path));
      for (size_t i = 0; i < list->size(); ++i) {
        CACHET_RETURN_IF_ERROR(
            AddPreTokenizer((*list)[i], Index(path + ".pretokenizers", i), depth + 1));
      }
      return OkStatus();
    }
    if (type != "Split" && type != "ByteLevel") return f_.Unsupported(Join(path, "type"), type);
    if (tok_->steps_.size() >= kMaxPreTokenizerSteps) {
      return f_.Invalid(
          path, "more than " + std::to_string(kMaxPreTokenizerSteps) + " pre-tokenizer steps");
    }
    // Later steps would see text in ByteLevel's alphabet, which the encoder never materializes.
    if (tok_->byte_level_) return f_.Unsupported(Join(path, "type"), type + " after ByteLevel");
    // Owned by the tokenizer from here on, so that an error below still frees its regex.
    BpeTokenizer::Step& step = tok_->steps_.emplace_back();
    if (type == "ByteLevel") {
      step.byte_level = tok_->byte_level_ = true;
      CACHET_ASSIGN_OR_RETURN(step.add_prefix_space, f_.Bool(pt, "add_prefix_space", path, true));
      CACHET_ASSIGN_OR_RETURN(bool use_regex, f_.Bool(pt, "use_regex", path, true));
      if (use_regex) {
        CACHET_ASSIGN_OR_RETURN(step.regex, Compile(kGpt2Regex, path));
      }
    } else {
      CACHET_ASSIGN_OR_RETURN(const json* pattern, f_.Object(pt, "pattern", path));
      const std::string ppath = path + ".pattern";
      if (Find(*pattern, "Regex")) {
        CACHET_ASSIGN_OR_RETURN(std::string re, f_.String(*pattern, "Regex", ppath));
        CACHET_ASSIGN_OR_RETURN(step.regex, Compile(re, ppath + ".Regex"));
      } else if (Find(*pattern, "String")) {
        CACHET_ASSIGN_OR_RETURN(step.literal, f_.String(*pattern, "String", ppath));
      } else {
        return f_.Invalid(ppath, "expected {\"Regex\": ...} or {\"String\": ...}");
      }
      CACHET_ASSIGN_OR_RETURN(std::string behavior, f_.String(pt, "behavior", path));
      using B = BpeTokenizer::Behavior;
      static const std::pair<const char*, B> kBehaviors[] = {
          {"Isolated", B::kIsolated},
          {"Removed", B::kRemoved},
          {"MergedWithPrevious", B::kMergedWithPrevious},
          {"MergedWithNext", B::kMergedWithNext},
          {"Contiguous", B::kContiguous}};
      auto it = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                             [&](const auto& b) { return behavior == b.first; });
      if (it == std::end(kBehaviors)) return f_.Unsupported(path + ".behavior", behavior);
      step.behavior = it->second;
      CACHET_ASSIGN_OR_RETURN(step.invert, f_.Bool(pt, "invert", path, false));
    }
    return OkStatus();
  }

  Result<void*> Compile(const std::string& pattern, const std::string& path) {
    OnigRegex re = nullptr;
    OnigErrorInfo info;
    std::lock_guard<std::mutex> lock(OnigMutex());
    static const bool initialized = [] {
      OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
      return onig_initialize(encodings, 1) == ONIG_NORMAL;
    }();
    if (!initialized) return Internal("Oniguruma failed to initialize");
    const int r = onig_new(&re, U(pattern), U(pattern) + pattern.size(), ONIG_OPTION_NONE,
                           ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &info);
    if (r != ONIG_NORMAL) {
      OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
      onig_error_code_to_str(msg, r, &info);
      return f_.Invalid(path, std::string("bad regex: ") + reinterpret_cast<char*>(msg));
    }
    return static_cast<void*>(re);
  }

  Status LoadModel(const json& root) {
    CACHET_ASSIGN_OR_RETURN(const json* model, f_.Object(root, "model", ""));
    const json& m = *model;
    if (Find(m, "type")) {
      CACHET_ASSIGN_OR_RETURN(std::string type, f_.String(m, "type", "model"));
      if (type != "BPE") return f_.Unsupported("model.type", type);
    } else if (!Find(m, "merges")) {
      return f_.Invalid("model.type", "missing");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const json* v = Find(m, key);
      if (v && !(v->is_string() && v->get<std::string>().empty())) {
        return f_.Unsupported(Join("model", key),
                              v->is_string() ? v->get<std::string>() : JsonExcerpt(*v));
      }
    }
    BpeTokenizer& t = *tok_;
    CACHET_ASSIGN_OR_RETURN(t.byte_fallback_, f_.Bool(m, "byte_fallback", "model", false));
    CACHET_ASSIGN_OR_RETURN(t.ignore_merges_, f_.Bool(m, "ignore_merges", "model", false));
    CACHET_ASSIGN_OR_RETURN(t.fuse_unk_, f_.Bool(m, "fuse_unk", "model", false));

    CACHET_ASSIGN_OR_RETURN(const json* vocab, f_.Object(m, "vocab", "model"));
    std::string raw;
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      CACHET_ASSIGN_OR_RETURN(int32_t id,
                              f_.Id(it.value(), "model.vocab[" + json(it.key()).dump() + "]"));
      const std::string& s = it.key();
      names_[s] = id;
      if (static_cast<size_t>(id) >= t.token_bytes_.size()) t.token_bytes_.resize(id + 1);
      if (t.byte_level_) {
        // Strings outside the alphabet (added tokens' text) are unreachable by BPE.
        if (DecodeByteLevel(s, &raw)) {
          t.vocab_[raw] = id;
          t.token_bytes_[id] = raw;
        } else {
          t.token_bytes_[id] = s;
        }
      } else {
        t.vocab_[s] = id;
        const int byte = t.byte_fallback_ ? ParseByteToken(s) : -1;
        t.token_bytes_[id] = byte >= 0 ? std::string(1, static_cast<char>(byte)) : s;
      }
    }
    for (int b = 0; b < 256; ++b) {
      int32_t id = -1;
      if (t.byte_level_) {
        const char c = static_cast<char>(b);
        auto it = t.vocab_.find(std::string_view(&c, 1));
        if (it != t.vocab_.end()) id = it->second;
      }
      if (id < 0 && t.byte_fallback_) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        auto it = names_.find(std::string_view(name));
        if (it != names_.end()) id = it->second;
      }
      t.byte_ids_[b] = id;
    }
    if (Find(m, "unk_token")) {
      CACHET_ASSIGN_OR_RETURN(std::string name, f_.String(m, "unk_token", "model"));
      auto it = names_.find(name);
      if (it == names_.end()) {
        return f_.Invalid("model.unk_token", "'" + name + "' not in model.vocab");
      }
      t.unk_id_ = it->second;
    }

    CACHET_ASSIGN_OR_RETURN(const json* merges, f_.Array(m, "merges", "model"));
    t.merges_.reserve(merges->size());
    std::string a, b;
    for (size_t i = 0; i < merges->size(); ++i) {
      const json& e = (*merges)[i];
      const std::string path = Index("model.merges", i);
      if (e.is_string()) {
        const std::string& s = e.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          return f_.Invalid(path, "expected \"left right\", got " + JsonExcerpt(e));
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        return f_.Invalid(path, "expected \"left right\" or [left, right], got " + JsonExcerpt(e));
      }
      auto ia = names_.find(a), ib = names_.find(b), iab = names_.find(a + b);
      if (ia == names_.end() || ib == names_.end() || iab == names_.end()) {
        return f_.Invalid(path, "merge " + JsonExcerpt(e) + " uses a token not in model.vocab");
      }
      // emplace keeps the first (lowest-rank) occurrence of a duplicated pair.
      t.merges_.emplace(PairKey(ia->second, ib->second),
                        BpeTokenizer::Merge{static_cast<int32_t>(i), iab->second});
    }
    return OkStatus();
  }

  Status LoadAddedTokens(const json& root) {
    const json* list = Find(root, "added_tokens");
    if (!list) return OkStatus();
    if (!list->is_array()) return f_.WrongType("added_tokens", "an array", *list);
    BpeTokenizer& t = *tok_;
    for (size_t i = 0; i < list->size(); ++i) {
      const json& e = (*list)[i];
      const std::string path = Index("added_tokens", i);
      if (!e.is_object()) return f_.WrongType(path, "an object", e);
      BpeTokenizer::AddedToken a;
      const json* id = Find(e, "id");
      if (!id) return f_.Invalid(path + ".id", "missing");
      CACHET_ASSIGN_OR_RETURN(a.id, f_.Id(*id, path + ".id"));
      CACHET_ASSIGN_OR_RETURN(a.content, f_.String(e, "content", path));
      CACHET_ASSIGN_OR_RETURN(a.special, f_.Bool(e, "special", path, false));
      CACHET_ASSIGN_OR_RETURN(a.lstrip, f_.Bool(e, "lstrip", path, false));
      CACHET_ASSIGN_OR_RETURN(a.rstrip, f_.Bool(e, "rstrip", path, false));
      if (static_cast<size_t>(a.id) >= t.token_bytes_.size()) t.token_bytes_.resize(a.id + 1);
      t.token_bytes_[a.id] = a.content;
      names_[a.content] = a.id;
      if (a.special) {
        if (t.special_.size() <= static_cast<size_t>(a.id)) t.special_.resize(a.id + 1);
        t.special_[a.id] = 1;
      }
      if (!a.content.empty()) t.added_.push_back(std::move(a));
    }
    // Longest first, so that the first candidate matching at a position is the longest match.
    std::stable_sort(t.added_.begin(), t.added_.end(), [](const auto& x, const auto& y) {
      return x.content.size() > y.content.size();
    });
    for (size_t k = 0; k < t.added_.size(); ++k) {
      t.added_first_[static_cast<unsigned char>(t.added_[k].content[0])].push_back(k);
    }
    return OkStatus();
  }

  Status CheckDecoder(const json& d, const std::string& path, int depth) {
    CACHET_ASSIGN_OR_RETURN(std::string type, f_.String(d, "type", path));
    if (type == "Sequence") {
      if (depth >= kMaxNesting) {
        return f_.Invalid(
            path, "Sequence nested more than " + std::to_string(kMaxNesting) + " levels deep");
      }
      CACHET_ASSIGN_OR_RETURN(const json* list, f_.Array(d, "decoders", path));
      for (size_t i = 0; i < list->size(); ++i) {
        CACHET_RETURN_IF_ERROR(CheckDecoder((*list)[i], Index(path + ".decoders", i), depth + 1));
      }
      return OkStatus();
    }
    // TokenBytes already undoes these; anything else (Metaspace, Replace, Strip...) would change
    // the decoded text in ways TokenBytes does not.
    if (type != "ByteLevel" && type != "ByteFallback" && type != "Fuse") {
      return f_.Unsupported(Join(path, "type"), type);
    }
    return OkStatus();
  }

  // The first SpecialToken of a TemplateProcessing "single" template (possibly inside a
  // Sequence post-processor): the BOS the reference tokenizer prepends. Like other shapes it does
  // not know, it ignores Sequences nested deeper than kMaxNesting.
  std::optional<int32_t> TemplateBos(const json* pp, int depth = 0) {
    if (!pp || !pp->is_object()) return std::nullopt;
    const json* type = Find(*pp, "type");
    if (!type || !type->is_string()) return std::nullopt;
    if (*type == "Sequence") {
      const json* list = Find(*pp, "processors");
      if (!list || !list->is_array() || depth >= kMaxNesting) return std::nullopt;
      for (const json& p : *list) {
        if (auto id = TemplateBos(&p, depth + 1)) return id;
      }
      return std::nullopt;
    }
    if (*type != "TemplateProcessing") return std::nullopt;
    const json* single = Find(*pp, "single");
    if (!single || !single->is_array() || single->empty()) return std::nullopt;
    const json* st = Find((*single)[0], "SpecialToken");
    const json* name = st ? Find(*st, "id") : nullptr;
    if (!name || !name->is_string()) return std::nullopt;
    if (const json* specials = Find(*pp, "special_tokens")) {
      const json* entry = Find(*specials, name->get_ref<const std::string&>().c_str());
      const json* ids = entry ? Find(*entry, "ids") : nullptr;
      if (ids && ids->is_array() && !ids->empty() && (*ids)[0].is_number_integer()) {
        return (*ids)[0].get<int32_t>();
      }
    }
    auto it = names_.find(name->get_ref<const std::string&>());
    if (it == names_.end()) return std::nullopt;
    return it->second;
  }

  Status LoadSpecialIds(const json& root) {
    BpeTokenizer& t = *tok_;
    const std::optional<int32_t> template_bos = TemplateBos(Find(root, "post_processor"));
    std::optional<bool> add_bos;
    const std::filesystem::path dir = std::filesystem::path(f_.file()).parent_path();
    std::error_code ec;
    const std::string cfg_path = (dir / "tokenizer_config.json").string();
    if (side_files_ && std::filesystem::exists(cfg_path, ec)) {
      CACHET_ASSIGN_OR_RETURN(json cfg, ParseJsonFile(cfg_path));
      JsonFile cf(cfg_path);
      if (!cfg.is_object()) return cf.WrongType("(root)", "an object", cfg);
      for (auto [key, out] : {std::pair{"bos_token", &t.bos_id_}, {"eos_token", &t.eos_id_}}) {
        const json* v = Find(cfg, key);
        if (!v) continue;
        const json* content = v->is_object() ? Find(*v, "content") : v;
        if (!content || !content->is_string()) {
          return cf.WrongType(key, "a string or {\"content\": string}", *v);
        }
        auto it = names_.find(content->get_ref<const std::string&>());
        if (it == names_.end()) {
          return cf.Invalid(key, JsonExcerpt(*content) + " is not a token of " + f_.file());
        }
        *out = it->second;
      }
      if (Find(cfg, "add_bos_token")) {
        CACHET_ASSIGN_OR_RETURN(bool b, cf.Bool(cfg, "add_bos_token", "", false));
        add_bos = b;
      }
    }
    if (t.bos_id_ < 0 && template_bos) t.bos_id_ = *template_bos;
    const std::string model_cfg_path = (dir / "config.json").string();
    if (side_files_ && (t.bos_id_ < 0 || t.eos_id_ < 0) &&
        std::filesystem::exists(model_cfg_path, ec)) {
      CACHET_ASSIGN_OR_RETURN(json cfg, ParseJsonFile(model_cfg_path));
      JsonFile cf(model_cfg_path);
      for (auto [key, out] :
           {std::pair{"bos_token_id", &t.bos_id_}, {"eos_token_id", &t.eos_id_}}) {
        const json* v = Find(cfg, key);
        if (!v || *out >= 0) continue;
        if (v->is_array() && !v->empty()) {
          CACHET_ASSIGN_OR_RETURN(*out, cf.Id((*v)[0], Index(key, 0)));
        } else {
          CACHET_ASSIGN_OR_RETURN(*out, cf.Id(*v, key));
        }
      }
    }
    for (int32_t* id : {&t.bos_id_, &t.eos_id_}) {
      if (*id < 0 || *id >= t.vocab_size()) *id = -1;
    }
    t.add_bos_ = add_bos.value_or(template_bos.has_value()) && t.bos_id_ >= 0;
    return OkStatus();
  }

  JsonFile f_;
  bool side_files_ = true;   // tokenizer_config.json / config.json next to the file
  bool special_ids_ = true;  // BOS / EOS / add_bos from the post_processor and side files
  std::unique_ptr<BpeTokenizer> tok_;
  StringMap<int32_t> names_;  // vocab strings as written in the file, and added tokens -> id
};

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromHfJson(const std::string& json_path) {
  try {
    return BpeLoader(json_path).Load();
  } catch (const std::exception& e) {  // e.g. bad_alloc: keep exceptions out of callers
    return Internal(json_path + ": " + e.what());
  }
}

Result<std::unique_ptr<Tokenizer>> BpeTokenizerFromJsonText(std::string_view text,
                                                            const std::string& origin) {
  try {
    return BpeLoader(origin).LoadText(text);
  } catch (const std::exception& e) {
    return Internal(origin + ": " + e.what());
  }
}

Result<std::unique_ptr<Tokenizer>> BpeTokenizerFromJson(const nlohmann::json& root,
                                                        const std::string& origin, int32_t bos_id,
                                                        int32_t eos_id, bool add_bos) {
  try {
    return BpeLoader(origin).LoadInMemory(root, bos_id, eos_id, add_bos);
  } catch (const std::exception& e) {
    return Internal(origin + ": " + e.what());
  }
}

}  // namespace cachet

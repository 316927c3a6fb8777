// Tokenizer entry points shared by both kinds, and the streaming UTF-8 detokenizer.
#include "cachet/tokenizer.h"

#include <filesystem>

#include "model/bpe_tokenizer.h"
#include "model/gguf_model.h"

namespace cachet {

using tokenizer_internal::Utf8Scan;
using tokenizer_internal::Utf8Step;

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& model_dir) {
  if (IsGgufPath(model_dir)) {
    CACHET_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(model_dir));
    return TokenizerFromGguf(file);
  }
  const std::filesystem::path dir(model_dir);
  std::error_code ec;
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) {
    return FromHfJson((dir / "tokenizer.json").string());
  }
  if (std::filesystem::exists(dir / "tokenizer.model", ec)) {
    return FromSentencePiece((dir / "tokenizer.model").string());
  }
  return NotFound(model_dir + ": no tokenizer.json or tokenizer.model");
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += TokenBytes(id);
  return out;
}

std::vector<int32_t> Tokenizer::EncodePrompt(std::string_view text) const {
  std::vector<int32_t> ids;
  if (add_bos_ && bos_id_ >= 0) ids.push_back(bos_id_);
  std::vector<int32_t> body = Encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Appends the well-formed prefix of `in` to `out`, ill-formed subparts as U+FFFD. Returns how
// many bytes were consumed: all of them when `final`, else all but a truncated last character.
size_t AppendValid(std::string_view in, bool final, std::string* out) {
  const auto* p = reinterpret_cast<const unsigned char*>(in.data());
  size_t i = 0;
  while (i < in.size()) {
    if (p[i] < 0x80) {
      out->push_back(in[i++]);
      continue;
    }
    const Utf8Step st = Utf8Scan(p + i, in.size() - i);
    if (st.truncated && !final) break;
    if (st.valid) {
      out->append(in.substr(i, st.len));
    } else {
      out->append(kReplacement);
    }
    i += st.len;
  }
  return i;
}

}  // namespace

std::string StreamDecoder::Push(int32_t id) {
  pending_ += tok_.TokenBytes(id);
  std::string out;
  pending_.erase(0, AppendValid(pending_, /*final=*/false, &out));
  return out;
}

std::string StreamDecoder::Flush() {
  std::string out;
  AppendValid(pending_, /*final=*/true, &out);
  pending_.clear();
  return out;
}

}  // namespace cachet

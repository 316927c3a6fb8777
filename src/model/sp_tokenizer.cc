// SentencePiece tokenizer.model, through libsentencepiece's own processor so that segmentation
// and normalization match the reference exactly.
#include <sentencepiece_processor.h>

#include <filesystem>

#include "cachet/tokenizer.h"

namespace cachet {
namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581, SentencePiece's space

class SpTokenizer final : public Tokenizer {
 public:
  explicit SpTokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> sp)
      : sp_(std::move(sp)) {
    const int n = sp_->GetPieceSize();
    bytes_.resize(n);
    special_.resize(n);
    for (int id = 0; id < n; ++id) {
      const std::string& piece = sp_->IdToPiece(id);
      special_[id] = sp_->IsControl(id) || sp_->IsUnknown(id);
      if (special_[id]) {
        bytes_[id] = piece;
      } else if (sp_->IsByte(id)) {  // "<0xNN>"
        bytes_[id] = std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
      } else {
        std::string& s = bytes_[id];
        for (size_t i = 0; i < piece.size();) {
          if (piece.compare(i, kSpaceMark.size(), kSpaceMark) == 0) {
            s += ' ';
            i += kSpaceMark.size();
          } else {
            s += piece[i++];
          }
        }
      }
    }
    bos_id_ = sp_->bos_id();
    eos_id_ = sp_->eos_id();
    add_bos_ = bos_id_ >= 0;
  }

  // SentencePiece has no notion of special tokens written in the text: control pieces such as
  // "<s>" are never matched (user-defined symbols always are), so parse_special has no effect.
  std::vector<int32_t> Encode(std::string_view text, bool /*parse_special*/) const override {
    std::vector<int> ids;
    if (!sp_->Encode(text, &ids).ok()) return {};
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  std::string TokenBytes(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? bytes_[id] : std::string();
  }

  // The processor's decode drops control tokens and the dummy-prefix space.
  std::string Decode(std::span<const int32_t> ids) const override {
    std::vector<int> valid;
    valid.reserve(ids.size());
    for (int32_t id : ids) {
      if (id >= 0 && id < vocab_size()) valid.push_back(id);
    }
    std::string out;
    if (!sp_->Decode(valid, &out).ok()) return Tokenizer::Decode(ids);
    return out;
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(bytes_.size()); }
  bool IsSpecial(int32_t id) const override { return id >= 0 && id < vocab_size() && special_[id]; }
  std::string_view kind() const override { return "sentencepiece"; }

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::vector<std::string> bytes_;
  std::vector<uint8_t> special_;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromSentencePiece(const std::string& model_path) {
  std::error_code ec;
  if (!std::filesystem::exists(model_path, ec)) return NotFound(model_path + ": no such file");
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->Load(model_path);
  if (!status.ok()) return DataLoss(model_path + ": " + status.ToString());
  return std::unique_ptr<Tokenizer>(std::make_unique<SpTokenizer>(std::move(sp)));
}

}  // namespace cachet

// Tokenizers: HF tokenizer.json byte-level BPE and SentencePiece tokenizer.model.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet {

class Tokenizer {
 public:
  // Loads <dir>/tokenizer.json if present, else <dir>/tokenizer.model (SentencePiece).
  // Reads <dir>/tokenizer_config.json (add_bos_token, bos/eos names) when present.
  static Result<std::unique_ptr<Tokenizer>> Load(const std::string& model_dir);
  // Loaders for one file each; errors name the file and the JSON path that is wrong.
  static Result<std::unique_ptr<Tokenizer>> FromHfJson(const std::string& json_path);
  static Result<std::unique_ptr<Tokenizer>> FromSentencePiece(const std::string& model_path);

  virtual ~Tokenizer() = default;

  // Text to ids, without BOS. Added/special tokens written in the text are matched first when
  // parse_special is set. Invalid UTF-8 never crashes (bytes still round-trip for byte-level BPE).
  virtual std::vector<int32_t> Encode(std::string_view text, bool parse_special = true) const = 0;
  // The raw bytes a token stands for (special tokens: their text). Concatenating TokenBytes of a
  // sequence gives its decoded text, except SentencePiece's leading-space rule in Decode.
  virtual std::string TokenBytes(int32_t id) const = 0;
  virtual std::string Decode(std::span<const int32_t> ids) const;
  virtual int32_t vocab_size() const = 0;
  // -1 when the tokenizer has no such token.
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool add_bos() const { return add_bos_; }
  virtual bool IsSpecial(int32_t id) const = 0;
  virtual std::string_view kind() const = 0;  // "bpe" or "sentencepiece"

  // BOS (when add_bos()) + Encode(text).
  std::vector<int32_t> EncodePrompt(std::string_view text) const;

 protected:
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  bool add_bos_ = false;
};

// Streaming detokenizer: returns only complete UTF-8 characters, holding back bytes of a
// character split across tokens until the rest arrives.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string Push(int32_t id);
  std::string Flush();  // whatever is held back (invalid UTF-8 bytes replaced by U+FFFD)
  // Whether bytes of the tokens pushed so far are held back (a character not yet complete).
  bool holding() const { return !pending_.empty(); }

 private:
  const Tokenizer& tok_;
  std::string pending_;
};

}  // namespace cachet

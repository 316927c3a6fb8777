// Output constrained to one JSON object (OpenAI's response_format {"type": "json_object"}): a
// byte-level pushdown automaton of RFC 8259 JSON whose top level is an object, and the token
// filter the sampler consults with it.
//
// The automaton is a few words of state (the open containers a bit each, up to kMaxDepth), so a
// candidate token is checked by copying it and feeding the token's bytes. Strings must be valid
// UTF-8 without control characters (as RFC 8259 and every strict parser want), a run of white
// space is at most kMaxSpace bytes with one line break (pretty-printing needs no more, as in
// llama.cpp's JSON grammar: a model looping on blank lines is cut off, and a chat template's
// "\n\n" stop string never ends an object early), the text starts with the object's '{', and once
// the object is closed only EOS may follow (no other special token before it).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cachet {

class Tokenizer;

class JsonObjectPrefix {
 public:
  static constexpr int kMaxDepth = 64;
  static constexpr int kMaxSpace = 32;

  // Whether bytes continue the text so far towards a JSON object; on false the state is
  // undefined (check on a copy).
  bool Feed(std::string_view bytes);
  // The object is closed: the text so far is one JSON object (and white space).
  bool complete() const { return mode_ == Mode::kDone; }

 private:
  enum class Mode : uint8_t {
    kStart,       // before the top-level '{'
    kKeyOrEnd,    // after '{'
    kKey,         // after ',' in an object
    kColon,       // after a key
    kValue,       // after ':', or ',' in an array
    kValueOrEnd,  // after '['
    kAfter,       // after a value in a container: ',' or the container's close
    kString,      // in a string (key_: an object's key)
    kEscape,      // after a backslash in a string
    kHex,         // in \uXXXX (hex_left_ digits to go)
    kNumber,      // in a number (num_)
    kLiteral,     // in true, false or null (literal_, literal_at_)
    kDone,        // the top-level object is closed
  };
  enum class Num : uint8_t { kMinus, kZero, kInt, kDot, kFrac, kE, kESign, kExp };

  bool Byte(uint8_t c);
  bool StartValue(uint8_t c);
  bool Open(bool object);
  bool Close(bool object);
  void ValueDone() { mode_ = depth_ == 0 ? Mode::kDone : Mode::kAfter; }
  bool in_object() const { return (objects_ >> (depth_ - 1)) & 1; }

  Mode mode_ = Mode::kStart;
  Num num_ = Num::kMinus;
  bool key_ = false;
  uint8_t depth_ = 0;
  uint8_t space_run_ = 0;
  bool newline_in_run_ = false;
  uint8_t hex_left_ = 0;
  uint16_t hex_value_ = 0;
  bool low_surrogate_next_ = false;          // a \uD800-\uDBFF must be followed by a \uDC00-\uDFFF
  uint8_t utf8_left_ = 0;                    // continuation bytes a character still needs
  uint8_t utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // the next continuation byte's range
  uint8_t literal_at_ = 0;
  const char* literal_ = nullptr;
  uint64_t objects_ = 0;  // bit d: container d is an object (else an array)
};

// The sampler's filter for one sequence: which tokens may come next, and the text so far.
class JsonConstraint {
 public:
  explicit JsonConstraint(const Tokenizer& tokenizer);
  bool Allows(int32_t token);
  // Every token that may not come next gets -inf; none allowed leaves EOS (never reached: one
  // byte always continues a JSON prefix, and byte tokens are in every vocabulary this reads).
  void Mask(std::span<float> logits);
  void Accept(int32_t token);
  bool complete() const { return state_.complete(); }

 private:
  // A token's bytes (empty for a special token), from the table made at the first call: no
  // allocation per token after it.
  std::string_view Bytes(int32_t token);
  const Tokenizer& tok_;
  JsonObjectPrefix state_;
  std::string blob_;
  std::vector<uint32_t> offsets_;
  std::vector<uint8_t> special_;
};

}  // namespace cachet

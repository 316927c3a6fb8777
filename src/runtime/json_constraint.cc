#include "runtime/json_constraint.h"

#include <cstring>
#include <limits>

#include "cachet/tokenizer.h"

namespace cachet {
namespace {

bool IsSpace(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool IsDigit(uint8_t c) { return c >= '0' && c <= '9'; }
bool IsHex(uint8_t c) { return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

bool JsonObjectPrefix::Feed(std::string_view bytes) {
  for (const char ch : bytes) {
    if (!Byte(static_cast<uint8_t>(ch))) return false;
  }
  return true;
}

bool JsonObjectPrefix::Open(bool object) {
  if (depth_ >= kMaxDepth) return false;
  objects_ = (objects_ & ~(uint64_t{1} << depth_)) | (uint64_t{object} << depth_);
  ++depth_;
  mode_ = object ? Mode::kKeyOrEnd : Mode::kValueOrEnd;
  return true;
}

bool JsonObjectPrefix::Close(bool object) {
  if (depth_ == 0 || in_object() != object) return false;
  --depth_;
  ValueDone();
  return true;
}

bool JsonObjectPrefix::StartValue(uint8_t c) {
  switch (c) {
    case '{':
      return Open(true);
    case '[':
      return Open(false);
    case '"':
      mode_ = Mode::kString;
      key_ = false;
      return true;
    case '-':
      mode_ = Mode::kNumber;
      num_ = Num::kMinus;
      return true;
    case 't':
    case 'f':
    case 'n':
      mode_ = Mode::kLiteral;
      literal_ = c == 't' ? "true" : c == 'f' ? "false" : "null";
      literal_at_ = 1;
      return true;
    default:
      if (!IsDigit(c)) return false;
      mode_ = Mode::kNumber;
      num_ = c == '0' ? Num::kZero : Num::kInt;
      return true;
  }
}

bool JsonObjectPrefix::Byte(uint8_t c) {
  // White space between the object's tokens; none before it or after it (the text is the object,
  // as OpenAI's JSON mode writes it, and a closed object ends with EOS at once).
  const bool structural = mode_ != Mode::kString && mode_ != Mode::kEscape && mode_ != Mode::kHex &&
                          mode_ != Mode::kLiteral && mode_ != Mode::kNumber &&
                          mode_ != Mode::kStart && mode_ != Mode::kDone;
  if (structural && IsSpace(c)) {
    if (c == '\n' && newline_in_run_) return false;
    newline_in_run_ |= c == '\n';
    return ++space_run_ <= kMaxSpace;
  }
  space_run_ = 0;
  newline_in_run_ = false;
  switch (mode_) {
    case Mode::kStart:
      return c == '{' && Open(true);
    case Mode::kKeyOrEnd:
      if (c == '}') return Close(true);
      [[fallthrough]];
    case Mode::kKey:
      if (c != '"') return false;
      mode_ = Mode::kString;
      key_ = true;
      return true;
    case Mode::kColon:
      if (c != ':') return false;
      mode_ = Mode::kValue;
      return true;
    case Mode::kValueOrEnd:
      if (c == ']') return Close(false);
      [[fallthrough]];
    case Mode::kValue:
      return StartValue(c);
    case Mode::kAfter:
      if (c == ',') {
        mode_ = in_object() ? Mode::kKey : Mode::kValue;
        return true;
      }
      if (c == '}' || c == ']') return Close(c == '}');
      return false;
    case Mode::kString:
      if (utf8_left_ > 0) {
        if (c < utf8_lo_ || c > utf8_hi_) return false;
        --utf8_left_;
        utf8_lo_ = 0x80;
        utf8_hi_ = 0xBF;
        return true;
      }
      if (low_surrogate_next_ && c != '\\') return false;
      if (c == '"') {
        if (key_) {
          mode_ = Mode::kColon;
        } else {
          ValueDone();
        }
        return true;
      }
      if (c == '\\') {
        mode_ = Mode::kEscape;
        return true;
      }
      if (c < 0x20) return false;
      if (c < 0x80) return true;
      // UTF-8 lead bytes and the ranges of the byte after them (no overlong forms, no
      // surrogates, nothing past U+10FFFF).
      if (c >= 0xC2 && c <= 0xDF) {
        utf8_left_ = 1;
      } else if (c >= 0xE0 && c <= 0xEF) {
        utf8_left_ = 2;
        if (c == 0xE0) utf8_lo_ = 0xA0;
        if (c == 0xED) utf8_hi_ = 0x9F;
      } else if (c >= 0xF0 && c <= 0xF4) {
        utf8_left_ = 3;
        if (c == 0xF0) utf8_lo_ = 0x90;
        if (c == 0xF4) utf8_hi_ = 0x8F;
      } else {
        return false;
      }
      return true;
    case Mode::kEscape:
      if (c == 'u') {
        mode_ = Mode::kHex;
        hex_left_ = 4;
        hex_value_ = 0;
        return true;
      }
      if (low_surrogate_next_ || c == 0 || std::strchr("\"\\/bfnrt", c) == nullptr) return false;
      mode_ = Mode::kString;
      return true;
    case Mode::kHex: {
      if (!IsHex(c)) return false;
      const int digit = IsDigit(c) ? c - '0' : (c | 0x20) - 'a' + 10;
      hex_value_ = static_cast<uint16_t>(hex_value_ * 16 + digit);
      if (--hex_left_ > 0) return true;
      mode_ = Mode::kString;
      const bool high = hex_value_ >= 0xD800 && hex_value_ <= 0xDBFF;
      const bool low = hex_value_ >= 0xDC00 && hex_value_ <= 0xDFFF;
      if (low != low_surrogate_next_) return false;  // a lone half of a surrogate pair
      low_surrogate_next_ = high;
      return true;
    }
    case Mode::kLiteral:
      if (c != static_cast<uint8_t>(literal_[literal_at_])) return false;
      if (literal_[++literal_at_] == '\0') ValueDone();
      return true;
    case Mode::kNumber: {
      switch (num_) {
        case Num::kMinus:
          if (!IsDigit(c)) return false;
          num_ = c == '0' ? Num::kZero : Num::kInt;
          return true;
        case Num::kInt:
          if (IsDigit(c)) return true;
          [[fallthrough]];
        case Num::kZero:
          if (c == '.') {
            num_ = Num::kDot;
            return true;
          }
          if (c == 'e' || c == 'E') {
            num_ = Num::kE;
            return true;
          }
          break;
        case Num::kDot:
          if (!IsDigit(c)) return false;
          num_ = Num::kFrac;
          return true;
        case Num::kFrac:
          if (IsDigit(c)) return true;
          if (c == 'e' || c == 'E') {
            num_ = Num::kE;
            return true;
          }
          break;
        case Num::kE:
          if (c == '+' || c == '-') {
            num_ = Num::kESign;
            return true;
          }
          [[fallthrough]];
        case Num::kESign:
          if (!IsDigit(c)) return false;
          num_ = Num::kExp;
          return true;
        case Num::kExp:
          if (IsDigit(c)) return true;
          break;
      }
      // The number ended (a number is never the top level here: a delimiter follows it).
      ValueDone();
      return Byte(c);
    }
    case Mode::kDone:
      return false;
  }
  return false;
}

JsonConstraint::JsonConstraint(const Tokenizer& tokenizer) : tok_(tokenizer) {}

std::string_view JsonConstraint::Bytes(int32_t token) {
  if (offsets_.empty()) {
    const int32_t n = tok_.vocab_size();
    offsets_.reserve(n + 1);
    special_.resize(n);
    for (int32_t t = 0; t < n; ++t) {
      offsets_.push_back(static_cast<uint32_t>(blob_.size()));
      special_[t] = tok_.IsSpecial(t);
      if (!special_[t]) blob_ += tok_.TokenBytes(t);
    }
    offsets_.push_back(static_cast<uint32_t>(blob_.size()));
  }
  return std::string_view(blob_).substr(offsets_[token], offsets_[token + 1] - offsets_[token]);
}

bool JsonConstraint::Allows(int32_t token) {
  if (token < 0 || token >= tok_.vocab_size()) return false;
  const std::string_view bytes = Bytes(token);
  if (special_[token]) return state_.complete() && token == tok_.eos_id();
  JsonObjectPrefix next = state_;
  return !bytes.empty() && next.Feed(bytes);
}

void JsonConstraint::Mask(std::span<float> logits) {
  const float kNo = -std::numeric_limits<float>::infinity();
  const auto vocab = static_cast<size_t>(tok_.vocab_size());
  bool any = false;
  for (size_t t = 0; t < logits.size(); ++t) {
    const bool ok = t < vocab && Allows(static_cast<int32_t>(t));
    if (!ok) logits[t] = kNo;
    any |= ok;
  }
  const int32_t eos = tok_.eos_id();
  if (!any && eos >= 0 && static_cast<size_t>(eos) < logits.size()) logits[eos] = 0.0f;
}

void JsonConstraint::Accept(int32_t token) {
  if (token < 0 || token >= tok_.vocab_size()) return;
  JsonObjectPrefix next = state_;
  if (next.Feed(Bytes(token))) state_ = next;  // a special token's bytes: none
}

}  // namespace cachet

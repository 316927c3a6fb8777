// A chat reply's thinking apart from its answer, as DeepSeek's API and llama.cpp's server
// (--reasoning-format deepseek) return it: the text between <think> and </think> goes to
// `reasoning_content`, the rest to `content`. A reply is thinking when it opens with <think>
// (after white space), or from its first byte when the generation prompt opened the tag itself
// (DeepSeek-R1's templates end the prompt with "<think>\n": ChatTemplate::open_think). White
// space right after </think> is dropped, as R1 writes "</think>\n\n" before its answer.
//
// Fed the reply piece by piece as it streams (a tag may be cut anywhere, a token's text being any
// bytes): each Feed returns what can already be told apart, holding back only what might still
// be the start of a tag; Finish returns the rest (Feed with last does both).
#pragma once

#include <string>
#include <string_view>

#include "cachet/server.h"  // ReasoningFormat

namespace cachet::server {

class ReasoningSplit {
 public:
  struct Piece {
    std::string reasoning;
    std::string content;
  };
  // opened: the prompt ended inside <think>.
  explicit ReasoningSplit(bool opened) : state_(opened ? State::kThinking : State::kStart) {}
  Piece Feed(std::string_view text, bool last = false);
  Piece Finish();
  // The reply had a <think> part (possibly empty, possibly never closed).
  bool reasoned() const { return state_ != State::kStart && state_ != State::kContent; }

 private:
  enum class State : uint8_t {
    kStart,     // nothing but white space yet: a <think> may still open
    kThinking,  // inside <think>
    kAfter,     // past </think>, only white space since
    kAnswer,    // past </think> and its white space
    kContent,   // no <think>: everything is content
  };
  State state_;
  std::string held_;
};

}  // namespace cachet::server

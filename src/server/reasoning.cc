#include "reasoning.h"

#include <algorithm>

namespace cachet::server {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// The length of the longest end of text that begins tag (and is shorter than it).
size_t TagStartAtEnd(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (tag.starts_with(text.substr(text.size() - n))) return n;
  }
  return 0;
}

}  // namespace

Result<ReasoningFormat> ParseReasoningFormat(std::string_view name) {
  if (name == "none") return ReasoningFormat::kNone;
  if (name == "deepseek" || name == "auto") return ReasoningFormat::kDeepSeek;
  std::string message = "'";
  message.append(name).append("' is not a reasoning format (none, deepseek, auto)");
  return InvalidArgument(message);
}

ReasoningSplit::Piece ReasoningSplit::Feed(std::string_view text, bool last) {
  Piece out;
  held_.append(text);
  for (bool more = true; more;) {
    more = false;
    std::string_view h = held_;
    switch (state_) {
      case State::kStart: {
        const size_t lead = std::find_if_not(h.begin(), h.end(), IsSpace) - h.begin();
        const std::string_view rest = h.substr(lead);
        if (rest.starts_with(kOpen)) {
          held_.erase(0, lead + kOpen.size());
          state_ = State::kThinking;
          more = true;
        } else if (rest.empty() || kOpen.starts_with(rest)) {
          // Held: white space, or the tag's beginning.
        } else {
          state_ = State::kContent;
          more = true;
        }
        break;
      }
      case State::kThinking: {
        const size_t end = h.find(kClose);
        if (end != h.npos) {
          out.reasoning.append(h.substr(0, end));
          held_.erase(0, end + kClose.size());
          state_ = State::kAfter;
          more = true;
        } else {
          const size_t keep = TagStartAtEnd(h, kClose);
          out.reasoning.append(h.substr(0, h.size() - keep));
          held_.erase(0, h.size() - keep);
        }
        break;
      }
      case State::kAfter: {
        const size_t lead = std::find_if_not(h.begin(), h.end(), IsSpace) - h.begin();
        held_.erase(0, lead);
        if (!held_.empty()) {
          state_ = State::kAnswer;
          more = true;
        }
        break;
      }
      case State::kAnswer:
      case State::kContent:
        out.content.append(held_);
        held_.clear();
        break;
    }
  }
  if (last) {
    const Piece rest = Finish();
    out.reasoning += rest.reasoning;
    out.content += rest.content;
  }
  return out;
}

ReasoningSplit::Piece ReasoningSplit::Finish() {
  Piece out;
  switch (state_) {
    case State::kStart:  // only white space, or a <think> cut short: the reply as it is
    case State::kAnswer:
    case State::kContent:
      out.content = std::move(held_);
      break;
    case State::kThinking:  // never closed: all of it was thinking
      out.reasoning = std::move(held_);
      break;
    case State::kAfter:
      break;
  }
  held_.clear();
  return out;
}

}  // namespace cachet::server

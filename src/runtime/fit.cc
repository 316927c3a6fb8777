// Chats longer than the context: the --on-full policy, and a prompt made to fit by pressing its
// history (Session::EvalFitting, which `cachet serve --on-full press:...` runs at admission).
#include <algorithm>
#include <cstdlib>
#include <string>

#include "cachet/engine.h"
#include "cachet/press.h"
#include "kv/paged_sequence.h"

namespace cachet {
namespace press {

Result<OnFull> ParseOnFull(std::string_view text) {
  OnFull o;
  if (text == "error") return o;
  if (text == "shift") {
    o.kind = OnFull::Kind::kShift;
    return o;
  }
  const size_t colon = text.rfind(':');
  if (!text.starts_with("press:") || colon <= 6) {
    return InvalidArgument("--on-full: '" + std::string(text) +
                           "' is not error, shift or press:NAME:RATIO (e.g. press:keydiff:0.5)");
  }
  o.kind = OnFull::Kind::kPress;
  CACHET_RETURN_IF_ERROR(ParsePressSpec(text.substr(6, colon - 6), &o.press));
  const std::string ratio(text.substr(colon + 1));
  char* end = nullptr;
  o.press.ratio = std::strtod(ratio.c_str(), &end);
  if (ratio.empty() || *end != '\0' || !(o.press.ratio > 0 && o.press.ratio < 1)) {
    return InvalidArgument("--on-full: the press ratio '" + ratio + "' is not in (0, 1)");
  }
  if (!o.press.ReadsCacheAlone()) {
    return InvalidArgument(
        "--on-full press: the history is pressed when the next turn would not fit, with no "
        "prompt being observed, so the scorer must read the cache alone (streaming, knorm, "
        "keydiff, random), without quest, +chunked, demotion or pressing while decoding");
  }
  // One token set for every table, so the pressed tokens' positions can be given back.
  if (o.press.share == ShareLayers::kNone) o.press.share = ShareLayers::kMax;
  return o;
}

}  // namespace press

Result<int> Session::EvalFitting(std::span<const int32_t> tokens, const FitOptions& fit,
                                 std::vector<float>* logits) {
  if (n_tokens() != 0 || !pending_.empty()) {
    return FailedPrecondition("EvalFitting evaluates a prompt into an empty session");
  }
  const press::PressOptions& p = fit.press;
  if (!p.ReadsCacheAlone() || p.share == press::ShareLayers::kNone ||
      !(p.ratio > 0 && p.ratio < 1)) {
    return InvalidArgument(
        "fitting a prompt: its press must read the cache alone, keep one token set for every "
        "table (+max or +mean) and remove a ratio in (0, 1)");
  }
  const int n = static_cast<int>(tokens.size());
  const int tail = std::clamp(fit.tail, 0, n);
  const int protect = std::clamp(fit.protect, 0, tail);
  const int after = n - tail, n_ctx = engine_.n_ctx();
  if (int64_t{protect} + after + fit.reserve > n_ctx) {
    return OutOfRange("the first " + std::to_string(protect) + " tokens and the last " +
                      std::to_string(after) + " with room for " + std::to_string(fit.reserve) +
                      " more do not fit in the context of " + std::to_string(n_ctx) +
                      ", however much the history between them is pressed");
  }
  press::PressOptions o = p;
  o.sinks = protect;
  o.window = 0;  // the tail, the part kept whole, comes after
  int pressed_away = 0;
  // No page ages (--kv-cold) until the prompt is in: a press keeps one token set over the hot
  // tables, which pages moved to the cold pool would leave (CompactPositions refused them).
  struct AgingPaused {
    PagedSequence& seq;
    const int after = seq.age_out();
    ~AgingPaused() { seq.set_age_out(after); }
  } paused{*seq_};
  seq_->set_age_out(0);
  auto fail = [&](Status s) {
    (void)Truncate(0);
    return s;
  };
  // The protected tokens first, on their own (at least one): a fresh session looks their pages up
  // in the prefix cache and publishes them, so a chat's system prompt is shared; what comes after
  // is not published, so pressing it copies no shared page.
  const int head = std::max(protect, std::min(1, tail));
  if (head > 0) {
    if (Status s = Eval(tokens.first(head), head == n ? logits : nullptr); !s.ok()) return fail(s);
  }
  for (int at = head; at < tail;) {
    // The largest piece that leaves room for the tail and the reserve; the history is pressed
    // until there is one.
    auto largest_piece = [&] {
      return std::min(
          {engine_.options().ubatch, tail - at, n_ctx - n_tokens() - after - fit.reserve});
    };
    int piece = largest_piece();
    while (piece <= 0) {
      const int before = n_tokens();
      if (before <= protect) break;
      auto r = Compress(o);
      if (!r.ok()) return fail(r.status());
      if (Status s = CompactPositions(); !s.ok()) return fail(s);
      if (n_tokens() >= before) break;  // the press kept everything: pressing again will too
      pressed_away += before - n_tokens();
      piece = largest_piece();
    }
    if (piece <= 0) {
      return fail(
          OutOfRange("pressing the history freed too little: " + std::to_string(n_tokens()) +
                     " tokens held, " + std::to_string(after) + " to come and room for " +
                     std::to_string(fit.reserve) + " in the context of " + std::to_string(n_ctx)));
    }
    at += piece;
    std::vector<float>* out = at == n ? logits : nullptr;
    if (Status s = Eval(tokens.subspan(at - piece, piece), out); !s.ok()) return fail(s);
  }
  if (after > 0) {
    if (Status s = Eval(tokens.subspan(tail), logits); !s.ok()) return fail(s);
  }
  return pressed_away;
}

}  // namespace cachet

#include "cachet/eval/method.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <optional>
#include <tuple>

#include "cachet/engine.h"
#include "kv/codecs/codec.h"
#include "kv/press/press.h"

namespace cachet::eval {

const char* CompressAtName(CompressAt c) { return c == CompressAt::kPrompt ? "prompt" : "context"; }

Result<CompressAt> ParseCompressAt(std::string_view name) {
  if (name == "prompt") return CompressAt::kPrompt;
  if (name == "context") return CompressAt::kContext;
  return InvalidArgument("--compress-at must be 'prompt' or 'context', got '" + std::string(name) +
                         "'");
}

const std::vector<std::string>& KnownPresses() {
  static const std::vector<std::string> kPresses = [] {
    std::vector<std::string> v = {"full"};
    for (const std::string& s : press::ScorerNames()) v.push_back(s);
    v.push_back("pyramidkv");
    v.push_back("quest");
    return v;
  }();
  return kPresses;
}

std::string Method::Label() const {
  char size[32] = "";
  if (budget > 0) {
    std::snprintf(size, sizeof size, "#%d", budget);
  } else if (press != "full") {
    std::snprintf(size, sizeof size, "@%g", ratio);
  }
  std::string s = blend ? "chunks:" + BlendName(*blend) : press;
  s.append(size).append("/").append(codec_k);
  if (codec_v != codec_k) s.append(":").append(codec_v);
  return s;
}

Result<Method> ParseMethod(std::string_view label) {
  Method m;
  std::string_view press = label, codec;
  if (size_t slash = label.find('/'); slash != std::string_view::npos) {
    press = label.substr(0, slash);
    codec = label.substr(slash + 1);
  }
  auto number = [&](std::string_view text, auto* out) -> Status {
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
    if (ec != std::errc() || end != text.data() + text.size()) {
      return InvalidArgument("bad number '" + std::string(text) + "' in method '" +
                             std::string(label) + "'");
    }
    return OkStatus();
  };
  if (size_t at = press.find('@'); at != std::string_view::npos) {
    CACHET_RETURN_IF_ERROR(number(press.substr(at + 1), &m.ratio));
    press = press.substr(0, at);
  } else if (size_t hash = press.find('#'); hash != std::string_view::npos) {
    CACHET_RETURN_IF_ERROR(number(press.substr(hash + 1), &m.budget));
    press = press.substr(0, hash);
  }
  m.press = std::string(press);
  if (!codec.empty()) std::tie(m.codec_k, m.codec_v) = codecs::SplitKv(codec);
  CACHET_RETURN_IF_ERROR(ValidateMethod(m));
  return m;
}

namespace {
// Keys in this codec are encoded per group of tokens (KIVI), so single tokens cannot be evicted
// from, or appended to, their pages one by one.
bool GroupEncodesKeys(const std::string& name) {
  const auto c = codecs::ParseCodec(name);
  return c.ok() && codecs::NeedsFullPage(c.value(), codecs::Role::kKey);
}

// m's press as parsed (null for "full" and for specs ValidateMethod rejects).
std::optional<press::PressOptions> ParsedPress(const Method& m) {
  press::PressOptions o;
  if (m.press == "full" || !press::ParsePressSpec(m.press, &o).ok()) return std::nullopt;
  return o;
}

}  // namespace

Status ValidateMethod(const Method& m) {
  if (m.press != "full") {
    press::PressOptions o;
    CACHET_RETURN_IF_ERROR(press::ParsePressSpec(m.press, &o));
    if (!o.demote.empty() && !codecs::ParseCodec(o.demote).ok()) {
      return InvalidArgument("unknown demote codec '" + o.demote + "' in press '" + m.press + "'");
    }
  }
  for (const std::string& c : {m.codec_k, m.codec_v}) {
    if (auto codec = codecs::ParseCodec(c); !codec.ok()) return codec.status();
  }
  if (!(m.ratio >= 0 && m.ratio < 1)) {
    return InvalidArgument("--ratio is the fraction of KV removed and must be in [0, 1)");
  }
  if (m.budget < 0) return InvalidArgument("--budget must be a positive token count");
  if (m.press == "full" && (m.ratio > 0 || m.budget > 0)) {
    return InvalidArgument("press 'full' keeps every entry: it takes no ratio or budget");
  }
  return OkStatus();
}

Status MethodAvailable(const Method& m) {
  CACHET_RETURN_IF_ERROR(ValidateMethod(m));
  const auto o = ParsedPress(m);
  if (o && GroupEncodesKeys(o->demote)) {
    return Unimplemented("press '" + m.press +
                         "': demoted tokens are appended one by one, so the cold codec must be "
                         "row-wise, not " +
                         o->demote);
  }
  return OkStatus();
}

bool NeedsAttention(const Method& m) { return Gatherings(m) != 0; }

uint32_t Gatherings(const Method& m) {
  const auto o = ParsedPress(m);
  return o ? press::GatheringsFor(*o) : 0;
}

bool CompressesDuringPrefill(const Method& m) {
  const auto o = ParsedPress(m);
  return o && o->during_prefill;
}

namespace {
Result<press::PressOptions> PressOf(const Method& m) {
  press::PressOptions o;
  CACHET_RETURN_IF_ERROR(press::ParsePressSpec(m.press, &o));
  o.ratio = m.ratio;
  o.budget = m.budget;
  o.window = m.window;
  o.sinks = m.sinks;
  o.demote_fetch = m.demote_fetch;
  o.probe_texts = m.probe_texts;
  return o;
}
}  // namespace

Status PrefillCompressing(const Method& m, std::span<const int32_t> prompt, Session& session,
                          std::vector<float>* logits, size_t* peak_bytes) {
  CACHET_RETURN_IF_ERROR(MethodAvailable(m));
  CACHET_ASSIGN_OR_RETURN(press::PressOptions o, PressOf(m));
  return session.EvalCompressing(prompt, o, logits, peak_bytes);
}

Status ApplyMethod(const Method& m, Session& session, std::span<const int32_t> segment_starts,
                   size_t* peak_bytes) {
  CACHET_RETURN_IF_ERROR(MethodAvailable(m));
  // The codec is not applied here: it is a property of the engine's pool, so the session was
  // prefilled by an engine storing pages in m's codecs (EngineFor in harness.cc).
  if (m.press == "full") return OkStatus();
  CACHET_ASSIGN_OR_RETURN(press::PressOptions o, PressOf(m));
  o.segment_starts.assign(segment_starts.begin(), segment_starts.end());
  auto r = session.Compress(o);
  if (!r.ok()) return r.status();
  if (peak_bytes) *peak_bytes = std::max(*peak_bytes, r->peak_bytes);
  return OkStatus();
}

}  // namespace cachet::eval

// Press specs (cachet/press.h): the scorers' table, parsing a spec into PressOptions and naming
// it back. The presses themselves: press.cc.
#include <algorithm>
#include <cstdio>
#include <iterator>

#include "kv/codecs/codec.h"
#include "kv/press/press.h"

namespace cachet::press {
namespace {

constexpr const char* kScorerNames[] = {"streaming", "h2o",      "snapkv", "tova",  "knorm",
                                        "keydiff",   "expected", "random", "kvzip", "lookahead"};
static_assert(std::size(kScorerNames) == static_cast<size_t>(Scorer::kLookahead) + 1);

}  // namespace

// Expected attention reads the window's query statistics, gathered alongside the window's
// weights.
uint32_t ScorerGatherings(Scorer s) {
  switch (s) {
    case Scorer::kH2O:
      return 1u << PressObserver::kAll;
    case Scorer::kSnapKV:
    case Scorer::kExpected:
      return 1u << PressObserver::kWindow;
    case Scorer::kTova:
      return 1u << PressObserver::kLast;
    case Scorer::kKvzip:
    case Scorer::kLookahead:
      return 1u << PressObserver::kWindowMax;
    default:
      return 0;
  }
}

bool PressOptions::NeedsAttention() const {
  return !quest && !Probes() && ScorerGatherings(scorer) != 0;
}
bool PressOptions::Probes() const {
  return scorer == Scorer::kKvzip || scorer == Scorer::kLookahead;
}

bool PressOptions::ReadsCacheAlone() const {
  return !NeedsAttention() && !Probes() && !quest && !during_prefill && demote.empty() &&
         decode_every == 0;
}

const std::vector<std::string>& ScorerNames() {
  static const std::vector<std::string> kNames(std::begin(kScorerNames), std::end(kScorerNames));
  return kNames;
}

const char* ScorerName(Scorer s) { return kScorerNames[static_cast<int>(s)]; }

Status ParsePressSpec(std::string_view spec, PressOptions* o) {
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t plus = spec.find('+', start);
    parts.push_back(spec.substr(start, plus - start));
    if (plus == std::string_view::npos) break;
    start = plus + 1;
  }
  o->allocator = Allocator::kUniform;
  o->share = ShareLayers::kNone;
  o->quest = false;
  o->during_prefill = false;
  o->demote.clear();
  o->protect_boundaries = false;
  o->merge = false;
  std::string_view name = parts[0];
  if (name == "quest") {
    if (parts.size() > 1) {
      return InvalidArgument("press 'quest' evicts nothing, so it takes no modifiers ('" +
                             std::string(spec) + "')");
    }
    o->quest = true;
    return OkStatus();
  }
  if (name == "pyramidkv") {
    name = "snapkv";
    o->allocator = Allocator::kPyramid;
  }
  const auto& names = ScorerNames();
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    std::string known;
    for (const auto& n : names) known += n + ", ";
    return InvalidArgument("unknown press '" + std::string(name) + "' in '" + std::string(spec) +
                           "' (known: " + known + "pyramidkv, quest)");
  }
  o->scorer = static_cast<Scorer>(it - names.begin());
  // One modifier of each kind: "snapkv+ada+pyramid" silently took the last.
  std::string_view kind_given[3] = {name == "snapkv" && o->allocator == Allocator::kPyramid
                                        ? std::string_view("pyramidkv")
                                        : std::string_view(),
                                    {},
                                    {}};
  auto once = [&](int kind, std::string_view m) -> Status {
    static constexpr const char* kKinds[] = {"per-head allocators", "cross-layer selections",
                                             "demotions"};
    if (!kind_given[kind].empty()) {
      return InvalidArgument("press '" + std::string(spec) + "' gives two " + kKinds[kind] + " ('" +
                             std::string(kind_given[kind]) + "' and '" + std::string(m) +
                             "'): give one");
    }
    kind_given[kind] = m;
    return OkStatus();
  };
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string_view m = parts[i];
    const int kind = m == "uniform" || m == "pyramid" || m == "ada" ? 0
                     : m == "max" || m == "mean"                    ? 1
                     : m.substr(0, 7) == "demote:"                  ? 2
                                                                    : -1;
    if (kind >= 0) CACHET_RETURN_IF_ERROR(once(kind, m));
    if (m == "uniform") {
      o->allocator = Allocator::kUniform;
    } else if (m == "pyramid") {
      o->allocator = Allocator::kPyramid;
    } else if (m == "ada") {
      o->allocator = Allocator::kAda;
    } else if (m == "max") {
      o->share = ShareLayers::kMax;
    } else if (m == "mean") {
      o->share = ShareLayers::kMean;
    } else if (m == "merge") {
      o->merge = true;
    } else if (m == "protect") {
      o->protect_boundaries = true;
    } else if (m == "chunked") {
      o->during_prefill = true;
    } else if (m.substr(0, 7) == "demote:" && m.size() > 7) {
      // Codec names may hold a '+' (rot3+qjl): the next parts belong to the codec while they do.
      o->demote = std::string(m.substr(7));
      for (std::string longer; i + 1 < parts.size(); o->demote = longer) {
        longer = o->demote;
        longer.append("+").append(parts[i + 1]);
        if (!codecs::ParseCodec(longer).ok()) break;
        ++i;
      }
    } else {
      return InvalidArgument(
          "unknown press modifier '" + std::string(m) + "' in '" + std::string(spec) +
          "' (allocators: uniform, pyramid, ada; cross-layer: max, mean; "
          "chunked: during prefill; demote:CODEC: keep evicted tokens in CODEC; protect: "
          "segment boundaries; merge: fold evicted values into kept neighbours)");
    }
  }
  if (o->share != ShareLayers::kNone && o->allocator != Allocator::kUniform) {
    return InvalidArgument("press '" + std::string(spec) +
                           "': cross-layer selection (max/mean) keeps one token set everywhere, "
                           "so it takes no per-head allocator");
  }
  return OkStatus();
}

std::string PressSpec(const PressOptions& o) {
  if (o.quest) return "quest";
  std::string s = ScorerName(o.scorer);
  if (o.allocator == Allocator::kPyramid) s += "+pyramid";
  if (o.allocator == Allocator::kAda) s += "+ada";
  if (o.share == ShareLayers::kMax) s += "+max";
  if (o.share == ShareLayers::kMean) s += "+mean";
  if (o.merge) s += "+merge";
  if (o.protect_boundaries) s += "+protect";
  if (o.during_prefill) s += "+chunked";
  if (!o.demote.empty()) s += "+demote:" + o.demote;
  return s;
}

std::string DescribePress(const PressOptions& o) {
  const std::string spec = PressSpec(o);
  if (o.quest) return spec;
  if (o.budget > 0) return spec + " budget " + std::to_string(o.budget);
  char ratio[32];
  std::snprintf(ratio, sizeof(ratio), " ratio %.3f", o.ratio);
  return spec + ratio;
}

uint32_t GatheringsFor(const PressOptions& o) { return o.quest ? 0 : ScorerGatherings(o.scorer); }

}  // namespace cachet::press

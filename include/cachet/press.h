// Presses: which cached tokens a sequence keeps when it is compressed (the algorithms are in
// src/kv/press/; ALGORITHMS.md describes each). A press is named by a spec string ("snapkv",
// "snapkv+max", "quest", ...) that ParsePressSpec turns into PressOptions once, at the edge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet::press {

// kvzip and lookahead score by the attention of queries the cache has not seen, evaluated after
// it and dropped again (Session::Compress): kvzip's the context repeated (KVzip's reconstruction),
// lookahead's generic questions (probe_texts). Neither needs the prompt observed.
enum class Scorer {
  kStreaming,
  kH2O,
  kSnapKV,
  kTova,
  kKNorm,
  kKeyDiff,
  kExpected,
  kRandom,
  kKvzip,
  kLookahead
};
enum class Allocator { kUniform, kPyramid, kAda };
enum class ShareLayers { kNone, kMax, kMean };

struct PressOptions {
  Scorer scorer = Scorer::kSnapKV;
  Allocator allocator = Allocator::kUniform;
  ShareLayers share = ShareLayers::kNone;  // one token set for every layer and head
  double ratio = 0;                        // fraction of each table's tokens removed, in [0, 1)
  int budget = 0;       // tokens kept per (layer, KV head) on average; overrides ratio when > 0
  int sinks = 4;        // the first tokens, always kept
  int window = 32;      // SnapKV/expected: observation window of last prompt queries, always kept
  int pool_kernel = 7;  // SnapKV: 1-D max pooling of the window's attention
  double ada_floor = 0.2;     // Ada-KV: each head keeps at least this fraction of the mean budget
  double pyramid_beta = 20;   // PyramidKV: the top layer gets 1/beta of the mean budget
  int expected_future = 128;  // expected attention: future query positions RoPE is averaged over
  uint64_t seed = 0;          // random
  // Quest instead of eviction: decode steps read the `quest_pages` pages (or the fraction
  // 1 - ratio of the pages) whose key bounds score highest; nothing is freed.
  bool quest = false;
  int quest_pages = 0;
  // Compress after every prefill chunk (spec modifier "+chunked"), so the KV never holds more
  // than the budget plus one chunk: Session::EvalCompressing. Attention scorers then see each
  // chunk's own queries (SnapKV's window is the chunk's last tokens).
  bool during_prefill = false;
  // Demote, don't drop: tokens the press would evict move to a cold pool in this row-wise codec
  // (e.g. "int8", "q4_0"); decode steps fetch back the fraction demote_fetch of the cold pages
  // whose key bounds score highest. Empty: evicted tokens are freed.
  std::string demote;
  double demote_fetch = 0.125;
  // Press again every N decoded tokens, back to the budget set after the prompt; the observer
  // stays attached, so attention scores (H2O's heavy hitters) keep accumulating while decoding.
  int decode_every = 0;
  // Boundary protection (modifier "+protect"): boundary_share of the budget goes to the first and
  // last tokens of each prompt segment (segments start at these positions; none: one segment).
  // Merge (modifier "+merge"): each evicted token's value is folded into the more similar (by
  // key cosine) of its two nearest kept neighbours, weighted by attention scores where the scorer
  // has them.
  bool merge = false;
  bool protect_boundaries = false;
  double boundary_share = 0.1;
  std::vector<int32_t> segment_starts;

  // kvzip, lookahead: the probes' text (lookahead: each a question; empty: kDefaultProbes) and
  // how many probe tokens are evaluated at once (kvzip's context is repeated in chunks).
  std::vector<std::string> probe_texts;
  int probe_chunk = 512;

  bool NeedsAttention() const;  // whether a PressObserver must watch the prompt
  bool Probes() const;          // kvzip, lookahead: scored by probes after the cache
  // Whether it needs nothing but the cache, at any time (a chat's history pressed when full):
  // no observed prompt or probes, no Quest, per-chunk pressing, demotion or pressing while
  // decoding.
  bool ReadsCacheAlone() const;
};

const std::vector<std::string>& ScorerNames();
const char* ScorerName(Scorer s);
// "snapkv", "snapkv+ada", "snapkv+max", "h2o+pyramid", "pyramidkv" (= snapkv+pyramid), "quest": a
// scorer and optional modifiers (+chunked: compress during prefill) (allocators
// uniform|pyramid|ada, cross-layer max|mean). Sets the scorer, allocator and share fields of
// *options and leaves the others.
Status ParsePressSpec(std::string_view spec, PressOptions* options);
std::string PressSpec(const PressOptions& options);  // the inverse
// The spec with its amount, as saved caches record it: "snapkv ratio 0.750", "h2o budget 128",
// "quest".
std::string DescribePress(const PressOptions& options);

// What a chat does when its next turn would not fit in the context (--on-full of `cachet chat`
// and `cachet serve`): stop with an error, shift (drop the oldest turns after the system prompt),
// or press the history with `press` (a scorer that reads the cache alone, one token set for every
// table, so that the freed positions can be given back).
struct OnFull {
  enum class Kind { kError, kShift, kPress } kind = Kind::kError;
  PressOptions press;  // kPress
};
// "error", "shift" or "press:NAME:RATIO" (e.g. "press:keydiff:0.5").
Result<OnFull> ParseOnFull(std::string_view text);

// What Compress decided, for reports and tests.
struct PressResult {
  int64_t tokens_before = 0, tokens_after = 0;  // summed over tables
  size_t bytes_before = 0, bytes_after = 0;     // the sequence's page bytes
  // What pressing cost: its wall time (scoring, planning, compaction), of which probe_ms went to
  // kvzip's and lookahead's probe pass; and the most bytes it held at once, the sequence's pages
  // plus, during a probe pass, the probe's K/V and the attention gathered for every token.
  double ms = 0, probe_ms = 0;
  size_t peak_bytes = 0;
};

}  // namespace cachet::press

// Presses: evict cached tokens to a budget, freeing their pages (ALGORITHMS.md, "Eviction
// scorers" and "Budget allocation"). A scorer rates every cached token of every (layer, KV head);
// an allocator turns the global budget into per-(layer, head) budgets; the plan keeps the protected
// tokens plus the best-rated ones and PagedSequence::Retain compacts the tables and frees pages.
// Scores that need attention weights come from a PressObserver attached while the prompt is
// evaluated: the attention kernels add the weights during their own pass.
#pragma once

#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kv/paged_sequence.h"
#include "util/status.h"

namespace cachet::press {

enum class Scorer { kStreaming, kH2O, kSnapKV, kTova, kKNorm, kKeyDiff, kExpected, kRandom };
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

  bool NeedsAttention() const;  // whether a PressObserver must watch the prompt
};

const std::vector<std::string>& ScorerNames();
const char* ScorerName(Scorer s);
// "snapkv", "snapkv+ada", "snapkv+max", "h2o+pyramid", "pyramidkv" (= snapkv+pyramid), "quest": a
// scorer and optional modifiers (+chunked: compress during prefill) (allocators
// uniform|pyramid|ada, cross-layer max|mean). Sets the scorer, allocator and share fields of
// *options and leaves the others.
Status ParsePressSpec(std::string_view spec, PressOptions* options);
std::string PressSpec(const PressOptions& options);  // the inverse

// Gathers, for one sequence, what attention-based scorers need: per (layer, KV head) and key,
// the attention weight summed over all queries (h2o), over the queries at positions >=
// end - window (snapkv), and of the last query (tova); and the mean and covariance of the window's
// queries (expected attention). Attach it before the prompt is evaluated
// (PagedSequence::set_observer) and keep it until Compress.
class PressObserver final : public AttentionObserver {
 public:
  // end: the position just past the prompt's last token; head_dim and the GQA group size as the
  // model has them.
  // gatherings: a mask of 1 << Gathering; only those are gathered (the all-queries one makes
  // the kernels buffer every row, the others only the window's).
  PressObserver(int n_layers, int n_kv_heads, int head_dim, int32_t end, int window,
                uint32_t gatherings = 7);
  std::span<const kernels::AttnObserve> Observe(int layer, int kv_head, int n_keys,
                                                const kernels::AttnBatch& batch) override;
  void Merge(int layer, int kv_head) override;
  // Keeps what was gathered for the kept tokens only (the keep lists of PagedSequence::Retain),
  // so the observer can go on watching a compressed sequence.
  void Compact(std::span<const std::vector<int32_t>> keep);

  enum Gathering { kAll = 0, kWindow = 1, kLast = 2, kGatherings = 3 };
  // Read once the observed Evals are done.
  const std::vector<float>& weights(int layer, int kv_head, Gathering g) const {
    return heads_[layer * n_kv_heads_ + kv_head].weights[g];
  }
  // The model's RoPE (rotate-half, these inverse frequencies): the window's queries are then
  // kept un-rotated, and QueryStats rotates their statistics to the future positions.
  void set_rope(std::vector<float> inv_freq) { inv_freq_ = std::move(inv_freq); }
  // Mean [head_dim] and covariance [head_dim][head_dim] of the window's query rows; with RoPE
  // set, of the queries at positions end() .. end() + future - 1: the un-rotated statistics under
  // the rotation averaged over those positions (mean A mu, covariance A Sigma A^T).
  void QueryStats(int layer, int kv_head, int future, std::vector<double>* mean,
                  std::vector<double>* cov) const;
  int32_t end() const { return end_; }
  int window() const { return window_; }

 private:
  struct Head {
    std::mutex mu;  // guards the rest
    std::vector<float> weights[kGatherings];
    std::vector<double> q_sum, q_outer;  // over window query rows
    int64_t q_rows = 0;
  };
  uint32_t gatherings_;
  int32_t min_pos_[kGatherings];
  int n_kv_heads_, head_dim_;
  int32_t end_;
  int window_;
  std::vector<Head> heads_;
  std::vector<float> inv_freq_;
};

// The gatherings (PressObserver mask) o's scorer reads.
uint32_t GatheringsFor(const PressOptions& o);

// Per-(layer, KV head) budgets (table order) for tables of n_tokens each, given the scores the
// Ada-KV allocator pools; every budget is in [min_keep, n_tokens] and they sum to
// total (when that is reachable).
std::vector<int> AllocateBudgets(const PressOptions& o, int n_layers, int n_kv_heads, int n_tokens,
                                 int64_t total, int min_keep,
                                 std::span<const std::vector<float>> scores);

// Scores every token of every table (higher = keep), in table order.
Status ScoreTokens(const PressOptions& o, const PagedSequence& seq, int n_layers, int n_kv_heads,
                   const PressObserver* observer, std::vector<std::vector<float>>* scores);

// The kept tokens' V rows after folding each evicted token into the more similar (key cosine) of
// its two nearest kept neighbours, weighted by weights (null: equal weights).
void MergeValues(const PagedSequence& seq, int layer, int kv_head, const std::vector<int32_t>& keep,
                 const std::vector<float>* weights, std::vector<float>* values);

// What Compress decided, for reports and tests.
struct PressResult {
  int64_t tokens_before = 0, tokens_after = 0;  // summed over tables
  size_t bytes_before = 0, bytes_after = 0;     // the sequence's page bytes
};

// Quest's page selection as Compress sets it for o (o.quest), turned on before the prompt is
// evaluated so that the sequence builds each page's key bounds as the prompt fills it (instead of
// the first decode step building them all). Does nothing unless o.quest and o is valid (Compress
// reports what is wrong).
void PrepareQuest(const PressOptions& o, PagedSequence& seq);

// Evicts to the budget and frees the pages. observer may be null for scorers that do not
// need attention (NeedsAttention()); it is only read (forks share it) unless compact_observer,
// which then must own it, so that it goes on watching the compressed sequence. Nothing changes
// on error.
Result<PressResult> Compress(const PressOptions& o, PagedSequence& seq, int n_layers,
                             int n_kv_heads, const PressObserver* observer,
                             PressObserver* compact_observer = nullptr);

}  // namespace cachet::press

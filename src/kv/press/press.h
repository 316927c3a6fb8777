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

#include "cachet/press.h"
#include "cachet/status.h"
#include "kv/paged_sequence.h"

namespace cachet::press {

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

  // kWindowMax: the window's queries' largest weight on each key (kvzip, lookahead).
  enum Gathering { kAll = 0, kWindow = 1, kLast = 2, kWindowMax = 3, kGatherings = 4 };
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
  size_t bytes() const;  // what it has gathered, held until the press reads it

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

// The observer gatherings (1 << PressObserver::Gathering) a scorer reads; 0: none.
uint32_t ScorerGatherings(Scorer s);
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

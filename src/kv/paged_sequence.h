// One sequence's KV cache over the page pool: a block table per (layer, KV head) holding page ids
// and a token count. Pages can be shared between sequences (Fork); a shared, partly filled page is
// copied before it is written (copy-on-write). With a codec layout, tokens are encoded as they
// are written (row-wise codecs) or staged in a raw page and encoded when it fills (KIVI keys);
// pages holding the first `sinks` tokens stay raw. The parts: kv/block_table.h (a table, its
// rows), kv/staging.h (which pages are raw), kv/compaction.h (Retain), kv/quest_index.h (Quest's
// bounds and selection), kv/table_attention.h (the kernels' views of the tables).
#pragma once

#include <algorithm>
#include <climits>
#include <memory>
#include <span>
#include <vector>

#include "kv/block_table.h"
#include "kv/page_pool.h"
#include "model/kv_sequence.h"

namespace cachet {

// Sees every attention call of a sequence (presses gather attention weights this way, inside the
// kernels' own pass). Calls come from several threads at once, for the same (layer, KV head) too
// (the forward pass splits a head's query tokens into tasks): Observe hands out buffers private to
// the calling thread, and Merge, called on the same thread after the kernel, folds them in.
class AttentionObserver {
 public:
  virtual ~AttentionObserver() = default;
  // The gatherings to add to this call over a table of n_keys tokens (may be empty).
  virtual std::span<const kernels::AttnObserve> Observe(int layer, int kv_head, int n_keys,
                                                        const kernels::AttnBatch& batch) = 0;
  virtual void Merge(int layer, int kv_head) = 0;
};

class PagedSequence final : public KvSequence {
 public:
  explicit PagedSequence(PagePool& pool);
  ~PagedSequence() override;  // drops its references; pages shared with others stay
  PagedSequence(const PagedSequence&) = delete;
  PagedSequence& operator=(const PagedSequence&) = delete;

  // A new sequence sharing every page of this one (no copy, refcounts only).
  std::unique_ptr<PagedSequence> Fork() const;

  // Reserve ages pages first (--kv-cold): those old enough move to the cold pool.
  Status Reserve(int n) override;
  // Moves the pages old enough to the cold pool now, as the next Reserve would (no-op without
  // one, or while an observer gathers attention).
  void AgeOut();
  void Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) override;
  // Staged layouts: tokens are written raw; SealAged seals the pages they aged (what is left,
  // at CommitTokens).
  void SealAged(int layer) override;
  void CommitTokens(int n) override;
  void Attend(int layer, int kv_head, const kernels::AttnBatch& batch) const override;
  // A part per kKeysPerPart keys of the longest table (hot and cold), no more than give the
  // threads four tasks each over the KV heads (parts cost a merge and a cold start of the page
  // prefetch: mha-85m's 12 heads at 16k on two threads decoded 5-10% slower in 16 parts) nor
  // kMaxParts; one where a pass must see every key at once (an observer) or picks its pages
  // (Quest, a partial cold fetch).
  int DecodeParts(int threads) const override;
  static constexpr int kKeysPerPart = 1024, kMaxParts = 16;

  // The page-table view of a plain (f32) layout, as the kernels take it.
  kernels::PagedKv View(int layer, int kv_head) const;
  // Decodes the cached K and V of (layer, kv_head) into f32 rows, with their positions.
  void Gather(int layer, int kv_head, std::vector<float>* k, std::vector<float>* v,
              std::vector<int32_t>* positions) const;
  // The same of its cold table (--kv-cold, demoted tokens): empty without one.
  void GatherCold(int layer, int kv_head, std::vector<float>* k, std::vector<float>* v,
                  std::vector<int32_t>* positions) const;

  // Appends one full block of shared pages (one per (layer, KV head), in table order), taking a
  // reference on each. The sequence must hold whole blocks only, with equal per-head lengths.
  void AttachBlock(std::span<const int32_t> pages);
  // The pages of full block b, one per (layer, KV head); false when per-head lengths differ
  // (a compressed sequence) or the block is not full or not yet in its final (encoded) form.
  bool BlockPages(int block, std::vector<int32_t>* pages) const;

  // Eviction: keeps in each (layer, KV head) table only the tokens whose indices (ascending, into
  // the table's current order) are listed in keep[layer * n_kv_heads + kv_head], compacted to the
  // front, and frees the pages no longer needed. Plan, then apply: pages shared with another
  // sequence or the prefix cache are copied before they are written, and when the pool cannot
  // supply those copies nothing changes (ResourceExhausted). Staged layouts (KIVI keys,
  // --kv-window) re-encode each changed page whole, in the kind the new length gives it.
  // With demote, the tokens not kept move to the cold pool (set_cold_pool) instead of being
  // dropped: encoded in its codec, appended to the table's cold pages.
  // values, when given and non-empty for a table, replace the kept tokens' V rows
  // ([keep.size()][head_dim], e.g. merged with the evicted ones).
  Status Retain(std::span<const std::vector<int32_t>> keep, bool demote = false,
                std::span<const std::vector<float>> values = {});

  // Rollback to the tokens at positions [0, n) (n <= n_tokens()): each (layer, KV head) table
  // keeps its rows at positions below n, in the cold tables too. Hot tables are in position order
  // (appends and Retain keep it), so each keeps a prefix of its rows: all n tokens, or fewer where
  // a press evicted some. Pages wholly past the kept rows are released (a page shared with a fork
  // or the prefix cache only loses this sequence's reference) and reserved codec pages for sealing
  // too; the partly kept last page keeps its rows, and is copied before it is next written when
  // shared, as Reserve always does. No shared page is written. Staged layouts: a partly kept page
  // that was already sealed is decoded back into a fresh raw page (staged pages are written raw);
  // whole pages stay as they are, sealed ones sealed. Quest keeps the key bounds of the pages
  // kept whole. All or nothing: InvalidArgument for a bad n, ResourceExhausted when the pool
  // cannot supply those raw pages (or the cold pool the copies its compaction needs).
  Status Truncate(int n);

  // Renumbering (context shift, chunk reuse): the token at position p takes position new_pos[p]
  // (new_pos.size() == n_tokens(); -1 drops it; the kept ones' new positions ascending), its key
  // re-rotated by the difference (RoPE with inv_freq), in every table, cold ones included; then
  // n_tokens() is the last new position + 1. Pages shared with forks or the prefix cache are
  // copied before they are written; all or nothing (ResourceExhausted when the pool cannot supply
  // the copies). The K/V of tokens after a dropped one were computed with it in view, so blocks
  // from the first changed position on are no longer published to the prefix cache.
  Status Renumber(std::span<const int32_t> new_pos, std::span<const float> inv_freq);

  // Chunk reuse (runtime/chunk_reuse.cc): tokens from position pos on hold K/V that a fresh
  // computation would not give (reused chunks), so their blocks are not published.
  void MarkInexactFrom(int pos) { exact_tokens_ = std::min(exact_tokens_, pos); }
  // Plain (f32) layouts: row `row` of (layer, kv_head), read in place, or written over with new K
  // and V (the page must not be shared: CacheBlend's recompute in a private sequence).
  const float* RawKey(int layer, int kv_head, int row) const;
  const float* RawValue(int layer, int kv_head, int row) const;
  void OverwriteRow(int layer, int kv_head, int row, const float* k, const float* v);

  // Demote, don't drop: a second pool, in a low-bit row-wise codec, for tokens a press demotes.
  // Decode steps read every hot page plus the fraction `fetch` of the cold pages whose key bounds
  // score highest for the query (and the last cold page); prefill chunks read all of them.
  void set_cold_pool(PagePool* cold, double fetch) {
    cold_pool_ = cold;
    cold_fetch_ = fetch;
  }
  // Precision by age (kv/aging.h): before each reservation, full pages whose tokens are all
  // `after` or more tokens old move to the cold pool (set_cold_pool, fetch 1: attention reads them
  // all); 0 turns it off. Not while an observer is set (a press's scores index the hot tables). A
  // full cold pool leaves the pages hot.
  void set_age_out(int after) { age_after_ = after; }
  int age_out() const { return age_after_; }
  int cold_length(int layer, int kv_head) const {
    return cold_tables_.empty()
               ? 0
               : cold_tables_[layer * pool_.layout().n_kv_heads + kv_head].n_tokens;
  }
  size_t cold_bytes_held() const;
  // Token positions of one table, in table order.
  void Positions(int layer, int kv_head, std::vector<int32_t>* positions) const;

  void set_observer(AttentionObserver* observer) { observer_ = observer; }  // null: none
  AttentionObserver* observer() const { return observer_; }

  // Quest (decode-time page selection, nothing evicted): a decode step (one query token) reads,
  // per (layer, KV head), only the full pages whose key bounds promise its queries the highest
  // scores, plus the last page: `pages` of them, or when pages is 0 the fraction `keep` of the
  // full pages (at least one). Each full page's per-channel key min/max is computed once: as the
  // page reaches its final form (full, and sealed in staged layouts) once the tokens appended
  // have attended (SealAged), when Quest is on then, so set it before the prompt is evaluated;
  // pages without bounds (forks, prefix reuse, Retain, the recent window) get them at the first
  // decode step that needs them. keep >= 1 with pages == 0 turns it off.
  void set_quest(int pages, double keep) {
    quest_pages_ = pages;
    quest_keep_ = keep;
  }
  bool quest() const { return quest_pages_ > 0 || quest_keep_ < 1.0; }
  // Quest's key bounds of (layer, kv_head) built so far (QuestIndex::bounds).
  std::span<const uint16_t> key_bounds(int layer, int kv_head) const {
    return table(layer, kv_head).quest.bounds();
  }

  // Saving and loading (kv/sequence_file.h): the tables as they stand, and adopting tables whose
  // pages (one reference each, held) came from a file; the sequence must be empty (Clear).
  PagePool& pool() const { return pool_; }
  const std::vector<BlockTable>& tables() const { return tables_; }
  const std::vector<BlockTable>& cold_tables() const { return cold_tables_; }
  PagePool* cold_pool() const { return cold_pool_; }
  double cold_fetch() const { return cold_fetch_; }
  int quest_pages() const { return quest_pages_; }
  double quest_keep() const { return quest_keep_; }
  void Adopt(std::vector<BlockTable> tables, std::vector<BlockTable> cold_tables, int n_tokens);

  int n_tokens() const { return n_tokens_; }  // tokens committed to the sequence
  const KvLayout& layout() const { return pool_.layout(); }
  int head_length(int layer, int kv_head) const { return table(layer, kv_head).n_tokens; }
  int longest_head() const;   // the most tokens any (layer, KV head) holds
  int pages_held() const;     // page references held, reserved ones included (hot pool)
  size_t bytes_held() const;  // their bytes (raw and codec pages differ in size), cold ones too
  void Clear();               // back to empty, all references dropped

 private:
  BlockTable& table(int layer, int kv_head) {
    return tables_[layer * pool_.layout().n_kv_heads + kv_head];
  }
  const BlockTable& table(int layer, int kv_head) const {
    return tables_[layer * pool_.layout().n_kv_heads + kv_head];
  }

  PagePool& pool_;
  std::vector<BlockTable> tables_;
  PagePool* cold_pool_ = nullptr;
  double cold_fetch_ = 1.0;
  std::vector<BlockTable> cold_tables_;  // per (layer, KV head), in cold_pool_; empty: none
  int age_after_ = 0;
  int n_tokens_ = 0;
  // Tokens from the start whose K/V are what a fresh computation of them gives (Renumber lowers
  // it): BlockPages offers no block past it.
  int exact_tokens_ = INT_MAX;
  AttentionObserver* observer_ = nullptr;  // not owned, not inherited by forks
  int quest_pages_ = 0;
  double quest_keep_ = 1.0;
  std::vector<int32_t> scratch_raw_, scratch_codec_;  // reused by Reserve: no per-step allocation
  std::vector<int32_t> scratch_claimed_;  // pages Reserve took from the tables' claims, in order
  std::vector<int> scratch_taken_;        // how many of them each table took
  // The run of slots a table claims when it takes page p fresh: an eighth of the pages it will
  // hold, at most kMaxRunPages, never past the context; 1 (no claim) in staged layouts, whose raw
  // pages are sealed away, and for sink pages.
  static constexpr int64_t kMaxRunPages = 16;
  int64_t RunPages(int64_t p) const;
  // Takes table t's next pages up to want from its claim (a new claim when it is spent), into
  // scratch_claimed_; returns how many.
  int TakeClaimedPages(BlockTable& t, int64_t want);
};

}  // namespace cachet

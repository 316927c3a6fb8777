// One sequence's KV cache over the page pool: a block table per (layer, KV head) holding page ids
// and a token count. Pages can be shared between sequences (Fork); a shared, partly filled page is
// copied before it is written (copy-on-write).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "kv/page_pool.h"
#include "model/kv_sequence.h"

namespace cachet {

class PagedSequence final : public KvSequence {
 public:
  explicit PagedSequence(PagePool& pool);
  ~PagedSequence() override;  // drops its references; pages shared with others stay
  PagedSequence(const PagedSequence&) = delete;
  PagedSequence& operator=(const PagedSequence&) = delete;

  // A new sequence sharing every page of this one (no copy, refcounts only).
  std::unique_ptr<PagedSequence> Fork() const;

  Status Reserve(int n) override;
  void Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) override;
  void CommitTokens(int n) override { n_tokens_ += n; }
  kernels::PagedKv View(int layer, int kv_head) const override;

  // Appends one full block of shared pages (one per (layer, KV head), in table order), taking a
  // reference on each. The sequence must hold whole blocks only, with equal per-head lengths.
  void AttachBlock(std::span<const int32_t> pages);
  // The pages of full block b, one per (layer, KV head); false when per-head lengths differ
  // (a compressed sequence) or the block is not full.
  bool BlockPages(int block, std::vector<int32_t>* pages) const;

  int n_tokens() const { return n_tokens_; }  // tokens committed to the sequence
  int head_length(int layer, int kv_head) const { return table(layer, kv_head).n_tokens; }
  int pages_held() const;
  void Clear();  // back to empty, all references dropped

 private:
  struct BlockTable {
    std::vector<int32_t> pages;
    int32_t n_tokens = 0;
  };
  BlockTable& table(int layer, int kv_head) {
    return tables_[layer * pool_.layout().n_kv_heads + kv_head];
  }
  const BlockTable& table(int layer, int kv_head) const {
    return tables_[layer * pool_.layout().n_kv_heads + kv_head];
  }

  PagePool& pool_;
  std::vector<BlockTable> tables_;
  int n_tokens_ = 0;
  std::vector<int32_t> scratch_pages_;  // reused by Reserve: no allocation per decode step
};

}  // namespace cachet

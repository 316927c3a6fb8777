// Quest (decode-time page selection): one block table's (`table`: layer * n_kv_heads + KV head)
// per-page key bounds, and the pages a decode step reads by them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/kernels.h"
#include "kv/page_pool.h"

namespace cachet {

class QuestIndex {
 public:
  // Per page of the table's first pages, the per-channel key min then max ([pages][2][head_dim]),
  // f16 bits rounded outward: half the bytes a decode step scans, and still bounds.
  std::span<const uint16_t> bounds() const { return bounds_; }
  // Whatever changed the table's pages other than by appending tokens makes the bounds stale.
  void Invalidate() { bounds_.clear(); }
  // The table keeps its first `pages` pages as they are (it was truncated): their bounds stay.
  void KeepPages(int64_t pages, int head_dim) {
    bounds_.resize(std::min<size_t>(bounds_.size(), size_t(pages) * 2 * head_dim));
  }

  // Called once appended tokens have attended, with the number of pages in their final form
  // before and after them: bounds the pages that reached it, so that the first decode step after
  // a prompt has none left to build. Only when every page before them has bounds: a table that
  // lost them (a fork, prefix reuse, Retain) gets them all back at the next decode step, one task
  // per table rather than here on one thread.
  void OnFinal(PagePool& pool, int table, std::span<const int32_t> pages, int64_t final_before,
               int64_t final_pages);

  // The logical pages a decode step reads (ascending, the last page last): the top `pages` (or,
  // when pages is 0, the fraction keep) of all but the last page by key bound, then the last;
  // false when that would be every page. Builds the bounds the candidates lack first (usually
  // built as the pages filled; here after a fork, prefix reuse or Retain, and for the recent
  // window's pages).
  bool Select(PagePool& pool, int table, std::span<const int32_t> table_pages, int32_t n_tokens,
              const kernels::AttnBatch& batch, int pages, double keep,
              std::vector<int32_t>* selected);

 private:
  // Bounds up to page `end`, from the keys as stored (decoded, and turned back from a rotation):
  // the one place bounds are computed.
  void Extend(PagePool& pool, int table, std::span<const int32_t> pages, int64_t end);
  int64_t pages_bounded(int head_dim) const { return int64_t(bounds_.size()) / (2 * head_dim); }

  std::vector<uint16_t> bounds_;
};

}  // namespace cachet

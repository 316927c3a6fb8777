// The page pool: one arena of fixed-size slots, each holding one page (page_tokens tokens of one
// KV head of one layer: K rows, V rows, and the tokens' original positions). Slots carry only ids
// and refcounts; byte accounting is exact and the capacity is a hard limit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "util/status.h"

namespace cachet {

struct KvLayout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 16;

  int64_t slot_floats() const { return int64_t{2} * page_tokens * head_dim; }
  // K and V values plus the int32 position of each token.
  size_t page_bytes() const {
    return slot_floats() * sizeof(float) + page_tokens * sizeof(int32_t);
  }
  int heads_total() const { return n_layers * n_kv_heads; }
};

// Something that holds pages it could give back when the pool runs dry (the prefix cache).
class PageReclaimer {
 public:
  virtual ~PageReclaimer() = default;
  virtual int32_t Reclaimable() const = 0;
  // Frees at least `pages` pages if it can; returns how many it freed.
  virtual int32_t Reclaim(int32_t pages) = 0;
};

class PagePool {
 public:
  // Capacity is rounded down to whole pages. Memory is reserved, not touched: RSS grows only with
  // the pages actually written.
  PagePool(const KvLayout& layout, size_t capacity_bytes);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  const KvLayout& layout() const { return layout_; }
  int32_t capacity_pages() const { return capacity_; }
  int32_t free_pages() const { return static_cast<int32_t>(free_.size()); }
  int32_t used_pages() const { return capacity_ - free_pages(); }
  int32_t high_water_pages() const { return high_water_; }
  size_t used_bytes() const { return static_cast<size_t>(used_pages()) * layout_.page_bytes(); }

  // n fresh pages (refcount 1), all or nothing: ResourceExhausted leaves the pool unchanged
  // (the reclaimer is asked for pages only when it can cover the whole shortfall).
  Status Alloc(int n, std::vector<int32_t>* out);
  void set_reclaimer(PageReclaimer* r) { reclaimer_ = r; }
  // Pages a request could get now: free plus reclaimable.
  int32_t available_pages() const {
    return free_pages() + (reclaimer_ ? reclaimer_->Reclaimable() : 0);
  }
  void Ref(int32_t page) { ++refs_[page]; }
  void Unref(int32_t page);  // frees the page when its last reference goes
  int32_t refcount(int32_t page) const { return refs_[page]; }

  float* keys(int32_t page) { return slots_ + page * layout_.slot_floats(); }
  float* values(int32_t page) { return keys(page) + layout_.page_tokens * layout_.head_dim; }
  int32_t* positions(int32_t page) { return positions_ + page * layout_.page_tokens; }
  const float* slots_base() const { return slots_; }
  const int32_t* positions_base() const { return positions_; }

 private:
  KvLayout layout_;
  int32_t capacity_ = 0;
  float* slots_ = nullptr;
  int32_t* positions_ = nullptr;
  size_t mapped_bytes_ = 0;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // a stack: recently freed (cache-warm) pages are reused first
  int32_t high_water_ = 0;
  PageReclaimer* reclaimer_ = nullptr;
};

}  // namespace cachet

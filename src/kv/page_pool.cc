#include "kv/page_pool.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <new>

namespace cachet {

PagePool::PagePool(const KvLayout& layout, size_t capacity_bytes) : layout_(layout) {
  const size_t page_bytes = layout.page_bytes();
  capacity_ = static_cast<int32_t>(std::min<size_t>(capacity_bytes / page_bytes, INT32_MAX / 2));
  const size_t value_bytes = static_cast<size_t>(capacity_) * layout.slot_floats() * sizeof(float);
  const size_t pos_bytes = static_cast<size_t>(capacity_) * layout.page_tokens * sizeof(int32_t);
  mapped_bytes_ = value_bytes + pos_bytes;
  if (mapped_bytes_ > 0) {
    void* p = ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    slots_ = static_cast<float*>(p);
    positions_ = reinterpret_cast<int32_t*>(static_cast<char*>(p) + value_bytes);
  }
  refs_.assign(capacity_, 0);
  free_.reserve(capacity_);
  for (int32_t i = capacity_ - 1; i >= 0; --i) free_.push_back(i);
}

PagePool::~PagePool() {
  if (slots_) ::munmap(slots_, mapped_bytes_);
}

Status PagePool::Alloc(int n, std::vector<int32_t>* out) {
  if (n > free_pages() && reclaimer_ != nullptr && n <= available_pages()) {
    reclaimer_->Reclaim(n - free_pages());
  }
  if (n > free_pages()) {
    return ResourceExhausted("KV pool exhausted: need " + std::to_string(n) + " pages, " +
                             std::to_string(available_pages()) + " of " +
                             std::to_string(capacity_) + " free (" +
                             std::to_string(layout_.page_bytes()) +
                             " bytes each); raise --kv-mem or shorten the prompt");
  }
  for (int i = 0; i < n; ++i) {
    int32_t page = free_.back();
    free_.pop_back();
    refs_[page] = 1;
    out->push_back(page);
  }
  high_water_ = std::max(high_water_, used_pages());
  return OkStatus();
}

void PagePool::Unref(int32_t page) {
  if (refs_[page] <= 0) {
    std::fprintf(stderr, "cachet: internal error: page %d freed twice\n", page);
    std::abort();
  }
  if (--refs_[page] == 0) free_.push_back(page);
}

}  // namespace cachet

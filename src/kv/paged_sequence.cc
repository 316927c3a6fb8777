#include "kv/paged_sequence.h"

#include <cstring>

namespace cachet {

PagedSequence::PagedSequence(PagePool& pool) : pool_(pool), tables_(pool.layout().heads_total()) {}

PagedSequence::~PagedSequence() { Clear(); }

void PagedSequence::Clear() {
  for (BlockTable& t : tables_) {
    for (int32_t p : t.pages) pool_.Unref(p);
    t.pages.clear();
    t.n_tokens = 0;
  }
  n_tokens_ = 0;
}

std::unique_ptr<PagedSequence> PagedSequence::Fork() const {
  auto child = std::make_unique<PagedSequence>(pool_);
  child->tables_ = tables_;
  child->n_tokens_ = n_tokens_;
  for (const BlockTable& t : tables_) {
    for (int32_t p : t.pages) pool_.Ref(p);
  }
  return child;
}

void PagedSequence::AttachBlock(std::span<const int32_t> pages) {
  const int pt = pool_.layout().page_tokens;
  for (size_t i = 0; i < tables_.size(); ++i) {
    BlockTable& t = tables_[i];
    pool_.Ref(pages[i]);
    t.pages.push_back(pages[i]);
    t.n_tokens += pt;
  }
  n_tokens_ += pt;
}

bool PagedSequence::BlockPages(int block, std::vector<int32_t>* pages) const {
  const int pt = pool_.layout().page_tokens;
  pages->clear();
  for (const BlockTable& t : tables_) {
    if (t.n_tokens != n_tokens_ || (block + 1) * pt > t.n_tokens) return false;
    pages->push_back(t.pages[block]);
  }
  return true;
}

int PagedSequence::pages_held() const {
  int n = 0;
  for (const BlockTable& t : tables_) n += static_cast<int>(t.pages.size());
  return n;
}

Status PagedSequence::Reserve(int n) {
  const int pt = pool_.layout().page_tokens;
  // Plan: count the pages every table needs (new pages, plus a private copy of a shared partly
  // filled last page), then take them all at once so a failure changes nothing.
  int64_t need = 0;
  for (const BlockTable& t : tables_) {
    const int64_t want = (static_cast<int64_t>(t.n_tokens) + n + pt - 1) / pt;
    need += std::max<int64_t>(0, want - static_cast<int64_t>(t.pages.size()));
    if (n > 0 && t.n_tokens % pt != 0 && pool_.refcount(t.pages.back()) > 1) ++need;
  }
  if (need == 0) return OkStatus();
  if (need > INT32_MAX) return ResourceExhausted("KV reservation too large");
  scratch_pages_.clear();
  CACHET_RETURN_IF_ERROR(pool_.Alloc(static_cast<int>(need), &scratch_pages_));
  // Apply.
  size_t next = 0;
  const KvLayout& lay = pool_.layout();
  for (BlockTable& t : tables_) {
    if (n > 0 && t.n_tokens % pt != 0 && pool_.refcount(t.pages.back()) > 1) {
      const int32_t shared = t.pages.back(), copy = scratch_pages_[next++];
      std::memcpy(pool_.keys(copy), pool_.keys(shared), lay.slot_floats() * sizeof(float));
      std::memcpy(pool_.positions(copy), pool_.positions(shared), pt * sizeof(int32_t));
      pool_.Unref(shared);
      t.pages.back() = copy;
    }
    const int64_t want = (static_cast<int64_t>(t.n_tokens) + n + pt - 1) / pt;
    while (static_cast<int64_t>(t.pages.size()) < want) t.pages.push_back(scratch_pages_[next++]);
  }
  return OkStatus();
}

void PagedSequence::Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) {
  BlockTable& t = table(layer, kv_head);
  const KvLayout& lay = pool_.layout();
  const int32_t page = t.pages[t.n_tokens / lay.page_tokens];
  const int off = t.n_tokens % lay.page_tokens;
  std::memcpy(pool_.keys(page) + off * lay.head_dim, k, lay.head_dim * sizeof(float));
  std::memcpy(pool_.values(page) + off * lay.head_dim, v, lay.head_dim * sizeof(float));
  pool_.positions(page)[off] = pos;
  ++t.n_tokens;
}

kernels::PagedKv PagedSequence::View(int layer, int kv_head) const {
  const BlockTable& t = table(layer, kv_head);
  const KvLayout& lay = pool_.layout();
  kernels::PagedKv v;
  v.slots = pool_.slots_base();
  v.positions = pool_.positions_base();
  v.slot_floats = lay.slot_floats();
  v.page_tokens = lay.page_tokens;
  v.head_dim = lay.head_dim;
  v.page_ids = t.pages.data();
  v.n_tokens = t.n_tokens;
  return v;
}

}  // namespace cachet

#include "kv/aging.h"

#include <string>

#include "kv/staging.h"

namespace cachet {
namespace {

// The first page index past the sink pages, and how many pages from there have aged out.
struct AgedRun {
  int64_t first = 0, count = 0;
};

AgedRun FindAged(const PagePool& pool, const BlockTable& t, int n_tokens, int after) {
  const KvLayout& lay = pool.layout();
  const int64_t pt = lay.page_tokens;
  AgedRun r;
  while (r.first < int64_t(t.pages.size()) && IsSinkPage(lay, r.first)) ++r.first;
  const int64_t final_pages = FinalPages(lay, t.n_tokens);
  for (int64_t p = r.first; p < final_pages; ++p) {
    if (pool.positions(t.pages[p])[pt - 1] >= int64_t(n_tokens) - after) break;
    ++r.count;
  }
  return r;
}

}  // namespace

Status AgeOutPages(PagePool& pool, std::vector<BlockTable>& tables, PagePool& cold_pool,
                   std::vector<BlockTable>& cold_tables, int n_tokens, int after, int* moved) {
  if (moved) *moved = 0;
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens;
  if (cold_pool.layout().page_tokens != pt || cold_pool.layout().head_dim != lay.head_dim) {
    return FailedPrecondition("--kv-cold: the cold pool's pages differ from the hot pool's");
  }
  // Plan.
  std::vector<AgedRun> runs(tables.size());
  int need = 0;
  for (size_t ti = 0; ti < tables.size(); ++ti) {
    runs[ti] = FindAged(pool, tables[ti], n_tokens, after);
    if (runs[ti].count == 0) continue;
    const int64_t c_tokens = cold_tables.empty() ? 0 : cold_tables[ti].n_tokens;
    const int64_t c_pages = cold_tables.empty() ? 0 : int64_t(cold_tables[ti].pages.size());
    need += static_cast<int>((c_tokens + runs[ti].count * pt + pt - 1) / pt - c_pages);
    // A shared, partly filled last cold page (a fork's, after a rollback) is copied first.
    need += c_tokens % pt != 0 && cold_pool.refcount(cold_tables[ti].pages.back()) > 1;
  }
  if (need == 0) return OkStatus();
  std::vector<int32_t> fresh;
  const bool raw = cold_pool.layout().plain();  // a pool of one codec (f32: raw pages)
  if (Status s = cold_pool.Alloc(raw ? need : 0, raw ? 0 : need, &fresh, &fresh); !s.ok()) {
    return ResourceExhausted("--kv-cold: the cold pool is full (" + s.message() + ")");
  }
  // Apply.
  if (cold_tables.empty()) cold_tables.resize(tables.size());
  size_t next = 0;
  thread_local std::vector<float> k, v;
  k.resize(size_t(pt) * lay.head_dim);
  v.resize(size_t(pt) * lay.head_dim);
  for (size_t ti = 0; ti < tables.size(); ++ti) {
    const AgedRun& r = runs[ti];
    if (r.count == 0) continue;
    BlockTable& t = tables[ti];
    BlockTable& c = cold_tables[ti];
    for (int64_t p = r.first; p < r.first + r.count; ++p) {
      const int32_t page = t.pages[p];
      DecodeRows(pool, int(ti), page, pt, k.data(), v.data());
      const int32_t* pos = pool.positions(page);
      for (int j = 0; j < pt; ++j) {
        const int off = c.n_tokens % pt;
        if (off == 0) {
          c.pages.push_back(fresh[next++]);
        } else if (cold_pool.refcount(c.pages.back()) > 1) {
          const int32_t shared = c.pages.back(), copy = fresh[next++];
          cold_pool.CopyPage(shared, copy);
          cold_pool.Unref(shared);
          c.pages.back() = copy;
        }
        WriteRow(cold_pool, int(ti), c.pages.back(), off, k.data() + size_t(j) * lay.head_dim,
                 v.data() + size_t(j) * lay.head_dim, pos[j]);
        ++c.n_tokens;
      }
      pool.Unref(page);
    }
    t.pages.erase(t.pages.begin() + r.first, t.pages.begin() + r.first + r.count);
    t.n_tokens -= static_cast<int32_t>(r.count * pt);
    t.quest.Invalidate();  // page indices moved
    if (moved) *moved += static_cast<int>(r.count);
  }
  return OkStatus();
}

}  // namespace cachet

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
    if (pool.position(t.pages[p], pt - 1) >= int64_t(n_tokens) - after) break;
    ++r.count;
  }
  return r;
}

}  // namespace

Status AgeOutPages(PagePool& pool, std::vector<BlockTable>& tables, PagePool& cold_pool,
                   std::vector<BlockTable>& cold_tables, int n_tokens, int after) {
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens;
  if (cold_pool.layout().page_tokens != pt || cold_pool.layout().head_dim != lay.head_dim) {
    return FailedPrecondition("--kv-cold: the cold pool's pages differ from the hot pool's");
  }
  // Plan. (Empty cold tables hold no state: making them changes nothing.)
  if (cold_tables.empty()) cold_tables.resize(tables.size());
  std::vector<AgedRun> runs(tables.size());
  int64_t need = 0;
  for (size_t ti = 0; ti < tables.size(); ++ti) {
    runs[ti] = FindAged(pool, tables[ti], n_tokens, after);
    if (runs[ti].count > 0)
      need += ColdPagesNeeded(cold_pool, cold_tables[ti], runs[ti].count * pt);
  }
  if (need == 0) return OkStatus();
  std::vector<int32_t> fresh;
  const bool raw = cold_pool.layout().plain();  // a pool of one codec (f32: raw pages)
  const int n = static_cast<int>(need);
  if (Status s = cold_pool.Alloc(raw ? n : 0, raw ? 0 : n, &fresh, &fresh); !s.ok()) {
    return ResourceExhausted("--kv-cold: the cold pool is full (" + s.message() + ")");
  }
  // Apply.
  size_t next = 0;
  thread_local std::vector<float> k, v;
  thread_local std::vector<int32_t> pos;
  pos.resize(pt);
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
      pool.ReadPositions(page, pt, pos.data());
      for (int j = 0; j < pt; ++j) {
        AppendColdRow(cold_pool, int(ti), c, fresh, &next, k.data() + size_t(j) * lay.head_dim,
                      v.data() + size_t(j) * lay.head_dim, pos[j]);
      }
      pool.Unref(page);
    }
    t.pages.erase(t.pages.begin() + r.first, t.pages.begin() + r.first + r.count);
    t.n_tokens -= static_cast<int32_t>(r.count * pt);
    t.quest.Invalidate();  // page indices moved
  }
  return OkStatus();
}

}  // namespace cachet

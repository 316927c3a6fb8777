#include "kv/quest_index.h"

#include <algorithm>
#include <cmath>

#include "kv/block_table.h"
#include "util/dtype.h"

namespace cachet {

using codecs::Role;

void QuestIndex::OnFinal(PagePool& pool, int table, std::span<const int32_t> pages,
                         int64_t final_before, int64_t final_pages) {
  if (final_pages > final_before && pages_bounded(pool.layout().head_dim) == final_before) {
    Extend(pool, table, pages, final_pages);
  }
}

void QuestIndex::Extend(PagePool& pool, int table, std::span<const int32_t> pages, int64_t end) {
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  thread_local std::vector<float> kbuf, lohi;
  kbuf.resize(size_t(pt) * hd);
  lohi.resize(2 * size_t(hd));
  for (int64_t p = pages_bounded(hd); p < end; ++p) {
    const int32_t page = pages[p];
    // SIMD decoding (the scalar DecodePage made the first decode step after a 16k prompt cost
    // 0.16 s); rotation and pca codecs decode in their basis, kvq keys before RoPE, so their rows
    // are turned back.
    const codecs::Codec c = pool.codec_of(page, Role::kKey);
    const codecs::CalPlan* plan = pool.plan_of(page, table, Role::kKey);
    DecodeStoredRows(pool, table, page, Role::kKey, pt, kbuf.data());
    if (codecs::BasisOf(c) != codecs::Basis::kPlain) {
      for (int j = 0; j < pt; ++j)
        codecs::OutOfBasis(c, plan, kbuf.data() + size_t(j) * hd, hd, true);
    }
    kernels::KeyBounds(kbuf.data(), pt, hd, lohi.data(), lohi.data() + hd);
    for (int i = 0; i < hd; ++i) bounds_.push_back(F32ToF16Down(lohi[i]));
    for (int i = hd; i < 2 * hd; ++i) bounds_.push_back(F32ToF16Up(lohi[i]));
  }
}

bool QuestIndex::Select(PagePool& pool, int table, std::span<const int32_t> table_pages,
                        int32_t n_tokens, const kernels::AttnBatch& batch, int pages, double keep,
                        std::vector<int32_t>* selected) {
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  const int n_pages = (n_tokens + pt - 1) / pt;
  const int candidates = n_pages - 1;  // the last page is always read
  const int k = pages > 0 ? pages : std::max(1, static_cast<int>(std::ceil(keep * candidates)));
  if (k >= candidates) return false;
  Extend(pool, table, table_pages, candidates);
  // Upper bound of q.k over a page: sum_i max(q_i min_i, q_i max_i); the group's heads share the
  // selection, so a page counts by its best head.
  thread_local std::vector<float> score;
  score.resize(candidates);
  kernels::PageBoundScores(batch.q, batch.n_heads, hd, bounds_.data(), candidates, score.data());
  selected->resize(k);
  kernels::TopK(score.data(), candidates, k, selected->data());
  selected->push_back(n_pages - 1);
  return true;
}

}  // namespace cachet

#include "kv/block_table.h"

#include <algorithm>
#include <cstring>

namespace cachet {

using codecs::Role;

void WriteRow(PagePool& pool, int table, int32_t page, int off, const float* k, const float* v,
              int32_t pos) {
  const int hd = pool.layout().head_dim;
  for (Role role : {Role::kKey, Role::kValue}) {
    const codecs::Codec c = pool.codec_of(page, role);
    codecs::EncodePage(c, role, role == Role::kKey ? k : v, 1, 1, hd,
                       pool.rows(page, role) + off * codecs::RowStride(c, hd),
                       pool.plan_of(page, table, role));
  }
  pool.positions(page)[off] = pos;
}

void DecodeRows(PagePool& pool, int table, int32_t page, int cnt, float* k, float* v) {
  const KvLayout& lay = pool.layout();
  for (Role role : {Role::kKey, Role::kValue}) {
    codecs::DecodePage(pool.codec_of(page, role), role, pool.rows(page, role), cnt, lay.page_tokens,
                       lay.head_dim, role == Role::kKey ? k : v, pool.plan_of(page, table, role));
  }
}

void GatherTable(PagePool& pool, int table, const BlockTable& t, std::vector<float>* k,
                 std::vector<float>* v, std::vector<int32_t>* positions) {
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  k->resize(size_t(t.n_tokens) * hd);
  v->resize(size_t(t.n_tokens) * hd);
  positions->resize(t.n_tokens);
  for (int p = 0; p * pt < t.n_tokens; ++p) {
    const int32_t page = t.pages[p];
    const int cnt = std::min(pt, t.n_tokens - p * pt);
    DecodeRows(pool, table, page, cnt, k->data() + size_t(p) * pt * hd,
               v->data() + size_t(p) * pt * hd);
    std::memcpy(positions->data() + size_t(p) * pt, pool.positions(page), cnt * sizeof(int32_t));
  }
}

}  // namespace cachet

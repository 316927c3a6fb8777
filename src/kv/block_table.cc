#include "kv/block_table.h"

#include <algorithm>
#include <cstring>

#include "kv/codecs/codec_simd.h"

namespace cachet {

using codecs::Role;

namespace {

// A page's first n positions as int32: in place, or widened into a buffer of this thread (valid
// until the next call).
const int32_t* WidePositions(const PagePool& pool, int32_t page, int n) {
  thread_local std::vector<int32_t> buf;
  if (buf.size() < size_t(n)) buf.resize(n);
  return pool.Positions(page, n, buf.data());
}

}  // namespace

void EncodePageRows(PagePool& pool, int table, int32_t page, Role role, const float* rows,
                    int first, int n) {
  const KvLayout& lay = pool.layout();
  const int hd = lay.head_dim;
  const codecs::Codec c = pool.codec_of(page, role);
  if (codecs::StoredBeforeRope(c, role)) {
    thread_local std::vector<float> back;
    back.assign(rows, rows + size_t(n) * hd);
    lay.rope->Turn(back.data(), n, hd, WidePositions(pool, page, first + n) + first, true);
    rows = back.data();
  }
  const codecs::CalPlan* plan = pool.plan_of(page, table, role);
  if (codecs::NeedsFullPage(c, role)) {  // coded over the page at once: first is 0
    codecs::EncodePage(c, role, rows, n, lay.page_tokens, hd, pool.rows(page, role), plan);
  } else {
    codecs::EncodePage(c, role, rows, n, n, hd,
                       pool.rows(page, role) + first * codecs::RowStride(c, hd), plan);
  }
}

namespace {

// Rows decoded in the basis they are stored in made ready for attention: keys stored before RoPE
// are turned by their positions. Other rows are left as they are.
void RopeStoredRows(const PagePool& pool, int32_t page, Role role, int cnt, float* rows) {
  if (!codecs::StoredBeforeRope(pool.codec_of(page, role), role)) return;
  const KvLayout& lay = pool.layout();
  lay.rope->Turn(rows, cnt, lay.head_dim, WidePositions(pool, page, cnt), false);
}

}  // namespace

void DecodeStoredRows(PagePool& pool, int table, int32_t page, Role role, int cnt, float* rows) {
  const KvLayout& lay = pool.layout();
  codecs::simd::DecodeStored(pool.codec_of(page, role), role, pool.rows(page, role), cnt,
                             lay.page_tokens, lay.head_dim, rows, pool.plan_of(page, table, role),
                             lay.rope.get(), WidePositions(pool, page, cnt));
}

void WriteRow(PagePool& pool, int table, int32_t page, int off, const float* k, const float* v,
              int32_t pos) {
  pool.set_position(page, off, pos);
  for (Role role : {Role::kKey, Role::kValue}) {
    EncodePageRows(pool, table, page, role, role == Role::kKey ? k : v, off, 1);
  }
}

int64_t ColdPagesNeeded(const PagePool& cold, const BlockTable& c, int64_t n) {
  const int64_t pt = cold.layout().page_tokens;
  return (c.n_tokens + n + pt - 1) / pt - int64_t(c.pages.size()) +
         (n > 0 && c.n_tokens % pt != 0 && cold.refcount(c.pages.back()) > 1);
}

void AppendColdRow(PagePool& cold, int table, BlockTable& c, const std::vector<int32_t>& fresh,
                   size_t* next, const float* k, const float* v, int32_t pos) {
  const int off = c.n_tokens % cold.layout().page_tokens;
  if (off == 0) {
    c.pages.push_back(fresh[(*next)++]);
  } else if (cold.refcount(c.pages.back()) > 1) {  // shared with a fork
    const int32_t shared = c.pages.back(), copy = fresh[(*next)++];
    cold.CopyPage(shared, copy);
    cold.Unref(shared);
    c.pages.back() = copy;
  }
  WriteRow(cold, table, c.pages.back(), off, k, v, pos);
  ++c.n_tokens;  // key bounds cover full pages before the last only: appending keeps them valid
}

void DecodeRows(PagePool& pool, int table, int32_t page, int cnt, float* k, float* v) {
  const KvLayout& lay = pool.layout();
  for (Role role : {Role::kKey, Role::kValue}) {
    float* rows = role == Role::kKey ? k : v;
    codecs::DecodePage(pool.codec_of(page, role), role, pool.rows(page, role), cnt, lay.page_tokens,
                       lay.head_dim, rows, pool.plan_of(page, table, role));
    RopeStoredRows(pool, page, role, cnt, rows);
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
    pool.ReadPositions(page, cnt, positions->data() + size_t(p) * pt);
  }
}

}  // namespace cachet

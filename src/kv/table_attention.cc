#include "kv/table_attention.h"

#include <algorithm>
#include <span>

namespace cachet {

using codecs::Role;

namespace {

// One page of an attention pass: pages may come from the hot or the cold pool.
struct PageRef {
  PagePool* pool;
  int32_t page;
  int32_t cnt;        // tokens in it
  int32_t first_key;  // index of its first key among the pass's keys
};

// How many pages a pass reads of one table: its selection, or every page.
int PagesRead(const TablePages& read) {
  const int pt = read.pool->layout().page_tokens;
  return read.subset ? static_cast<int>(read.subset->size()) : (read.table->n_tokens + pt - 1) / pt;
}

// Appends the pages [begin, end) (clamped) of those a pass reads of one table; returns the table's
// page count (selected or not).
int AddRefs(const TablePages& read, int begin, int end, std::vector<PageRef>* refs) {
  const BlockTable& t = *read.table;
  const int pt = read.pool->layout().page_tokens;
  int32_t first = refs->empty() ? 0 : refs->back().first_key + refs->back().cnt;
  end = std::min(end, PagesRead(read));
  for (int i = std::max(begin, 0); i < end; ++i) {
    const int p = read.subset ? (*read.subset)[i] : i;
    const int32_t cnt = std::min(pt, t.n_tokens - p * pt);
    refs->push_back({read.pool, t.pages[p], cnt, first});
    first += cnt;
  }
  return (t.n_tokens + pt - 1) / pt;
}

// The logical pages [*begin, *end) of n that part b.part of b.n_parts reads (AttnBatch::part).
void PartPages(const kernels::AttnBatch& b, int n, int* begin, int* end) {
  *begin = static_cast<int>(int64_t{n} * b.part / b.n_parts);
  *end = static_cast<int>(int64_t{n} * (b.part + 1) / b.n_parts);
}

// The codec whose basis a pass reads one role in, and its plan.
struct RoleBasis {
  codecs::Codec codec;
  const codecs::CalPlan* plan;
};

// Pages of the hot and the cold pool as the attention kernels read them. Each role (K, V) is read
// in one basis, a RoleBasis (the hot pool's codec's or the cold pool's: AttendRows chooses):
// rotated or projected queries score keys stored so, values accumulate in it and the output is
// turned back once per row. Rows stored in another basis (raw sink and window pages beside such
// a codec, a cold pool of another codec) are decoded and turned into it.
struct RefRows final : kernels::PageRows {
  // Each ref's pages are hot's or cold's (null: no cold pool).
  RefRows(std::span<const PageRef> refs, const KvLayout& layout, int table, const PagePool& hot,
          const PagePool* cold, int table_pages, RoleBasis k, RoleBasis v)
      : refs_(refs), layout_(layout), table_(table), hot_(&hot), basis_{k, v} {
    SetBytes(hot, bytes_[0]);
    if (cold != nullptr) SetBytes(*cold, bytes_[1]);
    // The table's bytes as its first page's times its count (whether the pass reads every page or
    // a selection: Quest's are scattered over all of them).
    far_ = !refs_.empty() && size_t(table_pages) * PageBytes(0) >= kFarMinTableBytes;
  }
  int n_pages() const override { return static_cast<int>(refs_.size()); }
  int n_keys() const override {  // a part's refs start past the pass's first key
    return refs_.empty() ? 0 : refs_.back().first_key + refs_.back().cnt - refs_.front().first_key;
  }
  int page_tokens() const override { return layout_.page_tokens; }
  int head_dim() const override { return layout_.head_dim; }
  kernels::PagePositions Positions(int page, int* cnt) const override {
    *cnt = refs_[page].cnt;
    const PagePool& pool = *refs_[page].pool;
    const uint8_t* p = pool.position_data(refs_[page].page);
    if (pool.short_positions()) return {nullptr, reinterpret_cast<const uint16_t*>(p)};
    return {reinterpret_cast<const int32_t*>(p)};
  }
  kernels::PageData Rows(int page, float* k_buf, float* v_buf) const override {
    PagePool& pool = *refs_[page].pool;
    const int32_t id = refs_[page].page;
    kernels::PageData d;
    const codecs::Codec ck = pool.codec_of(id, Role::kKey);
    if (ck == codecs::Codec::kKivi4 || ck == codecs::Codec::kKivi2) {  // read fused
      const uint8_t* k = pool.rows(id, Role::kKey);
      d.k_channels = reinterpret_cast<const uint16_t*>(k);
      d.k = k + codecs::KiviKeyMetaBytes(layout_.head_dim);
      d.k_bits = ck == codecs::Codec::kKivi4 ? 4 : 2;
    } else {
      d.k = Rows(pool, id, Role::kKey, refs_[page].cnt, k_buf, &d.k_type);
    }
    if (pool.codec_of(id, Role::kValue) == codecs::Codec::kCq2 &&
        codecs::BasisOf(basis_[1].codec) == codecs::Basis::kChannels) {  // read in place
      d.v = pool.rows(id, Role::kValue);
      d.v_levels = codecs::Cq2Levels();
    } else {
      d.v = Rows(pool, id, Role::kValue, refs_[page].cnt, v_buf, &d.v_type);
    }
    return d;
  }
  // The page into L1 and, for a light tile over a table of kFarMinTableBytes or more in pages of
  // kFarMinBytes or more, the one kFarPages after it into L2. With only the next page in flight,
  // MHA decode attention over f16 pages streamed from DRAM at 15 GB/s on one Zen 5 core and took
  // 1.15x as long (kernels_bench TABLES=384 MHA_ONLY=1 ... codecs); Quest's scattered selection
  // at 16k tokens decoded 1.07x faster with it. Where a page takes longer to score than to arrive
  // the far prefetches are only more instructions: in cache (f16 1.1x slower, q4_0 1.07x) and for
  // a GQA group's eight rows (TinyLlama-shaped f16 KV at 4096 tokens 4% slower). q4_0's 1.1 KB
  // pages of 64-wide heads gained nothing while their values were summed in floats; since the
  // int8 value and key kernels (kernels/cpu/value_sums_int8.cc) they wait on DRAM too: 144
  // tables of 16k keys 1.26x faster with the far prefetch, mha-85m's decode at 16k 1.1x. A
  // table of kFarMinTableBytes is one of a model of dozens: the step's cache outgrows the L3.
  void Prefetch(int page, bool light) const override {
    FetchPage<3>(page);
    const int far = page + kFarPages;
    if (light && far_ && far < n_pages() && PageBytes(far) >= kFarMinBytes) FetchPage<2>(far);
  }

 private:
  static constexpr int kFarPages = 4;
  static constexpr size_t kFarMinBytes = 1024;
  static constexpr size_t kFarMinTableBytes = size_t{1} << 20;

  // A page's K and V byte counts (bytes_ by its pool and kind).
  const size_t* Bytes(int page) const {
    return bytes_[refs_[page].pool != hot_][IsCodecPage(refs_[page].page)];
  }
  size_t PageBytes(int page) const { return Bytes(page)[0] + Bytes(page)[1]; }

  // Inlined where it is used: GCC 12 dropped the prefetches of a helper lambda it had not inlined
  // (a call with no other effect), leaving Prefetch empty.
  template <int kLocality>
  __attribute__((always_inline)) inline void FetchPage(int page) const {
    PagePool& pool = *refs_[page].pool;
    const int32_t id = refs_[page].page;
    const size_t* bytes = Bytes(page);
    auto fetch = [](const void* p, size_t n) __attribute__((always_inline)) {
      for (size_t off = 0; off < n; off += 64) {
        __builtin_prefetch(static_cast<const char*>(p) + off, 0, kLocality);
      }
    };
    fetch(pool.rows(id, Role::kKey), bytes[0]);
    fetch(pool.rows(id, Role::kValue), bytes[1]);
    // The positions live apart from the rows, and the kernel reads them first (which keys are
    // visible): unfetched, a scattered page's positions were a DRAM miss that a third of a Quest
    // decode step's attention waited on.
    fetch(pool.position_data(id), pool.layout().page_position_bytes());
  }

  // Bytes of a page's K and V rows in a pool, by kind (raw, codec), as codec_of gives their codecs.
  static void SetBytes(const PagePool& pool, size_t (&bytes)[2][2]) {
    const KvLayout& l = pool.layout();
    const codecs::Codec raw = l.raw_codec();
    bytes[0][0] = codecs::PageBytes(raw, Role::kKey, l.page_tokens, l.head_dim);
    bytes[0][1] = codecs::PageBytes(raw, Role::kValue, l.page_tokens, l.head_dim);
    bytes[1][0] = codecs::PageBytes(l.codec_k, Role::kKey, l.page_tokens, l.head_dim);
    bytes[1][1] = codecs::PageBytes(l.codec_v, Role::kValue, l.page_tokens, l.head_dim);
  }

  // f32, f16, bf16, q8_0 and q4_0 rows in the basis they are stored in are read in place (the
  // kernel widens or unpacks them as it loads); other rows are decoded into buf.
  const void* Rows(PagePool& pool, int32_t id, Role role, int cnt, float* buf, DType* type) const {
    const codecs::Codec c = pool.codec_of(id, role);
    const uint8_t* data = pool.rows(id, role);
    const RoleBasis& into = basis_[role == Role::kValue];
    const int hd = layout_.head_dim;
    if (c != into.codec && codecs::BasisOf(c) != codecs::BasisOf(into.codec)) {
      const codecs::CalPlan* plan = pool.plan_of(id, table_, role);
      DecodeStoredRows(pool, table_, id, role, cnt, buf);
      for (int t = 0; t < cnt; ++t) {
        codecs::OutOfBasis(c, plan, buf + size_t(t) * hd, hd, true);
        codecs::IntoBasis(into.codec, into.plan, buf + size_t(t) * hd, hd, codecs::BasisVec::kRow);
      }
      *type = DType::kF32;
      return buf;
    }
    switch (c) {
      case codecs::Codec::kF32:
        *type = DType::kF32;
        return data;
      case codecs::Codec::kF16:
        *type = DType::kF16;
        return data;
      case codecs::Codec::kBF16:
        *type = DType::kBF16;
        return data;
      case codecs::Codec::kQ8_0:  // llama.cpp's block layouts: the kernel unpacks them fused
        *type = DType::kQ8_0;
        return data;
      case codecs::Codec::kQ4_0:
      case codecs::Codec::kCq4:  // q4_0 blocks in the basis the queries were turned into
        *type = DType::kQ4_0;
        return data;
      default:
        DecodeStoredRows(pool, table_, id, role, cnt, buf);
        *type = DType::kF32;
        return buf;
    }
  }

  std::span<const PageRef> refs_;
  const KvLayout& layout_;
  int table_;
  const PagePool* hot_;
  RoleBasis basis_[2];          // [K, V]
  size_t bytes_[2][2][2] = {};  // [hot, cold][raw, codec page][K, V]: Prefetch's byte counts
  bool far_ = false;            // whether Prefetch also fetches kFarPages ahead
};

void AttendPlain(const kernels::AttnBatch& batch, const TablePages& hot) {
  const BlockTable& t = *hot.table;
  kernels::PagedKv v = PlainView(*hot.pool, t);
  if (hot.subset) {  // the selected pages form a page table of their own
    thread_local std::vector<int32_t> ids;
    ids.clear();
    for (int32_t p : *hot.subset) ids.push_back(t.pages[p]);
    const int pt = hot.pool->layout().page_tokens;
    v.page_ids = ids.data();
    v.n_tokens =
        static_cast<int>((ids.size() - 1) * pt + (t.n_tokens - (t.n_tokens - 1) / pt * pt));
  }
  if (batch.n_parts > 1) {  // every page but the last is full
    const int pt = v.page_tokens, n = (v.n_tokens + pt - 1) / pt;
    int begin = 0, end = 0;
    PartPages(batch, n, &begin, &end);
    v.page_ids += begin;
    v.n_tokens = end == n ? std::max(0, v.n_tokens - begin * pt) : (end - begin) * pt;
  }
  kernels::PagedAttention(batch, v);
}

void AttendRows(const kernels::AttnBatch& batch, const TablePages& hot, const TablePages* cold) {
  // The pages of the pass (hot, then cold), or of its part: only those are listed.
  const int n_hot = PagesRead(hot), n_read = n_hot + (cold ? PagesRead(*cold) : 0);
  int begin = 0, end = n_read;
  if (batch.n_parts > 1) PartPages(batch, n_read, &begin, &end);
  thread_local std::vector<PageRef> refs;
  refs.clear();
  int table_pages = AddRefs(hot, begin, end, &refs);
  if (cold) table_pages += AddRefs(*cold, begin - n_hot, end - n_hot, &refs);
  // The basis of each role: the hot pool's, or where that is plain and the pass reads more cold
  // pages than hot ones, the cold pool's (aged pages of cq4 / cq2 are then read in place, and the
  // recent rows turned into their basis); rows stored in another basis are converted.
  const KvLayout& lay = hot.pool->layout();
  const bool cold_most = cold != nullptr && PagesRead(*cold) > n_hot;
  auto basis_of = [&](Role role) {
    const codecs::Codec h = role == Role::kKey ? lay.codec_k : lay.codec_v;
    if (cold_most && codecs::BasisOf(h) == codecs::Basis::kPlain) {
      const KvLayout& cl = cold->pool->layout();
      const codecs::Codec c = role == Role::kKey ? cl.codec_k : cl.codec_v;
      if (codecs::BasisOf(c) != codecs::Basis::kPlain)
        return RoleBasis{c, cl.plan(hot.index, role, c)};
    }
    return RoleBasis{h, lay.plan(hot.index, role, h)};
  };
  const RoleBasis bk = basis_of(Role::kKey), bv = basis_of(Role::kValue);
  const codecs::Codec ck = bk.codec, cv = bv.codec;
  const bool turn_k = codecs::BasisOf(ck) != codecs::Basis::kPlain;
  const bool turn_v = codecs::BasisOf(cv) != codecs::Basis::kPlain;
  const codecs::CalPlan* plan_k = bk.plan;
  const codecs::CalPlan* plan_v = bv.plan;
  const int hd = lay.head_dim, q_dim = batch.n_heads * hd;
  kernels::AttnBatch b = batch;
  thread_local std::vector<float> q_rot, out_rot;
  if (turn_k) {  // queries in the keys' basis, compact (not centered: q.mean shifts every score)
    q_rot.resize(size_t(b.n_tok) * q_dim);
    for (int i = 0; i < b.n_tok; ++i) {
      for (int h = 0; h < b.n_heads; ++h) {
        float* q = q_rot.data() + size_t(i) * q_dim + size_t(h) * hd;
        std::copy_n(batch.q + i * batch.q_stride + h * hd, hd, q);
        codecs::IntoBasis(ck, plan_k, q, hd, codecs::BasisVec::kQuery);
      }
    }
    b.q = q_rot.data();
    b.q_stride = q_dim;
  }
  if (turn_v) {
    out_rot.resize(size_t(b.n_tok) * q_dim);
    b.out = out_rot.data();
    b.out_stride = q_dim;
  }
  kernels::PagedAttentionRows(b, RefRows(refs, lay, hot.index, *hot.pool,
                                         cold ? cold->pool : nullptr, table_pages, bk, bv));
  if (turn_v) {  // the weights sum to 1: the centered values' mean comes back once
    for (int i = 0; i < b.n_tok; ++i) {
      for (int h = 0; h < b.n_heads; ++h) {
        float* out = batch.out + i * batch.out_stride + h * hd;
        std::copy_n(out_rot.data() + size_t(i) * q_dim + size_t(h) * hd, hd, out);
        codecs::OutOfBasis(cv, plan_v, out, hd, true);
      }
    }
  }
}

}  // namespace

kernels::PagedKv PlainView(const PagePool& pool, const BlockTable& t) {
  const KvLayout& lay = pool.layout();
  kernels::PagedKv v;
  v.slots = pool.slots_base();
  v.positions = pool.positions_base();
  v.slot_floats = lay.slot_floats();
  v.page_tokens = lay.page_tokens;
  v.head_dim = lay.head_dim;
  v.page_ids = t.pages.data();
  v.n_tokens = t.n_tokens;
  return v;
}

void AttendTables(const kernels::AttnBatch& batch, const TablePages& hot, const TablePages* cold) {
  if (hot.pool->layout().plain() && cold == nullptr) {
    AttendPlain(batch, hot);
  } else {
    AttendRows(batch, hot, cold);
  }
}

}  // namespace cachet

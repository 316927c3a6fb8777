// Highway PagedAttention: block-wise online softmax over the pages of a page table.
//
// The query rows of a GQA group (every head of up to kMaxTileRows / n_heads tokens) form a tile
// that walks the pages once, so each K/V row loaded serves every head and token of the tile. Per
// page: the scores of all its keys for all rows (dot products two query rows x four keys at a
// time), masking keys whose position is past the row's query position; then per row one rescale of
// the running sum and accumulator to the new running max, exp of the scores, and acc += p . V.
// Positions are read per key: they need not be contiguous or sorted. Single-threaded; scratch is
// per thread and reused. This file walks the pages (PageWalk; AttnObserve's terms: ObservedRows);
// what is done with one page's rows is in kernels/cpu/attention_page-inl.h.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/block_keys.h"
#include "kernels/cpu/scratch.h"
#include "kernels/kernels.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/cpu/hwy_util-inl.h"
#include "kernels/cpu/attention_rows-inl.h"
#include "kernels/cpu/attention_page-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// The fallback target for CPUs without SSE4 (HWY_SCALAR with GCC < 12.3): the reference kernel.
void PagedAttentionImpl(const AttnBatch& b, const PagedKv& kv) { ref::PagedAttention(b, kv); }
void PagedAttentionRowsImpl(const AttnBatch& b, const PageRows& kv) {
  ref::PagedAttentionRows(b, kv);
}
#else
namespace {

// Query rows (token, head) of a tile; a group with more heads than this still forms one tile per
// token.
constexpr int kMaxTileRows = 32;
// Score lanes of a chunk of pages that share one online-softmax step (PageWalk): the per-step
// work (max, rescale, sums) is paid once per chunk rather than once per small page.
constexpr int kChunkKeys = 64;
// Tiles of at most this many query rows (an MHA decode step) tell the page source that they are
// light (PageRows::Prefetch): a GQA group's eight rows score a page longer than it takes to load.
constexpr int kLightRows = 2;
constexpr int kMaxSlots = kChunkKeys / 4;  // pages of a chunk: s_stride >= 4
// The most a call keeps of pages decoded for later tiles (PageWalk): 16k keys of head_dim 128
// (per thread; a longer context decodes the pages past them per tile, as before).
constexpr size_t kMaxKeptBytes = size_t{17} << 20;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One page of a chunk: its keys' positions and rows.
struct Slot {
  int page, cnt;
  const int32_t* pos;
  int64_t j0;  // the page's first key, among all keys
  bool all_visible;
  PageData rows;
};

// AttnObserve's terms: the final softmax weights are known only once a tile has walked every page,
// so for the observed rows (those of tokens with q_pos >= the smallest min_pos) each page's
// exp(s - m) terms and the running max m they were taken against are kept (per row, per key / per
// page), and at the end of the tile folded into weight_j = p_j * exp(m_page - m_final) /
// sum_final. Rows are indexed by their token's slot among the observed tokens of the tile.
class ObservedRows {
 public:
  template <class Pages>
  ObservedRows(const AttnBatch& b, const Pages& pages, int n_pages, int n_keys, int tile_tok)
      : b_(b), n_pages_(n_pages), n_keys_(n_keys) {
    if (b.n_observe <= 0 || n_pages <= 0) return;
    min_pos_ = b.observe[0].min_pos;
    for (int i = 1; i < b.n_observe; ++i) min_pos_ = std::min(min_pos_, b.observe[i].min_pos);
    int n_obs_tok = 0;
    for (int t = 0; t < b.n_tok; ++t) n_obs_tok += b.q_pos[t] >= min_pos_;
    if (n_obs_tok == 0) return;
    const size_t rows = static_cast<size_t>(std::min(tile_tok, n_obs_tok)) * b.n_heads;
    p_ = ThreadScratch(kScratchAttentionObserve, rows * (static_cast<size_t>(n_keys) + n_pages));
    m_ = p_ + rows * n_keys;
    thread_local std::vector<int64_t> page_first;
    page_first.assign(n_pages + 1, 0);
    for (int page = 0; page < n_pages; ++page) {
      int cnt = 0;
      pages.Positions(page, &cnt);
      page_first[page + 1] = page_first[page] + cnt;
    }
    page_first_ = page_first.data();
  }

  // The tile's observed tokens take their slots; their terms start empty.
  void BeginTile(const int32_t* q_pos, int nt) {
    tok_ = 0;
    if (p_ == nullptr) return;
    for (int t = 0; t < nt; ++t) slot_[t] = q_pos[t] >= min_pos_ ? tok_++ : -1;
    std::fill(m_, m_ + static_cast<size_t>(tok_) * b_.n_heads * n_pages_, kNegInf);
  }

  // Row r's terms of a chunk (its score row s after the softmax step against max m), if observed.
  void Keep(int r, const float* s, const Slot* slots, int n_slots, int s_stride, float m) {
    const int64_t o = Row(r);
    if (o < 0) return;
    for (int i = 0; i < n_slots; ++i) {
      std::copy_n(s + i * s_stride, slots[i].cnt, p_ + o * n_keys_ + slots[i].j0);
      m_[o * n_pages_ + slots[i].page] = m;
    }
  }

  // The tile's kept terms folded into the observers' key weights.
  void Fold(const int32_t* q_pos, int rows, const float* run_max, const float* run_sum) const {
    for (int r = 0; r < rows; ++r) {
      const int64_t o = Row(r);
      if (o < 0 || run_sum[r] == 0.0f) continue;
      const int32_t qp = q_pos[r / b_.n_heads];
      const float* p_row = p_ + o * n_keys_;
      const float* m_row = m_ + o * n_pages_;
      const float inv = 1.0f / run_sum[r];
      for (int page = 0; page < n_pages_; ++page) {
        const int64_t j0 = page_first_[page];
        const int cnt = static_cast<int>(page_first_[page + 1] - j0);
        if (m_row[page] == kNegInf) continue;  // nothing of the page visible to the row
        const float c = std::exp(m_row[page] - run_max[r]) * inv;
        for (int i = 0; i < b_.n_observe; ++i) {
          if (qp < b_.observe[i].min_pos) continue;
          float* w = b_.observe[i].key_weight + j0;
          if (b_.observe[i].max) {
            for (int j = 0; j < cnt; ++j) w[j] = std::max(w[j], c * p_row[j0 + j]);
          } else {
            AxpyRow(c, p_row + j0, cnt, w);
          }
        }
      }
    }
  }

 private:
  // Row r's index among the tile's observed rows, or -1.
  int64_t Row(int r) const {
    if (tok_ == 0 || slot_[r / b_.n_heads] < 0) return -1;
    return static_cast<int64_t>(slot_[r / b_.n_heads]) * b_.n_heads + r % b_.n_heads;
  }

  const AttnBatch& b_;
  int n_pages_, n_keys_;
  float* p_ = nullptr;  // [row][n_keys]: exp(s - m) of every key, page-table order
  float* m_ = nullptr;  // [row][n_pages]: the m of each page, -inf where the row saw nothing of it
  int32_t min_pos_ = 0;
  int tok_ = 0;                          // observed tokens in this tile
  int slot_[kMaxTileRows];               // tile token -> its slot among the observed tokens, or -1
  const int64_t* page_first_ = nullptr;  // each page's first key, and the total last
};

// Row r's scores of a chunk's pages (slots side by side, s_stride apart): keys past the row's
// position qp masked, each page's lanes past its keys padded, with -inf.
HWY_INLINE void MaskChunkRow(float* s, const Slot* slots, int n_slots, int s_stride, int32_t qp) {
  for (int i = 0; i < n_slots; ++i) {
    const Slot& sl = slots[i];
    float* si = s + i * s_stride;
    if (!sl.all_visible) {
      for (int j = 0; j < sl.cnt; ++j) {
        if (sl.pos[j] > qp) si[j] = kNegInf;
      }
    }
    std::fill(si + sl.cnt, si + s_stride, kNegInf);
  }
}

// A row's online-softmax step over a chunk's masked score row s (width lanes): the running max m
// moves to the chunk's if larger (the running sum and the row's accumulator rescaled), and s
// becomes exp(s - m), added to the sum. Returns m, or -inf when no key of the chunk is visible to
// the row (s is then zeroed and nothing else changes).
HWY_INLINE float SoftmaxStep(float* s, int width, float* run_max, float* run_sum, float* acc_r,
                             int hd) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  VF vmax = hn::Set(df, kNegInf);
  for (int j = 0; j < width; j += N) vmax = hn::Max(vmax, hn::LoadU(df, s + j));
  const float chunk_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
  if (chunk_max == kNegInf) {
    std::fill(s, s + width, 0.0f);
    return kNegInf;
  }
  const float m_new = std::max(*run_max, chunk_max);
  if (*run_max != kNegInf && m_new > *run_max) {
    const float correction = std::exp(*run_max - m_new);
    *run_sum *= correction;
    ScaleRow(acc_r, hd, correction);
  }
  *run_max = m_new;
  const VF vm = hn::Set(df, m_new);
  VF vsum = hn::Zero(df);
  for (int j = 0; j < width; j += N) {
    const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + j), vm));  // exp(-inf) = 0
    hn::StoreU(p, df, s + j);
    vsum = hn::Add(vsum, p);
  }
  *run_sum += ReduceSum(vsum);
  return m_new;
}

// The kernel over any page source: `pages` gives logical page i's positions and key count
// (Positions) and its f32 K/V rows (Rows, which may decode into the two page-sized buffers it is
// passed). Page i's keys are numbered from the sum of the earlier pages' counts.
//
// Pages go by chunks of up to max_slots: each page's scores land in its slot of the score rows,
// then every row takes one online-softmax step over the whole chunk, then each page's values are
// added. Fewer, wider softmax steps; the same bits whether rows are read fused or unpacked.
template <class Pages>
class PageWalk {
 public:
  PageWalk(const AttnBatch& b, const Pages& pages, int n_pages, int n_keys, int pt, int hd)
      : b_(b),
        pages_(pages),
        n_pages_(n_pages),
        hd_(hd),
        n_heads_(b.n_heads),
        tile_tok_(std::max(1, kMaxTileRows / b.n_heads)),
        // Score rows hold a page's keys padded with -inf to whole vectors, hence to groups of
        // four keys (N >= 4 on every SIMD target).
        s_stride_((pt + kMaxLanes - 1) / kMaxLanes * kMaxLanes),
        // A chunk: as many pages as fit kChunkKeys score lanes, at least one.
        max_slots_(std::max(1, kChunkKeys / s_stride_)),
        c_stride_(max_slots_ * s_stride_),
        // A page's rows as f32 (pages a source decodes).
        page_floats_(static_cast<size_t>(pt) * hd),
        observed_(b, pages, n_pages, n_keys, tile_tok_) {
    const int max_rows = std::min(tile_tok_, b.n_tok) * n_heads_;
    const size_t acc_floats = static_cast<size_t>(max_rows) * hd;
    const size_t score_floats = static_cast<size_t>(max_rows) * c_stride_;
    const size_t chan_floats = static_cast<size_t>(2 + kRowBlock) * hd;  // ScoreChannelPage
    acc_ = ThreadScratch(kScratchAttention, acc_floats + score_floats + 2 * max_rows +
                                                2 * max_slots_ * page_floats_ + chan_floats +
                                                max_slots_ * s_stride_);
    scores_ = acc_ + acc_floats;
    run_max_ = scores_ + score_floats;
    run_sum_ = run_max_ + max_rows;
    k_buf_ = run_sum_ + max_rows;
    v_buf_ = k_buf_ + max_slots_ * page_floats_;
    chan_ = v_buf_ + max_slots_ * page_floats_;
    pos_buf_ = reinterpret_cast<int32_t*>(chan_ + chan_floats);
    // A prompt's tiles each walk the pages: pages the source decodes (codec pages) are decoded by
    // the first tile that sees them into a buffer of their own and read from there by the others
    // (a 512-token chunk is 52 tiles of a GQA-3 group): the first n_keep_ pages, kMaxKeptBytes.
    if (std::is_base_of_v<PageRows, Pages> && b.n_tok > tile_tok_) {
      n_keep_ = static_cast<int>(
          std::min<size_t>(n_pages, kMaxKeptBytes / (2 * page_floats_ * sizeof(float))));
    }
    if (n_keep_ > 0) {
      kept_buf_ = ThreadScratch(kScratchAttentionKept, size_t(n_keep_) * 2 * page_floats_);
      KeptRows().resize(n_keep_);
      Kept().assign(n_keep_, 0);
    }
    const int nb = std::max(1, hd / 32);
    q8_ = reinterpret_cast<int8_t*>(
        ThreadScratch(kScratchAttentionQ8, static_cast<size_t>(max_rows) * (hd / 4 + 2 * nb)));
    q8_d_ = reinterpret_cast<float*>(q8_ + static_cast<size_t>(max_rows) * hd);
    q8_sum_ = reinterpret_cast<int32_t*>(q8_d_ + static_cast<size_t>(max_rows) * nb);
    // A group of more than kMaxTileRows heads (multi-query attention) is a tile of one token.
    Q8Rows().resize(max_rows);
    q8_rows_ = Q8Rows().data();
  }

  void Run() {
    for (int t0 = 0; t0 < b_.n_tok; t0 += tile_tok_) Tile(t0);
  }

 private:
  // The pages decoded by a prompt's first tile (kept_buf_), and which are.
  static std::vector<PageData>& KeptRows() {
    thread_local std::vector<PageData> rows;
    return rows;
  }
  static std::vector<QueryQ8>& Q8Rows() {
    thread_local std::vector<QueryQ8> rows;
    return rows;
  }
  static std::vector<uint8_t>& Kept() {
    thread_local std::vector<uint8_t> kept;
    return kept;
  }

  const float* QueryRow(int t0, int r) const {
    return b_.q + (t0 + r / n_heads_) * b_.q_stride + static_cast<int64_t>(r % n_heads_) * hd_;
  }

  void Tile(int t0) {
    const int nt = std::min(tile_tok_, b_.n_tok - t0);
    const int rows = nt * n_heads_;
    const int32_t* q_pos = b_.q_pos + t0;
    const int32_t q_min = *std::min_element(q_pos, q_pos + nt);
    const int32_t q_max = *std::max_element(q_pos, q_pos + nt);
    q8_ready_ = false;
    first_key_ = 0;
    std::fill(acc_, acc_ + static_cast<size_t>(rows) * hd_, 0.0f);
    std::fill(run_max_, run_max_ + rows, kNegInf);
    std::fill(run_sum_, run_sum_ + rows, 0.0f);
    observed_.BeginTile(q_pos, nt);
    for (int page = 0; page < n_pages_;) {
      const int n_slots = ScoreChunk(t0, rows, q_min, q_max, &page);
      if (n_slots == 0) break;
      for (int r = 0; r < rows; ++r) {
        float* s = scores_ + static_cast<int64_t>(r) * c_stride_;
        MaskChunkRow(s, slots_, n_slots, s_stride_, q_pos[r / n_heads_]);
        const float m = SoftmaxStep(s, n_slots * s_stride_, run_max_ + r, run_sum_ + r,
                                    acc_ + static_cast<int64_t>(r) * hd_, hd_);
        if (m != kNegInf) observed_.Keep(r, s, slots_, n_slots, s_stride_, m);
      }
      for (int i = 0; i < n_slots; ++i) {
        const Slot& sl = slots_[i];
        // q4_0 values of 64-wide heads: the int8 kernel, where the CPU has it.
        if (sl.rows.v_type == DType::kQ4_0 && sl.rows.v_levels == nullptr &&
            cpu::Q4ValueSums(static_cast<const uint8_t*>(sl.rows.v), sl.cnt, hd_, rows,
                             scores_ + i * s_stride_, c_stride_, acc_)) {
          continue;
        }
        WithValueRows(sl.rows, hd_, [&](const auto& v_rows) {
          AccumulatePage(v_rows, sl.cnt, hd_, rows, scores_ + i * s_stride_, c_stride_, acc_);
        });
      }
    }
    WriteRows(t0, rows);
    observed_.Fold(q_pos, rows, run_max_, run_sum_);
  }

  // Fills the chunk's slots with pages from *page on, each scored for the tile's rows (a page
  // none of whose keys the tile sees is passed over); returns how many.
  int ScoreChunk(int t0, int rows, int32_t q_min, int32_t q_max, int* page) {
    int n_slots = 0;
    for (; *page < n_pages_ && n_slots < max_slots_; ++*page) {
      if constexpr (std::is_base_of_v<PageRows, Pages>) {
        if (*page + 1 < n_pages_) pages_.Prefetch(*page + 1, rows <= kLightRows);
      }
      Slot& sl = slots_[n_slots];
      const PagePositions pp = pages_.Positions(*page, &sl.cnt);
      sl.page = *page;
      sl.j0 = first_key_;
      first_key_ += sl.cnt;
      int32_t p_min, p_max;
      if (pp.wide != nullptr) {
        sl.pos = pp.wide;
        PositionBounds(sl.pos, sl.cnt, &p_min, &p_max);
      } else {
        int32_t* buf = pos_buf_ + n_slots * s_stride_;
        WidenPositions(pp.narrow, sl.cnt, buf, &p_min, &p_max);
        sl.pos = buf;
      }
      if (p_min > q_max) continue;  // no key of the page is visible to the tile
      sl.all_visible = p_max <= q_min;
      float* kb = k_buf_ + n_slots * page_floats_;
      FetchRows(*page, kb, v_buf_ + n_slots * page_floats_, &sl.rows);
      ScoreKeys(sl, t0, rows, scores_ + n_slots * s_stride_, kb);
      ++n_slots;
    }
    return n_slots;
  }

  // A page's rows: from the source (decoded into k_buf / v_buf if it must), or kept by the
  // tile that decoded it first.
  void FetchRows(int page, float* k_buf, float* v_buf, PageData* rows) {
    if (page >= n_keep_) {
      // Built in place: assigning the returned struct copied it with one wide load of the
      // callee's field-by-field stores, a store-forwarding stall on every page (15% of an MHA
      // decode step's attention in cache).
      ::new (static_cast<void*>(rows)) PageData(pages_.Rows(page, k_buf, v_buf));
    } else if (Kept()[page]) {
      *rows = KeptRows()[page];
    } else {
      float* own = kept_buf_ + size_t(page) * 2 * page_floats_;
      *rows = KeptRows()[page] = pages_.Rows(page, own, own + page_floats_);
      Kept()[page] = 1;
    }
  }

  // A page's key scores for the tile's rows, into its slot s0 of the score rows.
  void ScoreKeys(const Slot& sl, int t0, int rows, float* s0, float* k_buf) {
    auto q_row = [&](int r) { return QueryRow(t0, r); };
    if (sl.rows.k_channels != nullptr) {
      ScoreChannelPage(sl.rows, sl.cnt, hd_, rows, q_row, b_.scale, s0, c_stride_, k_buf, chan_);
    } else if (IsBlockKeyType(sl.rows.k_type)) {
      if (!q8_ready_) {  // the tile's query rows quantized, once a page of block keys needs them
        for (int r = 0; r < rows; ++r) {
          q8_rows_[r] = {q8_ + r * hd_, q8_d_ + r * (hd_ / 32), q8_sum_ + r * (hd_ / 32)};
          cpu::QuantizeQuery(q_row(r), hd_, q8_ + r * hd_, q8_d_ + r * (hd_ / 32),
                             q8_sum_ + r * (hd_ / 32));
        }
        q8_ready_ = true;
      }
      cpu::BlockKeyScores(static_cast<const uint8_t*>(sl.rows.k), sl.rows.k_type, sl.cnt, hd_,
                          q8_rows_, rows, b_.scale, s0, c_stride_);
    } else {
      WithPlainRows(sl.rows.k, sl.rows.k_type, hd_, [&](const auto& k_rows) {
        ScorePage(k_rows, sl.cnt, hd_, rows, q_row, b_.scale, s0, c_stride_, NoBias);
      });
    }
  }

  // The tile's outputs: each row's accumulator over its sum (zero where no key was visible).
  void WriteRows(int t0, int rows) const {
    const DF df;
    for (int r = 0; r < rows; ++r) {
      float* out =
          b_.out + (t0 + r / n_heads_) * b_.out_stride + static_cast<int64_t>(r % n_heads_) * hd_;
      const float* acc_r = acc_ + static_cast<int64_t>(r) * hd_;
      if (b_.row_max != nullptr) {
        b_.row_max[t0 * n_heads_ + r] = run_max_[r];
        b_.row_sum[t0 * n_heads_ + r] = run_sum_[r];
      }
      if (run_sum_[r] == 0.0f) {
        std::fill(out, out + hd_, 0.0f);
        continue;
      }
      const float inv = 1.0f / run_sum_[r];
      const VF vinv = hn::Set(df, inv);
      int d = 0;
      for (; d + kMaxLanes <= hd_; d += kMaxLanes) {
        hn::StoreU(hn::Mul(hn::LoadU(df, acc_r + d), vinv), df, out + d);
      }
      for (; d < hd_; ++d) out[d] = acc_r[d] * inv;
    }
  }

  const AttnBatch& b_;
  const Pages& pages_;
  const int n_pages_, hd_, n_heads_, tile_tok_;
  const int s_stride_, max_slots_, c_stride_;
  const size_t page_floats_;
  ObservedRows observed_;
  // Carved from the thread's scratch: per tile row its accumulator, score row (a chunk's pages
  // side by side), running max and sum; a decoded page per slot (K, then V) for sources that
  // store pages encoded; ScoreChannelPage's rows; 16-bit positions widened, per slot.
  float *acc_, *scores_, *run_max_, *run_sum_, *k_buf_, *v_buf_, *chan_;
  int32_t* pos_buf_;
  int n_keep_ = 0;
  float* kept_buf_ = nullptr;
  int8_t* q8_;  // the tile's query rows quantized for block keys (q8_ready_), their scales, sums
  float* q8_d_;
  int32_t* q8_sum_;
  QueryQ8* q8_rows_;
  bool q8_ready_ = false;
  Slot slots_[kMaxSlots];
  int64_t first_key_ = 0;  // of the tile's next page, among all keys
};

template <class Pages>
void AttendPages(const AttnBatch& b, const Pages& pages, int n_pages, int n_keys, int pt, int hd) {
  if (b.n_tok <= 0 || b.n_heads <= 0 || hd <= 0) return;
  PageWalk<Pages>(b, pages, n_pages, n_keys, pt, hd).Run();
}

// A plain page table of raw f32 pages.
struct RawPages {
  const PagedKv& kv;
  PagePositions Positions(int page, int* cnt) const {
    *cnt = std::min(kv.page_tokens, kv.n_tokens - page * kv.page_tokens);
    return {kv.positions + int64_t{kv.page_ids[page]} * kv.page_tokens};
  }
  PageData Rows(int page, float*, float*) const {
    const float* k = kv.slots + int64_t{kv.page_ids[page]} * kv.slot_floats;
    return {k, k + int64_t{kv.page_tokens} * kv.head_dim};
  }
};

}  // namespace

void PagedAttentionImpl(const AttnBatch& b, const PagedKv& kv) {
  const int pt = kv.page_tokens;
  const int n_pages = kv.n_tokens > 0 ? (kv.n_tokens + pt - 1) / pt : 0;
  AttendPages(b, RawPages{kv}, n_pages, kv.n_tokens, pt, kv.head_dim);
}

void PagedAttentionRowsImpl(const AttnBatch& b, const PageRows& kv) {
  AttendPages(b, kv, kv.n_pages(), kv.n_keys(), kv.page_tokens(), kv.head_dim());
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cachet::kernels::cpu {

HWY_EXPORT(PagedAttentionImpl);
HWY_EXPORT(PagedAttentionRowsImpl);

void PagedAttention(const AttnBatch& b, const PagedKv& kv) {
  HWY_DYNAMIC_DISPATCH(PagedAttentionImpl)(b, kv);
}
void PagedAttentionRows(const AttnBatch& b, const PageRows& kv) {
  HWY_DYNAMIC_DISPATCH(PagedAttentionRowsImpl)(b, kv);
}

}  // namespace cachet::kernels::cpu
#endif  // HWY_ONCE

// Highway PagedAttention: block-wise online softmax over the pages of a page table.
//
// The query rows of a GQA group (every head of up to kMaxTileRows / n_heads tokens) form a tile
// that walks the pages once, so each K/V row loaded serves every head and token of the tile. Per
// page: the scores of all its keys for all rows (dot products two query rows x four keys at a
// time), masking keys whose position is past the row's query position; then per row one rescale of
// the running sum and accumulator to the new running max, exp of the scores, and acc += p . V.
// Positions are read per key: they need not be contiguous or sorted. Single-threaded; scratch is
// per thread and reused.
//
// AttnObserve: the final softmax weights are known only once a tile has walked every page, so for
// the observed rows each page's exp(s - m) terms and the running max m they were taken against are
// kept (per row, per key / per page), and at the end of the tile folded into
// weight_j = p_j * exp(m_page - m_final) / sum_final.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
// Score lanes of a chunk of pages that share one online-softmax step (AttendPages): the per-step
// work (max, rescale, sums) is paid once per chunk rather than once per small page.
constexpr int kChunkKeys = 64;
// Tiles of at most this many query rows (an MHA decode step) tell the page source that they are
// light (PageRows::Prefetch): a GQA group's eight rows score a page longer than it takes to load.
constexpr int kLightRows = 2;
constexpr int kMaxSlots = kChunkKeys / 4;  // pages of a chunk: s_stride >= 4
// The most a call keeps of pages decoded for later tiles (AttendPages): 16k keys of head_dim 128
// (per thread; a longer context decodes the pages past them per tile, as before).
constexpr size_t kMaxKeptBytes = size_t{17} << 20;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scores (times scale) of a page's cnt keys for R query rows, four keys at a time; a last partial
// group repeats its last key. R * 4 accumulators stay in registers while each key vector is
// loaded (and widened) once for all R rows.
template <int R, class Rows>
HWY_INLINE void ScoreBlock(const Rows& k, int cnt, int hd, const float* const* q, float scale,
                           float* scores, int s_stride, const float* bias) {
  const DF df;
  const D4 d4;
  constexpr int N = kMaxLanes;
  const V4 vscale = hn::Set(d4, scale);
  for (int j = 0; j < cnt; j += 4) {
    int t[4];
    for (int i = 0; i < 4; ++i) t[i] = std::min(j + i, cnt - 1);
    VF a[R][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[r][i] = hn::Zero(df);
    }
    auto fma_rows = [&](int d, const VF* kv) HWY_ATTR {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const VF qv = hn::LoadU(df, q[r] + d);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) a[r][i] = hn::MulAdd(qv, kv[i], a[r][i]);
      }
    };
    // Block-quantized keys never come here: BlockKeyScores scores them.
    static_assert(!Rows::kBlocks);
    int d = 0;
    for (; d + N <= hd; d += N) {
      VF kv[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) kv[i] = k.Load(t[i], d);
      fma_rows(d, kv);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      V4 s = Reduce4(a[r][0], a[r][1], a[r][2], a[r][3]);
      if (d < hd) {
        float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int e = d; e < hd; ++e) {
          for (int i = 0; i < 4; ++i) tail[i] += q[r][e] * k.Elem(t[i], e);
        }
        s = hn::Add(s, hn::LoadU(d4, tail));
      }
      if (bias != nullptr) s = hn::Add(s, hn::Set(d4, bias[r]));
      hn::StoreU(hn::Mul(s, vscale), d4, scores + static_cast<int64_t>(r) * s_stride + j);
    }
  }
}

// Whether a row reader gives two vectors per load (q4_0: a block's low and high nibbles).
template <class Rows>
constexpr int kVecsPerLoad = [] {
  if constexpr (Rows::kBlocks) return Rows::kNibbles ? 2 : 1;
  return 1;
}();

// acc_r += sum_j p_r[j] * v_j over lanes of a page's cnt values for R rows (p_r at p + r *
// s_stride, acc_r at acc + r * hd): U loads of each value row starting at load u0 (a load is N
// lanes of a plain row at u * N, or one Values call of a block row: block u / per_block, codes
// (u % per_block) * N on). The U * R sums are independent FMA chains walked together, key by
// key: walked one after the other, a decode step (one to four rows) waited on the FMA latency at
// every key (kernels_bench's decode attention over f32 / f16 / q8_0 pages: 5-14% slower). Each
// lane still adds its keys in order, so the bits do not depend on U or R.
template <int R, int U, class Rows>
HWY_INLINE void AccumulateLoads(const Rows& v, int cnt, int hd, const float* p, int s_stride,
                                float* acc, int u0) {
  const DF df;
  constexpr int N = kMaxLanes;
  constexpr int kV = kVecsPerLoad<Rows>;
  int lane[U][kV];  // each sum's first lane within the row
  for (int u = 0; u < U; ++u) {
    if constexpr (Rows::kBlocks) {
      constexpr int kPerBlock = kCodeSpan<Rows> / N;
      const int at = (u0 + u) / kPerBlock * 32 + (u0 + u) % kPerBlock * N;
      lane[u][0] = at;
      if constexpr (kV == 2) lane[u][1] = at + 16;
    } else {
      lane[u][0] = (u0 + u) * N;
    }
  }
  VF a[R][U][kV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
#pragma GCC unroll 2
      for (int i = 0; i < kV; ++i) {
        a[r][u][i] = hn::LoadU(df, acc + static_cast<int64_t>(r) * hd + lane[u][i]);
      }
    }
  }
  if constexpr (Rows::kBlocks) {
    constexpr int kPerBlock = kCodeSpan<Rows> / N;
    for (int j = 0; j < cnt; ++j) {
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        const int blk = (u0 + u) / kPerBlock;
        VF x[2];
        v.Values(j, blk, (u0 + u) % kPerBlock * N, &x[0], &x[1]);
        const float scale = v.Scale(j, blk);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          // The row's weight times the block's scale, then times the code: the same steps
          // whether the block is read in place or unpacked (ScaledRows).
          const VF w = hn::Set(df, p[static_cast<int64_t>(r) * s_stride + j] * scale);
#pragma GCC unroll 2
          for (int i = 0; i < kV; ++i) a[r][u][i] = hn::MulAdd(w, x[i], a[r][u][i]);
        }
      }
    }
  } else {
    for (int j = 0; j < cnt; ++j) {
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        const VF x = v.Load(j, lane[u][0]);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          a[r][u][0] =
              hn::MulAdd(hn::Set(df, p[static_cast<int64_t>(r) * s_stride + j]), x, a[r][u][0]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
#pragma GCC unroll 2
      for (int i = 0; i < kV; ++i) {
        hn::StoreU(a[r][u][i], df, acc + static_cast<int64_t>(r) * hd + lane[u][i]);
      }
    }
  }
}

// acc_r += sum_j p_r[j] * v_j over a page's cnt values for R rows: as many loads walked together
// as the accumulators' registers allow, each value vector loaded (and unpacked) once for all R
// rows.
template <int R, class Rows>
HWY_INLINE void AccumulateBlock(const Rows& v, int cnt, int hd, const float* p, int s_stride,
                                float* acc) {
  constexpr int N = kMaxLanes;
  // Half the vector registers (16 of AVX-512's 32) hold sums; the loads, weights and addresses
  // take the rest.
  constexpr int kSumRegs = N >= 16 ? 16 : 8;
  constexpr int kU = std::max(1, std::min(4, kSumRegs / (R * kVecsPerLoad<Rows>)));
  int n_loads = hd / N;
  if constexpr (Rows::kBlocks) n_loads = hd / 32 * (kCodeSpan<Rows> / N);  // hd % 32 == 0
  int u = 0;
  if constexpr (kU >= 4) {
    for (; u + 4 <= n_loads; u += 4) AccumulateLoads<R, 4>(v, cnt, hd, p, s_stride, acc, u);
  }
  if constexpr (kU >= 2) {
    for (; u + 2 <= n_loads; u += 2) AccumulateLoads<R, 2>(v, cnt, hd, p, s_stride, acc, u);
  }
  for (; u < n_loads; ++u) AccumulateLoads<R, 1>(v, cnt, hd, p, s_stride, acc, u);
  if constexpr (!Rows::kBlocks) {
    for (int d = n_loads * N; d < hd; ++d) {
      for (int j = 0; j < cnt; ++j) {
        const float x = v.Elem(j, d);
        for (int r = 0; r < R; ++r) {
          acc[static_cast<int64_t>(r) * hd + d] += p[static_cast<int64_t>(r) * s_stride + j] * x;
        }
      }
    }
  }
}

// Rows in blocks of at most kRowBlock share each loaded key and value vector. ScorePage and
// AccumulatePage switch on the block's size themselves: dispatching through a generic lambda made
// a decode step about 5% slower (kernels_bench, GCC 12).
constexpr int kRowBlock = 4;

// q_row(r) is row r's query; a bias, when given, is added to row r's dot products (bias(r0, n,
// q, b) may also replace the block's queries, as KIVI keys' folded scales do).
template <class Rows, class QRow, class Bias>
HWY_INLINE void ScorePage(const Rows& k, int cnt, int hd, int rows, const QRow& q_row, float scale,
                          float* scores, int s_stride, const Bias& bias_of) {
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* q[kRowBlock];
    const int n = std::min(kRowBlock, rows - r0);
    for (int r = 0; r < n; ++r) q[r] = q_row(r0 + r);
    const float* bias = bias_of(r0, n, q);
    float* s = scores + static_cast<int64_t>(r0) * s_stride;
    switch (n) {
      case 1:
        ScoreBlock<1>(k, cnt, hd, q, scale, s, s_stride, bias);
        break;
      case 2:
        ScoreBlock<2>(k, cnt, hd, q, scale, s, s_stride, bias);
        break;
      case 3:
        ScoreBlock<3>(k, cnt, hd, q, scale, s, s_stride, bias);
        break;
      default:
        ScoreBlock<4>(k, cnt, hd, q, scale, s, s_stride, bias);
        break;
    }
  }
}

template <class Rows>
HWY_INLINE void AccumulatePage(const Rows& v, int cnt, int hd, int rows, const float* p,
                               int s_stride, float* acc) {
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* pr = p + static_cast<int64_t>(r0) * s_stride;
    float* ar = acc + static_cast<int64_t>(r0) * hd;
    switch (std::min(kRowBlock, rows - r0)) {
      case 1:
        AccumulateBlock<1>(v, cnt, hd, pr, s_stride, ar);
        break;
      case 2:
        AccumulateBlock<2>(v, cnt, hd, pr, s_stride, ar);
        break;
      case 3:
        AccumulateBlock<3>(v, cnt, hd, pr, s_stride, ar);
        break;
      default:
        AccumulateBlock<4>(v, cnt, hd, pr, s_stride, ar);
        break;
    }
  }
}

// Block rows [0, cnt) of a page unpacked into buf (cnt * hd codes, then cnt * hd / 32 scales), for
// a tile of more rows than one row block.
template <DType kType>
HWY_INLINE ScaledRows UnpackScaled(const BlockRows<kType>& rows, int cnt, int hd, float* buf) {
  const DF df;
  constexpr int N = kMaxLanes;
  const int nb = hd / 32;
  float* u = buf;
  float* s = buf + static_cast<int64_t>(cnt) * hd;
  for (int t = 0; t < cnt; ++t) {
    for (int blk = 0; blk < nb; ++blk) {
      s[t * nb + blk] = rows.Scale(t, blk);
      float* ub = u + static_cast<int64_t>(t) * hd + blk * 32;
      for (int o = 0; o < kCodeSpan<BlockRows<kType> >; o += N) {
        VF lo, hi;
        rows.Values(t, blk, o, &lo, &hi);
        hn::StoreU(lo, df, ub + o);
        if constexpr (BlockRows<kType>::kNibbles) hn::StoreU(hi, df, ub + 16 + o);
      }
    }
  }
  return ScaledRows{u, s, hd};
}

// Rows [0, cnt) of a page as f32, for a tile of more rows than one row block.
template <class Rows>
HWY_INLINE PlainRows<float> UnpackRows(const Rows& rows, int cnt, int hd, float* buf) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  for (int t = 0; t < cnt; ++t) {
    for (int d = 0; d < hd; d += N) {
      hn::StoreU(rows.Load(t, d), df, buf + static_cast<int64_t>(t) * hd + d);
    }
  }
  return PlainRows<float>{buf, hd};
}

// Row blocks' scores without a bias.
inline const float* NoBias(int, int, const float**) { return nullptr; }

// KIVI keys: q . (min + scale * c) = q . min + (q * scale) . c, so each row block's queries are
// scaled once per page and scored against the codes as they are: read fused, or for a larger
// tile unpacked once into buf (as f32 codes, so that both give the same bits).
// chan: 2 + kRowBlock rows of hd floats.
template <class QRow>
HWY_INLINE void ScoreChannelPage(const PageData& pd, int cnt, int hd, int rows, const QRow& q_row,
                                 float scale, float* scores, int s_stride, float* buf,
                                 float* chan) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  float* mins = chan;
  float* scales = chan + hd;
  float* qs = chan + 2 * hd;
  ChannelMeta(pd.k_channels, hd, mins, scales);
  float bias[kRowBlock];
  auto fold = [&](int, int n, const float** q) -> const float* {
    for (int r = 0; r < n; ++r) {
      float* out = qs + static_cast<int64_t>(r) * hd;
      VF acc = hn::Zero(df);
      for (int d = 0; d < hd; d += N) {
        const VF qv = hn::LoadU(df, q[r] + d);
        hn::StoreU(hn::Mul(qv, hn::LoadU(df, scales + d)), df, out + d);
        acc = hn::MulAdd(qv, hn::LoadU(df, mins + d), acc);
      }
      bias[r] = ReduceSum(acc);
      q[r] = out;
    }
    return bias;
  };
  auto with_codes = [&](const auto& codes) {
    if (rows <= kRowBlock) {
      ScorePage(codes, cnt, hd, rows, q_row, scale, scores, s_stride, fold);
    } else {
      ScorePage(UnpackRows(codes, cnt, hd, buf), cnt, hd, rows, q_row, scale, scores, s_stride,
                fold);
    }
  };
  const uint8_t* codes = static_cast<const uint8_t*>(pd.k);
  if (pd.k_bits == 4) {
    with_codes(ChannelRows<4>{codes, hd});
  } else {
    with_codes(ChannelRows<2>{codes, hd});
  }
}

// Calls f with a row reader for f32, f16 or bf16 rows.
template <class F>
HWY_INLINE void WithPlainRows(const void* rows, DType t, int hd, const F& f) {
  switch (t) {
    case DType::kF16:
      return f(PlainRows<hwy::float16_t>{static_cast<const hwy::float16_t*>(rows), hd});
    case DType::kBF16:
      return f(PlainRows<hwy::bfloat16_t>{static_cast<const hwy::bfloat16_t*>(rows), hd});
    default:
      return f(PlainRows<float>{static_cast<const float*>(rows), hd});
  }
}

// Calls f with a row reader for a page's V rows. Block-quantized rows are read fused (unpacked in
// registers as they are loaded) when one row block shares them; a larger tile unpacks them once
// into buf instead. (Block-quantized K rows are scored by BlockKeyScores.)
template <class F>
HWY_INLINE void WithValueRows(const void* rows, DType t, int cnt, int hd, int n_rows, float* buf,
                              const F& f) {
  auto blocks = [&](const auto& b) {
    return n_rows <= kRowBlock ? f(b) : f(UnpackScaled(b, cnt, hd, buf));
  };
  const auto row_bytes = static_cast<int64_t>(DTypeRowBytes(t, hd));
  const auto* bytes = static_cast<const uint8_t*>(rows);
  switch (t) {
    case DType::kQ4_0:
      return blocks(BlockRows<DType::kQ4_0>{bytes, row_bytes});
    case DType::kQ8_0:
      return blocks(BlockRows<DType::kQ8_0>{bytes, row_bytes});
    default:
      return WithPlainRows(rows, t, hd, f);
  }
}

// The least and greatest of n >= 1 positions, a vector at a time (a page's keys: 16 in a vector on
// AVX-512; std::min_element and max_element were two scalar passes per page and tile).
HWY_INLINE void PositionBounds(const int32_t* pos, int n, int32_t* lo, int32_t* hi) {
  const hn::ScalableTag<int32_t> di;
  const int N = static_cast<int>(hn::Lanes(di));
  auto vlo = hn::Set(di, std::numeric_limits<int32_t>::max());
  auto vhi = hn::Set(di, std::numeric_limits<int32_t>::min());
  int i = 0;
  for (; i + N <= n; i += N) {
    const auto p = hn::LoadU(di, pos + i);
    vlo = hn::Min(vlo, p), vhi = hn::Max(vhi, p);
  }
  if (i < n && n >= N) {  // the tail: the last vector, overlapping the one before
    const auto p = hn::LoadU(di, pos + n - N);
    vlo = hn::Min(vlo, p), vhi = hn::Max(vhi, p);
    i = n;
  }
  int32_t a = hn::GetLane(hn::MinOfLanes(di, vlo)), b = hn::GetLane(hn::MaxOfLanes(di, vhi));
  for (; i < n; ++i) a = std::min(a, pos[i]), b = std::max(b, pos[i]);
  *lo = a, *hi = b;
}

// 16-bit positions widened into buf (whole vectors: buf has room for n rounded up to them), with
// their bounds, in one pass: widened apart, the wide load of the bounds waited on narrow stores.
HWY_INLINE void WidenPositions(const uint16_t* pos, int n, int32_t* buf, int32_t* lo, int32_t* hi) {
  const hn::ScalableTag<int32_t> di;
  const hn::Rebind<uint16_t, decltype(di)> du;
  const int N = static_cast<int>(hn::Lanes(di));
  auto vlo = hn::Set(di, std::numeric_limits<int32_t>::max());
  auto vhi = hn::Set(di, std::numeric_limits<int32_t>::min());
  int i = 0;
  for (; i + N <= n; i += N) {
    const auto p = hn::PromoteTo(di, hn::LoadU(du, pos + i));
    hn::StoreU(p, di, buf + i);
    vlo = hn::Min(vlo, p), vhi = hn::Max(vhi, p);
  }
  if (i < n) {  // a part vector (a table's last page): nothing past the page is read
    uint16_t tail[64] = {};
    std::copy_n(pos + i, n - i, tail);
    const auto p = hn::PromoteTo(di, hn::LoadU(du, tail));
    hn::StoreU(p, di, buf + i);
    const auto in = hn::FirstN(di, n - i);
    vlo = hn::IfThenElse(in, hn::Min(vlo, p), vlo);
    vhi = hn::IfThenElse(in, hn::Max(vhi, p), vhi);
  }
  *lo = hn::GetLane(hn::MinOfLanes(di, vlo));
  *hi = hn::GetLane(hn::MaxOfLanes(di, vhi));
}

// y += c * x.
HWY_INLINE void AxpyRow(float c, const float* HWY_RESTRICT x, int n, float* HWY_RESTRICT y) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const VF vc = hn::Set(df, c);
  int i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::MulAdd(vc, hn::LoadU(df, x + i), hn::LoadU(df, y + i)), df, y + i);
  }
  for (; i < n; ++i) y[i] += c * x[i];
}

HWY_INLINE void ScaleRow(float* HWY_RESTRICT x, int n, float s) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const VF vs = hn::Set(df, s);
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, x + i), vs), df, x + i);
  for (; i < n; ++i) x[i] *= s;
}

// The kernel over any page source: `pages` gives logical page i's positions and key count
// (Positions) and its f32 K/V rows (Rows, which may decode into the two page-sized buffers it is
// passed). Page i's keys are numbered from the sum of the earlier pages' counts.
template <class Pages>
void AttendPages(const AttnBatch& b, const Pages& pages, int n_pages, int n_keys, int pt, int hd) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const int n_heads = b.n_heads;
  if (b.n_tok <= 0 || n_heads <= 0 || hd <= 0) return;

  const int tile_tok = std::max(1, kMaxTileRows / n_heads);
  const int max_rows = std::min(tile_tok, b.n_tok) * n_heads;
  // Score rows hold a page's keys padded with -inf to whole vectors, hence to groups of four keys
  // (N >= 4 on every SIMD target).
  const int s_stride = (pt + N - 1) / N * N;

  // A chunk: as many pages as fit kChunkKeys score lanes, at least one.
  const int max_slots = std::max(1, kChunkKeys / s_stride);
  const int c_stride = max_slots * s_stride;  // a score row: the chunk's pages side by side

  const size_t acc_floats = static_cast<size_t>(max_rows) * hd;
  const size_t score_floats = static_cast<size_t>(max_rows) * c_stride;
  // A page's rows as f32, and for UnpackScaled the blocks' scales after them.
  const size_t page_floats = static_cast<size_t>(pt) * (hd + hd / 32);
  const size_t chan_floats = static_cast<size_t>(2 + kRowBlock) * hd;  // ScoreChannelPage
  float* scratch = ThreadScratch(kScratchAttention, acc_floats + score_floats + 2 * max_rows +
                                                        2 * max_slots * page_floats + chan_floats +
                                                        max_slots * s_stride);
  float* acc = scratch;
  float* scores = acc + acc_floats;
  float* run_max = scores + score_floats;
  float* run_sum = run_max + max_rows;
  // A decoded page per slot, for sources that store pages encoded: K pages, then V pages.
  float* k_buf = run_sum + max_rows;
  float* v_buf = k_buf + max_slots * page_floats;
  float* chan = v_buf + max_slots * page_floats;
  // 16-bit positions widened: a page's per slot, in whole vectors (s_stride).
  int32_t* pos_buf = reinterpret_cast<int32_t*>(chan + chan_floats);
  struct Slot {
    int page, cnt;
    const int32_t* pos;
    int64_t j0;  // the page's first key, among all keys
    bool all_visible;
    PageData rows;
  };
  Slot slots[kMaxSlots];
  // A prompt's tiles each walk the pages: pages the source decodes (codec pages) are decoded by
  // the first tile that sees them into a buffer of their own and read from there by the others
  // (a 512-token chunk is 52 tiles of a GQA-3 group): the first n_keep pages, kMaxKeptBytes.
  const int n_keep = std::is_base_of_v<PageRows, Pages> && b.n_tok > tile_tok
                         ? static_cast<int>(std::min<size_t>(
                               n_pages, kMaxKeptBytes / (2 * page_floats * sizeof(float))))
                         : 0;
  float* kept_buf = nullptr;
  thread_local std::vector<PageData> kept_rows;
  thread_local std::vector<uint8_t> kept;  // page i decoded (or read in place): kept_rows[i]
  if (n_keep > 0) {
    kept_buf = ThreadScratch(kScratchAttentionKept, size_t(n_keep) * 2 * page_floats);
    kept_rows.resize(n_keep);
    kept.assign(n_keep, 0);
  }
  // The tile's query rows quantized, once a block-quantized key page needs them.
  const int nb = std::max(1, hd / 32);
  int8_t* q8 = reinterpret_cast<int8_t*>(
      ThreadScratch(kScratchAttentionQ8, static_cast<size_t>(max_rows) * (hd / 4 + 2 * nb)));
  float* q8_d = reinterpret_cast<float*>(q8 + static_cast<size_t>(max_rows) * hd);
  int32_t* q8_sum = reinterpret_cast<int32_t*>(q8_d + static_cast<size_t>(max_rows) * nb);
  QueryQ8 q8_rows[kMaxTileRows];

  // Observed rows: those of tokens with q_pos >= the smallest min_pos. For each, obs_p holds the
  // exp(s - m) of every key ([row][n_tokens], page-table order) and obs_m the m of each page
  // ([row][n_pages], -inf where the row saw nothing of the page). Rows are indexed by the
  // token's slot among the observed tokens of the tile.
  float* obs_p = nullptr;
  float* obs_m = nullptr;
  int32_t obs_min_pos = 0;
  int obs_slot[kMaxTileRows];  // tile token -> its slot among observed tokens, or -1
  // Observed passes: the first key of each page (and the total last), for folding the kept terms.
  thread_local std::vector<int64_t> page_first;
  if (b.n_observe > 0 && n_pages > 0) {
    obs_min_pos = b.observe[0].min_pos;
    for (int i = 1; i < b.n_observe; ++i) obs_min_pos = std::min(obs_min_pos, b.observe[i].min_pos);
    int n_obs_tok = 0;
    for (int t = 0; t < b.n_tok; ++t) n_obs_tok += b.q_pos[t] >= obs_min_pos;
    if (n_obs_tok > 0) {
      const size_t obs_rows = static_cast<size_t>(std::min(tile_tok, n_obs_tok)) * n_heads;
      obs_p = ThreadScratch(kScratchAttentionObserve,
                            obs_rows * (static_cast<size_t>(n_keys) + n_pages));
      obs_m = obs_p + obs_rows * n_keys;
      page_first.assign(n_pages + 1, 0);
      for (int page = 0; page < n_pages; ++page) {
        int cnt = 0;
        pages.Positions(page, &cnt);
        page_first[page + 1] = page_first[page] + cnt;
      }
    }
  }

  for (int t0 = 0; t0 < b.n_tok; t0 += tile_tok) {
    const int nt = std::min(tile_tok, b.n_tok - t0);
    const int rows = nt * n_heads;
    const int32_t* q_pos = b.q_pos + t0;
    const int32_t q_min = *std::min_element(q_pos, q_pos + nt);
    const int32_t q_max = *std::max_element(q_pos, q_pos + nt);
    auto q_row = [&](int r) {
      return b.q + (t0 + r / n_heads) * b.q_stride + static_cast<int64_t>(r % n_heads) * hd;
    };

    bool q8_ready = false;
    std::fill(acc, acc + static_cast<size_t>(rows) * hd, 0.0f);
    std::fill(run_max, run_max + rows, kNegInf);
    std::fill(run_sum, run_sum + rows, 0.0f);
    int obs_tok = 0;  // observed tokens in this tile
    if (obs_p != nullptr) {
      for (int t = 0; t < nt; ++t) obs_slot[t] = q_pos[t] >= obs_min_pos ? obs_tok++ : -1;
      std::fill(obs_m, obs_m + static_cast<size_t>(obs_tok) * n_heads * n_pages, kNegInf);
    }

    // Pages go by chunks of up to max_slots: each page's scores land in its slot of the score
    // rows, then every row takes one online-softmax step over the whole chunk, then each page's
    // values are added. Fewer, wider softmax steps; the same bits whether rows are read fused or
    // unpacked.
    int64_t first_key = 0;  // of the page, among all keys
    for (int page = 0; page < n_pages;) {
      int n_slots = 0;
      for (; page < n_pages && n_slots < max_slots; ++page) {
        if constexpr (std::is_base_of_v<PageRows, Pages>) {
          if (page + 1 < n_pages) pages.Prefetch(page + 1, rows <= kLightRows);
        }
        Slot& sl = slots[n_slots];
        const PagePositions pp = pages.Positions(page, &sl.cnt);
        sl.page = page;
        sl.j0 = first_key;
        first_key += sl.cnt;
        int32_t p_min, p_max;
        if (pp.wide != nullptr) {
          sl.pos = pp.wide;
          PositionBounds(sl.pos, sl.cnt, &p_min, &p_max);
        } else {
          int32_t* buf = pos_buf + n_slots * s_stride;
          WidenPositions(pp.narrow, sl.cnt, buf, &p_min, &p_max);
          sl.pos = buf;
        }
        if (p_min > q_max) continue;  // no key of the page is visible to the tile
        sl.all_visible = p_max <= q_min;
        float* kb = k_buf + n_slots * page_floats;
        if (page >= n_keep) {
          // Built in place: assigning the returned struct copied it with one wide load of the
          // callee's field-by-field stores, a store-forwarding stall on every page (15% of an MHA
          // decode step's attention in cache).
          ::new (static_cast<void*>(&sl.rows))
              PageData(pages.Rows(page, kb, v_buf + n_slots * page_floats));
        } else if (kept[page]) {
          sl.rows = kept_rows[page];
        } else {
          float* own = kept_buf + size_t(page) * 2 * page_floats;
          sl.rows = kept_rows[page] = pages.Rows(page, own, own + page_floats);
          kept[page] = 1;
        }
        float* s0 = scores + n_slots * s_stride;
        if (sl.rows.k_channels != nullptr) {
          ScoreChannelPage(sl.rows, sl.cnt, hd, rows, q_row, b.scale, s0, c_stride, kb, chan);
        } else if (IsBlockKeyType(sl.rows.k_type)) {
          if (!q8_ready) {
            for (int r = 0; r < rows; ++r) {
              q8_rows[r] = {q8 + r * hd, q8_d + r * (hd / 32), q8_sum + r * (hd / 32)};
              cpu::QuantizeQuery(q_row(r), hd, q8 + r * hd, q8_d + r * (hd / 32),
                                 q8_sum + r * (hd / 32));
            }
            q8_ready = true;
          }
          cpu::BlockKeyScores(static_cast<const uint8_t*>(sl.rows.k), sl.rows.k_type, sl.cnt, hd,
                              q8_rows, rows, b.scale, s0, c_stride);
        } else {
          WithPlainRows(sl.rows.k, sl.rows.k_type, hd, [&](const auto& k_rows) {
            ScorePage(k_rows, sl.cnt, hd, rows, q_row, b.scale, s0, c_stride, NoBias);
          });
        }
        ++n_slots;
      }
      if (n_slots == 0) break;
      const int width = n_slots * s_stride;

      for (int r = 0; r < rows; ++r) {
        float* s = scores + static_cast<int64_t>(r) * c_stride;
        for (int i = 0; i < n_slots; ++i) {
          const Slot& sl = slots[i];
          float* si = s + i * s_stride;
          if (!sl.all_visible) {
            const int32_t qp = q_pos[r / n_heads];
            for (int j = 0; j < sl.cnt; ++j) {
              if (sl.pos[j] > qp) si[j] = kNegInf;
            }
          }
          std::fill(si + sl.cnt, si + s_stride, kNegInf);
        }

        VF vmax = hn::Set(df, kNegInf);
        for (int j = 0; j < width; j += N) vmax = hn::Max(vmax, hn::LoadU(df, s + j));
        const float chunk_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
        if (chunk_max == kNegInf) {  // nothing visible to this row in this chunk
          std::fill(s, s + width, 0.0f);
          continue;
        }

        float* acc_r = acc + static_cast<int64_t>(r) * hd;
        const float m_new = std::max(run_max[r], chunk_max);
        if (run_max[r] != kNegInf && m_new > run_max[r]) {
          const float correction = std::exp(run_max[r] - m_new);
          run_sum[r] *= correction;
          ScaleRow(acc_r, hd, correction);
        }
        run_max[r] = m_new;

        const VF vm = hn::Set(df, m_new);
        VF vsum = hn::Zero(df);
        for (int j = 0; j < width; j += N) {
          const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + j), vm));  // exp(-inf) = 0
          hn::StoreU(p, df, s + j);
          vsum = hn::Add(vsum, p);
        }
        run_sum[r] += ReduceSum(vsum);
        if (obs_tok > 0 && obs_slot[r / n_heads] >= 0) {
          const int64_t o = static_cast<int64_t>(obs_slot[r / n_heads]) * n_heads + r % n_heads;
          for (int i = 0; i < n_slots; ++i) {
            std::copy_n(s + i * s_stride, slots[i].cnt, obs_p + o * n_keys + slots[i].j0);
            obs_m[o * n_pages + slots[i].page] = m_new;
          }
        }
      }
      for (int i = 0; i < n_slots; ++i) {
        const Slot& sl = slots[i];
        WithValueRows(sl.rows.v, sl.rows.v_type, sl.cnt, hd, rows, v_buf + i * page_floats,
                      [&](const auto& v_rows) {
                        AccumulatePage(v_rows, sl.cnt, hd, rows, scores + i * s_stride, c_stride,
                                       acc);
                      });
      }
    }

    for (int r = 0; r < rows; ++r) {
      float* out =
          b.out + (t0 + r / n_heads) * b.out_stride + static_cast<int64_t>(r % n_heads) * hd;
      const float* acc_r = acc + static_cast<int64_t>(r) * hd;
      if (run_sum[r] == 0.0f) {
        std::fill(out, out + hd, 0.0f);  // no key visible
        continue;
      }
      const float inv = 1.0f / run_sum[r];
      const VF vinv = hn::Set(df, inv);
      int d = 0;
      for (; d + N <= hd; d += N) hn::StoreU(hn::Mul(hn::LoadU(df, acc_r + d), vinv), df, out + d);
      for (; d < hd; ++d) out[d] = acc_r[d] * inv;
    }

    // Fold the kept terms of the observed rows into their final weights.
    for (int r = 0; r < rows && obs_tok > 0; ++r) {
      const int32_t qp = q_pos[r / n_heads];
      if (obs_slot[r / n_heads] < 0 || run_sum[r] == 0.0f) continue;
      const int64_t o = static_cast<int64_t>(obs_slot[r / n_heads]) * n_heads + r % n_heads;
      const float* p_row = obs_p + o * n_keys;
      const float* m_row = obs_m + o * n_pages;
      const float inv = 1.0f / run_sum[r];
      for (int page = 0; page < n_pages; ++page) {
        const int64_t j0 = page_first[page];
        const int cnt = static_cast<int>(page_first[page + 1] - j0);
        if (m_row[page] == kNegInf) continue;  // nothing of the page visible to the row
        const float c = std::exp(m_row[page] - run_max[r]) * inv;
        for (int i = 0; i < b.n_observe; ++i) {
          if (qp < b.observe[i].min_pos) continue;
          float* w = b.observe[i].key_weight + j0;
          if (b.observe[i].max) {
            for (int j = 0; j < cnt; ++j) w[j] = std::max(w[j], c * p_row[j0 + j]);
          } else {
            AxpyRow(c, p_row + j0, cnt, w);
          }
        }
      }
    }
  }
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

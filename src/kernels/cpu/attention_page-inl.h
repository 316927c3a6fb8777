// A page's part of the attention kernel (kernels/cpu/attention.cc) for the query rows of a tile:
// its keys' scores (ScorePage, ScoreChannelPage; block-quantized keys go to BlockKeyScores), its
// values' weighted sums (AccumulatePage), its positions' bounds, and the row readers' dispatch.
// Per-target header with Highway's toggle guard; attention.cc includes it after
// "kernels/cpu/attention_rows-inl.h" in its foreach_target block.

#if defined(CACHET_KERNELS_CPU_ATTENTION_PAGE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CACHET_KERNELS_CPU_ATTENTION_PAGE_INL_H_
#undef CACHET_KERNELS_CPU_ATTENTION_PAGE_INL_H_
#else
#define CACHET_KERNELS_CPU_ATTENTION_PAGE_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <limits>

#include "hwy/highway.h"
#include "kernels/cpu/attention_rows-inl.h"
#include "kernels/cpu/hwy_util-inl.h"
#include "kernels/kernels.h"

// GCC < 12.3 makes HWY_SCALAR the fallback target; attention.cc uses the reference there.
#if HWY_TARGET != HWY_SCALAR
HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {
namespace {

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
  if constexpr (Rows::kBlocks) return Rows::kHalves ? 2 : 1;
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
          // The row's weight times the block's scale, then times the code.
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

// Calls f with a row reader for a page's V rows. Block-quantized rows are read fused (unpacked
// in registers as they are loaded) for every row block of a tile: unpacked once into a buffer
// instead, a page of q4_0 values took longer for any tile up to 48 rows (kernels_bench's decode
// attention of a GQA-8 group 1.2x, of 32 rows 1.15x; a TinyLlama-shaped prefill 5% slower).
// (Block-quantized K rows are scored by BlockKeyScores.)
template <class F>
HWY_INLINE void WithValueRows(const PageData& d, int hd, const F& f) {
  const DType t = d.v_type;
  const auto* bytes = static_cast<const uint8_t*>(d.v);
  if (d.v_levels != nullptr) {
    return f(LevelRows{bytes, int64_t{hd} / 32 * kLevelBlockBytes, d.v_levels});
  }
  const auto row_bytes = static_cast<int64_t>(DTypeRowBytes(t, hd));
  switch (t) {
    case DType::kQ4_0:
      return f(BlockRows<DType::kQ4_0>{bytes, row_bytes});
    case DType::kQ8_0:
      return f(BlockRows<DType::kQ8_0>{bytes, row_bytes});
    default:
      return WithPlainRows(d.v, t, hd, f);
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

}  // namespace
}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();
#endif  // HWY_TARGET != HWY_SCALAR

#endif  // include guard

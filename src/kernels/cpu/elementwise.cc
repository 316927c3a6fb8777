// Highway RmsNorm, RopeRotateHalf, SiluMul, the Quest bounds and selection and the read-bandwidth
// probe: full vectors, then a scalar tail.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/kernels.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/elementwise.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/cpu/hwy_util-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// The fallback target for CPUs without SSE4 (HWY_SCALAR with GCC < 12.3): the reference kernels.
void RmsNormImpl(const float* x, const float* weight, int64_t dim, float eps, float* y) {
  ref::RmsNorm(x, weight, dim, eps, y);
}
void RopeRotateHalfImpl(float* x, int n_heads, int head_dim, const float* cos, const float* sin) {
  ref::RopeRotateHalf(x, n_heads, head_dim, cos, sin);
}
void SiluMulImpl(const float* gate, const float* up, float* out, int64_t n) {
  ref::SiluMul(gate, up, out, n);
}
void KeyBoundsImpl(const float* keys, int n, int head_dim, float* lo, float* hi) {
  ref::KeyBounds(keys, n, head_dim, lo, hi);
}
uint64_t SumWordsImpl(const uint64_t* x, int64_t n, bool prefetch) {
  return ref::SumWords(x, n, prefetch);
}
void PageBoundScoresImpl(const float* q, int n_heads, int head_dim, const uint16_t* bounds,
                         int n_pages, float* out) {
  ref::PageBoundScores(q, n_heads, head_dim, bounds, n_pages, out);
}
void TopKImpl(const float* x, int n, int k, int32_t* out) { ref::TopK(x, n, k, out); }
#else

void RmsNormImpl(const float* x, const float* weight, int64_t dim, float eps, float* y) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  VF s0 = hn::Zero(df), s1 = hn::Zero(df);
  int64_t i = 0;
  for (; i + 2 * N <= dim; i += 2 * N) {
    const VF a = hn::LoadU(df, x + i);
    const VF b = hn::LoadU(df, x + i + N);
    s0 = hn::MulAdd(a, a, s0);
    s1 = hn::MulAdd(b, b, s1);
  }
  for (; i + N <= dim; i += N) {
    const VF a = hn::LoadU(df, x + i);
    s0 = hn::MulAdd(a, a, s0);
  }
  float sum_sq = ReduceSum(hn::Add(s0, s1));
  for (; i < dim; ++i) sum_sq += x[i] * x[i];

  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
  const VF v_inv = hn::Set(df, inv_rms);
  i = 0;
  for (; i + N <= dim; i += N) {
    const VF v = hn::Mul(hn::LoadU(df, x + i), v_inv);
    hn::StoreU(hn::Mul(v, hn::LoadU(df, weight + i)), df, y + i);
  }
  for (; i < dim; ++i) y[i] = x[i] * inv_rms * weight[i];
}

void RopeRotateHalfImpl(float* x, int n_heads, int head_dim, const float* cos, const float* sin) {
  for (int h = 0; h < n_heads; ++h) {
    RotateHalfRow(x + static_cast<int64_t>(h) * head_dim, head_dim, cos, sin);
  }
}

void SiluMulImpl(const float* gate, const float* up, float* out, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const VF one = hn::Set(df, 1.0f);
  // exp(-g) overflows f32 past 88.7; clamping there changes silu(g) by less than 1e-36.
  const VF max_arg = hn::Set(df, 88.0f);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const VF g = hn::LoadU(df, gate + i);
    const VF u = hn::LoadU(df, up + i);
    const VF e = hn::Exp(df, hn::Min(hn::Neg(g), max_arg));
    hn::StoreU(hn::Mul(hn::Div(g, hn::Add(one, e)), u), df, out + i);
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void KeyBoundsImpl(const float* keys, int n, int head_dim, float* lo, float* hi) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  int i = 0;
  for (; i + N <= head_dim; i += N) {
    VF l = hn::LoadU(df, keys + i), h = l;
    for (int j = 1; j < n; ++j) {
      const VF k = hn::LoadU(df, keys + int64_t(j) * head_dim + i);
      l = hn::Min(l, k);
      h = hn::Max(h, k);
    }
    hn::StoreU(l, df, lo + i);
    hn::StoreU(h, df, hi + i);
  }
  for (; i < head_dim; ++i) {
    lo[i] = hi[i] = keys[i];
    for (int j = 1; j < n; ++j) {
      lo[i] = std::min(lo[i], keys[int64_t(j) * head_dim + i]);
      hi[i] = std::max(hi[i], keys[int64_t(j) * head_dim + i]);
    }
  }
}

void PageBoundScoresImpl(const float* q, int n_heads, int head_dim, const uint16_t* bounds,
                         int n_pages, float* out) {
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int N = static_cast<int>(hn::Lanes(df));
  if (head_dim % N != 0) return ref::PageBoundScores(q, n_heads, head_dim, bounds, n_pages, out);
  const auto* b16 = reinterpret_cast<const hwy::float16_t*>(bounds);
  for (int p = 0; p < n_pages; ++p) {
    const hwy::float16_t* lo = b16 + int64_t(p) * 2 * head_dim;
    const hwy::float16_t* hi = lo + head_dim;
    float best = -INFINITY;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + int64_t(h) * head_dim;
      VF acc = hn::Zero(df);
      for (int i = 0; i < head_dim; i += N) {
        const VF qv = hn::LoadU(df, qh + i);
        const VF l = hn::PromoteTo(df, hn::LoadU(dh, lo + i));
        const VF u = hn::PromoteTo(df, hn::LoadU(dh, hi + i));
        acc = hn::Add(acc, hn::Max(hn::Mul(qv, l), hn::Mul(qv, u)));
      }
      best = std::max(best, ReduceSum(acc));
    }
    out[p] = best;
  }
}

// The k-th largest value found bit by bit as an integer key, each bit by one vector pass that
// counts the keys at or above the candidate (32 passes over a thousand pages: about 1 us), then the
// indices over it compressed out in order: an nth_element over (value, index) pairs and a sort of
// the winners took ten times that, 6% of a Quest decode step at 16k tokens.
void TopKImpl(const float* x, int n, int k, int32_t* out) {
  using DI = hn::RebindToSigned<DF>;
  using VI = hn::Vec<DI>;
  const DI di;
  const DF df;
  const int N = static_cast<int>(hn::Lanes(di));
  // Keys ordered as the floats (+0 for -0, so that they tie), padded with INT32_MIN: below every
  // key of a float that is not NaN.
  thread_local std::vector<int32_t> keys;
  const int n_pad = (n + N - 1) / N * N;
  keys.assign(n_pad, INT32_MIN);
  const VI magnitude = hn::Set(di, 0x7FFFFFFF);
  auto key_of = [&](VF v) HWY_ATTR {
    const VI b = hn::BitCast(di, hn::Add(v, hn::Zero(df)));
    return hn::Xor(b, hn::And(hn::ShiftRight<31>(b), magnitude));
  };
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(key_of(hn::LoadU(df, x + i)), di, keys.data() + i);
  if (i < n) {
    HWY_ALIGN float tail[hn::MaxLanes(df)] = {};
    std::copy(x + i, x + n, tail);
    const VI kt = key_of(hn::Load(df, tail));
    HWY_ALIGN int32_t kt_lanes[hn::MaxLanes(di)];
    hn::Store(kt, di, kt_lanes);
    std::copy(kt_lanes, kt_lanes + (n - i), keys.data() + i);
  }
  auto count_over = [&](int32_t t) HWY_ATTR {  // keys > t
    const VI vt = hn::Set(di, t);
    size_t c = 0;
    for (int j = 0; j < n_pad; j += N)
      c += hn::CountTrue(di, hn::Gt(hn::LoadU(di, keys.data() + j), vt));
    return static_cast<int>(c);
  };
  // The largest t (biased to unsigned) with k keys at or above it.
  uint32_t t = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t c = t | (uint32_t{1} << bit);  // >= 1: its signed form minus 1 does not wrap
    if (count_over(static_cast<int32_t>(c ^ 0x80000000u) - 1) >= k) t = c;
  }
  const int32_t kth = static_cast<int32_t>(t ^ 0x80000000u);
  int ties = k - count_over(kth);  // of the keys equal to the k-th, how many are taken
  const VI vk = hn::Set(di, kth);
  int written = 0;
  for (int j = 0; j < n_pad; j += N) {
    const VI kv = hn::LoadU(di, keys.data() + j);
    const VI idx = hn::Iota(di, j);
    auto take = hn::Gt(kv, vk);
    const auto eq = hn::Eq(kv, vk);
    const int n_eq = static_cast<int>(hn::CountTrue(di, eq));
    if (n_eq > 0 && ties >= n_eq) {
      take = hn::Or(take, eq);
      ties -= n_eq;
    } else if (n_eq > 0 && ties > 0) {  // the last ties, lowest indices first
      for (int l = 0; l < N; ++l) {
        const int32_t key = keys[j + l];
        if (key > kth || (key == kth && ties-- > 0)) out[written++] = j + l;
      }
      continue;
    }
    written += static_cast<int>(hn::CompressBlendedStore(idx, take, di, out + written));
  }
}

// Four full vectors an iteration (a scalar loop reads a fifth less per thread on some CPUs), with a
// software prefetch 1 KiB ahead or without: MeasureReadBandwidth keeps the faster.
uint64_t SumWordsImpl(const uint64_t* x, int64_t n, bool prefetch) {
  const hn::ScalableTag<uint64_t> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    if (prefetch) hwy::Prefetch(x + i + 128);
    a0 = hn::Add(a0, hn::LoadU(d, x + i));
    a1 = hn::Add(a1, hn::LoadU(d, x + i + N));
    a2 = hn::Add(a2, hn::LoadU(d, x + i + 2 * N));
    a3 = hn::Add(a3, hn::LoadU(d, x + i + 3 * N));
  }
  // Lanes summed as unsigned words: SumOfLanes reduces u64 with a signed intrinsic (UBSan).
  HWY_ALIGN uint64_t lanes[hn::MaxLanes(d)];
  hn::Store(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), d, lanes);
  uint64_t s = 0;
  for (int64_t j = 0; j < N; ++j) s += lanes[j];
  for (; i < n; ++i) s += x[i];
  return s;
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cachet::kernels::cpu {

HWY_EXPORT(RmsNormImpl);
HWY_EXPORT(RopeRotateHalfImpl);
HWY_EXPORT(SiluMulImpl);
HWY_EXPORT(KeyBoundsImpl);
HWY_EXPORT(PageBoundScoresImpl);
HWY_EXPORT(TopKImpl);
HWY_EXPORT(SumWordsImpl);

void RmsNorm(const float* x, const float* weight, int64_t dim, float eps, float* y) {
  HWY_DYNAMIC_DISPATCH(RmsNormImpl)(x, weight, dim, eps, y);
}

void RopeRotateHalf(float* x, int n_heads, int head_dim, const float* cos, const float* sin) {
  HWY_DYNAMIC_DISPATCH(RopeRotateHalfImpl)(x, n_heads, head_dim, cos, sin);
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(SiluMulImpl)(gate, up, out, n);
}

void KeyBounds(const float* keys, int n, int head_dim, float* lo, float* hi) {
  HWY_DYNAMIC_DISPATCH(KeyBoundsImpl)(keys, n, head_dim, lo, hi);
}

void PageBoundScores(const float* q, int n_heads, int head_dim, const uint16_t* bounds, int n_pages,
                     float* out) {
  HWY_DYNAMIC_DISPATCH(PageBoundScoresImpl)(q, n_heads, head_dim, bounds, n_pages, out);
}

void TopK(const float* x, int n, int k, int32_t* out) {
  HWY_DYNAMIC_DISPATCH(TopKImpl)(x, n, k, out);
}

uint64_t SumWords(const uint64_t* x, int64_t n, bool prefetch) {
  return HWY_DYNAMIC_DISPATCH(SumWordsImpl)(x, n, prefetch);
}

}  // namespace cachet::kernels::cpu
#endif  // HWY_ONCE

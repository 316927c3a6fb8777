// Highway RmsNorm, RopeRotateHalf, SiluMul, the Quest bounds and the read-bandwidth probe: full
// vectors, then a scalar tail.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>

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
uint64_t SumWordsImpl(const uint64_t* x, int64_t n) { return ref::SumWords(x, n); }
void PageBoundScoresImpl(const float* q, int n_heads, int head_dim, const uint16_t* bounds,
                         int n_pages, float* out) {
  ref::PageBoundScores(q, n_heads, head_dim, bounds, n_pages, out);
}
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

// Four full vectors an iteration and a software prefetch 1 KiB ahead, as the decode kernels read
// their weight rows: a scalar loop without prefetch reads a fifth less per thread on some CPUs,
// and would understate the roofline.
uint64_t SumWordsImpl(const uint64_t* x, int64_t n) {
  const hn::ScalableTag<uint64_t> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    hwy::Prefetch(x + i + 128);
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

uint64_t SumWords(const uint64_t* x, int64_t n) { return HWY_DYNAMIC_DISPATCH(SumWordsImpl)(x, n); }

}  // namespace cachet::kernels::cpu
#endif  // HWY_ONCE

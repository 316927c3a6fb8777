// Small Highway helpers shared by the kernels/cpu/ translation units. Per-target header: include it
// after "hwy/highway.h" inside a foreach_target translation unit (it has Highway's toggle guard).

#if defined(CACHET_KERNELS_CPU_HWY_UTIL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CACHET_KERNELS_CPU_HWY_UTIL_INL_H_
#undef CACHET_KERNELS_CPU_HWY_UTIL_INL_H_
#else
#define CACHET_KERNELS_CPU_HWY_UTIL_INL_H_
#endif

#include "hwy/highway.h"

// GCC < 12.3 makes HWY_SCALAR the fallback target; the kernels use the reference code there.
#if HWY_TARGET != HWY_SCALAR
HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using D4 = hn::Full128<float>;  // four f32 lanes: one 128-bit block
using V4 = hn::Vec<D4>;

// Adds the 128-bit blocks of v: lane i of the result is the sum of lane i of every block.
template <class D>
HWY_INLINE V4 SumBlocks(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) <= 4) {
    (void)d;
    return v;
  } else {
    const hn::Half<D> dh;
    return SumBlocks(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  }
}

// Horizontal sums of four vectors at once: [sum(a0), sum(a1), sum(a2), sum(a3)]. The additions
// follow the same pattern for each of the four, so a dot product's result does not depend on the
// slot it was reduced in.
HWY_INLINE V4 Reduce4(VF a0, VF a1, VF a2, VF a3) {
  const DF d;
  const hn::Repartition<uint64_t, DF> d64;
  // Per block: [a0_0+a0_2, a1_0+a1_2, a0_1+a0_3, a1_1+a1_3], same for a2/a3.
  const VF b01 = hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
  const VF b23 = hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
  const auto w01 = hn::BitCast(d64, b01);
  const auto w23 = hn::BitCast(d64, b23);
  // Per block: [sum a0, sum a1, sum a2, sum a3] of that block.
  const VF c = hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, w01, w23)),
                       hn::BitCast(d, hn::InterleaveUpper(d64, w01, w23)));
  return SumBlocks(d, c);
}

HWY_INLINE float ReduceSum(VF v) { return hn::GetLane(hn::SumOfLanes(DF(), v)); }

// Rotate-half RoPE of one head of head_dim values in place: (x0, x1) = (x[i], x[half + i]) turned
// by (cos[i], sin[i]). RopeRotateHalf runs it per head; the KV decoders per key stored before
// RoPE.
HWY_INLINE void RotateHalfRow(float* HWY_RESTRICT x, int head_dim, const float* HWY_RESTRICT cos,
                              const float* HWY_RESTRICT sin) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const int half = head_dim / 2;
  float* HWY_RESTRICT hi = x + half;
  int i = 0;
  for (; i + N <= half; i += N) {
    const VF x0 = hn::LoadU(df, x + i);
    const VF x1 = hn::LoadU(df, hi + i);
    const VF c = hn::LoadU(df, cos + i);
    const VF s = hn::LoadU(df, sin + i);
    hn::StoreU(hn::NegMulAdd(x1, s, hn::Mul(x0, c)), df, x + i);  // x0*c - x1*s
    hn::StoreU(hn::MulAdd(x0, s, hn::Mul(x1, c)), df, hi + i);    // x1*c + x0*s
  }
  for (; i < half; ++i) {
    const float x0 = x[i];
    const float x1 = hi[i];
    x[i] = x0 * cos[i] - x1 * sin[i];
    hi[i] = x1 * cos[i] + x0 * sin[i];
  }
}

}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();
#endif  // HWY_TARGET != HWY_SCALAR

#endif  // include guard

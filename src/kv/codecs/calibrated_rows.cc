#include "kv/codecs/calibrated_rows.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "util/dtype.h"

namespace cachet::codecs {
namespace {

// Little-endian packing of codes of varying widths (a pca row: bits[i] per axis, 0 skips it).
void PackVar(const uint8_t* codes, const uint8_t* bits, int n, uint8_t* out) {
  uint64_t acc = 0;
  int have = 0;
  for (int i = 0; i < n; ++i) {
    acc |= static_cast<uint64_t>(codes[i]) << have;
    have += bits[i];
    while (have >= 8) {
      *out++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      have -= 8;
    }
  }
  if (have > 0) *out = static_cast<uint8_t>(acc);
}

// Codes of varying widths read in order (a pca or kvq row's; widths of 0 read as code 0).
void UnpackVar(const uint8_t* src, const uint8_t* bits, int n, uint32_t* codes) {
  uint64_t acc = 0;
  int have = 0;
  for (int i = 0; i < n; ++i) {
    const int b = bits[i];
    while (have < b) {
      acc |= static_cast<uint64_t>(*src++) << have;
      have += 8;
    }
    codes[i] = static_cast<uint32_t>(acc & ((1u << b) - 1));
    acc >>= b;
    have -= b;
  }
}

// The nearest of 1 << b ascending levels: how many of their midpoints z is past, found by a
// bisection whose steps compile to conditional moves (a branch per step mispredicts half the time).
int Nearest(float z, const float* mids, int b) {
  int c = 0;
  for (int step = (1 << b) >> 1; step > 0; step >>= 1) c += z > mids[c + step - 1] ? step : 0;
  return c;
}

// Codes z_i / rms as the nearest of coordinate i's levels (1 << bits[i] of the pooled levels, as
// HeadStats keeps them); returns the row scale r, the least-squares fit of z_i by r level_i with
// coordinate i weighed by what its error costs, weight_i sigma_i^2 (none where skip[i]).
double CodeToLevels(const CalPlan& p, const float* pooled_levels, const float* z, float rms,
                    const bool* skip, uint8_t* codes) {
  const float inv_rms = rms > 0 ? 1.0f / rms : 0.0f;
  double num = 0, den = 0;
  for (int i = 0; i < p.dim; ++i) {
    codes[i] = 0;
    const int b = p.bits[i];
    if (b == 0) continue;
    const float* lv = pooled_levels + ((1 << b) - 2);
    const int c = Nearest(z[i] * inv_rms, p.mids.data() + ((1 << b) - 2), b);
    codes[i] = static_cast<uint8_t>(c);
    if (skip != nullptr && skip[i]) continue;
    const double w = double(p.weight[i]) * p.sigma[i] * p.sigma[i];
    num += w * z[i] * lv[c];
    den += w * lv[c] * lv[c];
  }
  return den > 0 ? num / den : 0.0;
}

// A kvq row: its scale r (one byte, r = 2^((byte - 128) / 32), 0 for a zero row), KvqOutliers(dim)
// little-endian u16 entries (the channel in the low 9 bits, the high 7 bits of its code above),
// then each channel's bits[i]-bit code packed as the pca codecs pack theirs: channel i is
// ch_mean_i + r table[level_at_i + code_i] (table: ch_scale_i times its levels). An outlier's slot
// holds its code's low bits[i] bits; its code is uniform over [-zmax, zmax] of
// (x_i - ch_mean_i) / ch_scale_i, whatever r.
int KvqOutlierCodeMax(int bits) { return (1 << (16 - kKvqChannelBits + bits)) - 1; }
uint8_t KvqScaleByte(double r) {
  if (!(r > 0)) return 0;
  return static_cast<uint8_t>(std::clamp<long>(std::lround(std::log2(r) * 32 + 128), 1, 255));
}
}  // namespace

void ProjectOnAxes(const HeadStats& h, float* x, int dim, bool centered) {
  float y[kMaxDim];
  for (int k = 0; k < dim; ++k) y[k] = centered ? x[k] - h.mean[k] : x[k];
  for (int i = 0; i < dim; ++i) {
    const float* ax = h.axes.data() + size_t(i) * dim;
    // Eight running sums, which the compiler keeps in one vector (one sum was a chain of dim
    // dependent adds: encoding a pca4 row, the projection was most of a prefill's codec work).
    float acc[8] = {};
    int k = 0;
    for (; k + 8 <= dim; k += 8) {
      for (int j = 0; j < 8; ++j) acc[j] += ax[k + j] * y[k + j];
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; k < dim; ++k) s += ax[k] * y[k];
    x[i] = s;
  }
}

// c = A (x - mean); z_i = c_i / sigma_i over the row's RMS, coded to the nearest of its axis's
// levels; the row's scale is then the weighted least-squares fit of sigma_i level_i to c_i.
void EncodePcaRow(const CalPlan& p, const float* x, uint8_t* out) {
  const HeadStats& h = *p.stats;
  const int d = p.dim;
  float c[kMaxDim] = {};  // (zeroed: GCC cannot tell CodeToLevels reads only dim of them)
  std::copy_n(x, d, c);
  ProjectOnAxes(h, c, d, /*centered=*/true);
  double ss = 0;
  int live = 0;
  for (int i = 0; i < d; ++i) {
    if (h.variance[i] > 1e-20f) {
      const double z = c[i] / p.sigma[i];
      ss += z * z, ++live;
    }
  }
  const float rms = live > 0 ? static_cast<float>(std::sqrt(ss / live)) : 0.0f;
  for (int i = 0; i < d; ++i) c[i] /= p.sigma[i];  // now z_i: c_i = sigma_i z_i
  uint8_t codes[kMaxDim];
  const uint16_t scale_h =
      F32ToF16(static_cast<float>(CodeToLevels(p, h.levels.data(), c, rms, nullptr, codes)));
  std::memcpy(out, &scale_h, 2);
  PackVar(codes, p.bits.data(), d, out + 2);
}

// The row's coordinates on the axes (what DotKeys and AccumulateValues read).
void DecodePcaRow(const CalPlan& p, const uint8_t* in, float* c) {
  uint16_t scale_h;
  std::memcpy(&scale_h, in, 2);
  const float r = F16ToF32(scale_h);
  uint32_t codes[kMaxDim];
  UnpackVar(in + 2, p.bits.data(), p.dim, codes);
  for (int i = 0; i < p.dim; ++i) c[i] = r * p.table[p.level_at[i] + codes[i]];
}

void EncodeKvqRow(const CalPlan& p, const float* x, uint8_t* out) {
  const HeadStats& h = *p.stats;
  const int d = p.dim, k = KvqOutliers(d);
  float z[kMaxDim];
  for (int i = 0; i < d; ++i) {
    z[i] = h.ch_scale[i] > 0 ? (x[i] - h.ch_mean[i]) / h.ch_scale[i] : 0.0f;
  }
  // The k largest |z| (k is small: a pass each).
  bool outlier[kMaxDim] = {};
  for (int j = 0; j < k; ++j) {
    int best = 0;
    float m = -1;
    for (int i = 0; i < d; ++i) {
      if (!outlier[i] && std::fabs(z[i]) > m) m = std::fabs(z[i]), best = i;
    }
    outlier[best] = true;
  }
  // The rest over their RMS to the nearest level, then r their weighted least-squares fit.
  double ss = 0;
  for (int i = 0; i < d; ++i) ss += outlier[i] ? 0.0 : double(z[i]) * z[i];
  const float rms = static_cast<float>(std::sqrt(ss / std::max(1, d - k)));
  // r weighs each channel by what its error costs (std^2 x the query energy, keys), as pca's
  // scale does: keys 0.031 against 0.033 unweighted; an RMS so weighted measured 0.032, and
  // outliers picked by weighted size 0.037.
  uint8_t codes[kMaxDim];
  // (Coding the row again over the rounded r measured worse: 0.037 against 0.034 keys' KL.)
  out[0] = KvqScaleByte(CodeToLevels(p, h.ch_levels.data(), z, rms, outlier, codes));
  const float zmax = h.ch_zmax;
  uint8_t* entry = out + kKvqScaleBytes;
  for (int i = 0; i < d; ++i) {
    if (!outlier[i]) continue;
    const int b = p.bits[i], qmax = KvqOutlierCodeMax(b);
    const float u = (std::clamp(z[i], -zmax, zmax) + zmax) / (2 * zmax) * qmax;
    const int code = std::clamp(static_cast<int>(std::lround(u)), 0, qmax);
    codes[i] = static_cast<uint8_t>(code & ((1 << b) - 1));
    const uint16_t e = static_cast<uint16_t>(i | ((code >> b) << kKvqChannelBits));
    std::memcpy(entry, &e, 2);
    entry += 2;
  }
  PackVar(codes, p.bits.data(), d, entry);
}

size_t KvqCodesOffset(int dim) { return kKvqScaleBytes + 2 * size_t(KvqOutliers(dim)); }
// r = 2^((byte - 128) / 32), read once per decoded row: tabled, and inline (a call per row, and
// a function-local table's guard, were 1.5% of a kvtiny kvq4 decode step).
const std::array<float, 256> kKvqScales = [] {
  std::array<float, 256> t{};
  for (int b = 1; b < 256; ++b) t[b] = std::exp2((b - 128) / 32.0f);
  return t;
}();

KvqOutlierPatch::KvqOutlierPatch(const CalPlan& p)
    : mean_(p.stats->ch_mean.data()),
      scale_(p.stats->ch_scale.data()),
      step_(p.outlier_step.data()),
      byte_at_(p.byte_at.data()),
      shift_(p.shift.data()),
      mask_(p.mask.data()),
      bits_(p.bits.data()),
      zmax_(p.stats->ch_zmax),
      n_(KvqOutliers(p.dim)),
      row_bytes_(static_cast<int>(KvqCodesOffset(p.dim) + PackedBytes(p.dim, p.bits_per_value))) {}

float KvqOutlierStep(float zmax, int bits) { return 2 * zmax / float(KvqOutlierCodeMax(bits)); }

// Rows as the codec stores them (keys before RoPE).
void DecodeKvqRow(const CalPlan& p, const uint8_t* in, float* x) {
  const HeadStats& h = *p.stats;
  const float r = KvqRowScale(in);
  uint32_t codes[kMaxDim];
  UnpackVar(in + KvqCodesOffset(p.dim), p.bits.data(), p.dim, codes);
  for (int i = 0; i < p.dim; ++i) {
    const float t = r * p.table[p.level_at[i] + codes[i]];
    x[i] = h.ch_mean[i] + t;
  }
  KvqOutlierPatch(p).Apply(in, x);
}

}  // namespace cachet::codecs

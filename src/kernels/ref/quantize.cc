// Reference quantizers of the GGUF block formats (layouts: kernels/ref/quant.cc) and of the int8
// path's activations. q8_0, q4_0, q5_0, q4_1 and q5_1 map each block's range as llama.cpp's
// quantizers do; the k-quants' (q2_K .. q6_K) fit their scales as llama.cpp's reference quantizer
// does (the weighted least-squares searches below), so that `cachet convert --type q4_k_m` writes
// files of its quality; iq4_nl / iq4_xs map the range onto the levels without llama.cpp's search
// (tests only).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/int8_dot.h"
#include "kernels/kernels.h"

namespace cachet::kernels::ref {
namespace {

// Block readers shared with the int8 path (kernels/int8_dot.h).
using int8_detail::LoadF16;
using int8_detail::ScaleMinK4;
void StoreF16(uint8_t* p, float f) {
  const uint16_t h = F32ToF16(f);
  std::memcpy(p, &h, 2);
}
// Rounds to nearest, ties to even, as nearbyint in the default rounding mode, for |f| < 2^22 (every
// code and scale here): adding 1.5 * 2^23 leaves the integer in the low mantissa bits, without a
// libm call in the quantizers' inner loops.
int NearestInt(float f) {
  const float v = f + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

void QuantizeQ8_0(const float* x, uint8_t* b) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  StoreF16(b, d);
  int8_t* q = reinterpret_cast<int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::round(x[j] * id));
}

// The value of largest magnitude of n values, with its sign: q4_0 and q5_0 map it to code 0, the
// k-quants to their lowest code.
float SignedMax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  return max;
}

// As llama.cpp's quantize_row_q4_1_ref / q5_1: codes 0..levels from the block's minimum up.
void QuantizeMin(const float* x, int levels, uint8_t* b) {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < 32; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  const float d = (hi - lo) / static_cast<float>(levels);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  StoreF16(b, d);
  StoreF16(b + 2, lo);
  const bool fifth = levels == 31;
  uint8_t* q = b + (fifth ? 8 : 4);
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const int x0 = std::min(levels, static_cast<int>((x[j] - lo) * id + 0.5f));
    const int x1 = std::min(levels, static_cast<int>((x[j + 16] - lo) * id + 0.5f));
    q[j] = static_cast<uint8_t>((x0 & 0xF) | ((x1 & 0xF) << 4));
    qh |= static_cast<uint32_t>(x0 >> 4) << j;
    qh |= static_cast<uint32_t>(x1 >> 4) << (j + 16);
  }
  if (fifth) std::memcpy(b + 4, &qh, 4);
}

// The index of kIQ4Values nearest to v.
int NearestIQ4(float v) {
  int best = 0;
  for (int i = 1; i < 16; ++i) {
    if (std::fabs(v - kIQ4Values[i]) < std::fabs(v - kIQ4Values[best])) best = i;
  }
  return best;
}

// 32 values as iq4_nl's nibbles against the scale d (d = 0: the level nearest 0).
void QuantizeIQ4Nibbles(const float* x, float d, uint8_t* q) {
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<uint8_t>(NearestIQ4(x[j] * id) | (NearestIQ4(x[j + 16] * id) << 4));
  }
}

// The block's value of largest magnitude maps to the level -127 (no search over scales, as
// llama.cpp's quantizer does).
void QuantizeIQ4_NL(const float* x, uint8_t* b) {
  StoreF16(b, SignedMax(x, 32) / -127.0f);
  QuantizeIQ4Nibbles(x, LoadF16(b), b + 2);
}

void QuantizeIQ4_XS(const float* x, uint8_t* b) {
  float scale[8], max_abs = 0.0f, max_scale = 0.0f;
  for (int s = 0; s < 8; ++s) {
    scale[s] = SignedMax(x + 32 * s, 32) / -127.0f;
    if (std::fabs(scale[s]) > max_abs) {
      max_abs = std::fabs(scale[s]);
      max_scale = scale[s];
    }
  }
  StoreF16(b, max_scale / -32.0f);
  const float d = LoadF16(b);
  uint16_t scales_h = 0;
  std::memset(b + 4, 0, 4);
  for (int s = 0; s < 8; ++s) {
    const int ls = d != 0.0f ? std::clamp(NearestInt(scale[s] / d), -32, 31) + 32 : 32;
    scales_h |= static_cast<uint16_t>((ls >> 4) << (2 * s));
    b[4 + s / 2] |= static_cast<uint8_t>((ls & 0xF) << (4 * (s % 2)));
    QuantizeIQ4Nibbles(x + 32 * s, d * static_cast<float>(ls - 32), b + 8 + 16 * s);
  }
  std::memcpy(b + 2, &scales_h, 2);
}

void QuantizeQ4_0(const float* x, uint8_t* b) {
  const float d = SignedMax(x, 32) / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  StoreF16(b, d);
  uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    const int x0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
    const int x1 = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
    q[j] = static_cast<uint8_t>(std::max(0, x0) | (std::max(0, x1) << 4));
  }
}

// As llama.cpp's quantize_row_q5_0_ref.
void QuantizeQ5_0(const float* x, uint8_t* b) {
  const float d = SignedMax(x, 32) / -16.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  StoreF16(b, d);
  uint32_t qh = 0;
  uint8_t* q = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int x0 = std::clamp(static_cast<int>(x[j] * id + 16.5f), 0, 31);
    const int x1 = std::clamp(static_cast<int>(x[j + 16] * id + 16.5f), 0, 31);
    q[j] = static_cast<uint8_t>((x0 & 0xF) | ((x1 & 0xF) << 4));
    qh |= static_cast<uint32_t>(x0 >> 4) << j;
    qh |= static_cast<uint32_t>(x1 >> 4) << (j + 16);
  }
  std::memcpy(b + 2, &qh, 4);
}

// The k-quant fits, as llama.cpp's reference quantizer makes them (the files its llama-quantize
// writes without an importance matrix): each sub-block's scale (and minimum) is a weighted least-
// squares fit to the codes, searched over a few candidate scales, not the plain range mapping.

// Codes 0..nmax of n values with weights w (make_qkx2_quants): the range's codes (the minimum
// capped at 0), then, for nstep + 1 scales of nmax + rmin + rdelta * i levels over the range, the
// codes they round to with the least-squares scale and minimum for those codes; the fit of least
// weighted error (squared, or absolute with use_mad) wins. Returns the scale, *neg_min = -min.
float FitScaleMin(int n, int nmax, const float* x, const float* w, float rmin, float rdelta,
                  int nstep, bool use_mad, uint8_t* L, float* neg_min) {
  float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  lo = std::min(lo, 0.0f);
  if (hi == lo) {
    std::fill(L, L + n, 0);
    *neg_min = -lo;
    return 0.0f;
  }
  auto error = [&](float scale, float min, const int* codes) {
    float e = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float diff = scale * static_cast<float>(codes[i]) + min - x[i];
      e += w[i] * (use_mad ? std::fabs(diff) : diff * diff);
    }
    return e;
  };
  int best_codes[32], codes[32];  // ints, which stores of byte codes could not alias
  float iscale = nmax / (hi - lo), scale = 1 / iscale;
  for (int i = 0; i < n; ++i) best_codes[i] = std::clamp(NearestInt(iscale * (x[i] - lo)), 0, nmax);
  float best = error(scale, lo, best_codes);
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * static_cast<float>(step) + nmax) / (hi - lo);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(NearestInt(iscale * (x[i] - lo)), 0, nmax);
      codes[i] = l;
      const float wl = w[i] * static_cast<float>(l);
      sum_l += wl;
      sum_l2 += wl * static_cast<float>(l);
      sum_xl += wl * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    const float e = error(this_scale, this_min, codes);
    if (e < best) {
      std::copy(codes, codes + n, best_codes);
      best = e;
      scale = this_scale;
      lo = this_min;
    }
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(best_codes[i]);
  *neg_min = -lo;
  return scale;
}

// The codes -nmax..nmax-1 of n values at the scale 1 / iscale, and the sums sum(w x l) and
// sum(w l^2), weighted by w = x^2, of the least-squares scale sumlx / suml2 for them.
struct SymmetricFit {
  float sumlx = 0.0f, suml2 = 0.0f;
};
SymmetricFit FitCodesAt(int n, int nmax, const float* x, float iscale, int* codes) {
  SymmetricFit f;
  for (int i = 0; i < n; ++i) {
    const int l = std::clamp(NearestInt(iscale * x[i]), -nmax, nmax - 1);
    codes[i] = l;
    const float w = x[i] * x[i];
    f.sumlx += w * x[i] * static_cast<float>(l);
    f.suml2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  return f;
}

// Codes -nmax..nmax-1 (stored + nmax) of n (<= 16) values and their scale, weighted by x^2: from
// the largest magnitude mapped to -nmax, then either (make_qx_quants) the least-squares fit of 18
// scales around it with the largest sum(w x l)^2 / sum(w l^2), or (one_by_one, q3_K's
// make_q3_quants) up to five passes that move one code at a time to where the least-squares scale
// of the others puts it, while that lowers the error.
float FitSymmetric(int n, int nmax, const float* x, bool one_by_one, uint8_t* L) {
  const float max = SignedMax(x, n);
  if (std::fabs(max) < 1e-15f) {
    std::fill(L, L + n, 0);
    return 0.0f;
  }
  int best_codes[16], codes[16];
  SymmetricFit f = FitCodesAt(n, nmax, x, -nmax / max, best_codes);
  float scale = f.suml2 != 0.0f ? f.sumlx / f.suml2 : 0.0f, best = scale * f.sumlx;
  for (int is = -9; !one_by_one && is <= 9; ++is) {
    if (is == 0) continue;
    const SymmetricFit g =
        FitCodesAt(n, nmax, x, -(nmax + 0.1f * static_cast<float>(is)) / max, codes);
    if (g.suml2 > 0 && g.sumlx * g.sumlx > best * g.suml2) {
      std::copy(codes, codes + n, best_codes);
      scale = g.sumlx / g.suml2;
      best = scale * g.sumlx;
    }
  }
  for (int pass = 0; one_by_one && pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const int li = best_codes[i];
      const float w = x[i] * x[i];
      float slx = f.sumlx - w * x[i] * li;
      if (slx <= 0) continue;
      float sl2 = f.suml2 - w * li * li;
      const int nl = std::clamp(NearestInt(x[i] * sl2 / slx), -nmax, nmax - 1);
      if (nl == li) continue;
      slx += w * x[i] * nl;
      sl2 += w * nl * nl;
      if (sl2 > 0 && slx * slx * f.suml2 > f.sumlx * f.sumlx * sl2) {
        best_codes[i] = nl;
        f = {slx, sl2};
        ++changed;
      }
    }
    if (changed == 0) break;
    scale = f.suml2 > 0.0f ? f.sumlx / f.suml2 : 0.0f;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(best_codes[i] + nmax);
  return scale;
}

// FitSymmetric of each 16 values of a q6_K / q3_K super-block; returns the scale of largest
// magnitude, with its sign.
float FitSixteens(const float* x, int nmax, bool one_by_one, float* scale, uint8_t* L) {
  float max_scale = 0.0f;
  for (int s = 0; s < 16; ++s) {
    scale[s] = FitSymmetric(16, nmax, x + 16 * s, one_by_one, L + 16 * s);
    if (std::fabs(scale[s]) > std::fabs(max_scale)) max_scale = scale[s];
  }
  return max_scale;
}

// q4_K's and q5_K's header (f16 d, dmin and the 6-bit scales and minimums of 8 sub-blocks, at b)
// and codes 0..levels of the 256 values in L, quantized against the header as stored.
void QuantizeScaleMinK(const float* x, int levels, uint8_t* b, uint8_t* L) {
  float scale[8], minv[8], max_scale = 0.0f, max_min = 0.0f;
  for (int s = 0; s < 8; ++s) {
    const float* xs = x + 32 * s;
    float sum_x2 = 0.0f, w[32];
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(xs[l]);
    scale[s] = levels == 15
                   ? FitScaleMin(32, 15, xs, w, -1.0f, 0.1f, 20, false, L + 32 * s, &minv[s])
                   : FitScaleMin(32, 31, xs, w, -0.5f, 0.1f, 15, false, L + 32 * s, &minv[s]);
    max_scale = std::max(max_scale, scale[s]);
    max_min = std::max(max_min, minv[s]);
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  uint8_t ls[8], lm[8];
  for (int s = 0; s < 8; ++s) {
    ls[s] = static_cast<uint8_t>(std::min(63, NearestInt(inv_scale * scale[s])));
    lm[s] = static_cast<uint8_t>(std::min(63, NearestInt(inv_min * minv[s])));
  }
  StoreF16(b, max_scale / 63.0f);
  StoreF16(b + 2, max_min / 63.0f);
  uint8_t* scales = b + 4;
  std::memset(scales, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scales[j] = ls[j];
      scales[j + 4] = lm[j];
    } else {
      scales[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      scales[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
  const float df = LoadF16(b), dminf = LoadF16(b + 2);
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    ScaleMinK4(s, scales, &sc, &m);
    const float dl = df * sc, ml = dminf * m;
    if (dl == 0.0f) continue;
    for (int l = 0; l < 32; ++l) {
      L[s * 32 + l] =
          static_cast<uint8_t>(std::clamp(NearestInt((x[s * 32 + l] + ml) / dl), 0, levels));
    }
  }
}

void QuantizeQ4_K(const float* x, uint8_t* b) {
  uint8_t L[256];
  QuantizeScaleMinK(x, 15, b, L);
  uint8_t* q = b + 16;
  for (int j = 0; j < 256; j += 64, q += 32) {
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
  }
}

void QuantizeQ5_K(const float* x, uint8_t* b) {
  uint8_t L[256];
  QuantizeScaleMinK(x, 31, b, L);
  uint8_t* qh = b + 16;
  uint8_t* q = b + 48;
  std::memset(qh, 0, 32);
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo = L[j + l], hi = L[j + l + 32];
      q[l] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
      qh[l] |= static_cast<uint8_t>(((lo >> 4) << is) | ((hi >> 4) << (is + 1)));
    }
  }
}

void QuantizeQ6_K(const float* x, uint8_t* b) {
  float scale[16];
  uint8_t L[256];
  const float max_scale = FitSixteens(x, 32, false, scale, L);
  if (std::fabs(max_scale) < 1e-15f) {
    std::memset(b, 0, 210);
    return;
  }
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  int8_t* sc = reinterpret_cast<int8_t*>(b + 192);
  const float iscale = -128.0f / max_scale;
  StoreF16(b + 208, 1.0f / iscale);
  for (int s = 0; s < 16; ++s)
    sc[s] = static_cast<int8_t>(std::min(127, NearestInt(iscale * scale[s])));
  const float d = LoadF16(b + 208);
  for (int s = 0; s < 16; ++s) {
    const float dl = d * sc[s];
    if (dl == 0.0f) continue;
    for (int l = 0; l < 16; ++l) {
      L[s * 16 + l] =
          static_cast<uint8_t>(std::clamp(NearestInt(x[s * 16 + l] / dl), -32, 31) + 32);
    }
  }
  for (int j = 0; j < 256; j += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
      const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
      ql[l] = static_cast<uint8_t>(q1 | (q3 << 4));
      ql[l + 32] = static_cast<uint8_t>(q2 | (q4 << 4));
      qh[l] = static_cast<uint8_t>((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                   ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
    }
  }
}

// 256 values' 2-bit codes (and q3_K's third bits) from codes L (0..3 or 0..7), in the layout the
// readers above decode.
void PackTwoBitCodes(const uint8_t* L, uint8_t* qs, uint8_t* hmask) {
  std::memset(qs, 0, 64);
  if (hmask != nullptr) std::memset(hmask, 0, 32);
  for (int b = 0; b < 8; ++b) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t u = L[32 * b + l];
      qs[32 * (b / 4) + l] |= static_cast<uint8_t>((u & 3) << (2 * (b % 4)));
      if (hmask != nullptr) hmask[l] |= static_cast<uint8_t>((u >> 2) << b);
    }
  }
}

void QuantizeQ3_K(const float* x, uint8_t* b) {
  float scale[16];
  uint8_t L[256];
  const float max_scale = FitSixteens(x, 4, true, scale, L);
  std::memset(b, 0, 110);
  uint8_t* sc = b + 96;
  if (max_scale != 0.0f) {
    const float iscale = -32.0f / max_scale;
    for (int s = 0; s < 16; ++s) {
      const int ls = std::clamp(NearestInt(iscale * scale[s]), -32, 31) + 32;
      sc[s % 8] |= static_cast<uint8_t>((ls & 0xF) << (s < 8 ? 0 : 4));
      sc[8 + s % 4] |= static_cast<uint8_t>((ls >> 4) << (2 * (s / 4)));
    }
    StoreF16(b + 108, 1.0f / iscale);
  }
  const float d = LoadF16(b + 108);
  for (int s = 0; s < 16; ++s) {
    const float dl = d * static_cast<float>(int8_detail::Q3KScale(b, s) - 32);
    if (dl == 0.0f) continue;
    for (int l = 0; l < 16; ++l) {
      L[16 * s + l] = static_cast<uint8_t>(std::clamp(NearestInt(x[16 * s + l] / dl), -4, 3) + 4);
    }
  }
  PackTwoBitCodes(L, b + 32, b);
}

void QuantizeQ2_K(const float* x, uint8_t* b) {
  float scale[16], minv[16], max_scale = 0.0f, max_min = 0.0f;
  uint8_t L[256];
  for (int s = 0; s < 16; ++s) {
    float w[16];
    for (int l = 0; l < 16; ++l) w[l] = std::fabs(x[16 * s + l]);
    scale[s] = FitScaleMin(16, 3, x + 16 * s, w, -0.5f, 0.1f, 15, true, L + 16 * s, &minv[s]);
    max_scale = std::max(max_scale, scale[s]);
    max_min = std::max(max_min, minv[s]);
  }
  std::memset(b, 0, 84);
  if (max_scale > 0) {
    for (int s = 0; s < 16; ++s)
      b[s] = static_cast<uint8_t>(NearestInt(15.0f / max_scale * scale[s]));
    StoreF16(b + 80, max_scale / 15.0f);
  }
  if (max_min > 0) {
    for (int s = 0; s < 16; ++s)
      b[s] |= static_cast<uint8_t>(NearestInt(15.0f / max_min * minv[s]) << 4);
    StoreF16(b + 82, max_min / 15.0f);
  }
  const float d = LoadF16(b + 80), dmin = LoadF16(b + 82);
  for (int s = 0; s < 16; ++s) {
    const float dl = d * static_cast<float>(b[s] & 0xF), ml = dmin * static_cast<float>(b[s] >> 4);
    if (dl == 0.0f) continue;
    for (int l = 0; l < 16; ++l) {
      L[16 * s + l] = static_cast<uint8_t>(std::clamp(NearestInt((x[16 * s + l] + ml) / dl), 0, 3));
    }
  }
  PackTwoBitCodes(L, b + 16, nullptr);
}

void QuantizeQ4_1(const float* x, uint8_t* b) { QuantizeMin(x, 15, b); }
void QuantizeQ5_1(const float* x, uint8_t* b) { QuantizeMin(x, 31, b); }

// One block's quantizer per type (nullptr: the float types, converted element by element).
struct BlockQuantizer {
  DType type;
  void (*quantize)(const float* x, uint8_t* block);
};
constexpr BlockQuantizer kQuantizers[] = {
    {DType::kF32, nullptr},           {DType::kF16, nullptr},
    {DType::kBF16, nullptr},          {DType::kQ8_0, QuantizeQ8_0},
    {DType::kQ4_0, QuantizeQ4_0},     {DType::kQ4_K, QuantizeQ4_K},
    {DType::kQ6_K, QuantizeQ6_K},     {DType::kQ5_0, QuantizeQ5_0},
    {DType::kQ5_K, QuantizeQ5_K},     {DType::kQ4_1, QuantizeQ4_1},
    {DType::kQ5_1, QuantizeQ5_1},     {DType::kIQ4_NL, QuantizeIQ4_NL},
    {DType::kIQ4_XS, QuantizeIQ4_XS}, {DType::kQ3_K, QuantizeQ3_K},
    {DType::kQ2_K, QuantizeQ2_K},
};
static_assert(OneRowPerDType(kQuantizers), "kQuantizers needs one row per DType, in its order");
constexpr bool EveryBlockTypeHasItsQuantizer() {
  for (const BlockQuantizer& q : kQuantizers) {
    if ((q.quantize != nullptr) != DTypeIsQuantized(q.type)) return false;
  }
  return true;
}
static_assert(EveryBlockTypeHasItsQuantizer());

}  // namespace

void QuantizeRow(DType t, const float* x, int64_t n, void* out) {
  const auto quantize = kQuantizers[static_cast<size_t>(t)].quantize;
  if (quantize == nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      if (t == DType::kF32) {
        std::memcpy(static_cast<float*>(out) + i, x + i, 4);
      } else {
        const uint16_t h = t == DType::kF16 ? F32ToF16(x[i]) : F32ToBf16(x[i]);
        std::memcpy(static_cast<uint16_t*>(out) + i, &h, 2);
      }
    }
    return;
  }
  const int64_t be = DTypeBlockElems(t), bb = DTypeBlockBytes(t);
  uint8_t* o = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < n / be; ++i) quantize(x + i * be, o + i * bb);
}

// ------------------------------------------------------------------------------------------------
// The int8 path (kernels/int8_dot.h).

void QuantizeQ8(const float* x, int64_t cols, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < cols / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.0f;
    for (int j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int j = 0; j < kQ8Block; ++j) {
      const int c = NearestInt(xb[j] * id);
      q[b * kQ8Block + j] = static_cast<int8_t>(c);
      sum += c;
    }
    d[b] = db;
    s[b] = db * static_cast<float>(sum);
  }
}

}  // namespace cachet::kernels::ref

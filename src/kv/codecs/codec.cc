#include "kv/codecs/codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/kernels.h"
#include "kv/codecs/calibrated_rows.h"
#include "kv/codecs/calibration.h"
#include "util/dtype.h"

namespace cachet::codecs {
namespace {

constexpr int kBlock = 32;  // q8_0 / q4_0 block, KIVI value channel group

struct Info {
  Codec id;
  const char* name;
};
constexpr Info kCodecs[] = {
    {Codec::kF32, "f32"},          {Codec::kF16, "f16"},     {Codec::kBF16, "bf16"},
    {Codec::kInt8, "int8"},        {Codec::kQ8_0, "q8_0"},   {Codec::kQ4_0, "q4_0"},
    {Codec::kKivi4, "kivi4"},      {Codec::kKivi2, "kivi2"}, {Codec::kRot4, "rot4"},
    {Codec::kRot3, "rot3"},        {Codec::kRot2, "rot2"},   {Codec::kRot3Qjl, "rot3+qjl"},
    {Codec::kRot2Qjl, "rot2+qjl"}, {Codec::kPca4, "pca4"},   {Codec::kPca3, "pca3"},
    {Codec::kPca2, "pca2"},        {Codec::kKvq4, "kvq4"},   {Codec::kKvq3, "kvq3"},
    {Codec::kKvq2, "kvq2"},        {Codec::kCq4, "cq4"},     {Codec::kCq2, "cq2"},
    {Codec::kGear4, "gear4"},
};

int KiviBits(Codec c) { return c == Codec::kKivi4 ? 4 : 2; }
bool IsKivi(Codec c) { return c == Codec::kKivi4 || c == Codec::kKivi2; }

uint16_t H(float f) { return F32ToF16(f); }
float F(uint16_t h) { return F16ToF32(h); }

// Little-endian bit packing of n codes of b bits each.
void PackBits(const uint8_t* codes, int n, int b, uint8_t* out) {
  uint64_t acc = 0;
  int bits = 0;
  for (int i = 0; i < n; ++i) {
    acc |= static_cast<uint64_t>(codes[i]) << bits;
    bits += b;
    while (bits >= 8) {
      *out++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      bits -= 8;
    }
  }
  if (bits > 0) *out = static_cast<uint8_t>(acc);
}

void UnpackBits(const uint8_t* in, int n, int b, uint8_t* codes) {
  uint64_t acc = 0;
  int bits = 0;
  const uint8_t mask = static_cast<uint8_t>((1u << b) - 1);
  for (int i = 0; i < n; ++i) {
    while (bits < b) {
      acc |= static_cast<uint64_t>(*in++) << bits;
      bits += 8;
    }
    codes[i] = static_cast<uint8_t>(acc & mask);
    acc >>= b;
    bits -= b;
  }
}

// Lloyd-Max reconstruction levels of N(0, 1), ascending.
const float* LloydMax(int bits) {
  static const std::array<float, 4> k2 = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
  static const std::array<float, 8> k3 = {-2.1520f, -1.3439f, -0.7560f, -0.2451f,
                                          0.2451f,  0.7560f,  1.3439f,  2.1520f};
  static const std::array<float, 16> k4 = {
      -2.7326f, -2.0690f, -1.6181f, -1.2562f, -0.9424f, -0.6568f, -0.3881f, -0.1284f,
      0.1284f,  0.3881f,  0.6568f,  0.9424f,  1.2562f,  1.6181f,  2.0690f,  2.7326f};
  return bits == 2 ? k2.data() : bits == 3 ? k3.data() : k4.data();
}

uint8_t NearestLevel(float x, const float* levels, int n) {
  int i = 0;
  while (i + 1 < n && x > 0.5f * (levels[i] + levels[i + 1])) ++i;
  return static_cast<uint8_t>(i);
}

float HashSign(int i, uint64_t seed) {
  uint64_t z = static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return ((z ^ (z >> 31)) & 1) ? -1.0f : 1.0f;
}

// The random signs of the Hadamard rotation: fixed, so every process encodes alike.
float Sign(int i) { return HashSign(i, 0x5eed); }

// The signs of QJL's transform S = H D' / sqrt(dim): its own seed, so S is independent of the
// rotation. Tabulated because every decoded row applies S^T.
const float* QjlSigns() {
  static const std::array<float, kMaxDim> signs = [] {
    std::array<float, kMaxDim> s{};
    for (int i = 0; i < kMaxDim; ++i) s[i] = HashSign(i, 0x51ed'0a1bull);
    return s;
  }();
  return signs.data();
}

void Fwht(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int i = 0; i < n; i += len << 1) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

const CalPlan& NeedPlan(Codec c, const CalPlan* plan) {
  if (plan == nullptr) {  // a call site that does not know its table: a bug, not bad input
    std::fprintf(stderr, "cachet: codec %s used without its calibration plan\n", CodecName(c));
    std::abort();
  }
  return *plan;
}

// Asymmetric min/max quantization of n values with stride, as KIVI: f16 min and scale.
void QuantizeMinMax(const float* x, int n, int stride, int bits, uint16_t* min_h, uint16_t* scale_h,
                    uint8_t* codes) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  const int qmax = (1 << bits) - 1;
  *min_h = H(lo);
  *scale_h = H((hi - lo) / qmax);
  const float m = F(*min_h), s = F(*scale_h);
  const float inv = s > 0 ? 1.0f / s : 0.0f;
  for (int i = 0; i < n; ++i) {
    const int q = static_cast<int>(std::lround((x[i * stride] - m) * inv));
    codes[i] = static_cast<uint8_t>(std::clamp(q, 0, qmax));
  }
}

// llama.cpp's block_q4_0 rows: per 32 values an f16 d = max / -8 (max: the value of largest
// magnitude) and the nibbles x / d + 8, rounded.
void EncodeQ4_0(const float* x, int dim, uint8_t* out) {
  for (int b = 0; b < dim / kBlock; ++b, x += kBlock, out += 2 + kBlock / 2) {
    float amax = 0, max = 0;
    for (int i = 0; i < kBlock; ++i) {
      if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), max = x[i];
    }
    const float d = max / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
    const uint16_t dh = H(d);
    std::memcpy(out, &dh, 2);
    for (int j = 0; j < kBlock / 2; ++j) {
      const int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
      const int q1 = std::min(15, static_cast<int>(x[j + kBlock / 2] * id + 8.5f));
      out[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

// cq2's blocks (kernels::PageData's level blocks, read in place by attention): per 32 values the
// f16 scale d and the values' nearest of d x the 2-bit Lloyd-Max levels; d starts at the block's
// RMS and is refitted by least squares to the codes twice (the levels are those of a unit
// variance).
constexpr size_t kCq2BlockBytes = kernels::kLevelBlockBytes;
static_assert(kCq2BlockBytes == 2 + kBlock / 4);
void EncodeCq2(const float* x, int dim, uint8_t* out) {
  const float* levels = LloydMax(2);
  for (int b = 0; b < dim / kBlock; ++b, x += kBlock, out += kCq2BlockBytes) {
    float ss = 0;
    for (int i = 0; i < kBlock; ++i) ss += x[i] * x[i];
    float d = std::sqrt(ss / kBlock);
    uint8_t codes[kBlock] = {};
    for (int round = 0; round < 3 && d > 0; ++round) {
      const float inv = 1.0f / d;
      float dot = 0, lev2 = 0;
      for (int i = 0; i < kBlock; ++i) {
        codes[i] = NearestLevel(x[i] * inv, levels, 4);
        dot += x[i] * levels[codes[i]];
        lev2 += levels[codes[i]] * levels[codes[i]];
      }
      d = dot / lev2;
    }
    const uint16_t dh = H(d);
    std::memcpy(out, &dh, 2);
    std::memset(out + 2, 0, kBlock / 4);
    for (int i = 0; i < kBlock; ++i)
      out[2 + i % 8] |= static_cast<uint8_t>(codes[i] << (2 * (i / 8)));
  }
}

void DecodeQ4_0(const uint8_t* in, int dim, float* x) {
  for (int b = 0; b < dim / kBlock; ++b, x += kBlock, in += 2 + kBlock / 2) {
    uint16_t dh;
    std::memcpy(&dh, in, 2);
    const float d = F(dh);
    for (int j = 0; j < kBlock / 2; ++j) {
      x[j] = d * ((in[2 + j] & 0x0f) - 8);
      x[j + kBlock / 2] = d * ((in[2 + j] >> 4) - 8);
    }
  }
}

// gear4: q4_0's blocks, then the coordinates of their error r = x - q4_0(x) on the plan's
// kGearRank unit axes, a_j . r, in int8 over an f16 scale (the largest |a_j . r| / 127).
void EncodeGear4(const CalPlan& plan, const float* x, int dim, uint8_t* out) {
  EncodeQ4_0(x, dim, out);
  float r[kMaxDim];
  DecodeQ4_0(out, dim, r);
  for (int i = 0; i < dim; ++i) r[i] = x[i] - r[i];
  float coord[kGearRank], amax = 0;
  for (int j = 0; j < kGearRank; ++j) {
    const float* a = plan.gear_axes.data() + size_t(j) * dim;
    float s = 0;
    for (int i = 0; i < dim; ++i) s += a[i] * r[i];
    coord[j] = s;
    amax = std::max(amax, std::fabs(s));
  }
  uint8_t* tail = out + size_t(dim / kBlock) * (2 + kBlock / 2);
  const uint16_t sh = H(amax / 127.0f);
  const float scale = F(sh), inv = scale > 0 ? 1.0f / scale : 0.0f;
  for (int j = 0; j < kGearRank; ++j) {
    tail[j] = static_cast<uint8_t>(
        static_cast<int8_t>(std::clamp<long>(std::lround(coord[j] * inv), -127, 127)));
  }
  std::memcpy(tail + kGearRank, &sh, 2);
}

// Per-token row layout of the row-wise codecs (everything but KIVI keys).
// Rotation codecs: each row starts with its f16 scale (the least-squares fit of the levels).
constexpr size_t kRotScaleBytes = 2;

size_t RowBytes(Codec c, int dim) {
  switch (c) {
    case Codec::kF32:
      return 4 * size_t(dim);
    case Codec::kF16:
    case Codec::kBF16:
      return 2 * size_t(dim);
    case Codec::kInt8:
      return 4 + size_t(dim);
    case Codec::kQ8_0:
      return size_t(dim / kBlock) * (2 + kBlock);
    case Codec::kQ4_0:
    case Codec::kCq4:
      return size_t(dim / kBlock) * (2 + kBlock / 2);
    case Codec::kCq2:
      return size_t(dim / kBlock) * kCq2BlockBytes;
    case Codec::kGear4:  // q4_0's blocks, the correction's int8 coordinates, their f16 scale
      return size_t(dim / kBlock) * (2 + kBlock / 2) + kGearRank + 2;
    case Codec::kKivi4:
    case Codec::kKivi2:
      return size_t(dim / kBlock) * 4 + PackedBytes(dim, KiviBits(c));
    case Codec::kRot4:
    case Codec::kRot3:
    case Codec::kRot2:
      return kRotScaleBytes + PackedBytes(dim, RotBits(c));
    case Codec::kRot3Qjl:
    case Codec::kRot2Qjl:  // rotN's row, then the residual's sign bits and f16 norm
      return kRotScaleBytes + PackedBytes(dim, RotBits(c)) + PackedBytes(dim, 1) + 2;
    case Codec::kPca4:
    case Codec::kPca3:
    case Codec::kPca2:  // the f16 scale, then bits x dim code bits over the axes
      return 2 + PackedBytes(dim, CalBits(c));
    case Codec::kKvq4:
    case Codec::kKvq3:
    case Codec::kKvq2:  // the scale byte, the outliers' entries, then bits x dim code bits
      return KvqCodesOffset(dim) + PackedBytes(dim, CalBits(c));
  }
  return 0;
}

// Calibrated rows are coded by their (layer, KV head, role)'s plan; other codecs ignore it.
void EncodeRow(Codec c, const CalPlan* plan, const float* x, int dim, uint8_t* out) {
  switch (c) {
    case Codec::kF32:
      std::memcpy(out, x, 4 * size_t(dim));
      return;
    case Codec::kF16:
    case Codec::kBF16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      for (int i = 0; i < dim; ++i) o[i] = c == Codec::kF16 ? F32ToF16(x[i]) : F32ToBf16(x[i]);
      return;
    }
    case Codec::kInt8: {
      float amax = 0;
      for (int i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
      std::memcpy(out, &scale, 4);
      int8_t* q = reinterpret_cast<int8_t*>(out + 4);
      for (int i = 0; i < dim; ++i) q[i] = static_cast<int8_t>(std::lround(x[i] * inv));
      return;
    }
    case Codec::kQ8_0:
      for (int b = 0; b < dim / kBlock; ++b, x += kBlock, out += 2 + kBlock) {
        float amax = 0;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
        const uint16_t dh = H(d);
        std::memcpy(out, &dh, 2);
        for (int i = 0; i < kBlock; ++i) {
          out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(x[i] * id)));
        }
      }
      return;
    case Codec::kQ4_0:
      return EncodeQ4_0(x, dim, out);
    case Codec::kCq4:
    case Codec::kCq2: {  // blocks of the row in the channels' basis
      float z[kMaxDim];
      std::copy_n(x, dim, z);
      IntoBasis(c, plan, z, dim, BasisVec::kRow);
      return c == Codec::kCq4 ? EncodeQ4_0(z, dim, out) : EncodeCq2(z, dim, out);
    }
    case Codec::kGear4:
      return EncodeGear4(NeedPlan(c, plan), x, dim, out);
    case Codec::kKivi4:
    case Codec::kKivi2: {  // a value row: groups of 32 channels
      const int bits = KiviBits(c), groups = dim / kBlock;
      uint16_t* meta = reinterpret_cast<uint16_t*>(out);
      uint8_t codes[kMaxDim];
      for (int g = 0; g < groups; ++g) {
        QuantizeMinMax(x + g * kBlock, kBlock, 1, bits, &meta[2 * g], &meta[2 * g + 1],
                       codes + g * kBlock);
      }
      PackBits(codes, dim, bits, out + 4 * groups);
      return;
    }
    case Codec::kRot4:
    case Codec::kRot3:
    case Codec::kRot2:
    case Codec::kRot3Qjl:
    case Codec::kRot2Qjl: {
      const int bits = RotBits(c), n_levels = 1 << bits;
      const float* levels = LloydMax(bits);
      float y[kMaxDim];
      std::copy(x, x + dim, y);
      Rotate(y, dim);
      float norm2 = 0;
      for (int i = 0; i < dim; ++i) norm2 += y[i] * y[i];
      // Coordinates of a rotated unit vector are ~N(0, 1/dim): quantize y * sqrt(dim) / |y|.
      const float to_unit = norm2 > 0 ? std::sqrt(dim / norm2) : 0.0f;
      uint8_t codes[kMaxDim];
      float dot = 0, lev2 = 0;
      for (int i = 0; i < dim; ++i) {
        codes[i] = NearestLevel(y[i] * to_unit, levels, n_levels);
        dot += y[i] * levels[codes[i]];
        lev2 += levels[codes[i]] * levels[codes[i]];
      }
      // Least-squares fit of the levels to y, stored in f16 (what decoding multiplies by).
      const uint16_t scale_h = H(lev2 > 0 ? dot / lev2 : 0.0f);
      const float scale = F(scale_h);
      std::memcpy(out, &scale_h, kRotScaleBytes);
      PackBits(codes, dim, bits, out + kRotScaleBytes);
      if (!IsQjl(c)) return;
      // Residual r = y - scale * level, 1-bit quantized as sign(S r). Its norm is stored over
      // scale (~ |y| / sqrt(dim)) so the f16 holds an O(1) ratio whatever the row's magnitude.
      const float* qs = QjlSigns();
      float r2 = 0;
      for (int i = 0; i < dim; ++i) {
        y[i] -= scale * levels[codes[i]];
        r2 += y[i] * y[i];
        y[i] *= qs[i];
      }
      Fwht(y, dim);
      for (int i = 0; i < dim; ++i) codes[i] = y[i] < 0;
      uint8_t* tail = out + kRotScaleBytes + PackedBytes(dim, bits);
      PackBits(codes, dim, 1, tail);
      const uint16_t gamma = H(scale > 0 ? std::sqrt(r2) / scale : 0.0f);
      std::memcpy(tail + PackedBytes(dim, 1), &gamma, 2);
      return;
    }
    case Codec::kPca4:
    case Codec::kPca3:
    case Codec::kPca2:
      EncodePcaRow(NeedPlan(c, plan), x, out);
      return;
    case Codec::kKvq4:
    case Codec::kKvq3:
    case Codec::kKvq2:
      EncodeKvqRow(NeedPlan(c, plan), x, out);
      return;
  }
}

// Row t of a row-wise codec, decoded into the basis it is stored in (rotated for rot codecs, on
// the plan's axes for pca codecs).
void DecodeRowStored(Codec c, const CalPlan* plan, const uint8_t* in, int dim, float* x) {
  switch (c) {
    case Codec::kF32:
      std::memcpy(x, in, 4 * size_t(dim));
      return;
    case Codec::kF16:
    case Codec::kBF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(in);
      for (int i = 0; i < dim; ++i) x[i] = c == Codec::kF16 ? F16ToF32(h[i]) : Bf16ToF32(h[i]);
      return;
    }
    case Codec::kInt8: {
      float scale;
      std::memcpy(&scale, in, 4);
      const int8_t* q = reinterpret_cast<const int8_t*>(in + 4);
      for (int i = 0; i < dim; ++i) x[i] = scale * q[i];
      return;
    }
    case Codec::kQ8_0:
      for (int b = 0; b < dim / kBlock; ++b, x += kBlock, in += 2 + kBlock) {
        uint16_t dh;
        std::memcpy(&dh, in, 2);
        const float d = F(dh);
        for (int i = 0; i < kBlock; ++i) x[i] = d * static_cast<int8_t>(in[2 + i]);
      }
      return;
    case Codec::kQ4_0:
    case Codec::kCq4:  // its scaled channels: the basis attention reads it in
      return DecodeQ4_0(in, dim, x);
    case Codec::kGear4: {
      DecodeQ4_0(in, dim, x);
      const uint8_t* tail = in + RowBytes(Codec::kQ4_0, dim);
      uint16_t sh;
      std::memcpy(&sh, tail + kGearRank, 2);
      const float scale = F(sh);
      const float* axes = NeedPlan(c, plan).gear_axes.data();
      for (int j = 0; j < kGearRank; ++j) {
        const float cj = scale * static_cast<int8_t>(tail[j]);
        for (int i = 0; i < dim; ++i) x[i] += cj * axes[size_t(j) * dim + i];
      }
      return;
    }
    case Codec::kCq2: {
      const float* levels = LloydMax(2);
      for (int b = 0; b < dim / kBlock; ++b, x += kBlock, in += kCq2BlockBytes) {
        uint16_t dh;
        std::memcpy(&dh, in, 2);
        const float d = F(dh);
        for (int i = 0; i < kBlock; ++i) x[i] = d * levels[kernels::LevelCode(in, i)];
      }
      return;
    }
    case Codec::kKivi4:
    case Codec::kKivi2: {
      const int bits = KiviBits(c), groups = dim / kBlock;
      const uint16_t* meta = reinterpret_cast<const uint16_t*>(in);
      uint8_t codes[kMaxDim];
      UnpackBits(in + 4 * groups, dim, bits, codes);
      for (int i = 0; i < dim; ++i) {
        const int g = i / kBlock;
        x[i] = F(meta[2 * g]) + F(meta[2 * g + 1]) * codes[i];
      }
      return;
    }
    case Codec::kRot4:
    case Codec::kRot3:
    case Codec::kRot2:
    case Codec::kRot3Qjl:
    case Codec::kRot2Qjl: {
      const int bits = RotBits(c);
      const float* levels = LloydMax(bits);
      uint16_t scale_h;
      std::memcpy(&scale_h, in, kRotScaleBytes);
      const float scale = F(scale_h);
      uint8_t codes[kMaxDim];
      UnpackBits(in + kRotScaleBytes, dim, bits, codes);
      if (!IsQjl(c)) {
        for (int i = 0; i < dim; ++i) x[i] = scale * levels[codes[i]];
        return;
      }
      // r ~ gamma sqrt(pi / (2 dim)) S^T sign(S r). The rows s_i of S have unit norm and s_i.r is
      // ~N(0, |r|^2 / dim), so E[sign(s_i.r) s_i.r] = |r| sqrt(2 / (pi dim)): with this constant
      // the estimate's projection on r is r on average, and q.k is unbiased.
      const uint8_t* tail = in + kRotScaleBytes + PackedBytes(dim, bits);
      uint16_t gamma;
      std::memcpy(&gamma, tail + PackedBytes(dim, 1), 2);
      const float coef = scale * F(gamma) * std::sqrt(1.5707963f / dim);
      uint8_t signs[kMaxDim];
      UnpackBits(tail, dim, 1, signs);
      for (int i = 0; i < dim; ++i) x[i] = signs[i] ? -coef : coef;
      Fwht(x, dim);  // H is symmetric: S^T z = D' H z / sqrt(dim)
      const float* qs = QjlSigns();
      for (int i = 0; i < dim; ++i) x[i] = x[i] * qs[i] + scale * levels[codes[i]];
      return;
    }
    case Codec::kPca4:
    case Codec::kPca3:
    case Codec::kPca2:
      DecodePcaRow(NeedPlan(c, plan), in, x);
      return;
    case Codec::kKvq4:
    case Codec::kKvq3:
    case Codec::kKvq2:
      DecodeKvqRow(NeedPlan(c, plan), in, x);
      return;
  }
}

}  // namespace

const char* CodecName(Codec c) {
  for (const Info& i : kCodecs) {
    if (i.id == c) return i.name;
  }
  return "?";
}

std::string CodecNames() {
  std::string s;
  for (const Info& i : kCodecs) s += (s.empty() ? "" : ", ") + std::string(i.name);
  return s;
}

Result<Codec> ParseCodec(std::string_view name) {
  for (const Info& i : kCodecs) {
    if (name == i.name) return i.id;
  }
  return InvalidArgument("unknown KV codec '" + std::string(name) + "' (known: " + CodecNames() +
                         ")");
}

Result<CodecPair> ParseCodecPair(std::string_view name) {
  const size_t colon = name.find(':');
  CodecPair c;
  CACHET_ASSIGN_OR_RETURN(c.k, ParseCodec(name.substr(0, colon)));
  c.v = c.k;
  if (colon != std::string_view::npos) {
    CACHET_ASSIGN_OR_RETURN(c.v, ParseCodec(name.substr(colon + 1)));
  }
  return c;
}

Status CheckCodecNames(std::string_view kv) { return ParseCodecPair(kv).status(); }

std::string PairName(CodecPair c) {
  return c.k == c.v ? CodecName(c.k) : std::string(CodecName(c.k)) + ":" + CodecName(c.v);
}

Status CheckDim(Codec c, int dim) {
  if (dim <= 0 || dim > kMaxDim) {
    return InvalidArgument("head_dim " + std::to_string(dim) + " outside [1, 512]");
  }
  const bool block =
      c == Codec::kQ8_0 || c == Codec::kQ4_0 || IsCq(c) || c == Codec::kGear4 || IsKivi(c);
  if (block && dim % kBlock != 0) {
    return InvalidArgument(std::string("codec ") + CodecName(c) +
                           " needs head_dim % 32 == 0, got " + std::to_string(dim));
  }
  if (IsKvq(c) && dim % 8 != 0) {
    return InvalidArgument(std::string("codec ") + CodecName(c) + " needs head_dim % 8 == 0, got " +
                           std::to_string(dim));
  }
  if (IsRotated(c) && (dim & (dim - 1)) != 0) {
    return InvalidArgument(std::string("codec ") + CodecName(c) +
                           " needs a power-of-two head_dim, got " + std::to_string(dim));
  }
  return OkStatus();
}

size_t RowStride(Codec c, int dim) { return RowBytes(c, dim); }

size_t PackedBytes(int n, int b) { return (static_cast<size_t>(n) * b + 7) / 8; }

std::pair<std::string, std::string> SplitKv(std::string_view kv) {
  const size_t colon = kv.find(':');
  const std::string k(kv.substr(0, colon));
  return {k, colon == std::string_view::npos ? k : std::string(kv.substr(colon + 1))};
}

size_t KiviKeyMetaBytes(int dim) { return 4 * size_t(dim); }

int RotBits(Codec c) {
  return c == Codec::kRot4 ? 4 : c == Codec::kRot3 || c == Codec::kRot3Qjl ? 3 : 2;
}
const float* RotLevels(Codec c) { return LloydMax(RotBits(c)); }
bool IsQjl(Codec c) { return c == Codec::kRot3Qjl || c == Codec::kRot2Qjl; }

bool IsRotated(Codec c) {
  return c == Codec::kRot4 || c == Codec::kRot3 || c == Codec::kRot2 || IsQjl(c);
}

bool IsPca(Codec c) { return c == Codec::kPca4 || c == Codec::kPca3 || c == Codec::kPca2; }
bool IsKvq(Codec c) { return c == Codec::kKvq4 || c == Codec::kKvq3 || c == Codec::kKvq2; }
bool IsCalibrated(Codec c) { return IsPca(c) || IsKvq(c) || IsCq(c) || c == Codec::kGear4; }
bool IsCq(Codec c) { return c == Codec::kCq4 || c == Codec::kCq2; }
const float* Cq2Levels() {
  static const std::array<float, 16> table = [] {
    std::array<float, 16> t{};
    std::copy_n(LloydMax(2), 4, t.begin());
    return t;
  }();
  return table.data();
}
int CalBits(Codec c) {
  return c == Codec::kPca4 || c == Codec::kKvq4 || c == Codec::kCq4 || c == Codec::kGear4 ? 4
         : c == Codec::kPca3 || c == Codec::kKvq3                                         ? 3
                                                                                          : 2;
}
int KvqOutliers(int dim) { return std::max(1, dim / 64); }
bool StoredBeforeRope(Codec c, Role role) { return IsKvq(c) && role == Role::kKey; }
Basis BasisOf(Codec c) {
  return IsRotated(c) ? Basis::kHadamard
         : IsPca(c)   ? Basis::kPca
         : IsCq(c)    ? Basis::kChannels
                      : Basis::kPlain;
}

void IntoBasis(Codec c, const CalPlan* plan, float* x, int dim, BasisVec what) {
  const bool row = what == BasisVec::kRow;
  switch (BasisOf(c)) {
    case Basis::kPlain:
      return;
    case Basis::kHadamard:
      return Rotate(x, dim);
    case Basis::kPca:
      return ProjectOnAxes(*NeedPlan(c, plan).stats, x, dim, row);
    case Basis::kChannels: {
      const CalPlan& p = NeedPlan(c, plan);
      const float *mean = p.stats->mean.data(), *f = p.channel_factor.data();
      for (int i = 0; i < dim; ++i) x[i] = row ? (x[i] - mean[i]) / f[i] : x[i] * f[i];
      return;
    }
  }
}

void OutOfBasis(Codec c, const CalPlan* plan, float* x, int dim, bool centered) {
  if (IsRotated(c)) return Unrotate(x, dim);
  if (BasisOf(c) == Basis::kChannels) {
    const CalPlan& p = NeedPlan(c, plan);
    const float *mean = p.stats->mean.data(), *f = p.channel_factor.data();
    for (int i = 0; i < dim; ++i) x[i] = x[i] * f[i] + (centered ? mean[i] : 0.0f);
    return;
  }
  if (!IsPca(c)) return;
  const CalPlan& p = NeedPlan(c, plan);
  const HeadStats& h = *p.stats;
  float y[kMaxDim];
  for (int k = 0; k < dim; ++k) y[k] = centered ? h.mean[k] : 0.0f;
  for (int i = 0; i < dim; ++i) {
    const float* ax = h.axes.data() + size_t(i) * dim;
    for (int k = 0; k < dim; ++k) y[k] += ax[k] * x[i];
  }
  std::copy_n(y, dim, x);
}

bool NeedsFullPage(Codec c, Role role) { return IsKivi(c) && role == Role::kKey; }

size_t PageBytes(Codec c, Role role, int tokens, int dim) {
  if (IsKivi(c) && role == Role::kKey) {
    return KiviKeyMetaBytes(dim) + size_t(tokens) * PackedBytes(dim, KiviBits(c));
  }
  return size_t(tokens) * RowBytes(c, dim);
}

double BitsPerValue(Codec c, Role role, int tokens, int dim) {
  return 8.0 * PageBytes(c, role, tokens, dim) / (double(tokens) * dim);
}

void Rotate(float* x, int dim) {
  for (int i = 0; i < dim; ++i) x[i] *= Sign(i);
  Fwht(x, dim);
}

void Unrotate(float* x, int dim) {
  Fwht(x, dim);
  for (int i = 0; i < dim; ++i) x[i] *= Sign(i);
}

void EncodePage(Codec c, Role role, const float* rows, int n, int tokens, int dim, uint8_t* page,
                const CalPlan* plan) {
  (void)tokens;  // KIVI keys size their metadata by dim; rows past n are left as they are
  if (IsKivi(c) && role == Role::kKey) {
    const int bits = KiviBits(c);
    uint16_t* meta = reinterpret_cast<uint16_t*>(page);
    uint8_t* packed = page + KiviKeyMetaBytes(dim);
    const size_t row_bytes = PackedBytes(dim, bits);
    // Quantize channel by channel over the page's tokens, then pack token-major.
    uint8_t codes[kMaxDim * 256];
    for (int ch = 0; ch < dim; ++ch) {
      uint8_t col[256];
      QuantizeMinMax(rows + ch, n, dim, bits, &meta[2 * ch], &meta[2 * ch + 1], col);
      for (int t = 0; t < n; ++t) codes[t * dim + ch] = col[t];
    }
    for (int t = 0; t < n; ++t) PackBits(codes + t * dim, dim, bits, packed + t * row_bytes);
    return;
  }
  const size_t rb = RowBytes(c, dim);
  for (int t = 0; t < n; ++t) EncodeRow(c, plan, rows + size_t(t) * dim, dim, page + t * rb);
}

void DecodePage(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                const CalPlan* plan) {
  (void)tokens;
  if (IsKivi(c) && role == Role::kKey) {
    const int bits = KiviBits(c);
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(page);
    const uint8_t* packed = page + KiviKeyMetaBytes(dim);
    const size_t row_bytes = PackedBytes(dim, bits);
    uint8_t codes[kMaxDim];
    for (int t = 0; t < n; ++t) {
      UnpackBits(packed + t * row_bytes, dim, bits, codes);
      for (int ch = 0; ch < dim; ++ch) {
        rows[size_t(t) * dim + ch] = F(meta[2 * ch]) + F(meta[2 * ch + 1]) * codes[ch];
      }
    }
    return;
  }
  const size_t rb = RowBytes(c, dim);
  for (int t = 0; t < n; ++t) {
    float* x = rows + size_t(t) * dim;
    DecodeRowStored(c, plan, page + t * rb, dim, x);
    OutOfBasis(c, plan, x, dim, true);
  }
}

void DecodeStored(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                  const CalPlan* plan) {
  if (IsKivi(c) && role == Role::kKey) {
    DecodePage(c, role, page, n, tokens, dim, rows);  // KIVI is never rotated
    return;
  }
  const size_t rb = RowBytes(c, dim);
  for (int t = 0; t < n; ++t) {
    DecodeRowStored(c, plan, page + t * rb, dim, rows + size_t(t) * dim);
  }
}

void DotKeys(Codec c, const uint8_t* page, int n, int tokens, int dim, const float* q, float* out,
             const CalPlan* plan) {
  (void)tokens;
  if (IsKivi(c)) {
    // q.k = sum_c (q_c scale_c) code_c + sum_c q_c min_c: fold the per-channel scales into q once.
    const int bits = KiviBits(c);
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(page);
    const uint8_t* packed = page + KiviKeyMetaBytes(dim);
    const size_t row_bytes = PackedBytes(dim, bits);
    float qs[kMaxDim];
    float bias = 0;
    for (int ch = 0; ch < dim; ++ch) {
      qs[ch] = q[ch] * F(meta[2 * ch + 1]);
      bias += q[ch] * F(meta[2 * ch]);
    }
    uint8_t codes[kMaxDim];
    for (int t = 0; t < n; ++t) {
      UnpackBits(packed + t * row_bytes, dim, bits, codes);
      float s = 0;
      for (int ch = 0; ch < dim; ++ch) s += qs[ch] * codes[ch];
      out[t] = s + bias;
    }
    return;
  }
  const size_t rb = RowBytes(c, dim);
  float x[kMaxDim];
  for (int t = 0; t < n; ++t) {
    DecodeRowStored(c, plan, page + t * rb, dim, x);
    float s = 0;
    for (int i = 0; i < dim; ++i) s += q[i] * x[i];
    out[t] = s;
  }
}

void AccumulateValues(Codec c, const uint8_t* page, int n, int tokens, int dim, const float* p,
                      float* acc, const CalPlan* plan) {
  (void)tokens;
  const size_t rb = RowBytes(c, dim);
  float x[kMaxDim];
  for (int t = 0; t < n; ++t) {
    if (p[t] == 0.0f) continue;
    DecodeRowStored(c, plan, page + t * rb, dim, x);
    for (int i = 0; i < dim; ++i) acc[i] += p[t] * x[i];
  }
}

}  // namespace cachet::codecs

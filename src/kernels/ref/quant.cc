// Reference dequantization (and the int8 path's dot products) of the GGUF (GGML) block formats
// Cachet computes on directly, written from llama.cpp's ggml-quants layouts (little-endian, packed,
// no padding):
//
//   block_q8_0 (32 values, 34 bytes):  f16 d; int8 qs[32]            x = d * q
//   block_q4_0 (32 values, 18 bytes):  f16 d; u8 qs[16]              x[j] = d * (lo(qs[j]) - 8),
//                                                                    x[j+16] = d * (hi(qs[j]) - 8)
//   block_q5_0 (32 values, 22 bytes):  f16 d; u32 qh; u8 qs[16]      as q4_0 with bit j of qh as
//                                                                    code j's fifth bit, minus 16
//   block_q4_1 (32 values, 20 bytes):  f16 d; f16 m; u8 qs[16]       x = d * q + m (q: nibbles)
//   block_q5_1 (32 values, 24 bytes):  f16 d; f16 m; u32 qh; u8 qs[16]   x = d * q + m (5 bits)
//   block_q4_K (256 values, 144 bytes): f16 d; f16 dmin; u8 scales[12]; u8 qs[128]
//       8 sub-blocks of 32 with 6-bit scale sc and 6-bit min m (packed as get_scale_min_k4 reads
//       them); per 64 values, 32 bytes of qs: low nibbles are sub-block 2i, high nibbles 2i+1;
//       x = d * sc * q - dmin * m.
//   block_q5_K (256 values, 176 bytes): f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
//       q4_K's, with bit i of qh[l] the fifth bit of value l of sub-block i.
//   block_iq4_nl (32 values, 18 bytes): f16 d; u8 qs[16]           x = d * kIQ4Values[nibble]
//   block_iq4_xs (256 values, 136 bytes): f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]
//       8 sub-blocks of 32, each 16 bytes of qs as iq4_nl's, with the 6-bit scale ls (low 4 bits
//       in scales_l, high 2 in scales_h): x = d * (ls - 32) * kIQ4Values[nibble].
//   block_q6_K (256 values, 210 bytes): u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d
//       16 sub-blocks of 16; 6-bit q = low 4 bits from ql, high 2 bits from qh; x = d * sc * (q -
//       32).
//   block_q3_K (256 values, 110 bytes): u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d
//       16 sub-blocks of 16 with 6-bit scales sc (stored + 32, packed as Q3KScale reads them);
//       per 128 values, 32 bytes of qs hold four 32-value blocks, two bits each (block k at bits
//       2k); bit i of hmask[l] is the third bit of value l of 32-value block i; x = d * (sc - 32)
//       * (q - 4).
//   block_q2_K (256 values, 84 bytes): u8 scales[16]; u8 qs[64]; f16 d; f16 dmin
//       16 sub-blocks of 16, each with a 4-bit scale (low nibble) and min (high nibble); qs as
//       q3_K's; x = d * sc * q - dmin * m.
//
// The quantizers: kernels/ref/quantize.cc.
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

void DequantQ8_0(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]);
}

void DequantQ4_0(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const uint8_t* q = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((q[j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
  }
}

void DequantQ5_0(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* q = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (q[j] & 0xF) | (((qh >> j) & 1) << 4);
    const int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + 16] = d * static_cast<float>(hi - 16);
  }
}

// q4_1, q5_1, q4_K and q5_K: x = dw * code - o per 32-value (sub-)block, its scale and offset as
// the int8 path reads them (q4_1 / q5_1: d * code + m; q4_K / q5_K: d * sc * code - dmin * m).
template <DType kType>
void DequantScaled(const uint8_t* b, float* y) {
  constexpr int64_t kSub = DTypeBlockElems(kType) / 32;
  float dw[kSub], o[kSub];
  BlockScales<kType>(b, kSub, dw, o);
  for (int64_t s = 0; s < kSub; ++s) {
    for (int j = 0; j < 32; ++j) {
      y[s * 32 + j] = dw[s] * static_cast<float>(BlockCode<kType>(b, s, j)) - o[s];
    }
  }
}

// iq4_nl, iq4_xs: the level a nibble indexes times the (sub-)block's scale.
template <DType kType>
void DequantIQ4(const uint8_t* b, float* y) {
  constexpr int64_t kSub = DTypeBlockElems(kType) / 32;
  float dw[kSub], o[kSub];
  BlockScales<kType>(b, kSub, dw, o);
  for (int64_t s = 0; s < kSub; ++s) {
    for (int j = 0; j < 32; ++j) {
      y[s * 32 + j] = dw[s] * static_cast<float>(BlockCode<kType>(b, s, j) - 128);
    }
  }
}

void DequantQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = LoadF16(b + 208);
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[n + l] = d * sc[is] * static_cast<float>(q1);
      y[n + l + 32] = d * sc[is + 2] * static_cast<float>(q2);
      y[n + l + 64] = d * sc[is + 4] * static_cast<float>(q3);
      y[n + l + 96] = d * sc[is + 6] * static_cast<float>(q4);
    }
  }
}

// Written from the layout as llama.cpp's dequantize_row_q3_K walks it, apart from the BlockCode /
// HalfScales readers the int8 path uses, so that each checks the other.
void DequantQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d = LoadF16(b + 108);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m = static_cast<uint8_t>(m << 1)) {
      for (int half = 0; half < 2; ++half, ++is) {
        const float dl = d * static_cast<float>(int8_detail::Q3KScale(b, is) - 32);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int v = ((q[l] >> shift) & 3) - ((hm[l] & m) != 0 ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
      }
    }
  }
}

void DequantQ2_K(const uint8_t* b, float* y) {
  const uint8_t* q = b + 16;
  const float d = LoadF16(b + 80), dmin = LoadF16(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half, ++is) {
        const float dl = d * static_cast<float>(b[is] & 0xF),
                    ml = dmin * static_cast<float>(b[is] >> 4);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          *y++ = dl * static_cast<float>((q[l] >> shift) & 3) - ml;
        }
      }
    }
  }
}

// Template instances by name: GCC cannot compare their addresses with nullptr in a constant
// expression under -fsanitize=address.
void DequantQ4_K(const uint8_t* b, float* y) { DequantScaled<DType::kQ4_K>(b, y); }
void DequantQ5_K(const uint8_t* b, float* y) { DequantScaled<DType::kQ5_K>(b, y); }
void DequantQ4_1(const uint8_t* b, float* y) { DequantScaled<DType::kQ4_1>(b, y); }
void DequantQ5_1(const uint8_t* b, float* y) { DequantScaled<DType::kQ5_1>(b, y); }
void DequantIQ4_NL(const uint8_t* b, float* y) { DequantIQ4<DType::kIQ4_NL>(b, y); }
void DequantIQ4_XS(const uint8_t* b, float* y) { DequantIQ4<DType::kIQ4_XS>(b, y); }

// One block's dequantizer per type (nullptr: the float types, which are not read here).
struct BlockDequantizer {
  DType type;
  void (*dequant)(const uint8_t* block, float* y);
};
constexpr BlockDequantizer kDequantizers[] = {
    {DType::kF32, nullptr},          {DType::kF16, nullptr},      {DType::kBF16, nullptr},
    {DType::kQ8_0, DequantQ8_0},     {DType::kQ4_0, DequantQ4_0}, {DType::kQ4_K, DequantQ4_K},
    {DType::kQ6_K, DequantQ6_K},     {DType::kQ5_0, DequantQ5_0}, {DType::kQ5_K, DequantQ5_K},
    {DType::kQ4_1, DequantQ4_1},     {DType::kQ5_1, DequantQ5_1}, {DType::kIQ4_NL, DequantIQ4_NL},
    {DType::kIQ4_XS, DequantIQ4_XS}, {DType::kQ3_K, DequantQ3_K}, {DType::kQ2_K, DequantQ2_K},
};
static_assert(OneRowPerDType(kDequantizers), "kDequantizers needs one row per DType, in its order");
constexpr bool EveryBlockTypeHasItsDequantizer() {
  for (const BlockDequantizer& d : kDequantizers) {
    if ((d.dequant != nullptr) != DTypeIsQuantized(d.type)) return false;
  }
  return true;
}
static_assert(EveryBlockTypeHasItsDequantizer());

}  // namespace

void QuantDequantRow(const Matrix& w, int64_t r, float* out) {
  const auto dequant = kDequantizers[static_cast<size_t>(w.dtype)].dequant;
  const int64_t be = DTypeBlockElems(w.dtype), bb = DTypeBlockBytes(w.dtype);
  const int64_t n_blocks = w.cols / be;
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * n_blocks * bb;
  for (int64_t i = 0; i < n_blocks; ++i) dequant(row + i * bb, out + i * be);
}

namespace {

template <DType kType>
float Int8DotT(const uint8_t* row, const int8_t* q, const float* d, const float* s, int64_t nb) {
  double acc = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qb = q + b * kQ8Block;
    if constexpr (HasHalfScales(kType)) {
      // Two halves; q6_K's and q3_K's offsets inside each half's integer sum, q2_K's minimums
      // times the half's sum of activation codes.
      float dw[16], o[16];
      HalfScales<kType>(row + (b / 8) * DTypeBlockBytes(kType), dw, o);
      int32_t dot[2] = {0, 0}, sum[2] = {0, 0};
      for (int j = 0; j < kQ8Block; ++j) {
        dot[j / 16] += (BlockCode<kType>(row, b, j) - HalfOffset(kType)) * qb[j];
        sum[j / 16] += qb[j];
      }
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * static_cast<int>(b % 8) + h;
        acc += static_cast<double>(dw[s]) * dot[h] * d[b];
        if constexpr (kType == DType::kQ2_K) acc -= static_cast<double>(o[s]) * sum[h] * d[b];
      }
    } else {
      float dw, o;
      // Scales of one block: q4_K's, q5_K's and iq4_xs's are per super-block, so ask for the
      // whole one and pick.
      if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K || kType == DType::kIQ4_XS) {
        float dws[8], os[8];
        BlockScales<kType>(row + (b / 8) * DTypeBlockBytes(kType), 8, dws, os);
        dw = dws[b % 8];
        o = os[b % 8];
      } else {
        BlockScales<kType>(row + b * DTypeBlockBytes(kType), 1, &dw, &o);
      }
      int32_t dot = 0;
      for (int j = 0; j < kQ8Block; ++j) dot += BlockCode<kType>(row, b, j) * qb[j];
      acc += static_cast<double>(dw) * d[b] * dot - static_cast<double>(o) * s[b];
    }
  }
  return static_cast<float>(acc);
}

}  // namespace

float Int8Dot(const Matrix& w, int64_t r, const int8_t* q, const float* d, const float* s) {
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * DTypeRowBytes(w.dtype, w.cols);
  const int64_t nb = w.cols / kQ8Block;
  float dot = NAN;  // no int8 path (HasInt8Path)
  VisitQuantized(
      w.dtype, [&](auto t) { dot = Int8DotT<decltype(t)::value>(row, q, d, s, nb); }, [] {});
  return dot;
}

void Int8MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& /*pool*/) {
  const int64_t nb = w.cols / kQ8Block;
  std::vector<int8_t> q(w.cols);
  std::vector<float> d(nb), s(nb);
  for (int64_t t = 0; t < n; ++t) {
    QuantizeQ8(x + t * w.cols, w.cols, q.data(), d.data(), s.data());
    for (int64_t r = 0; r < w.rows; ++r) {
      y[t * y_stride + r] =
          Int8Dot(w, r, q.data(), d.data(), s.data()) + (bias != nullptr ? bias[r] : 0.0f);
    }
  }
}

}  // namespace cachet::kernels::ref

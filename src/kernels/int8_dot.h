// Quantized weights times 8-bit activations, as llama.cpp computes them: each activation row is
// quantized to blocks of 32 int8 codes with an f32 scale, and a weight block dotted with an
// activation block is an integer dot product of codes scaled once. Every weight type is seen the
// same way, one 32-value block b at a time: unsigned codes u (0..255) with a scale dw_b and an
// offset o_b such that weight = dw_b * u - o_b. A row times activations x is then
//   sum_b dw_b * dx_b * sum_j(u_j * q_j)  -  sum_b o_b * sx_b,      sx_b = dx_b * sum_j(q_j).
//   q4_0: u = the nibble, o = 8 dw;  q5_0: u = nibble | fifth bit << 4, o = 16 dw;
//   q4_1 / q5_1: u as q4_0 / q5_0, dw = d, o = -m (the block's f16 minimum);
//   q8_0: u = code + 128, o = 128 dw;
//   q4_K: u = the nibble of sub-block b, dw = d * scale_b, o = dmin * min_b;
//   q5_K: as q4_K, u = nibble | fifth bit << 4;
//   iq4_nl: u = kIQ4Values[nibble] + 128, o = 128 dw;
//   iq4_xs: as iq4_nl, dw = d * (6-bit scale_b - 32);
//   q6_K: u = the 6-bit code, o = 32 dw; its scales are per 16 values, so a block has two halves
//         with dw_h = d * scale_h, and the offsets go into the integer sums of each half:
//         dx_b * sum_h dw_h * sum_{j in h} (u_j - 32) q_j;
//   q3_K: as q6_K, u = the 3-bit code (two bits and a third), o = 4 dw, dw_h = d * (scale_h - 32);
//   q2_K: halves too, u = the 2-bit code, dw_h = d * scale_h, and an offset o_h = dmin * min_h
//         of its own: dx_b * sum_h (dw_h * sum_{j in h} u_j q_j - o_h * sum_{j in h} q_j).
// Shared by the scalar reference (kernels/ref/quant.cc) and the SIMD kernels (kernels/cpu/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "util/dtype.h"

namespace cachet::kernels {

constexpr int64_t kQ8Block = 32;

// n_tok activation rows of `cols` values (a multiple of 32) quantized: row t's codes at
// q + t * cols, its block scales dx at d + t * nb and sums sx at s + t * nb (nb = cols / 32).
struct Q8Acts {
  int8_t* q = nullptr;
  float* d = nullptr;
  float* s = nullptr;
  int64_t cols = 0;
  int64_t nb() const { return cols / kQ8Block; }
};

// The weight types with an int8 path: every block-quantized one.
inline bool HasInt8Path(DType t) { return DTypeIsQuantized(t); }

// Calls fn(std::integral_constant<DType, t>{}) when t is block-quantized (a row of kDTypes from
// q8_0 on), else other(): how the kernels turn a matrix's type into their template argument, so
// that each is compiled for every quantized row of the table.
template <class Fn, class Other>
void VisitQuantized(DType t, Fn&& fn, Other&& other) {
  constexpr size_t kFirst = static_cast<size_t>(DType::kQ8_0);
  [&]<size_t... I>(std::index_sequence<I...>) {
    const bool quantized =
        ((static_cast<size_t>(t) == kFirst + I &&
          (fn(std::integral_constant<DType, static_cast<DType>(kFirst + I)>{}), true)) ||
         ...);
    if (!quantized) other();
  }
  (std::make_index_sequence<static_cast<size_t>(DType::kCount) - kFirst>{});
}

// iq4_nl's and iq4_xs's 16 levels (llama.cpp's kvalues_iq4nl), which their nibbles index.
inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

// The offset o = Int8Offset(t) * dw of the legacy block types (q4_0, q5_0, q8_0) and iq4_nl /
// iq4_xs.
constexpr int Int8Offset(DType t) { return t == DType::kQ4_0 ? 8 : t == DType::kQ5_0 ? 16 : 128; }

// The legacy types with an f16 minimum after the scale (o = -m): q4_1, q5_1.
constexpr bool HasBlockMin(DType t) { return t == DType::kQ4_1 || t == DType::kQ5_1; }
// Where a block (q4_K, q5_K: a super-block) keeps its fifth bits (q5_0, q5_1, q5_K) and its
// nibbles (q4_0, q5_0, q4_1, q5_1, q4_K, q5_K, iq4_nl; iq4_xs: kernels/cpu/quant_int8.cc).
constexpr int64_t FifthBitsAt(DType t) {
  return t == DType::kQ5_0 ? 2 : t == DType::kQ5_1 ? 4 : 16;
}
constexpr int64_t NibblesAt(DType t) {
  switch (t) {
    case DType::kQ5_0:
      return 6;
    case DType::kQ5_1:
      return 8;
    case DType::kQ4_1:
      return 4;
    case DType::kQ4_K:
      return 16;
    case DType::kQ5_K:
      return 48;
    default:
      return 2;  // q4_0, iq4_nl
  }
}
constexpr bool HasFifthBit(DType t) {
  return t == DType::kQ5_0 || t == DType::kQ5_1 || t == DType::kQ5_K;
}

// The types whose scales are per 16 values (each 32-value block has two halves), and the offset
// of q6_K's and q3_K's codes (o_h = HalfOffset * dw_h; q2_K has minimums instead).
constexpr bool HasHalfScales(DType t) {
  return t == DType::kQ6_K || t == DType::kQ3_K || t == DType::kQ2_K;
}
constexpr int HalfOffset(DType t) { return t == DType::kQ6_K ? 32 : t == DType::kQ3_K ? 4 : 0; }
// Where q3_K's and q2_K's 64 bytes of 2-bit codes begin (q3_K: after its 32 bytes of third bits).
constexpr int64_t TwoBitCodesAt(DType t) { return t == DType::kQ3_K ? 32 : 16; }

namespace int8_detail {

inline float LoadF16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

// Scale and min of sub-block j (0..7) of a q4_K / q5_K super-block, as llama.cpp's
// get_scale_min_k4.
inline void ScaleMinK4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 6-bit scale of sub-block j (0..7) of an iq4_xs super-block: low 4 bits from scales_l
// (byte 4 + j / 2), high 2 from scales_h (the u16 at byte 2).
inline int IQ4XSScale(const uint8_t* blk, int64_t j) {
  uint16_t h;
  std::memcpy(&h, blk + 2, 2);
  return ((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((h >> (2 * j)) & 3) << 4);
}

// The 6-bit scale s (0..15) of a q3_K super-block as stored (its value is that minus 32): low 4
// bits from byte s (s < 8: low nibble) or s - 8 (high nibble), high 2 bits from byte 8 + s % 4.
inline int Q3KScale(const uint8_t* blk, int s) {
  const uint8_t* sc = blk + 96;
  const int low = s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4;
  return low | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
}

}  // namespace int8_detail

// dw_s and o_s of the sixteen 16-value halves of a q6_K / q3_K / q2_K super-block: value j of
// half s is dw_s * u_j - o_s.
template <DType kType>
inline void HalfScales(const uint8_t* blk, float* dw, float* o) {
  using int8_detail::LoadF16;
  static_assert(HasHalfScales(kType));
  for (int s = 0; s < 16; ++s) {
    if constexpr (kType == DType::kQ6_K) {
      dw[s] =
          LoadF16(blk + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(blk + 192)[s]);
    } else if constexpr (kType == DType::kQ3_K) {
      dw[s] = LoadF16(blk + 108) * static_cast<float>(int8_detail::Q3KScale(blk, s) - 32);
    } else {
      dw[s] = LoadF16(blk + 80) * static_cast<float>(blk[s] & 0xF);
      o[s] = LoadF16(blk + 82) * static_cast<float>(blk[s] >> 4);
      continue;
    }
    o[s] = static_cast<float>(HalfOffset(kType)) * dw[s];
  }
}

// dw[b] and o[b] of every 32-value block of a weight row of nb blocks (the types with one scale
// per block: not q6_K, q3_K, q2_K).
template <DType kType>
inline void BlockScales(const uint8_t* row, int64_t nb, float* dw, float* o) {
  using int8_detail::LoadF16;
  if constexpr (kType == DType::kQ4_0 || kType == DType::kQ5_0 || kType == DType::kQ8_0 ||
                kType == DType::kIQ4_NL) {
    for (int64_t b = 0; b < nb; ++b) {
      dw[b] = LoadF16(row + b * DTypeBlockBytes(kType));
      o[b] = static_cast<float>(Int8Offset(kType)) * dw[b];
    }
  } else if constexpr (kType == DType::kIQ4_XS) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + (b / 8) * DTypeBlockBytes(kType);
      dw[b] = LoadF16(blk) * static_cast<float>(int8_detail::IQ4XSScale(blk, b % 8) - 32);
      o[b] = 128.0f * dw[b];
    }
  } else if constexpr (HasBlockMin(kType)) {
    for (int64_t b = 0; b < nb; ++b) {
      dw[b] = LoadF16(row + b * DTypeBlockBytes(kType));
      o[b] = -LoadF16(row + b * DTypeBlockBytes(kType) + 2);
    }
  } else {
    static_assert(kType == DType::kQ4_K || kType == DType::kQ5_K);
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const uint8_t* blk = row + sb * DTypeBlockBytes(kType);
      const float d = LoadF16(blk), dmin = LoadF16(blk + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        int8_detail::ScaleMinK4(j, blk + 4, &sc, &m);
        dw[sb * 8 + j] = d * static_cast<float>(sc);
        o[sb * 8 + j] = dmin * static_cast<float>(m);
      }
    }
  }
}

// The types whose 32-value blocks are 16 bytes of nibbles, low nibbles first (q4_0, q5_0, q4_1,
// q5_1, iq4_nl, and iq4_xs's sub-blocks), and block b's 16 bytes.
constexpr bool HasBlockNibbles(DType t) {
  return t == DType::kQ4_0 || t == DType::kQ5_0 || HasBlockMin(t) || t == DType::kIQ4_NL ||
         t == DType::kIQ4_XS;
}
template <DType kType>
inline const uint8_t* BlockNibbles(const uint8_t* row, int64_t b) {
  static_assert(HasBlockNibbles(kType));
  if constexpr (kType == DType::kIQ4_XS) {  // after the super-block's 8-byte header
    return row + (b / 8) * DTypeBlockBytes(kType) + 8 + 16 * (b % 8);
  } else {
    return row + b * DTypeBlockBytes(kType) + NibblesAt(kType);
  }
}

// Unsigned code j (0..31) of block b of a weight row.
template <DType kType>
inline int BlockCode(const uint8_t* row, int64_t b, int j) {
  if constexpr (HasBlockNibbles(kType)) {
    const uint8_t* q = BlockNibbles<kType>(row, b);
    const int nibble = j < 16 ? q[j] & 0xF : q[j - 16] >> 4;
    if constexpr (kType == DType::kIQ4_NL || kType == DType::kIQ4_XS) {
      return kIQ4Values[nibble] + 128;
    } else if constexpr (!HasFifthBit(kType)) {
      return nibble;
    } else {
      uint32_t qh;
      std::memcpy(&qh, row + b * DTypeBlockBytes(kType) + FifthBitsAt(kType), 4);
      return nibble | (((qh >> j) & 1) << 4);
    }
  } else if constexpr (kType == DType::kQ8_0) {
    return static_cast<int8_t>(row[b * DTypeBlockBytes(kType) + 2 + j]) + 128;
  } else if constexpr (kType == DType::kQ3_K || kType == DType::kQ2_K) {
    // Per 128 values, 32 bytes of 2-bit codes: bits 2k.. of byte j are code j of 32-value block k
    // (0..3); q3_K's third bit of code j of block b (0..7) is bit b of hmask[j].
    const uint8_t* blk = row + (b / 8) * DTypeBlockBytes(kType);
    const int k = static_cast<int>(b % 8);
    const uint8_t* qs = blk + TwoBitCodesAt(kType) + 32 * (k / 4);
    const int low = (qs[j] >> (2 * (k % 4))) & 3;
    if constexpr (kType == DType::kQ2_K) return low;
    return low | (((blk[j] >> k) & 1) << 2);
  } else if constexpr (kType == DType::kQ6_K) {
    // Per 128 values: ql's 64 bytes hold the low nibbles of 32-value blocks 0 and 1 and (high
    // nibbles) 2 and 3, qh's 32 bytes the top two bits of all four, two bits per block.
    const uint8_t* blk = row + (b / 8) * DTypeBlockBytes(kType);
    const int half = static_cast<int>(b % 8) / 4, k = static_cast<int>(b % 4);
    const uint8_t ql = blk[64 * half + 32 * (k % 2) + j];
    const uint8_t qh = blk[128 + 32 * half + j];
    return (k < 2 ? ql & 0xF : ql >> 4) | (((qh >> (2 * k)) & 3) << 4);
  } else {
    static_assert(kType == DType::kQ4_K || kType == DType::kQ5_K);
    const int64_t sb = b / 8, sub = b % 8;
    const uint8_t* blk = row + sb * DTypeBlockBytes(kType);
    const uint8_t q = blk[NibblesAt(kType) + (sub / 2) * 32 + j];
    const int nibble = sub % 2 == 0 ? q & 0xF : q >> 4;
    if constexpr (!HasFifthBit(kType)) return nibble;
    return nibble | (((blk[FifthBitsAt(kType) + j] >> sub) & 1) << 4);
  }
}

}  // namespace cachet::kernels

// Element types of weights and activations, and scalar conversions for reference code.
#pragma once

#include <cstdint>
#include <cstring>

#include "cachet/dtype.h"

namespace cachet {

inline bool DTypeIsQuantized(DType t) { return t >= DType::kQ8_0; }
// Bytes of one element: f32/f16/bf16 only.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
// Elements per block (1 for the plain float types) and bytes per block.
constexpr int64_t DTypeBlockElems(DType t) {
  switch (t) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ5_0:
    case DType::kQ4_1:
    case DType::kQ5_1:
    case DType::kIQ4_NL:
      return 32;
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
    case DType::kIQ4_XS:
      return 256;
    default:
      return 1;
  }
}
constexpr int64_t DTypeBlockBytes(DType t) {
  switch (t) {
    case DType::kQ8_0:
      return 34;  // f16 scale + 32 x int8
    case DType::kQ4_0:
      return 18;  // f16 scale + 16 bytes of nibbles
    case DType::kQ5_0:
      return 22;  // f16 scale + 32 fifth bits + 16 bytes of nibbles
    case DType::kQ4_1:
      return 20;  // f16 scale, f16 minimum + 16 bytes of nibbles
    case DType::kQ5_1:
      return 24;  // f16 scale, f16 minimum + 32 fifth bits + 16 bytes of nibbles
    case DType::kIQ4_NL:
      return 18;  // f16 scale + 16 bytes of nibbles indexing a table of 16 values
    case DType::kIQ4_XS:
      return 136;  // f16 d, 8 6-bit sub-block scales (2 + 4 bytes), 128 bytes of such nibbles
    case DType::kQ4_K:
      return 144;  // f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    case DType::kQ5_K:
      return 176;  // q4_K's, with 32 bytes of fifth bits before the nibbles
    case DType::kQ6_K:
      return 210;  // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d
    default:
      return static_cast<int64_t>(DTypeSize(t));
  }
}
// Bytes of a row of `cols` elements; -1 when cols is not a multiple of the block size.
inline int64_t DTypeRowBytes(DType t, int64_t cols) {
  const int64_t be = DTypeBlockElems(t);
  if (cols % be != 0) return -1;
  return cols / be * DTypeBlockBytes(t);
}

inline float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as PyTorch does.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float f);  // round to nearest even; defined in dtype.cc
// Rounded toward -inf / +inf (bounds that stay bounds, as Quest's f16 page bounds).
uint16_t F32ToF16Down(float f);
uint16_t F32ToF16Up(float f);

// Reads element i of a row of the given type as f32.
inline float LoadAsF32(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(data)[i]);
    default:  // quantized types have no per-element access: use kernels::DequantRow
      break;
  }
  return 0.0f;
}

}  // namespace cachet

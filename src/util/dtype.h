// Element types of weights and activations, and scalar conversions for reference code.
#pragma once

#include <cstdint>
#include <cstring>

namespace cachet {

enum class DType : uint8_t { kF32, kF16, kBF16 };

inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
inline const char* DTypeName(DType t) {
  return t == DType::kF32 ? "f32" : t == DType::kF16 ? "f16" : "bf16";
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

// Reads element i of a row of the given type as f32.
inline float LoadAsF32(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0f;
}

}  // namespace cachet

// Element types of weights and activations, and scalar conversions for reference code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>

#include "cachet/dtype.h"

namespace cachet {

constexpr bool DTypeIsQuantized(DType t) { return t >= DType::kQ8_0; }
// Bytes of one element: f32/f16/bf16 only.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
// One row per type, in DType's order: what every layer needs to know of a type. Adding a weight
// type is one row here (the compiler checks that every type has its row), its kernels
// (kernels/ref/quant.cc's layouts) and its cases in the kernels' dispatch.
struct DTypeInfo {
  DType type;
  const char* name;
  int64_t block_elems;   // elements per block: 1 for the float types
  int64_t block_bytes;   // bytes per block
  uint32_t ggml_type;    // its GGUF tensor type id
  uint32_t file_type;    // GGUF general.file_type of a file all in this type (llama_ftype)
  uint32_t file_type_m;  // ... of llama.cpp's mix with this base type (_M, or Q2_K; 0: none)
};
inline constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "f32", 1, 4, 0, 0, 0},
    {DType::kF16, "f16", 1, 2, 1, 1, 0},
    {DType::kBF16, "bf16", 1, 2, 30, 32, 0},
    {DType::kQ8_0, "q8_0", 32, 34, 8, 7, 0},        // f16 scale + 32 x int8
    {DType::kQ4_0, "q4_0", 32, 18, 2, 2, 0},        // f16 scale + 16 bytes of nibbles
    {DType::kQ4_K, "q4_k", 256, 144, 12, 14, 15},   // f16 d, f16 dmin, 12 bytes of 6-bit
                                                    // scales/mins, 128 bytes of nibbles
    {DType::kQ6_K, "q6_k", 256, 210, 14, 18, 0},    // 128 bytes low nibbles, 64 bytes high 2
                                                    // bits, 16 int8 scales, f16 d
    {DType::kQ5_0, "q5_0", 32, 22, 6, 8, 0},        // f16 scale + 32 fifth bits + 16 bytes of
                                                    // nibbles
    {DType::kQ5_K, "q5_k", 256, 176, 13, 16, 17},   // q4_K's, with 32 bytes of fifth bits before
                                                    // the nibbles
    {DType::kQ4_1, "q4_1", 32, 20, 3, 3, 0},        // f16 scale, f16 minimum + 16 bytes of nibbles
    {DType::kQ5_1, "q5_1", 32, 24, 7, 9, 0},        // f16 scale, f16 minimum + 32 fifth bits + 16
                                                    // bytes of nibbles
    {DType::kIQ4_NL, "iq4_nl", 32, 18, 20, 25, 0},  // f16 scale + 16 bytes of nibbles indexing a
                                                    // table of 16 values
    {DType::kIQ4_XS, "iq4_xs", 256, 136, 23, 30, 0},  // f16 d, 8 6-bit sub-block scales (2 + 4
                                                      // bytes), 128 bytes of such nibbles
    {DType::kQ3_K, "q3_k", 256, 110, 11, 11, 12},     // 32 bytes of third bits, 64 bytes of 2-bit
                                                      // codes, 12 bytes of 6-bit scales, f16 d
    {DType::kQ2_K, "q2_k", 256, 84, 10, 10, 10},      // 16 bytes of 4-bit scales/mins, 64 bytes of
                                                      // 2-bit codes, f16 d, f16 dmin
};
// A table with one row per DType (a `type` member), in DType's order: what the tables keyed by
// type (this one, the reference kernels' block quantizers) static_assert.
template <typename Row, size_t N>
constexpr bool OneRowPerDType(const Row (&rows)[N]) {
  if (N != static_cast<size_t>(DType::kCount)) return false;
  for (size_t i = 0; i < N; ++i) {
    if (static_cast<size_t>(rows[i].type) != i) return false;
  }
  return true;
}
static_assert(OneRowPerDType(kDTypes), "kDTypes needs one row per DType, in DType's order");
constexpr const DTypeInfo& Info(DType t) { return kDTypes[static_cast<size_t>(t)]; }

constexpr int64_t DTypeBlockElems(DType t) { return Info(t).block_elems; }
constexpr int64_t DTypeBlockBytes(DType t) { return Info(t).block_bytes; }
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

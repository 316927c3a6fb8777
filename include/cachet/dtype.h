// Element types of model weights (src/util/dtype.h has their block layouts and conversions).
#pragma once

#include <cstdint>

namespace cachet {

// kQ8_0 .. kIQ4_XS are GGUF (GGML) block-quantized weight types: a row of a matrix is a sequence of
// blocks of DTypeBlockElems(t) elements, DTypeBlockBytes(t) bytes each (layouts in
// kernels/ref/quant.cc). They have no per-element size: use DTypeRowBytes, never DTypeSize.
enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kQ8_0,
  kQ4_0,
  kQ4_K,
  kQ6_K,
  kQ5_0,
  kQ5_K,
  kQ4_1,
  kQ5_1,
  kIQ4_NL,
  kIQ4_XS
};

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kQ8_0:
      return "q8_0";
    case DType::kQ4_0:
      return "q4_0";
    case DType::kQ4_K:
      return "q4_k";
    case DType::kQ6_K:
      return "q6_k";
    case DType::kQ5_0:
      return "q5_0";
    case DType::kQ5_K:
      return "q5_k";
    case DType::kQ4_1:
      return "q4_1";
    case DType::kQ5_1:
      return "q5_1";
    case DType::kIQ4_NL:
      return "iq4_nl";
    case DType::kIQ4_XS:
      return "iq4_xs";
  }
  return "?";
}

}  // namespace cachet

// Element types of model weights (src/util/dtype.h has their block layouts and conversions).
#pragma once

#include <cstdint>

namespace cachet {

// kQ8_0 and the types after it are GGUF (GGML) block-quantized weight types: a row of a matrix is a
// sequence of blocks of DTypeBlockElems(t) elements, DTypeBlockBytes(t) bytes each (layouts in
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
  kIQ4_XS,
  kQ3_K,
  kQ2_K,
  kCount  // not a type: how many there are (src/util/dtype.h has one row for each)
};

const char* DTypeName(DType t);  // "q4_k", ...: the names `cachet convert --type` takes

}  // namespace cachet

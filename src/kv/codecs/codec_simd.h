// Highway versions of the codec operations attention runs per page (dynamic dispatch; the scalar
// codec.cc functions are their reference, compared in tests/codec_test.cc).
#pragma once

#include <cstdint>

#include "kv/codecs/codec.h"

namespace cachet::codecs::simd {

// Same contract as codecs::DecodeStored.
void DecodeStored(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows);
float Dot(const float* a, const float* b, int n);
void Axpy(float a, const float* x, float* y, int n);  // y += a * x
void Scale(float s, float* x, int n);                 // x *= s

}  // namespace cachet::codecs::simd

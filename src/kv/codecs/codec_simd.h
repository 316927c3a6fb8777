// Highway decoding of codec pages the attention kernel does not read in place (dynamic dispatch;
// codecs::DecodeStored is its reference, compared in tests/codec_test.cc).
#pragma once

#include <cstdint>

#include "kv/codecs/codec.h"

namespace cachet::codecs::simd {

// Same contract as codecs::DecodeStored.
void DecodeStored(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                  const CalPlan* plan = nullptr);

}  // namespace cachet::codecs::simd

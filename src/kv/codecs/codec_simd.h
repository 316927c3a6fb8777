// Highway decoding of codec pages the attention kernel does not read in place (dynamic dispatch;
// codecs::DecodeStored is its reference, compared in tests/codec_test.cc).
#pragma once

#include <cstdint>

#include "kv/codecs/codec.h"

namespace cachet::codecs {
class RopeTable;
}  // namespace cachet::codecs

namespace cachet::codecs::simd {

// Same contract as codecs::DecodeStored; rows stored before RoPE (StoredBeforeRope) are then
// turned by the angles of positions[t] when rope is given, as RopeTable::Turn turns them.
void DecodeStored(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                  const CalPlan* plan = nullptr, const RopeTable* rope = nullptr,
                  const int32_t* positions = nullptr);

}  // namespace cachet::codecs::simd

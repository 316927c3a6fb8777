// Attention scores against block-quantized keys (q4_0 / q8_0 pages), as llama.cpp computes them
// for a quantized K cache: each query row is quantized to 8-bit blocks of 32 (QuantizeQ8), and a
// key block times a query block is an integer dot product of codes, scaled once:
//   q . k = sum_b dk_b * (dq_b * (sum_j u_j q_j - o * sum_j q_j))
// with u the key's unsigned codes (int8_dot.h's BlockCode: q4_0 the nibble, o = 8; q8_0 the code
// + 128, o = 128). The integer sums are exact, so every path that finishes them with
// BlockKeyScore's float steps, in its order, gives the same bits: a decode row read fused, a tile
// of rows, the reference.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/int8_dot.h"

namespace cachet::kernels {

// A query row quantized for block keys: head_dim codes, and per block of 32 the scale d and the
// integer sum of the codes.
struct QueryQ8 {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int32_t* sum = nullptr;
};

// The key types scored this way.
inline bool IsBlockKeyType(DType t) { return t == DType::kQ4_0 || t == DType::kQ8_0; }

// o of a block key type.
inline int32_t BlockKeyOffset(DType t) { return t == DType::kQ4_0 ? 8 : 128; }

// One score from its blocks' integer dots ints[b] = sum_j u_j q_j - o * sum_j q_j, the query's
// block scales dq and the key's dk: t_b = float(ints[b]) * dq_b; acc = t_0 * dk_0, then
// acc = fma(t_b, dk_b, acc); times scale. SIMD paths take these steps lane-wise.
inline float BlockKeyScore(const int32_t* ints, const float* dq, const float* dk, int nb,
                           float scale) {
  float acc = (static_cast<float>(ints[0]) * dq[0]) * dk[0];
  for (int b = 1; b < nb; ++b) acc = std::fma(static_cast<float>(ints[b]) * dq[b], dk[b], acc);
  return acc * scale;
}

}  // namespace cachet::kernels

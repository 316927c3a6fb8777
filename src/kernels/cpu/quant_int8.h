// The int8 path's prefill (quant_int8_prefill.cc), which Int8MatMul (quant_int8.cc) takes for
// more than kInt8MaxDecodeTokens tokens, and what both files share.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace cachet::kernels::cpu {

// Work under which a call stays on the calling thread.
constexpr int64_t kInt8MinParallelWeights = 1 << 16;

// y = x w^T + bias for n tokens by prefill's 16-row tiles; Int8MatMul's contract.
void Int8Prefill(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                 int64_t y_stride, ThreadPool& pool);

}  // namespace cachet::kernels::cpu

// How the next token is chosen (src/runtime/sampler.h implements it).
#pragma once

#include <cstdint>

namespace cachet {

struct SamplingParams {
  float temperature = 0.8f;     // <= 0: greedy
  int top_k = 40;               // <= 0: off
  float top_p = 0.95f;          // >= 1: off
  float min_p = 0.05f;          // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off (llama.cpp convention: logit / p if > 0 else * p)
  int repeat_last_n = 64;
  uint64_t seed = 0xcac4e7;
};

}  // namespace cachet

// Token sampling: logit bias, repetition / presence / frequency penalties, then greedy or
// temperature, top-k, top-p, min-p, seeded.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "cachet/sampling.h"

namespace cachet {

class Sampler {
 public:
  Sampler(const SamplingParams& params, int vocab_size);
  // Picks the next token from logits (modified in place by the bias and the penalties). history
  // holds the tokens so far (prompt and generated) for the penalties.
  int32_t Sample(std::span<float> logits, std::span<const int32_t> history);
  const SamplingParams& params() const { return p_; }

 private:
  struct Candidate {
    float logit;
    int32_t id;
  };
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<Candidate> cand_;  // reused: no allocation per token
  std::vector<float> probs_;
  std::vector<int32_t> count_;    // per vocabulary token: occurrences in the penalty window
  std::vector<int32_t> touched_;  // the window's distinct tokens, whose counts are reset after
};

int32_t ArgMax(std::span<const float> logits);

}  // namespace cachet

// Token sampling: logit bias, repetition / presence / frequency penalties, then greedy or
// temperature, top-k, top-p, min-p, seeded.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "cachet/sampling.h"
#include "runtime/json_constraint.h"

namespace cachet {

class Sampler {
 public:
  // tokenizer: the tokens' text, for params.format's constraint (needed for kJsonObject).
  Sampler(const SamplingParams& params, int vocab_size, const Tokenizer* tokenizer = nullptr);
  // Picks the next token from logits (modified in place by the bias, the penalties and the
  // format's mask). history holds the tokens so far (prompt and generated) for the penalties.
  // Under a format, the token drawn as usual is kept when it fits; otherwise every token that
  // does not fit is masked and the draw repeated (the masked distribution, drawn lazily as
  // llama.cpp's grammars are), and the text it adds is taken as generated.
  int32_t Sample(std::span<float> logits, std::span<const int32_t> history);
  const SamplingParams& params() const { return p_; }
  // The format's text is complete (a JSON object closed); true without a format.
  bool complete() const { return json_ == nullptr || json_->complete(); }

 private:
  void BiasAndPenalize(std::span<float> logits, std::span<const int32_t> history);
  int32_t Choose(std::span<float> logits);

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
  std::unique_ptr<JsonConstraint> json_;
};

int32_t ArgMax(std::span<const float> logits);

}  // namespace cachet

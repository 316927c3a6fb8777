#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace cachet {

int32_t ArgMax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Sampler::Sampler(const SamplingParams& params, int vocab_size, const Tokenizer* tokenizer)
    : p_(params), rng_(params.seed), count_(vocab_size, 0) {
  cand_.reserve(vocab_size);
  probs_.reserve(vocab_size);
  if (p_.format == OutputFormat::kJsonObject) {
    if (tokenizer == nullptr) {
      std::fprintf(stderr, "cachet: internal error: a JSON sampler without the tokenizer\n");
      std::abort();
    }
    json_ = std::make_unique<JsonConstraint>(*tokenizer);
  }
}

int32_t Sampler::Sample(std::span<float> logits, std::span<const int32_t> history) {
  BiasAndPenalize(logits, history);
  int32_t token = Choose(logits);
  if (json_ != nullptr) {
    if (!json_->Allows(token)) {
      json_->Mask(logits);
      token = Choose(logits);
    }
    json_->Accept(token);
  }
  return token;
}

void Sampler::BiasAndPenalize(std::span<float> logits, std::span<const int32_t> history) {
  const auto vocab = static_cast<int32_t>(logits.size());
  for (const LogitBias& b : p_.logit_bias) {
    if (b.token >= 0 && b.token < vocab) logits[b.token] += b.bias;
  }
  const bool penalties =
      p_.repeat_penalty != 1.0f || p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f;
  if (penalties && p_.repeat_last_n != 0) {
    const size_t n =
        p_.repeat_last_n < 0 ? history.size() : std::min<size_t>(history.size(), p_.repeat_last_n);
    // Counted in one pass (a whole 4k-token context was a quadratic scan per token before), then
    // each distinct token penalized once: the repeat penalty however often it repeats.
    touched_.clear();
    for (size_t i = history.size() - n; i < history.size(); ++i) {
      const int32_t t = history[i];
      if (t < 0 || t >= vocab || t >= static_cast<int32_t>(count_.size())) continue;
      if (count_[t]++ == 0) touched_.push_back(t);
    }
    for (const int32_t t : touched_) {
      float& l = logits[t];
      if (p_.repeat_penalty != 1.0f) l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
      l -= p_.frequency_penalty * static_cast<float>(count_[t]) + p_.presence_penalty;
      count_[t] = 0;
    }
  }
}

int32_t Sampler::Choose(std::span<float> logits) {
  if (p_.temperature <= 0.0f) return ArgMax(logits);

  // Only what the filters keep is ever sorted: a vocabulary of 150k tokens sorted per token per
  // sequence would cost a batched decode step milliseconds.
  cand_.clear();
  for (size_t i = 0; i < logits.size(); ++i) {
    cand_.push_back({logits[i] / p_.temperature, static_cast<int32_t>(i)});
  }
  auto by_logit = [](const Candidate& a, const Candidate& b) { return a.logit > b.logit; };
  size_t k = cand_.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < k) {
    k = p_.top_k;
    std::nth_element(cand_.begin(), cand_.begin() + (k - 1), cand_.end(), by_logit);
    cand_.resize(k);
  }
  // Softmax over the top k (unnormalized: exp(logit - max), and their sum).
  float max = cand_[0].logit;
  for (const Candidate& c : cand_) max = std::max(max, c.logit);
  probs_.resize(k);
  double sum = 0.0;
  for (size_t i = 0; i < k; ++i) sum += std::exp(static_cast<double>(cand_[i].logit - max));
  // min_p: tokens at least min_p times as likely as the most likely one.
  size_t n = k;
  if (p_.min_p > 0.0f) {
    const float floor = max + std::log(p_.min_p);
    n = std::partition(cand_.begin(), cand_.end(),
                       [&](const Candidate& c) { return c.logit >= floor; }) -
        cand_.begin();
    if (n == 0) {  // min_p > 1 keeps nothing: the most likely token stays
      auto below = [](const Candidate& a, const Candidate& b) { return a.logit < b.logit; };
      std::iter_swap(cand_.begin(), std::max_element(cand_.begin(), cand_.end(), below));
      n = 1;
    }
  }
  // top_p: the most likely tokens whose probabilities (over the top k) reach top_p, found by
  // sorting a growing prefix rather than everything.
  if (p_.top_p < 1.0f) {
    for (size_t m = std::min<size_t>(n, 64);; m = std::min(n, 4 * m)) {
      std::partial_sort(cand_.begin(), cand_.begin() + m, cand_.begin() + n, by_logit);
      double cum = 0.0;
      size_t keep = 0;
      while (keep < m && (keep == 0 || cum < p_.top_p)) {  // the most likely token at least
        cum += std::exp(static_cast<double>(cand_[keep++].logit - max)) / sum;
      }
      if (cum >= p_.top_p || m == n) {
        n = keep;
        break;
      }
    }
  }
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    probs_[i] = static_cast<float>(std::exp(static_cast<double>(cand_[i].logit - max)) / sum);
    total += probs_[i];
  }
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  for (size_t i = 0; i < n; ++i) {
    r -= probs_[i];
    if (r <= 0.0) return cand_[i].id;
  }
  return cand_[n - 1].id;
}

}  // namespace cachet

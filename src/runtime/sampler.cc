#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>

namespace cachet {

int32_t ArgMax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Sampler::Sampler(const SamplingParams& params, int vocab_size) : p_(params), rng_(params.seed) {
  cand_.reserve(vocab_size);
  probs_.reserve(vocab_size);
}

int32_t Sampler::Sample(std::span<float> logits, std::span<const int32_t> history) {
  if (p_.repeat_penalty != 1.0f && p_.repeat_last_n != 0) {
    const size_t n =
        p_.repeat_last_n < 0 ? history.size() : std::min<size_t>(history.size(), p_.repeat_last_n);
    // Each distinct token is penalized once, however often it repeats.
    for (size_t i = history.size() - n; i < history.size(); ++i) {
      const int32_t t = history[i];
      if (t < 0 || t >= static_cast<int32_t>(logits.size())) continue;
      bool seen = false;
      for (size_t j = history.size() - n; j < i && !seen; ++j) seen = history[j] == t;
      if (seen) continue;
      float& l = logits[t];
      l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
    }
  }
  if (p_.temperature <= 0.0f) return ArgMax(logits);

  cand_.clear();
  for (size_t i = 0; i < logits.size(); ++i) {
    cand_.push_back({logits[i] / p_.temperature, static_cast<int32_t>(i)});
  }
  auto by_logit = [](const Candidate& a, const Candidate& b) { return a.logit > b.logit; };
  size_t k = cand_.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < k) {
    k = p_.top_k;
    std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), by_logit);
    cand_.resize(k);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  // Softmax over the survivors (sorted, so cand_[0] holds the max).
  probs_.resize(k);
  double sum = 0.0;
  for (size_t i = 0; i < k; ++i) {
    probs_[i] = std::exp(cand_[i].logit - cand_[0].logit);
    sum += probs_[i];
  }
  for (size_t i = 0; i < k; ++i) probs_[i] = static_cast<float>(probs_[i] / sum);
  if (p_.min_p > 0.0f) {
    const float floor = p_.min_p * probs_[0];
    size_t keep = 1;
    while (keep < k && probs_[keep] >= floor) ++keep;
    k = keep;
  }
  if (p_.top_p < 1.0f) {
    double cum = 0.0;
    size_t keep = 0;
    while (keep < k) {
      cum += probs_[keep++];
      if (cum >= p_.top_p) break;
    }
    k = keep;
  }
  double total = 0.0;
  for (size_t i = 0; i < k; ++i) total += probs_[i];
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  for (size_t i = 0; i < k; ++i) {
    r -= probs_[i];
    if (r <= 0.0) return cand_[i].id;
  }
  return cand_[k - 1].id;
}

}  // namespace cachet

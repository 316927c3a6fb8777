// Fidelity of next-token distributions against a reference configuration, as llama.cpp's
// --kl-divergence reports it: KL(reference || tested) per scored position, its mean and 99th
// percentile, top-1 agreement, and the perplexity of both on the actual next tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace cachet::eval {

struct KlSummary {
  int64_t positions = 0;
  double mean_kl = 0, p99_kl = 0, max_kl = 0;
  double top1_agree = 0;  // fraction of positions where both argmaxes are the same token
  double ppl_ref = 0, ppl = 0;
};

class KlAccumulator {
 public:
  // One position: both rows of logits (vocab wide) and the token that actually came next.
  // Identical rows give exactly 0 (the difference of equal log-probabilities).
  void Add(std::span<const float> ref_logits, std::span<const float> logits, int32_t next_token);
  KlSummary Summary() const;

 private:
  std::vector<double> kl_;
  std::vector<double> ref_logp_, logp_;  // scratch, reused across positions
  double nll_ref_ = 0, nll_ = 0;
  int64_t top1_same_ = 0;
};

// Log-softmax of logits into out (resized to match), in double.
void LogSoftmax(std::span<const float> logits, std::vector<double>* out);

}  // namespace cachet::eval

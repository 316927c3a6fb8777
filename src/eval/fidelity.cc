#include "eval/fidelity.h"

#include <algorithm>
#include <cmath>

namespace cachet::eval {

void LogSoftmax(std::span<const float> logits, std::vector<double>* out) {
  out->resize(logits.size());
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - mx);
  const double log_z = mx + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) (*out)[i] = double(logits[i]) - log_z;
}

void KlAccumulator::Add(std::span<const float> ref_logits, std::span<const float> logits,
                        int32_t next_token) {
  LogSoftmax(ref_logits, &ref_logp_);
  LogSoftmax(logits, &logp_);
  double kl = 0;
  for (size_t i = 0; i < ref_logp_.size(); ++i) {
    kl += std::exp(ref_logp_[i]) * (ref_logp_[i] - logp_[i]);
  }
  kl_.push_back(kl);
  nll_ref_ -= ref_logp_[next_token];
  nll_ -= logp_[next_token];
  const auto ref_top = std::max_element(ref_logits.begin(), ref_logits.end()) - ref_logits.begin();
  const auto top = std::max_element(logits.begin(), logits.end()) - logits.begin();
  top1_same_ += ref_top == top;
}

KlSummary KlAccumulator::Summary() const {
  KlSummary s;
  s.positions = static_cast<int64_t>(kl_.size());
  if (kl_.empty()) return s;
  std::vector<double> sorted = kl_;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0;
  for (double k : sorted) sum += k;
  const double n = static_cast<double>(sorted.size());
  s.mean_kl = sum / n;
  // Nearest rank: the smallest value with at least 99% of the positions at or below it.
  s.p99_kl = sorted[static_cast<size_t>(std::ceil(0.99 * n)) - 1];
  s.max_kl = sorted.back();
  s.top1_agree = double(top1_same_) / n;
  s.ppl_ref = std::exp(nll_ref_ / n);
  s.ppl = std::exp(nll_ / n);
  return s;
}

}  // namespace cachet::eval

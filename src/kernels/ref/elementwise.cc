// Reference RmsNorm, RopeRotateHalf, SiluMul, the Quest bounds and selection: plain scalar loops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "util/dtype.h"

namespace cachet::kernels::ref {

void RmsNorm(const float* x, const float* weight, int64_t dim, float eps, float* y) {
  float sum_sq = 0.0f;
  for (int64_t i = 0; i < dim; ++i) sum_sq += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * inv_rms * weight[i];
}

void RopeRotateHalf(float* x, int n_heads, int head_dim, const float* cos, const float* sin) {
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* xh = x + static_cast<int64_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const float x0 = xh[i];
      const float x1 = xh[i + half];
      xh[i] = x0 * cos[i] - x1 * sin[i];
      xh[i + half] = x1 * cos[i] + x0 * sin[i];
    }
  }
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

uint64_t SumWords(const uint64_t* x, int64_t n, bool /*prefetch*/) {
  uint64_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

void KeyBounds(const float* keys, int n, int head_dim, float* lo, float* hi) {
  std::copy(keys, keys + head_dim, lo);
  std::copy(keys, keys + head_dim, hi);
  for (int j = 1; j < n; ++j) {
    for (int i = 0; i < head_dim; ++i) {
      lo[i] = std::min(lo[i], keys[int64_t(j) * head_dim + i]);
      hi[i] = std::max(hi[i], keys[int64_t(j) * head_dim + i]);
    }
  }
}

void PageBoundScores(const float* q, int n_heads, int head_dim, const uint16_t* bounds, int n_pages,
                     float* out) {
  for (int p = 0; p < n_pages; ++p) {
    const uint16_t* lo = bounds + int64_t(p) * 2 * head_dim;
    const uint16_t* hi = lo + head_dim;
    float best = -std::numeric_limits<float>::infinity();
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + int64_t(h) * head_dim;
      float s = 0;
      for (int i = 0; i < head_dim; ++i) {
        s += std::max(qh[i] * F16ToF32(lo[i]), qh[i] * F16ToF32(hi[i]));
      }
      best = std::max(best, s);
    }
    out[p] = best;
  }
}

void TopK(const float* x, int n, int k, int32_t* out) {
  std::vector<std::pair<float, int32_t>> v(n);
  for (int i = 0; i < n; ++i) v[i] = {x[i], i};
  std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (int i = 0; i < k; ++i) out[i] = v[i].second;
  std::sort(out, out + k);
}

}  // namespace cachet::kernels::ref

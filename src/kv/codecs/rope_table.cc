#include "kv/codecs/rope_table.h"

#include <cmath>

namespace cachet::codecs {
namespace {

void Angles(const std::vector<float>& inv_freq, int32_t pos, float* cs) {
  const size_t half = inv_freq.size();
  for (size_t j = 0; j < half; ++j) {
    const float angle = static_cast<float>(pos) * inv_freq[j];
    cs[j] = static_cast<float>(std::cos(static_cast<double>(angle)));
    cs[half + j] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

}  // namespace

RopeTable::RopeTable(std::vector<float> inv_freq, int n_positions)
    : inv_freq_(std::move(inv_freq)), n_positions_(n_positions) {
  const size_t hd = 2 * inv_freq_.size();
  cs_.resize(size_t(n_positions) * hd);
  for (int p = 0; p < n_positions; ++p) Angles(inv_freq_, p, cs_.data() + size_t(p) * hd);
}

void RopeTable::Turn(float* rows, int n, int dim, const int32_t* positions, bool back) const {
  const int half = dim / 2;
  float own[1024];
  for (int t = 0; t < n; ++t) {
    const int32_t pos = positions[t];
    const float* cs;
    if (pos >= 0 && pos < n_positions_) {
      cs = cs_.data() + size_t(pos) * dim;
    } else {
      Angles(inv_freq_, pos, own);
      cs = own;
    }
    const float sign = back ? -1.0f : 1.0f;
    float* x = rows + size_t(t) * dim;
    for (int j = 0; j < half; ++j) {
      const float c = cs[j], s = sign * cs[half + j];
      const float a = x[j], b = x[half + j];
      x[j] = a * c - b * s;
      x[half + j] = b * c + a * s;
    }
  }
}

}  // namespace cachet::codecs

#include "kv/codecs/rope_table.h"

#include <algorithm>

#include "kernels/kernels.h"

namespace cachet::codecs {

RopeTable::RopeTable(std::vector<float> inv_freq, int n_positions)
    : inv_freq_(std::move(inv_freq)), n_positions_(n_positions) {
  const int half = static_cast<int>(inv_freq_.size());
  cs_.resize(size_t(n_positions) * 2 * half);
  for (int p = 0; p < n_positions; ++p) {
    kernels::RopeAngles(inv_freq_.data(), half, p, cs_.data() + size_t(p) * 2 * half);
  }
}

const float* RopeTable::Made(int32_t pos, float* own) const {
  kernels::RopeAngles(inv_freq_.data(), static_cast<int>(inv_freq_.size()), pos, own);
  return own;
}

void RopeTable::Turn(float* rows, int n, int dim, const int32_t* positions, bool back) const {
  const int half = dim / 2;
  float own[1024];  // the angles of a position past the table; back: the sines negated
  for (int t = 0; t < n; ++t) {
    const float* cs = Angles(positions[t], own);
    if (back) {  // the inverse rotation: the angle negated
      if (cs != own) std::copy_n(cs, half, own);
      for (int j = 0; j < half; ++j) own[half + j] = -cs[half + j];
      cs = own;
    }
    kernels::RopeRotateHalf(rows + size_t(t) * dim, 1, dim, cs, cs + half);
  }
}

}  // namespace cachet::codecs

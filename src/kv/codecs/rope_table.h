// The model's RoPE, as codecs that store keys before RoPE (kvq) need it: rows turned back by their
// positions' angles before they are coded and forward once decoded. Angles as the forward pass
// makes them (f32(position) * inv_freq, then cos and sin in double), tabled for the positions
// below n_positions (others computed as met).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cachet::codecs {

class RopeTable {
 public:
  RopeTable(std::vector<float> inv_freq, int n_positions);
  // Rotate-half RoPE of n rows of dim (2 * inv_freq.size()) values at positions[t]; back: the
  // inverse rotation.
  void Turn(float* rows, int n, int dim, const int32_t* positions, bool back) const;
  // A position's angles, cos half then sin half: the table's row, or made in own (dim floats).
  const float* Angles(int32_t pos, float* own) const {
    if (pos >= 0 && pos < n_positions_) return cs_.data() + size_t(pos) * 2 * inv_freq_.size();
    return Made(pos, own);
  }

 private:
  const float* Made(int32_t pos, float* own) const;
  std::vector<float> inv_freq_;
  std::vector<float> cs_;  // [position][cos half, sin half]
  int n_positions_;
};

}  // namespace cachet::codecs

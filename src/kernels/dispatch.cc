#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "kernels/kernels.h"

namespace cachet::kernels {

bool UseReferenceKernels() {
  static const bool use_ref = [] {
    const char* v = std::getenv("CACHET_REF_KERNELS");
    return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
  }();
  return use_ref;
}

void RopeAngles(const float* inv_freq, int half, int32_t position, float* cos_sin) {
  for (int j = 0; j < half; ++j) {
    const float angle = static_cast<float>(position) * inv_freq[j];
    cos_sin[j] = static_cast<float>(std::cos(static_cast<double>(angle)));
    cos_sin[half + j] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void MergeAttnParts(const float* parts_out, const float* row_max, const float* row_sum, int n_parts,
                    int head_dim, const AttnBatch& b) {
  const int n_rows = b.n_tok * b.n_heads;
  for (int r = 0; r < n_rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < n_parts; ++p) {
      if (row_sum[p * n_rows + r] > 0.0f) m = std::max(m, row_max[p * n_rows + r]);
    }
    float* out = b.out + (r / b.n_heads) * b.out_stride + int64_t{r % b.n_heads} * head_dim;
    std::fill(out, out + head_dim, 0.0f);
    float total = 0.0f;
    for (int p = 0; p < n_parts; ++p) {
      const float sum = row_sum[p * n_rows + r];
      if (!(sum > 0.0f)) continue;
      const float w = sum * std::exp(row_max[p * n_rows + r] - m);
      const float* part = parts_out + (int64_t{p} * n_rows + r) * head_dim;
      for (int d = 0; d < head_dim; ++d) out[d] += w * part[d];
      total += w;
    }
    if (total > 0.0f) {
      const float inv = 1.0f / total;
      for (int d = 0; d < head_dim; ++d) out[d] *= inv;
    }
  }
}

}  // namespace cachet::kernels

#include <cmath>
#include <cstdlib>
#include <cstring>

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

}  // namespace cachet::kernels

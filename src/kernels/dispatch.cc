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

}  // namespace cachet::kernels

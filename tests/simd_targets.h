// The SIMD targets a kernel test runs cpu:: kernels on, one at a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hwy/targets.h"

namespace cachet::testing {

// The SIMD targets the cpu:: kernels are compiled for that this CPU supports, best first. Each
// cpu:: check runs once per target.
inline std::vector<int64_t> KernelTargets() {
  std::vector<int64_t> targets;
  const int64_t supported = hwy::SupportedTargets();
  for (int64_t t : {int64_t{HWY_AVX3}, int64_t{HWY_AVX2}, int64_t{HWY_SSE4}}) {
    if (supported & t) targets.push_back(t);
  }
  if (targets.empty()) targets.push_back(0);  // whatever dispatch picks
  return targets;
}

// Makes the cpu:: kernels dispatch to one target while in scope.
class ScopedTarget {
 public:
  explicit ScopedTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~ScopedTarget() { hwy::SetSupportedTargetsForTest(0); }
  ScopedTarget(const ScopedTarget&) = delete;
  ScopedTarget& operator=(const ScopedTarget&) = delete;
};

inline std::string TargetString(int64_t target) {
  return std::string(" target=") + (target == 0 ? "default" : hwy::TargetName(target));
}

}  // namespace cachet::testing

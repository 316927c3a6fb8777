// Wall-clock intervals as the engine reports them (milliseconds, steady clock).
#pragma once

#include <chrono>

namespace cachet {

inline double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace cachet

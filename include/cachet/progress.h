// A progress bar with ETA on stderr, for long work (bench, eval sweeps). Redraws in place on a
// terminal; elsewhere prints a line at most every few seconds, so logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace cachet {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total);
  ~ProgressBar();  // finishes the line
  void Update(int64_t done);
  void Add(int64_t n = 1) { Update(done_ + n); }

 private:
  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  bool drawn_ = false;
};

}  // namespace cachet

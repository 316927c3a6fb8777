#include "cachet/progress.h"

#include <unistd.h>

#include <cstdio>

namespace cachet {

ProgressBar::ProgressBar(std::string label, int64_t total)
    : label_(std::move(label)),
      total_(total > 0 ? total : 1),
      tty_(::isatty(2) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

ProgressBar::~ProgressBar() {
  if (drawn_ && tty_) std::fputc('\n', stderr);
}

void ProgressBar::Update(int64_t done) {
  done_ = done;
  const auto now = std::chrono::steady_clock::now();
  const double since_draw = std::chrono::duration<double>(now - last_draw_).count();
  const bool finished = done_ >= total_;
  if (!finished && since_draw < (tty_ ? 0.1 : 5.0)) return;
  last_draw_ = now;
  drawn_ = true;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double frac = static_cast<double>(done_) / static_cast<double>(total_);
  const double eta = done_ > 0 ? elapsed * (1.0 - frac) / frac : 0.0;
  constexpr int kWidth = 30;
  char bar[kWidth + 1];
  const int filled = static_cast<int>(frac * kWidth);
  for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '#' : '.';
  bar[kWidth] = '\0';
  std::fprintf(stderr, "%s%s [%s] %lld/%lld %3.0f%% %.0fs elapsed, ETA %.0fs%s", tty_ ? "\r" : "",
               label_.c_str(), bar, static_cast<long long>(done_), static_cast<long long>(total_),
               frac * 100.0, elapsed, eta, tty_ ? "" : "\n");
  std::fflush(stderr);
}

}  // namespace cachet

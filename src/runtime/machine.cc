#include "cachet/machine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <thread>
#include <vector>

#include "kernels/kernels.h"

namespace cachet {

double MeasureReadBandwidth(int threads) {
  using Clock = std::chrono::steady_clock;
  threads = std::max(1, threads);
  const int64_t n = (int64_t{512} << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  std::vector<uint64_t> sums(threads);
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
        sums[t] += kernels::SumWords(buf.data() + lo, hi - lo);
      });
    }
    for (std::thread& w : workers) w.join();
    runs.push_back(n * sizeof(uint64_t) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // The sums are used, so that the reads are not optimized away.
  if (std::accumulate(sums.begin(), sums.end(), uint64_t{0}) != uint64_t(n) * runs.size()) {
    std::fputs("cachet: read-bandwidth probe summed wrong\n", stderr);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

double PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_bytes = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page_bytes > 0 ? double(pages) * double(page_bytes) : 0.0;
}

}  // namespace cachet

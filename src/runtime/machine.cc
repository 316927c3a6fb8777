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

// The faster of two ways to stream: with a software prefetch 1 KiB ahead (which read more on the
// Intel VM than the hardware prefetcher alone) and without (which reads up to 1.5x more on the AMD
// EPYC VM: one thread 23-25 GB/s against 16-17, the rate Cachet's f16 decode reaches). A roofline
// from the slower pattern would credit kernels with more than the machine's bandwidth.
double MeasureReadBandwidth(int threads) {
  using Clock = std::chrono::steady_clock;
  threads = std::max(1, threads);
  const int64_t n = (int64_t{512} << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  std::vector<uint64_t> sums(threads);
  double best = 0.0;
  int64_t passes = 0;
  for (bool prefetch : {false, true}) {
    std::vector<double> runs;
    for (int rep = 0; rep < 5; ++rep, ++passes) {
      const auto t0 = Clock::now();
      std::vector<std::thread> workers;
      for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
          const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
          sums[t] += kernels::SumWords(buf.data() + lo, hi - lo, prefetch);
        });
      }
      for (std::thread& w : workers) w.join();
      runs.push_back(n * sizeof(uint64_t) /
                     std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(runs.begin(), runs.end());
    best = std::max(best, runs[runs.size() / 2]);
  }
  // The sums are used, so that the reads are not optimized away.
  if (std::accumulate(sums.begin(), sums.end(), uint64_t{0}) != uint64_t(n) * passes) {
    std::fputs("cachet: read-bandwidth probe summed wrong\n", stderr);
  }
  return best;
}

double PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_bytes = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page_bytes > 0 ? double(pages) * double(page_bytes) : 0.0;
}

}  // namespace cachet

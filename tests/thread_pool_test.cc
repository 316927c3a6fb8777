#include "util/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace cachet {
namespace {

TEST(ThreadPool, RunsEveryTaskOnceAcrossManyRounds) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    // Many short rounds of varying size: a worker that wakes late must never claim a task of a
    // finished round (that once over-counted completions and hung the next round).
    for (int round = 0; round < 5000; ++round) {
      const int n = 1 + round % 37;
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> bad_thread{0};
      pool.Run(n, [&](int64_t t, int thread) {
        if (t < 0 || t >= n || thread < 0 || thread >= threads) {
          bad_thread.fetch_add(1);
          return;
        }
        hits[t].fetch_add(1);
      });
      for (int i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1);
      ASSERT_EQ(bad_thread.load(), 0);
    }
  }
}

}  // namespace
}  // namespace cachet

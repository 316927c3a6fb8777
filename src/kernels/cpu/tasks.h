// How the cpu kernels split work over the pool (shared by every SIMD target).
#pragma once

#include <cstdint>

#include "util/thread_pool.h"

namespace cachet::kernels::cpu {

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Runs fn(task) for every task, on the pool unless the work is too small to be worth it.
template <class Fn>
void RunTasks(ThreadPool& pool, int64_t n_tasks, bool parallel, const Fn& fn) {
  if (!parallel || n_tasks <= 1 || pool.size() == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  pool.Run(n_tasks, [&fn](int64_t task, int /*thread*/) { fn(task); });
}

}  // namespace cachet::kernels::cpu

#include "util/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CACHET_PAUSE() _mm_pause()
#else
#define CACHET_PAUSE() ((void)0)
#endif

namespace cachet {
namespace {
// Decode issues dozens of short parallel steps per token; spinning this long between them
// avoids a futex wake-up per step, then workers sleep.
constexpr int kSpinIterations = 1 << 14;
}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads < 1) n_threads = 1;
  workers_.reserve(n_threads - 1);
  for (int t = 1; t < n_threads; ++t) workers_.emplace_back([this, t] { WorkerLoop(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  work_.fetch_add(uint64_t{1} << 32, std::memory_order_acq_rel);
  work_.notify_all();
  for (auto& w : workers_) w.join();
}

int ThreadPool::DefaultThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void ThreadPool::Drain(uint32_t generation, int thread) {
  for (;;) {
    uint64_t w = work_.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(w >> 32) != generation) return;
    const int64_t task = static_cast<uint32_t>(w);
    const int64_t n = n_tasks_.load(std::memory_order_relaxed);
    if (task >= n) return;
    if (!work_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
    // The claim succeeded in this generation, so fn_ and n_tasks_ are this round's.
    (*fn_.load(std::memory_order_relaxed))(task, thread);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) done_.notify_one();
  }
}

void ThreadPool::WorkerLoop(int thread) {
  uint32_t seen = 0;
  for (;;) {
    uint64_t w = work_.load(std::memory_order_acquire);
    for (int i = 0; i < kSpinIterations && static_cast<uint32_t>(w >> 32) == seen; ++i) {
      CACHET_PAUSE();
      w = work_.load(std::memory_order_acquire);
    }
    while (static_cast<uint32_t>(w >> 32) == seen) {
      work_.wait(w, std::memory_order_acquire);
      w = work_.load(std::memory_order_acquire);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = static_cast<uint32_t>(w >> 32);
    Drain(seen, thread);
  }
}

void ThreadPool::Run(int64_t n_tasks, const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  fn_.store(&fn, std::memory_order_relaxed);
  n_tasks_.store(n_tasks, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  ++generation_;
  work_.store(uint64_t{generation_} << 32, std::memory_order_release);
  work_.notify_all();
  Drain(generation_, 0);
  int64_t done = done_.load(std::memory_order_acquire);
  for (int i = 0; i < kSpinIterations && done != n_tasks; ++i) {
    CACHET_PAUSE();
    done = done_.load(std::memory_order_acquire);
  }
  while (done != n_tasks) {
    done_.wait(done, std::memory_order_acquire);
    done = done_.load(std::memory_order_acquire);
  }
}

}  // namespace cachet

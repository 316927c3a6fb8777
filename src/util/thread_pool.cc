#include "util/thread_pool.h"

#include <sched.h>

#include <cstdio>
#include <cstdlib>

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
// Task index of a generation that hands out no tasks.
constexpr uint64_t kClosed = 0xFFFFFFFFu;
}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads < 1) n_threads = 1;
  workers_.reserve(n_threads - 1);
  for (int t = 1; t < n_threads; ++t) workers_.emplace_back([this, t] { WorkerLoop(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  work_.fetch_add(uint64_t{1} << 32, std::memory_order_acq_rel);
  WakeWorkers();
  for (auto& w : workers_) w.join();
}

int ThreadPool::DefaultThreads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void ThreadPool::Drain(uint32_t generation, int thread) {
  for (;;) {
    uint64_t w = work_.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(w >> 32) != generation) return;
    const int64_t task = static_cast<uint32_t>(w);
    // Acquire: if this is already the next round's count, Run has closed the generation of w
    // before storing it, so the CAS below fails instead of claiming task n of an old round.
    const int64_t n = n_tasks_.load(std::memory_order_acquire);
    if (task >= n) return;
    if (!work_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
    // The claim succeeded in this generation, so fn_ and n_tasks_ are this round's.
    (*fn_.load(std::memory_order_relaxed))(task, thread);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      // Taking the lock orders this against a caller that checked done_ and is about to sleep.
      { std::lock_guard<std::mutex> lock(sleep_mu_); }
      done_cv_.notify_one();
    }
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
    if (static_cast<uint32_t>(w >> 32) == seen) {
      std::unique_lock<std::mutex> lock(sleep_mu_);
      work_cv_.wait(lock, [&] {
        w = work_.load(std::memory_order_acquire);
        return static_cast<uint32_t>(w >> 32) != seen;
      });
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = static_cast<uint32_t>(w >> 32);
    Drain(seen, thread);
  }
}

void ThreadPool::Run(int64_t n_tasks, const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  if (n_tasks >= static_cast<int64_t>(kClosed)) {
    std::fprintf(stderr, "ThreadPool::Run: %lld tasks exceed the 32-bit task index\n",
                 static_cast<long long>(n_tasks));
    std::abort();
  }
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  // Close the finished round first: its word (generation, n_old) must not be claimable by a worker
  // that reads the new n_tasks_ below (that once ran task n_old of the old round and over-counted
  // done_, which hung the next round in CI). Each round thus takes two generations.
  work_.store((uint64_t{++generation_} << 32) | kClosed, std::memory_order_relaxed);
  fn_.store(&fn, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  n_tasks_.store(n_tasks, std::memory_order_release);
  work_.store(uint64_t{++generation_} << 32, std::memory_order_release);
  WakeWorkers();
  Drain(generation_, 0);
  int64_t done = done_.load(std::memory_order_acquire);
  for (int i = 0; i < kSpinIterations && done != n_tasks; ++i) {
    CACHET_PAUSE();
    done = done_.load(std::memory_order_acquire);
  }
  if (done != n_tasks) {
    std::unique_lock<std::mutex> lock(sleep_mu_);
    done_cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == n_tasks; });
  }
}

void ThreadPool::WakeWorkers() {
  // A worker checks work_ under the lock before sleeping, so after this lock/unlock it has either
  // seen the new generation or is asleep and gets the notification.
  { std::lock_guard<std::mutex> lock(sleep_mu_); }
  work_cv_.notify_all();
}

}  // namespace cachet

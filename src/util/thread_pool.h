// One explicit thread pool, passed to whatever runs in parallel (no global threads).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cachet {

class ThreadPool {
 public:
  // n_threads counts the calling thread: ThreadPool(1) runs everything inline.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(task, thread) for every task in [0, n_tasks) and returns when all are done.
  // thread is in [0, size()) and identifies per-thread scratch. Not reentrant.
  void Run(int64_t n_tasks, const std::function<void(int64_t task, int thread)>& fn);

  // The CPUs this process may run on (its affinity mask: `taskset`, a container's cpuset), at
  // least 1: one worker each. More would spin against each other for the cores: the workers wait
  // in a spin loop between a decode step's many short parallel steps, and a task claimed by a
  // descheduled worker holds up its step (-t 1000 on 2 cores: over a minute for 4 tokens).
  static int DefaultThreads();

 private:
  void WorkerLoop(int thread);
  void Drain(uint32_t generation, int thread);
  void WakeWorkers();

  std::vector<std::thread> workers_;
  std::atomic<const std::function<void(int64_t, int)>*> fn_{nullptr};
  std::atomic<int64_t> n_tasks_{0};
  // (generation << 32) | next task. Tasks are claimed by CAS on the whole word, so a worker that
  // wakes late can never run a task of a round that has already finished: the caller waits only
  // for tasks that were claimed, never for a descheduled worker to show up.
  std::atomic<uint64_t> work_{0};
  std::atomic<int64_t> done_{0};
  uint32_t generation_ = 0;
  std::atomic<bool> stop_{false};
  // Sleeping after the spin goes through a mutex and condition variables, not atomic::wait:
  // libstdc++ 12 waits on 64-bit atomics through a shared proxy futex and lost a wake-up in CI
  // (a worker slept through a new round). Only sleepers and the last finisher touch the mutex.
  std::mutex sleep_mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
};

}  // namespace cachet

// One explicit thread pool, passed to whatever runs in parallel (no global threads).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
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
  // thread is in [0, size()) and identifies per-thread scratch.
  void Run(int64_t n_tasks, const std::function<void(int64_t task, int thread)>& fn);

  static int DefaultThreads();

 private:
  void WorkerLoop(int thread);
  void Drain(int thread);

  std::vector<std::thread> workers_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> busy_workers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace cachet

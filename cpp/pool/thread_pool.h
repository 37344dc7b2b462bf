// Persistent worker pool: the only place in moecc that creates threads.
//
// Work is a range of independent task indices [0, n_tasks); threads (the caller included) claim the next
// index from one atomic counter, so a slow task never holds up the others. Workers spin briefly after a
// job and then sleep on a condition variable: back-to-back calls (one per MoE layer) pay no wake-up
// latency, an idle process burns no CPU. The first exception thrown by a task is re-thrown in the caller.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moecc::pool {

// A task receives its index and the id of the thread running it (0 = the calling thread).
using TaskFunction = std::function<void(int64_t task, int thread_id)>;

class ThreadPool {
 public:
  // @param num_threads total threads including the caller; values < 1 mean "all cores we may run on".
  // @param pin_threads pin worker i to the i-th CPU of the process affinity mask. The calling thread is never
  //        pinned: threads it starts later (torch's OpenMP team) would inherit a one-CPU mask.
  ThreadPool(int num_threads, bool pin_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  bool pinned() const { return pinned_; }

  // Runs fn over every task index, blocking until all are done. Not re-entrant: one job at a time.
  void run(int64_t n_tasks, const TaskFunction& fn);

 private:
  void worker_loop(int thread_id);
  void drain(int thread_id);

  std::vector<std::thread> workers_;
  bool pinned_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::mutex run_mutex_;  // serialises callers

  const TaskFunction* job_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> active_workers_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;

  std::mutex error_mutex_;
  std::exception_ptr error_;
};

// Process-wide pool, created on first use with one pinned thread per available CPU. Callers hold the returned
// pointer while they run work, so replacing the pool never destroys one that is still in use.
std::shared_ptr<ThreadPool> global_pool();
// Replaces the global pool; the old one's threads are joined once its last user is done with it.
void reset_global_pool(int num_threads, bool pin_threads);
// Drops the global pool (joined once unused); the next global_pool() call starts a fresh one.
void shutdown_global_pool();
// Number of CPUs in this process's affinity mask.
int available_cpus();

}  // namespace moecc::pool

// Persistent worker pool; see thread_pool.h for the scheduling contract.
#include "thread_pool.h"

#include <sched.h>
#include <pthread.h>

#include <memory>

namespace moecc::pool {
namespace {

std::vector<int> allowed_cpu_ids() {
  std::vector<int> ids;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) ids.push_back(cpu);
    }
  }
  if (ids.empty()) {
    unsigned hw = std::thread::hardware_concurrency();
    for (unsigned i = 0; i < (hw ? hw : 1); ++i) ids.push_back(static_cast<int>(i));
  }
  return ids;
}

void pin_to_cpu(pthread_t thread, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  // Pinning is an optimisation: a refusal (containers, cgroups) leaves the thread unpinned.
  (void)pthread_setaffinity_np(thread, sizeof(set), &set);
}

// Spin this many polls before sleeping: long enough to bridge the gap between two layers' calls.
constexpr int kSpinPolls = 20000;

std::mutex g_pool_mutex;
std::shared_ptr<ThreadPool> g_pool;

// fork(): a child has only the forking thread, so the pool's workers are gone and a job would wait for them for
// ever. The child forgets the pool without joining (its memory is left behind on purpose: destroying joinable
// threads that do not exist would terminate) and its first global_pool() starts a fresh one. The mutex is held
// across fork so the child never inherits it locked by a thread it does not have.
void lock_before_fork() { g_pool_mutex.lock(); }
void unlock_in_parent() { g_pool_mutex.unlock(); }
void forget_in_child() {
  new std::shared_ptr<ThreadPool>(std::move(g_pool));
  g_pool_mutex.unlock();
}
const int g_fork_handlers = pthread_atfork(lock_before_fork, unlock_in_parent, forget_in_child);

}  // namespace

int available_cpus() { return static_cast<int>(allowed_cpu_ids().size()); }

ThreadPool::ThreadPool(int num_threads, bool pin_threads) : pinned_(pin_threads) {
  const std::vector<int> cpus = allowed_cpu_ids();
  if (num_threads < 1) num_threads = static_cast<int>(cpus.size());
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
    if (pin_threads) pin_to_cpu(workers_.back().native_handle(), cpus[i % cpus.size()]);
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::drain(int thread_id) {
  const TaskFunction& fn = *job_;
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= n_tasks_) break;
    try {
      fn(task, thread_id);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      next_task_.store(n_tasks_, std::memory_order_relaxed);  // stop handing out tasks
    }
  }
}

void ThreadPool::worker_loop(int thread_id) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t generation = generation_.load(std::memory_order_acquire);
    for (int poll = 0; generation == seen && poll < kSpinPolls; ++poll) {
      std::this_thread::yield();
      generation = generation_.load(std::memory_order_acquire);
    }
    if (generation == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      generation = generation_.load(std::memory_order_acquire);
    }
    seen = generation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return;
    }
    drain(thread_id);
    if (active_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_one();
    }
  }
}

void ThreadPool::run(int64_t n_tasks, const TaskFunction& fn) {
  if (n_tasks <= 0) return;
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  error_ = nullptr;
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t task = 0; task < n_tasks; ++task) fn(task, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    n_tasks_ = n_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    active_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  drain(0);
  // Spin first: the workers usually finish within microseconds of the caller.
  for (int poll = 0; active_workers_.load(std::memory_order_acquire) != 0 && poll < kSpinPolls; ++poll) {
    std::this_thread::yield();
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return active_workers_.load(std::memory_order_acquire) == 0; });
    job_ = nullptr;
  }
  if (error_) std::rethrow_exception(error_);
}

std::shared_ptr<ThreadPool> global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_shared<ThreadPool>(0, true);
  return g_pool;
}

void reset_global_pool(int num_threads, bool pin_threads) {
  auto fresh = std::make_shared<ThreadPool>(num_threads, pin_threads);
  std::shared_ptr<ThreadPool> old;
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    old.swap(g_pool);
    g_pool = std::move(fresh);
  }
  // `old` is released here, outside the lock; a caller still running on it keeps it alive until it returns.
}

void shutdown_global_pool() {
  std::shared_ptr<ThreadPool> old;
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    old.swap(g_pool);
  }
}

}  // namespace moecc::pool

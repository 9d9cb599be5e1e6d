// A fixed pool of worker threads for data-parallel kernels (matmuls,
// attention over heads/sequences). The calling thread takes part as worker 0.
//
// Thread-safety: run() must be called from one thread at a time (the engine
// step thread). Workers spin briefly after each job, then sleep on an atomic
// wait, so back-to-back small jobs (one per layer op) cost ~1 us to dispatch.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace kvstack {

class ThreadPool {
 public:
  // n_threads >= 1 counts the calling thread.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return n_threads_; }

  // Calls fn(thread_index) once on each of the n_threads() threads and waits.
  void run(const std::function<void(int)>& fn);

  // Splits [0, n) into contiguous chunks, one per thread, each a multiple of
  // `grain` (except the last); fn(begin, end) is called for non-empty chunks.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

// Number of threads to use by default: the machine's cores (hardware
// concurrency), at least 1.
int default_thread_count();

}  // namespace kvstack

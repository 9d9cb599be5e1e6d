// A fixed pool of worker threads for data-parallel kernels (matmuls,
// attention over heads/sequences). The calling thread takes part as worker 0.
//
// Thread-safety: run()/run_shared() must be called from one thread at a time
// (the engine step thread). Workers spin briefly after each job, then sleep on
// an atomic wait, so back-to-back small jobs (one per layer op) cost ~1 us to
// dispatch.
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

  // Work-sharing job: fn(0) runs on the calling thread and fn(t) on each
  // worker t that wakes up while the job is open (at most once each; a worker
  // descheduled by other load may not take part at all). Returns once the
  // caller's fn(0) has returned and every worker that entered fn has left.
  // REQUIRES: fn claims its work from shared state (e.g. an atomic counter) so
  // that the caller's call alone finishes whatever the others did not claim;
  // fn must not rely on any particular worker running. Unlike run(), the call
  // never waits for a worker that has not started, so one slow thread cannot
  // hold up a step whose work others could do.
  void run_shared(const std::function<void(int)>& fn);

  // Splits [0, n) into contiguous chunks, one per thread, each a multiple of
  // `grain` (except the last); fn(begin, end) is called for non-empty chunks.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  // The current job. Written by the caller before the release store of
  // generation_ that announces it, read by workers after acquiring it.
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  // 2 * (jobs started) + (1 if the latest job is a run_shared() job): a worker
  // learns the kind of job from the value it acquired, never from state the
  // caller may already have reused for a newer job.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  // run_shared(): generation of the open job (0 = closed) and the workers now
  // inside it.
  std::atomic<uint64_t> open_{0};
  std::atomic<int> active_{0};
  std::atomic<bool> stop_{false};
};

// Number of threads to use by default: the machine's cores (hardware
// concurrency), at least 1.
int default_thread_count();

}  // namespace kvstack

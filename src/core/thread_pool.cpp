#include "core/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvstack {
namespace {
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}
constexpr int kSpinIterations = 20000;
}  // namespace

int default_thread_count() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  workers_.reserve(n_threads_ - 1);
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(2, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g = generation_.load(std::memory_order_acquire);
    for (int spin = 0; g == seen && spin < kSpinIterations; ++spin) {
      cpu_relax();
      g = generation_.load(std::memory_order_acquire);
    }
    if (g == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      continue;
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    if ((g & 1) == 0) {
      job_.load(std::memory_order_relaxed)->operator()(index);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
      continue;
    }
    // Shared job: announce ourselves, then enter only if generation g is still
    // open. Paired with run_shared() closing the job and then waiting for
    // active_ == 0 (both seq_cst), either we see it closed or it sees us.
    active_.fetch_add(1, std::memory_order_seq_cst);
    if (open_.load(std::memory_order_seq_cst) == g) {
      job_.load(std::memory_order_relaxed)->operator()(index);
    }
    active_.fetch_sub(1, std::memory_order_release);
  }
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (n_threads_ == 1) {
    fn(0);
    return;
  }
  job_.store(&fn, std::memory_order_relaxed);
  pending_.store(n_threads_ - 1, std::memory_order_release);
  const uint64_t g = (generation_.load(std::memory_order_relaxed) | 1) + 1;  // next even value
  generation_.store(g, std::memory_order_release);
  generation_.notify_all();
  fn(0);
  // Spin briefly (workers usually finish within microseconds), then yield so
  // an oversubscribed machine can schedule the worker we are waiting for.
  for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
    if (spin < kSpinIterations) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::run_shared(const std::function<void(int)>& fn) {
  if (n_threads_ == 1) {
    fn(0);
    return;
  }
  // A worker that acquired an older generation does not run job_ (which may
  // already be this newer job): open_ names a different generation.
  job_.store(&fn, std::memory_order_relaxed);
  const uint64_t g = ((generation_.load(std::memory_order_relaxed) >> 1) + 1) * 2 + 1;  // odd
  open_.store(g, std::memory_order_relaxed);
  generation_.store(g, std::memory_order_release);
  generation_.notify_all();
  fn(0);
  open_.store(0, std::memory_order_seq_cst);
  for (int spin = 0; active_.load(std::memory_order_seq_cst) != 0; ++spin) {
    if (spin < kSpinIterations) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t n_grains = (n + grain - 1) / grain;
  const int n_used = static_cast<int>(std::min<int64_t>(n_threads_, n_grains));
  if (n_used <= 1) {
    fn(0, n);
    return;
  }
  run([&](int t) {
    if (t >= n_used) return;
    const int64_t g0 = n_grains * t / n_used;
    const int64_t g1 = n_grains * (t + 1) / n_used;
    const int64_t b = g0 * grain;
    const int64_t e = std::min(n, g1 * grain);
    if (b < e) fn(b, e);
  });
}

}  // namespace kvstack

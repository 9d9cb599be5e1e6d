#include "ops/matmul.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/check.h"
#include "core/cpu_features.h"
#include "core/half.h"
#include "ops/matmul_kernels.h"
#include "ops/quantize_act.h"

namespace kvstack {
namespace {

using ops_detail::ActKind;
using ops_detail::MatmulKernel;
using ops_detail::PreparedAct;

// Per calling thread: the prepared activation of the current call. Buffers
// only grow, so steady-state calls do not allocate.
struct Workspace {
  std::vector<int8_t> qs;
  std::vector<float> d, s, f32;
  std::vector<BlockQ8_K> q8k;
};

Workspace& workspace() {
  static thread_local Workspace ws;
  return ws;
}

template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Runs fn(r0, r1) over activation rows [0, m), split across the pool.
template <class Fn>
void for_rows(int64_t m, ThreadPool* pool, const Fn& fn) {
  const int n_threads = pool ? pool->n_threads() : 1;
  if (n_threads <= 1 || m < 4) return fn(0, m);
  // The job captures one pointer, so std::function stores it without allocating.
  struct Ctx {
    const Fn* fn;
    int64_t m;
    int n_threads;
  } ctx{&fn, m, n_threads};
  const Ctx* c = &ctx;
  pool->run([c](int t) {
    const int64_t r0 = c->m * t / c->n_threads, r1 = c->m * (t + 1) / c->n_threads;
    if (r0 < r1) (*c->fn)(r0, r1);
  });
}

PreparedAct prepare(ActKind kind, const float* x, int64_t m, int64_t n_in, ThreadPool* pool) {
  Workspace& ws = workspace();
  PreparedAct a;
  a.m = m;
  a.n_in = n_in;
  const size_t n = static_cast<size_t>(m * n_in);
  switch (kind) {
    case ActKind::kF32:
      a.f32 = x;
      break;
    case ActKind::kF16: {
      float* f = grow(ws.f32, n);
      for_rows(m, pool, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * n_in; i < r1 * n_in; ++i) f[i] = f16_to_f32(f32_to_f16(x[i]));
      });
      a.f32 = f;
      break;
    }
    case ActKind::kQ8_0:
    case ActKind::kQ8_1: {
      const int64_t nb = n_in / kQK;
      int8_t* qs = grow(ws.qs, n);
      float* d = grow(ws.d, static_cast<size_t>(m * nb));
      float* s = kind == ActKind::kQ8_1 ? grow(ws.s, static_cast<size_t>(m * nb)) : nullptr;
      for_rows(m, pool, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          quantize_act_q8(x + r * n_in, qs + r * n_in, d + r * nb, s ? s + r * nb : nullptr, n_in);
        }
      });
      a.qs = qs;
      a.d = d;
      a.s = s;
      break;
    }
    case ActKind::kQ8_K: {
      const int64_t nb = n_in / kQK_K;
      BlockQ8_K* q = grow(ws.q8k, static_cast<size_t>(m * nb));
      for_rows(m, pool, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) quantize_row_q8_K(x + r * n_in, q + r * nb, n_in);
      });
      a.q8k = q;
      break;
    }
  }
  return a;
}

MatmulKernel select_kernel(GgmlType type) {
  if (best_isa() >= Isa::kAvx2) {
    if (MatmulKernel k = ops_detail::avx2_kernel(type)) return k;
  }
  return ops_detail::scalar_kernel(type);
}

}  // namespace

bool matmul_supported(GgmlType type) {
  return ops_detail::scalar_kernel(type) != nullptr;
}

void matmul(const WeightView& w, const float* x, int64_t m, float* y, ThreadPool* pool) {
  KV_CHECK(matmul_supported(w.type), "matmul: unsupported weight type");
  const GgmlTypeTraits* traits = ggml_type_traits(static_cast<uint32_t>(w.type));
  KV_CHECK(w.n_in > 0 && w.n_in % traits->block_elems == 0,
           "matmul: n_in must be a positive multiple of the weight block size");
  if (m <= 0 || w.n_out <= 0) return;
  const MatmulKernel kernel = select_kernel(w.type);
  const PreparedAct act = prepare(ops_detail::act_kind(w.type), x, m, w.n_in, pool);

  const int n_threads = pool ? pool->n_threads() : 1;
  // Columns (weight rows) are handed out in chunks from a shared counter, so a
  // thread slowed by other load does not hold up the call. Chunks are
  // multiples of 4 rows (the kernels' widest tile) and aim for ~8 per thread.
  const int64_t target = std::max<int64_t>(1, w.n_out / (8 * n_threads));
  const int64_t chunk = std::max<int64_t>(16, (target + 3) / 4 * 4);
  const int64_t n_chunks = (w.n_out + chunk - 1) / chunk;
  if (n_threads <= 1 || n_chunks <= 1) {
    kernel(w, act, 0, w.n_out, y, w.n_out);
    return;
  }
  struct Ctx {
    std::atomic<int64_t> next{0};
    int64_t chunk, n_chunks;
    MatmulKernel kernel;
    const WeightView* w;
    const PreparedAct* act;
    float* y;
  } ctx{{}, chunk, n_chunks, kernel, &w, &act, y};
  Ctx* c = &ctx;  // one captured pointer: std::function stores it without allocating
  pool->run([c](int) {
    for (;;) {
      const int64_t i = c->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= c->n_chunks) break;
      const int64_t c0 = i * c->chunk;
      c->kernel(*c->w, *c->act, c0, std::min(c->w->n_out, c0 + c->chunk), c->y, c->w->n_out);
    }
  });
}

}  // namespace kvstack

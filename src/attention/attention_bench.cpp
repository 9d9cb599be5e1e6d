// Decode attention throughput: one sequence, one query row, KV in the block
// pool either paged (block size 16, blocks shuffled) or contiguous (a single
// block as long as the context, same kernel and view). Reports the KV bytes
// the step must read per second ("kv_bytes/s"), to compare with BM_MemRead,
// a plain parallel read of a 512 MiB buffer on the same number of threads.
//
//   attention_bench --benchmark_counters_tabular=true
//
// Arguments: ctx, shape (0: 9 q / 3 kv heads, d 64 = SmolLM2; 1: 32 / 8,
// d 128), dtype (0 f32, 1 f16), layout (0 contiguous, 1 paged), threads.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "attention/paged_attention.h"
#include "core/cpu_features.h"
#include "core/half.h"

namespace kvstack {
namespace {

struct Shape {
  int n_q_heads;
  int n_kv_heads;
  int head_dim;
};
constexpr Shape kShapes[] = {{9, 3, 64}, {32, 8, 128}};

// Buffers are anonymous mappings with transparent huge pages requested, as a
// block pool's should be (KVSTACK_BENCH_NO_HUGEPAGES=1 to compare): scattered
// block pieces over 4 KiB pages cost extra TLB misses.
struct Unmap {
  size_t bytes;
  void operator()(uint8_t* p) const { munmap(p, bytes); }
};
using Bytes = std::unique_ptr<uint8_t, Unmap>;

Bytes alloc_bytes(size_t n) {
  const size_t bytes = (n + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "attention_bench: cannot map %zu bytes\n", bytes);
    std::abort();
  }
  if (std::getenv("KVSTACK_BENCH_NO_HUGEPAGES") == nullptr) madvise(p, bytes, MADV_HUGEPAGE);
  return Bytes(static_cast<uint8_t*>(p), Unmap{bytes});
}

// K and V pools (block-major: [n_blocks, n_kv_heads, block_size, head_dim])
// holding one sequence of `ctx` tokens, plus its table.
struct KvSetup {
  Bytes k, v;
  PagedKvLayerView view;
  std::vector<int32_t> table;
  int64_t payload_bytes = 0;  // K + V bytes the step reads
};

void fill(uint8_t* p, size_t n_elems, KvDtype dtype, uint32_t seed) {
  uint32_t x = seed | 1u;
  for (size_t i = 0; i < n_elems; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    const float f = static_cast<float>(static_cast<int32_t>(x)) * (1.0f / 2147483648.0f);
    if (dtype == KvDtype::kF32) {
      std::memcpy(p + 4 * i, &f, 4);
    } else {
      const uint16_t h = f32_to_f16(f);
      std::memcpy(p + 2 * i, &h, 2);
    }
  }
}

KvSetup make_kv(const Shape& sh, KvDtype dtype, int ctx, bool paged) {
  KvSetup s;
  const int block_size = paged ? 16 : ctx;
  const int n_blocks = (ctx + block_size - 1) / block_size;
  const int eb = kv_dtype_bytes(dtype);
  PagedKvLayerView& v = s.view;
  v.dtype = dtype;
  v.block_size = block_size;
  v.n_kv_heads = sh.n_kv_heads;
  v.head_dim = sh.head_dim;
  v.slot_stride = int64_t{sh.head_dim} * eb;
  v.head_stride = v.slot_stride * block_size;
  v.block_stride = v.head_stride * sh.n_kv_heads;
  const size_t bytes = static_cast<size_t>(v.block_stride) * n_blocks;
  s.k = alloc_bytes(bytes);
  s.v = alloc_bytes(bytes);
  fill(s.k.get(), bytes / eb, dtype, 12345);
  fill(s.v.get(), bytes / eb, dtype, 67890);
  v.k = s.k.get();
  v.v = s.v.get();
  s.table.resize(n_blocks);
  std::iota(s.table.begin(), s.table.end(), 0);
  if (paged) std::shuffle(s.table.begin(), s.table.end(), std::mt19937(7));
  s.payload_bytes = 2LL * ctx * sh.n_kv_heads * sh.head_dim * eb;
  return s;
}

void BM_DecodeAttention(benchmark::State& state) {
  const int ctx = static_cast<int>(state.range(0));
  const Shape sh = kShapes[state.range(1)];
  const KvDtype dtype = state.range(2) == 0 ? KvDtype::kF32 : KvDtype::kF16;
  const bool paged = state.range(3) != 0;
  ThreadPool pool(static_cast<int>(state.range(4)));
  KvSetup kv = make_kv(sh, dtype, ctx, paged);
  std::vector<float> q(static_cast<size_t>(sh.n_q_heads) * sh.head_dim);
  std::vector<float> out(q.size());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (float& x : q) x = nd(rng);
  const AttnParams p{.n_q_heads = sh.n_q_heads,
                     .n_kv_heads = sh.n_kv_heads,
                     .head_dim = sh.head_dim,
                     .scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim))};
  const AttnSeq seq{.block_table = kv.table.data(),
                    .n_blocks = static_cast<int32_t>(kv.table.size()),
                    .n_past = ctx - 1,
                    .n_new = 1,
                    .q = q.data(),
                    .out = out.data()};
  for (auto _ : state) {
    const Status st = paged_attention(kv.view, p, std::span<const AttnSeq>(&seq, 1), &pool);
    if (!st.ok()) {
      state.SkipWithError(st.error().message.c_str());
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["kv_bytes/s"] = benchmark::Counter(static_cast<double>(kv.payload_bytes),
                                                    benchmark::Counter::kIsIterationInvariantRate,
                                                    benchmark::Counter::kIs1024);
  state.counters["kv_MiB"] = static_cast<double>(kv.payload_bytes) / (1 << 20);
  state.SetLabel(std::string(paged ? "paged16" : "contig") +
                 (dtype == KvDtype::kF32 ? "/f32" : "/f16") + "/isa=" + isa_name(best_isa()));
}

__attribute__((target("avx2"))) float read_sum_avx2(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

// Sequential read of 512 MiB split evenly across the threads.
void BM_MemRead(benchmark::State& state) {
  if (best_isa() < Isa::kAvx2) {
    state.SkipWithError("needs AVX2");
    return;
  }
  constexpr int64_t kBytes = 512LL << 20;
  const int n_threads = static_cast<int>(state.range(0));
  ThreadPool pool(n_threads);
  Bytes buf = alloc_bytes(kBytes);
  fill(buf.get(), kBytes / 4, KvDtype::kF32, 99);
  const auto* f = reinterpret_cast<const float*>(buf.get());
  const int64_t n = kBytes / 4;
  std::vector<float> sums(n_threads);
  for (auto _ : state) {
    pool.run([&](int t) {
      const int64_t b = n * t / n_threads / 32 * 32;
      const int64_t e = n * (t + 1) / n_threads / 32 * 32;
      sums[t] = read_sum_avx2(f + b, e - b);
    });
    benchmark::DoNotOptimize(sums.data());
  }
  state.counters["read_bytes/s"] =
      benchmark::Counter(static_cast<double>(kBytes), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1024);
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ctx", "shape", "f16", "paged", "threads"});
  for (int threads : {1, 2}) {
    for (int shape : {0, 1}) {
      for (int dtype : {1, 0}) {
        for (int ctx : {4096, 16384, 32768}) {
          for (int paged : {0, 1}) b->Args({ctx, shape, dtype, paged, threads});
        }
      }
    }
  }
}

BENCHMARK(BM_DecodeAttention)->Apply(decode_args)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_MemRead)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace kvstack

BENCHMARK_MAIN();

// Weight-matmul throughput per type and shape, and the machine's memory read
// bandwidth for comparison. Weights are replicated over >= 96 MiB and cycled,
// so (as in real decoding, ~98 MB of weights per token) they come from DRAM
// rather than cache.
#include <benchmark/benchmark.h>

#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/thread_pool.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"

namespace kvstack {
namespace {

// Threads: OPS_BENCH_THREADS if set, else the machine's cores.
ThreadPool& pool() {
  static ThreadPool p([] {
    const char* env = std::getenv("OPS_BENCH_THREADS");
    return env ? std::atoi(env) : default_thread_count();
  }());
  return p;
}

// Valid random weights: random quant bytes with small f16 scales (any byte
// pattern is a valid quant; scales must be finite).
std::vector<uint8_t> make_weights(GgmlType type, int64_t n_in, int64_t n_out, size_t copies) {
  const size_t bytes = ggml_row_bytes(type, n_in) * n_out;
  std::vector<uint8_t> buf(bytes * copies);
  std::mt19937 rng(1);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const uint16_t h = f32_to_f16(0.01f);
  auto fix = [&](size_t stride, size_t off) {
    for (size_t i = off; i + 2 <= buf.size(); i += stride) std::memcpy(&buf[i], &h, 2);
  };
  switch (type) {
    case GgmlType::kF32: {
      auto* f = reinterpret_cast<float*>(buf.data());
      for (size_t i = 0; i < buf.size() / 4; ++i) f[i] = 0.01f * static_cast<float>(i % 7);
      break;
    }
    case GgmlType::kF16:
      fix(2, 0);
      break;
    case GgmlType::kQ4_0:
      fix(sizeof(BlockQ4_0), 0);
      break;
    case GgmlType::kQ4_1:
      fix(sizeof(BlockQ4_1), 0), fix(sizeof(BlockQ4_1), 2);
      break;
    case GgmlType::kQ5_0:
      fix(sizeof(BlockQ5_0), 0);
      break;
    case GgmlType::kQ5_1:
      fix(sizeof(BlockQ5_1), 0), fix(sizeof(BlockQ5_1), 2);
      break;
    case GgmlType::kQ8_0:
      fix(sizeof(BlockQ8_0), 0);
      break;
    case GgmlType::kQ4_K:
      fix(sizeof(BlockQ4_K), 0), fix(sizeof(BlockQ4_K), 2);
      break;
    case GgmlType::kQ5_K:
      fix(sizeof(BlockQ5_K), 0), fix(sizeof(BlockQ5_K), 2);
      break;
    case GgmlType::kQ6_K:
      fix(sizeof(BlockQ6_K), offsetof(BlockQ6_K, d));
      break;
    default:
      break;
  }
  return buf;
}

void BM_Matmul(benchmark::State& state) {
  const auto type = static_cast<GgmlType>(state.range(0));
  const int64_t n_in = state.range(1), n_out = state.range(2), m = state.range(3);
  const size_t bytes = ggml_row_bytes(type, n_in) * n_out;
  // OPS_BENCH_HOT=1: one copy, so a matrix that fits in cache is read from
  // cache (the kernel's compute rate rather than DRAM's).
  const bool hot = std::getenv("OPS_BENCH_HOT") != nullptr;
  const size_t copies = hot ? 1 : std::max<size_t>(1, (96u << 20) / bytes + 1);
  auto w = make_weights(type, n_in, n_out, copies);
  // OPS_BENCH_PANELS=1: every copy packed into 16-column panels where
  // weight_panels_supported() (what --load-mode copy does at load).
  WeightLayout layout = WeightLayout::kRows;
  if (std::getenv("OPS_BENCH_PANELS") != nullptr &&
      weight_panels_supported(WeightView{type, w.data(), n_in, n_out})) {
    for (size_t c = 0; c < copies; ++c) {
      pack_weight_panels(WeightView{type, w.data() + c * bytes, n_in, n_out}, w.data() + c * bytes);
    }
    layout = WeightLayout::kPanels16;
  }
  std::vector<float> x(m * n_in), y(m * n_out);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  size_t i = 0;
  const WeightView first{type, w.data(), n_in, n_out, layout};
  for (auto _ : state) {
    const WeightView view{type, w.data() + (i++ % copies) * bytes, n_in, n_out, layout};
    matmul(view, x.data(), m, y.data(), &pool());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["weight_B/s"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * m * n_in * n_out, benchmark::Counter::kIsIterationInvariantRate);
  const char* path = matmul_kernel_name(first);
  state.SetLabel(std::string(ggml_type_traits(static_cast<uint32_t>(type))->name) + "/" +
                 (path ? path : "none"));
}

void shapes(benchmark::internal::Benchmark* b) {
  const GgmlType types[] = {GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ5_0,
                            GgmlType::kQ5_1, GgmlType::kF16,  GgmlType::kF32,  GgmlType::kQ4_K,
                            GgmlType::kQ5_K, GgmlType::kQ6_K};
  const int64_t dims[][2] = {{576, 576}, {576, 1536}, {1536, 576}};
  for (GgmlType t : types) {
    for (const auto& d : dims) {
      for (int64_t m : {1, 8, 64, 512}) b->Args({static_cast<int64_t>(t), d[0], d[1], m});
    }
  }
  // One-row shapes small enough for L2 (with OPS_BENCH_HOT=1: compute rate).
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ5_0, GgmlType::kQ4_K, GgmlType::kQ6_K}) {
    b->Args({static_cast<int64_t>(t), 1024, 512, 1});
  }
  // The tied output matrix of SmolLM2 (token_embd, Q8_0, 49152 x 576).
  for (int64_t m : {1, 8, 64, 512}) b->Args({static_cast<int64_t>(GgmlType::kQ8_0), 576, 49152, m});
}
BENCHMARK(BM_Matmul)
    ->ArgNames({"type", "n_in", "n_out", "m"})
    ->Apply(shapes)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// The matmul shapes of the two real models' decode step (m = 1), of batched
// decode steps (m = 4, 16) and of a 64-row prefill tile, each with the weight type the GGUF stores:
//   Gemma 3 270M Q4_K_M: q Q5_0 640->1024, gate/up Q5_0 640->2048, attn_output
//   Q4_K 1024->640, ffn_down Q4_K / Q6_K 2048->640, tied output Q8_0 640->262144;
//   SmolLM2 135M Q4_1: gate/up 576->1536, down 1536->576, q/o 576->576, tied
//   k/v 576->192, tied output Q8_0 576->49152.
// The label names the kernel that ran; KVSTACK_ISA=scalar|avx2 caps it, so
//   KVSTACK_ISA=avx2 ops_bench --benchmark_filter=BM_MatmulModel
// against the default run compares the paths (and OPS_BENCH_PANELS=1 the
// packed weights against the rows).
void model_shapes(benchmark::internal::Benchmark* b) {
  const struct {
    GgmlType type;
    int64_t n_in, n_out;
  } shapes[] = {
      {GgmlType::kQ8_0, 640, 262144}, {GgmlType::kQ5_0, 640, 2048},  {GgmlType::kQ5_0, 640, 1024},
      {GgmlType::kQ4_K, 1024, 640},   {GgmlType::kQ4_K, 2048, 640},  {GgmlType::kQ6_K, 2048, 640},
      {GgmlType::kQ4_1, 576, 1536},   {GgmlType::kQ4_1, 1536, 576},  {GgmlType::kQ4_1, 576, 576},
      {GgmlType::kQ4_1, 576, 192},    {GgmlType::kQ8_0, 576, 49152},
  };
  for (const auto& s : shapes) {
    // 1: one decode row; 4, 16: batched decode steps; 64: a prefill tile.
    for (int64_t m : {1, 4, 16, 64}) {
      b->Args({static_cast<int64_t>(s.type), s.n_in, s.n_out, m});
    }
  }
}
BENCHMARK(BM_Matmul)
    ->Name("BM_MatmulModel")
    ->ArgNames({"type", "n_in", "n_out", "m"})
    ->Apply(model_shapes)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// rms_norm of n_rows rows of SmolLM2's width (576): 1 row per layer norm in
// decoding. KVSTACK_ISA=scalar measures the scalar reference path.
void BM_RmsNorm(benchmark::State& state) {
  const int64_t n_rows = state.range(0), n = state.range(1);
  std::vector<float> x(n_rows * n), w(n), y(n_rows * n);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = 1.f + 0.1f * nd(rng);
  for (auto _ : state) {
    rms_norm(x.data(), w.data(), n_rows, n, 1e-5f, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["rows/s"] = benchmark::Counter(static_cast<double>(n_rows),
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_RmsNorm)
    ->ArgNames({"rows", "n"})
    ->Args({1, 576})
    ->Args({128, 576})
    ->Unit(benchmark::kMicrosecond);

// The rope calls of one SmolLM2 step of n_tokens new tokens: Q (9 heads) and
// K (3 heads) of head_dim 64 in each of 30 layers, all at the step's
// positions, which move on every iteration as in decoding.
void BM_RopeStep(benchmark::State& state) {
  const int64_t n_tokens = state.range(0), n_layers = 30, n_heads = 9, n_kv_heads = 3;
  const int64_t head_dim = 64;
  std::vector<float> q(n_tokens * n_heads * head_dim, 0.5f);
  std::vector<float> k(n_tokens * n_kv_heads * head_dim, 0.25f);
  std::vector<int32_t> pos(n_tokens);
  const RopeParams rp{.style = RopeStyle::kNormal, .n_rot = 64, .freq_base = 100000.f};
  int32_t next = 0;
  for (auto _ : state) {
    for (auto& p : pos) p = next++ % 8192;
    for (int64_t l = 0; l < n_layers; ++l) {
      rope(q.data(), pos.data(), n_tokens, n_heads, head_dim, rp);
      rope(k.data(), pos.data(), n_tokens, n_kv_heads, head_dim, rp);
    }
    benchmark::DoNotOptimize(q.data());
    benchmark::DoNotOptimize(k.data());
  }
}
BENCHMARK(BM_RopeStep)->ArgName("tokens")->Arg(1)->Arg(128)->Unit(benchmark::kMicrosecond);

// The greedy pick over a logits row of Gemma 3's vocabulary (262,144), in
// cache as after the output matmul; KVSTACK_ISA=scalar gives the
// std::max_element loop it replaced.
void BM_Argmax(benchmark::State& state) {
  std::vector<float> x(static_cast<size_t>(state.range(0)));
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  for (auto _ : state) benchmark::DoNotOptimize(argmax(x.data(), std::ssize(x)));
}
BENCHMARK(BM_Argmax)->Arg(262144)->Arg(49152)->Unit(benchmark::kMicrosecond);

// Memory read bandwidth: sum a 512 MiB float array on all pool threads.
__attribute__((target("avx2"))) float sum_range(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  float out[8];
  _mm256_storeu_ps(out, s);
  float t = 0;
  for (float v : out) t += v;
  for (; i < n; ++i) t += p[i];
  return t;
}

void BM_MemoryReadBandwidth(benchmark::State& state) {
  const size_t n = (512u << 20) / sizeof(float);
  std::vector<float> a(n, 1.f);
  const int n_threads = static_cast<int>(state.range(0));
  ThreadPool p(n_threads);
  std::vector<float> partial(n_threads);
  for (auto _ : state) {
    p.run([&](int t) {
      const size_t b = n * t / n_threads, e = n * (t + 1) / n_threads;
      partial[t] = sum_range(a.data() + b, e - b);
    });
    benchmark::DoNotOptimize(partial.data());
  }
  state.counters["read_B/s"] = benchmark::Counter(static_cast<double>(n * sizeof(float)),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_MemoryReadBandwidth)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

// Issue rate of one instruction, written in inline assembly: 14 chains in
// registers 0-13, sources in 14/15, kIssueIters steps per iteration; the
// counter is instructions per ns of one core (docs/benchmarks.md divides it
// by the clock). The attention kernels' per-key instruction counts divided by
// these rates give their compute floor. Inline assembly because with
// intrinsics GCC kept an array of 16 vector chains on the stack, and the
// loads and stores then bounded the loop instead of the instruction (the
// figures before session 15 measured that). An accumulating instruction
// (FMA, vpdpbusd) feeds its own result back, so no two compute the same
// value, and 14 chains cover a latency of up to 7 cycles at 2 per cycle; the
// others (add, maddubs, madd) overwrite their destination from the two
// sources, i.e. 14 independent instructions per step.
#define OPS_CHAINS14(op, r)                                                                       \
  op " %%" r "14, %%" r "15, %%" r "0\n\t" op " %%" r "14, %%" r "15, %%" r "1\n\t" op " %%" r    \
     "14, %%" r "15, %%" r "2\n\t" op " %%" r "14, %%" r "15, %%" r "3\n\t" op " %%" r "14, %%" r \
     "15, %%" r "4\n\t" op " %%" r "14, %%" r "15, %%" r "5\n\t" op " %%" r "14, %%" r "15, %%" r \
     "6\n\t" op " %%" r "14, %%" r "15, %%" r "7\n\t" op " %%" r "14, %%" r "15, %%" r "8\n\t" op \
     " %%" r "14, %%" r "15, %%" r "9\n\t" op " %%" r "14, %%" r "15, %%" r "10\n\t" op " %%" r   \
     "14, %%" r "15, %%" r "11\n\t" op " %%" r "14, %%" r "15, %%" r "12\n\t" op " %%" r          \
     "14, %%" r "15, %%" r "13\n\t"
#define OPS_CLOBBER14                                                                      \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
      "xmm11", "xmm12", "xmm13"

// Two instructions interleaved, 7 chains each (registers 0, 2, .. 12 for
// `a`, 1, 3, .. 13 for `b`): the pair's combined rate, against the two
// alone, says whether they compete for the same ports (e.g. the weight
// kernels' float update beside their vpdpbusd).
#define OPS_PAIR(a, b, r, i, j) \
  a " %%" r "14, %%" r "15, %%" r #i "\n\t" b " %%" r "14, %%" r "15, %%" r #j "\n\t"
#define OPS_MIX14(a, b, r) \
  OPS_PAIR(a, b, r, 0, 1)  \
  OPS_PAIR(a, b, r, 2, 3)  \
  OPS_PAIR(a, b, r, 4, 5)  \
  OPS_PAIR(a, b, r, 6, 7)  \
  OPS_PAIR(a, b, r, 8, 9) OPS_PAIR(a, b, r, 10, 11) OPS_PAIR(a, b, r, 12, 13)

constexpr int64_t kIssueIters = 1 << 16;
constexpr int kIssueChains = 14;

// Zeroes vector registers 0-15 (no denormal or NaN inputs for the FMA
// chains); upper halves included, so the 512-bit loops start clean too.
void zero_vector_registers() {
  __asm__ volatile(
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvmovdqa %%ymm0, %%ymm1\n\t"
      "vmovdqa %%ymm0, %%ymm2\n\tvmovdqa %%ymm0, %%ymm3\n\t"
      "vmovdqa %%ymm0, %%ymm4\n\tvmovdqa %%ymm0, %%ymm5\n\t"
      "vmovdqa %%ymm0, %%ymm6\n\tvmovdqa %%ymm0, %%ymm7\n\t"
      "vmovdqa %%ymm0, %%ymm8\n\tvmovdqa %%ymm0, %%ymm9\n\t"
      "vmovdqa %%ymm0, %%ymm10\n\tvmovdqa %%ymm0, %%ymm11\n\t"
      "vmovdqa %%ymm0, %%ymm12\n\tvmovdqa %%ymm0, %%ymm13\n\t"
      "vmovdqa %%ymm0, %%ymm14\n\tvmovdqa %%ymm0, %%ymm15\n\t" ::
          : OPS_CLOBBER14, "xmm14", "xmm15");
}

// AVX2. Arg: 0 vfmadd231ps, 1 vaddps, 2 vpmaddubsw, 3 vpmaddwd, 4 vpaddd.
template <int kOp>
void issue_chains() {
  zero_vector_registers();
  for (int64_t n = 0; n < kIssueIters; ++n) {
    if constexpr (kOp == 0) {
      __asm__ volatile(OPS_CHAINS14("vfmadd231ps", "ymm")::: OPS_CLOBBER14);
    } else if constexpr (kOp == 1) {
      __asm__ volatile(OPS_CHAINS14("vaddps", "ymm")::: OPS_CLOBBER14);
    } else if constexpr (kOp == 2) {
      __asm__ volatile(OPS_CHAINS14("vpmaddubsw", "ymm")::: OPS_CLOBBER14);
    } else if constexpr (kOp == 3) {
      __asm__ volatile(OPS_CHAINS14("vpmaddwd", "ymm")::: OPS_CLOBBER14);
    } else {
      __asm__ volatile(OPS_CHAINS14("vpaddd", "ymm")::: OPS_CLOBBER14);
    }
  }
  __asm__ volatile("vzeroupper" :::);
}

// AVX-512 (the weight kernels' VNNI path, the AVX-512 attention kernels).
// Arg: 0 vpdpbusd (64 int8 multiply-adds), 1 vfmadd231ps (16 f32), 2
// vpdpbusd and vfmadd231ps interleaved, 3 vpdpbusd and vaddps interleaved
// (2 and 3 count both instructions).
template <int kOp>
void issue_chains_zmm() {
  zero_vector_registers();
  for (int64_t n = 0; n < kIssueIters; ++n) {
    if constexpr (kOp == 0) {
      __asm__ volatile(OPS_CHAINS14("vpdpbusd", "zmm")::: OPS_CLOBBER14);
    } else if constexpr (kOp == 1) {
      __asm__ volatile(OPS_CHAINS14("vfmadd231ps", "zmm")::: OPS_CLOBBER14);
    } else if constexpr (kOp == 2) {
      __asm__ volatile(OPS_MIX14("vpdpbusd", "vfmadd231ps", "zmm")::: OPS_CLOBBER14);
    } else {
      __asm__ volatile(OPS_MIX14("vpdpbusd", "vaddps", "zmm")::: OPS_CLOBBER14);
    }
  }
  __asm__ volatile("vzeroupper" :::);
}

void issue_rate_counter(benchmark::State& state) {
  state.counters["instr/ns"] =
      benchmark::Counter(static_cast<double>(kIssueChains * kIssueIters) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Avx2IssueRate(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    state.SkipWithError("no AVX2/FMA on this CPU");
    return;
  }
  using Fn = void (*)();
  constexpr Fn kFns[] = {issue_chains<0>, issue_chains<1>, issue_chains<2>, issue_chains<3>,
                         issue_chains<4>};
  const Fn fn = kFns[state.range(0)];
  for (auto _ : state) fn();
  issue_rate_counter(state);
}
BENCHMARK(BM_Avx2IssueRate)->ArgName("op")->DenseRange(0, 4)->Unit(benchmark::kMicrosecond);

void BM_Avx512IssueRate(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni")) {
    state.SkipWithError("no AVX-512 F/VNNI on this CPU");
    return;
  }
  using Fn = void (*)();
  constexpr Fn kFns[] = {issue_chains_zmm<0>, issue_chains_zmm<1>, issue_chains_zmm<2>,
                         issue_chains_zmm<3>};
  const Fn fn = kFns[state.range(0)];
  for (auto _ : state) fn();
  issue_rate_counter(state);
}
BENCHMARK(BM_Avx512IssueRate)->ArgName("op")->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvstack

BENCHMARK_MAIN();

// Weight-matmul throughput per type and shape, and the machine's memory read
// bandwidth for comparison. Weights are replicated over >= 96 MiB and cycled,
// so (as in real decoding, ~98 MB of weights per token) they come from DRAM
// rather than cache.
#include <benchmark/benchmark.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
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

// ---- Per-block floors of a 16-row batched decode step (issue 23) ----
//
// A "block" here is what one 16-row step does per 16 weight columns and one
// 32-element weight block: 8192 int8 multiply-adds, then the float update of
// 16 x 16 outputs from their integer sums, which every kernel that keeps
// ggml's arithmetic for Q4_1 x Q8_1 / Q8_0 x Q8_0 does per block (the scale
// differs per block, so the sums cannot stay integer across blocks): per row
//   Q4_1: acc += (d_w * d_x) * float(sum); acc += m_w * s_x
//   Q8_0: acc += (d_w * d_x) * float(sum - 128 * qsum_x)
// (the weight kernels' per-block update, matmul_avx512.cpp, read from L1).
// SmolLM2's 16-row step is 207.4 K Q4_1 blocks and 55.3 K Q8_0 blocks.
constexpr int kFloorBlocks = 64;  // distinct blocks cycled (sums and scales in L1)

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -Wuninitialized reports inside the system
// header (GCC bug 105593); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

struct alignas(64) FloorData {
  int32_t sums[kFloorBlocks][16][16];  // [block][row][column]
  float dw[kFloorBlocks][16], mw[kFloorBlocks][16];
  float dx[kFloorBlocks][16], sx[kFloorBlocks][16];  // [block][row]
  int32_t off[kFloorBlocks][16];
};

std::unique_ptr<FloorData> make_floor_data() {
  auto f = std::make_unique<FloorData>();
  std::mt19937 rng(3);
  for (auto& b : f->sums) {
    for (auto& r : b) {
      for (int32_t& v : r) v = static_cast<int32_t>(rng() % 4001) - 2000;
    }
  }
  for (int b = 0; b < kFloorBlocks; ++b) {
    for (int i = 0; i < 16; ++i) {
      f->dw[b][i] = 1e-3f * static_cast<float>(1 + rng() % 100);
      f->mw[b][i] = -1e-3f * static_cast<float>(1 + rng() % 100);
      f->dx[b][i] = 1e-2f * static_cast<float>(1 + rng() % 100);
      f->sx[b][i] = 1e-1f * static_cast<float>(rng() % 100);
      f->off[b][i] = 128 * static_cast<int32_t>(rng() % 200);
    }
  }
  return f;
}

// One block's float update of 16 rows (kQ41: Q4_1's, else Q8_0's), from
// sums at `sums` (16 rows of 16 int32).
template <bool kQ41>
__attribute__((target("avx512f"), always_inline)) inline void floor_update(const FloorData& f,
                                                                           int b,
                                                                           const int32_t* sums,
                                                                           __m512* acc) {
  const __m512 dw = _mm512_load_ps(f.dw[b]);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    __m512i s = _mm512_load_si512(sums + 16 * r);
    if constexpr (!kQ41) s = _mm512_sub_epi32(s, _mm512_set1_epi32(f.off[b][r]));
    const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(f.dx[b][r]));
    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s)));
    if constexpr (kQ41) {
      acc[r] =
          _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_load_ps(f.mw[b]), _mm512_set1_ps(f.sx[b][r])));
    }
  }
}

template <bool kQ41>
__attribute__((target("avx512f"), noinline)) float floor_update_loop(const FloorData& f,
                                                                     int64_t n) {
  __m512 acc[16];
  for (__m512& v : acc) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const int b = static_cast<int>(i % kFloorBlocks);
    floor_update<kQ41>(f, b, f.sums[b][0], acc);
  }
  __m512 t = acc[0];
  for (int r = 1; r < 16; ++r) t = _mm512_add_ps(t, acc[r]);
  return _mm512_reduce_add_ps(t);
}

constexpr int64_t kFloorIters = 1 << 14;

// Reports block_ns: nanoseconds per block over the timed loop.
void floor_counter(benchmark::State& state, std::chrono::steady_clock::time_point t0) {
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  state.counters["block_ns"] =
      ns / (static_cast<double>(state.iterations()) * static_cast<double>(kFloorIters));
}

// BM_BlockUpdate/fmt: the float update alone (fmt 0: Q4_1, 1: Q8_0), one core.
void BM_BlockUpdate(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512 F on this CPU");
    return;
  }
  const auto f = make_floor_data();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    benchmark::DoNotOptimize(state.range(0) == 0 ? floor_update_loop<true>(*f, kFloorIters)
                                                 : floor_update_loop<false>(*f, kFloorIters));
  }
  floor_counter(state, t0);
}
BENCHMARK(BM_BlockUpdate)->ArgName("fmt")->DenseRange(0, 1)->Unit(benchmark::kMicrosecond);

// AMX-INT8: CPUID's AMX-TILE and AMX-INT8, the OS saving tile state (XCR0
// bits 17-18) and Linux granting this process tile data (arch_prctl).
bool amx_int8_granted() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || ((d >> 24) & 3u) != 3u) return false;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || ((c >> 27) & 1u) == 0) return false;  // OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Block k's tile product on tile set k % 2: A = 16 activation rows x 32
// int8 at stride 576 (tmm2 / tmm4), B = 8 rows of 16 columns' dwords (tmm3 /
// tmm5), C = 16 x 16 int32 (tmm0 / tmm1), stored to sums[k % 2]. With
// kUpdate, the other buffer's block (stored one product earlier, so the
// update does not wait on its store) gets the Q4_1 float update meanwhile.
template <bool kUpdate>
__attribute__((target("avx512f"), noinline)) float amx_block_loop(const FloorData& f,
                                                                  const int8_t* act,
                                                                  const uint8_t* wts,
                                                                  int32_t (*sums)[256], int64_t n) {
  __m512 acc[16];
  for (__m512& v : acc) v = _mm512_setzero_ps();
  const long lda = 576, ldb = 64, ldc = 64;
  for (int64_t i = 0; i < n; i += 2) {
    const int b = static_cast<int>(i % kFloorBlocks);
    const int8_t* a0 = act + 32 * (b % 18);
    const uint8_t* w0 = wts + 512 * b;
    __asm__ volatile(
        "tileloadd (%0,%2,1), %%tmm2\n\ttileloadd (%1,%3,1), %%tmm3\n\t"
        "tilezero %%tmm0\n\ttdpbsud %%tmm3, %%tmm2, %%tmm0\n\ttilestored %%tmm0, (%4,%5,1)" ::"r"(
            a0),
        "r"(w0), "r"(lda), "r"(ldb), "r"(sums[0]), "r"(ldc)
        : "memory");
    if constexpr (kUpdate) floor_update<true>(f, b + 1, sums[1], acc);
    __asm__ volatile(
        "tileloadd (%0,%2,1), %%tmm4\n\ttileloadd (%1,%3,1), %%tmm5\n\t"
        "tilezero %%tmm1\n\ttdpbsud %%tmm5, %%tmm4, %%tmm1\n\ttilestored %%tmm1, (%4,%5,1)" ::"r"(
            a0 + 32),
        "r"(w0 + 512), "r"(lda), "r"(ldb), "r"(sums[1]), "r"(ldc)
        : "memory");
    if constexpr (kUpdate) floor_update<true>(f, b, sums[0], acc);
  }
  __m512 t = acc[0];
  for (int r = 1; r < 16; ++r) t = _mm512_add_ps(t, acc[r]);
  return _mm512_reduce_add_ps(t);
}

// BM_AmxTileBlock/update: AMX-INT8 tile products of 16 x 16 x 32 blocks
// (update 0: products and their stores only; 1: each with the Q4_1 float
// update of BM_BlockUpdate, software-pipelined), one core; skipped without
// AMX-INT8. The integer half of a block on the tile unit, and whether it
// overlaps the float update on the vector ports.
void BM_AmxTileBlock(benchmark::State& state) {
  static const bool amx = amx_int8_granted();
  if (!amx) {
    state.SkipWithError("no AMX-INT8 on this CPU (or the OS does not grant tile data)");
    return;
  }
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {2, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 32;
  for (int t : {3, 5}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  const auto f = make_floor_data();
  std::vector<int8_t> act(16 * 576);
  std::vector<uint8_t> wts(512 * (kFloorBlocks + 1));
  std::mt19937 rng(4);
  for (int8_t& v : act) v = static_cast<int8_t>(rng());
  for (uint8_t& v : wts) v = static_cast<uint8_t>(rng() & 0x0f);
  alignas(64) int32_t sums[2][256];
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        state.range(0) == 0 ? amx_block_loop<false>(*f, act.data(), wts.data(), sums, kFloorIters)
                            : amx_block_loop<true>(*f, act.data(), wts.data(), sums, kFloorIters));
  }
  floor_counter(state, t0);
  __asm__ volatile("tilerelease" ::: "memory");
}
BENCHMARK(BM_AmxTileBlock)->ArgName("update")->DenseRange(0, 1)->Unit(benchmark::kMicrosecond);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace kvstack

BENCHMARK_MAIN();

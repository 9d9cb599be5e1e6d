// Decode attention kernel benchmark (issues 3 and 7): one sequence, one
// query row, `ctx` cached tokens in one layer.
//
// BM_DecodeAttention/ctx/shape/fmt/threads measures, interleaved run by run
// so that load from other processes hits all of them alike:
//   - paged:  the KV in blocks of 16 tokens, block table shuffled;
//   - contig: the same format in one block as long as the context (same
//             kernel, identity table);
//   - f16:    paged f16 (only for fmt != f16), the quantized formats' yardstick;
//   - memory: a streaming read of a buffer much larger than the LLC on the
//             same pool and thread count (the machine's read bandwidth).
// Each timed step starts with its KV out of every cache level (flush_lines
// over its bytes): before session 14 a step followed another over the same
// blocks, so a 12 MiB int8 context (and part of a 24 MiB f16 one) came from
// L3, and until session 18 the eviction was a 64 MiB read, which a host
// with a 480 MiB L3 (the Intel Xeon of session 18) did not evict: f16 at
// 32K took 1.10 ms there instead of 1.46 ms from memory.
// The reported time is the paged median; counters (medians of the runs):
//   paged/contig   contiguous time / paged time (>= 0.9 is the target)
//   kv_GB/s        KV bytes the step reads (codes + metadata) / paged time
//   mem_GB/s       measured read bandwidth
//   bw_frac        kv_GB/s / mem_GB/s (>= 0.7 at 32K is the target)
//   vs_f16         paged time / paged f16 time (< 1: faster than f16)
//   vs_avx2        paged time / the same step with the attention kernels
//                  capped at AVX2 (set_isa_override), when the default
//                  decode path is another one (AVX-512 f16 or VNNI); else 1
// and the same ratios from process CPU time (suffix _cpu), which on a
// machine shared with other jobs leave out the time spent waiting for a core
// (with threads > 1 they include the pool's spin-waiting).
//
//   attention_bench --benchmark_counters_tabular=true
//
// Arguments: ctx; shape (0: 9 q / 3 kv heads, d 64 = SmolLM2; 1: 32 / 8,
// d 128); fmt (0 f32, 1 f16, 2 bf16, 3 fp8, 4 int8, 5 int4); threads.
// BM_DecodeLayers (below) times a whole model's decode attention.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/paged_attention.h"
#include "core/cpu_features.h"
#include "kv/kv_codec.h"
#include "kv/kv_write.h"
#include "kv/layout.h"
#include "kv/retention.h"

namespace kvstack {
namespace {

using Clock = std::chrono::steady_clock;

// CPU seconds used by the whole process (every pool thread): on a machine
// shared with other jobs this excludes the time the threads wait for a core.
double process_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Timing {
  double wall = 0.0;  // seconds
  double cpu = 0.0;   // CPU seconds of the process
};

struct Shape {
  int n_q_heads;
  int n_kv_heads;
  int head_dim;
};
constexpr Shape kShapes[] = {{9, 3, 64}, {32, 8, 128}};
constexpr KvDtype kFormats[] = {KvDtype::kF32, KvDtype::kF16,  KvDtype::kBF16,
                                KvDtype::kFp8, KvDtype::kInt8, KvDtype::kInt4};

// Buffers are anonymous mappings with transparent huge pages requested, as a
// block pool's should be (KVSTACK_BENCH_NO_HUGEPAGES=1 to compare).
struct Unmap {
  size_t bytes;     // the mapping (whole 2 MiB pages)
  size_t used = 0;  // the bytes asked for, which the caller fills
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
  return Bytes(static_cast<uint8_t*>(p), Unmap{bytes, n});
}

int64_t align64(int64_t x) {
  return (x + 63) / 64 * 64;
}

// One layer of one sequence of `ctx` tokens. Paged: blocks of `block_size`
// tokens laid out by KvLayout, exactly as the block pool lays them out (per
// KV head a K tile then its V tile, then the metadata regions). Contiguous:
// one block as long as the context, so each head's K and V are one run each.
struct KvSetup {
  Bytes pool;
  PagedKvLayerView view;
  std::vector<int32_t> table;
  int64_t payload_bytes = 0;  // K + V codes and metadata the step reads
};

KvSetup make_kv(const Shape& sh, KvDtype dtype, int ctx, bool paged) {
  KvSetup s;
  const int block_size = paged ? 16 : ctx;
  const int n_blocks = (ctx + block_size - 1) / block_size;
  const KvRowGeometry geo = *kv_row_geometry(dtype, sh.head_dim);
  PagedKvLayerView& v = s.view;
  if (paged) {
    const KvLayout layout = *KvLayout::uniform(1, sh.n_kv_heads, sh.head_dim, dtype, block_size);
    s.pool = alloc_bytes(static_cast<size_t>(layout.block_bytes()) * n_blocks);
    v = layout.layer_view(0, s.pool.get());
  } else {
    const int64_t tile = geo.row_bytes * block_size;
    const int64_t data_bytes = align64(2 * tile * sh.n_kv_heads);
    const int64_t meta_head = geo.meta_row_bytes * block_size + geo.meta_block_bytes;
    const int64_t meta_bytes = align64(meta_head * sh.n_kv_heads);
    v.dtype = dtype;
    v.block_size = block_size;
    v.n_kv_heads = sh.n_kv_heads;
    v.head_dim = sh.head_dim;
    v.slot_stride = geo.row_bytes;
    v.head_stride = 2 * tile;
    v.block_stride = data_bytes + (kv_dtype_is_quantized(dtype) ? 2 * meta_bytes : 0);
    s.pool = alloc_bytes(static_cast<size_t>(v.block_stride) * n_blocks);
    v.k = s.pool.get();
    v.v = s.pool.get() + tile;
    if (kv_dtype_is_quantized(dtype)) {
      v.k_meta = s.pool.get() + data_bytes;
      v.v_meta = v.k_meta + meta_bytes;
      v.k_meta_head_stride = v.v_meta_head_stride = meta_head;
      v.k_meta_slot_stride = v.v_meta_slot_stride = geo.meta_row_bytes;
    }
  }
  s.table.resize(n_blocks);
  std::iota(s.table.begin(), s.table.end(), 0);
  if (paged) std::shuffle(s.table.begin(), s.table.end(), std::mt19937(7));
  uint32_t x = 11;  // xorshift: values in [-1, 1); the kernels' speed does not depend on them
  auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return static_cast<float>(static_cast<int32_t>(x)) * (1.0f / 2147483648.0f);
  };
  const int chunk = 1024;
  std::vector<float> k(static_cast<size_t>(chunk) * sh.n_kv_heads * sh.head_dim), vv(k.size());
  for (int p = 0; p < ctx; p += chunk) {
    for (float& e : k) e = next();
    for (float& e : vv) e = next();
    write_kv(v, s.table, p, k.data(), vv.data(), std::min(chunk, ctx - p));
  }
  s.payload_bytes = 2 * (int64_t{ctx} * sh.n_kv_heads * (geo.row_bytes + geo.meta_row_bytes) +
                         int64_t{n_blocks} * sh.n_kv_heads * geo.meta_block_bytes);
  return s;
}

// Writes back and drops every cache line of b's used bytes from every level,
// so that the next step over them reads memory, whatever the size of the
// LLC (clflush, in every x86-64 CPU; 24 MiB in ~13 ms on session 18's
// host). Not clflushopt, 13x faster there: its invalidations were still
// under way when the step began, and int8 at 32K measured 0.60x f16's time
// after it against 0.50x after clflush, after clflushopt and a 5 ms wait,
// and after a 1 GiB read.
void flush_lines(const Bytes& b) {
  for (size_t off = 0; off < b.get_deleter().used; off += 64) _mm_clflush(b.get() + off);
  _mm_mfence();
}

// The last-level cache's size as the OS reports it (glibc's sysconf), or
// 32 MiB where it reports none.
int64_t llc_bytes() {
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const long llc = l3 > 0 ? l3 : l2;
  return llc > 0 ? llc : int64_t{32} << 20;
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

// Streaming read of a buffer, split evenly across the pool's threads;
// seconds per pass. By default 4x the LLC, at least 256 MiB (256 MiB was
// within the 480 MiB L3 of session 18's host): the memory's read rate.
class MemReader {
 public:
  MemReader() : MemReader(std::max<int64_t>(int64_t{256} << 20, 4 * llc_bytes())) {}
  explicit MemReader(int64_t bytes)
      : bytes_(bytes), buf_(alloc_bytes(static_cast<size_t>(bytes_))) {
    std::memset(buf_.get(), 0, static_cast<size_t>(bytes_));  // touch every page
  }
  // One streaming read of the whole buffer, timed.
  Timing pass_seconds(ThreadPool& pool) { return read(pool, bytes_); }
  int64_t bytes() const { return bytes_; }

 private:
  // The first `bytes` of the buffer, split over the pool's threads.
  Timing read(ThreadPool& pool, int64_t bytes) {
    const int n_threads = pool.n_threads();
    std::vector<float> sums(n_threads);
    const auto* f = reinterpret_cast<const float*>(buf_.get());
    const int64_t n = bytes / 4;
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    pool.run([&](int t) {
      const int64_t b = n * t / n_threads / 32 * 32;
      const int64_t e = n * (t + 1) / n_threads / 32 * 32;
      sums[t] = read_sum_avx2(f + b, e - b);
    });
    const Timing tm{std::chrono::duration<double>(Clock::now() - t0).count(),
                    process_cpu_seconds() - c0};
    benchmark::DoNotOptimize(sums.data());
    return tm;
  }

  int64_t bytes_;
  Bytes buf_;
};

// The attention parameters of a shape, with the usual 1/sqrt(head_dim) scale.
AttnParams attn_params(const Shape& sh) {
  return AttnParams{.n_q_heads = sh.n_q_heads,
                    .n_kv_heads = sh.n_kv_heads,
                    .head_dim = sh.head_dim,
                    .scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim))};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void BM_DecodeAttention(benchmark::State& state) {
  const int ctx = static_cast<int>(state.range(0));
  const Shape sh = kShapes[state.range(1)];
  const KvDtype fmt = kFormats[state.range(2)];
  ThreadPool pool(static_cast<int>(state.range(3)));
  if (best_isa() < Isa::kAvx2) {
    state.SkipWithError("needs AVX2 (memory read loop)");
    return;
  }
  KvSetup paged = make_kv(sh, fmt, ctx, true);
  KvSetup contig = make_kv(sh, fmt, ctx, false);
  std::unique_ptr<KvSetup> f16;
  if (fmt != KvDtype::kF16) f16 = std::make_unique<KvSetup>(make_kv(sh, KvDtype::kF16, ctx, true));
  MemReader mem;
  std::vector<float> q(static_cast<size_t>(sh.n_q_heads) * sh.head_dim);
  std::vector<float> out(q.size());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (float& x : q) x = nd(rng);
  const AttnParams p = attn_params(sh);
  auto step = [&](const KvSetup& kv) {
    flush_lines(kv.pool);  // every timed step starts with its KV out of cache
    const AttnSeq seq{.block_table = kv.table.data(),
                      .n_blocks = static_cast<int32_t>(kv.table.size()),
                      .n_past = ctx - 1,
                      .n_new = 1,
                      .q = q.data(),
                      .out = out.data()};
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    const Status st = paged_attention(kv.view, p, std::span<const AttnSeq>(&seq, 1), &pool);
    Timing tm{std::chrono::duration<double>(Clock::now() - t0).count(), process_cpu_seconds() - c0};
    benchmark::DoNotOptimize(out.data());
    if (!st.ok()) tm.wall = -1.0;
    return tm;
  };
  // The same paged step with the attention kernels capped at AVX2
  // (set_isa_override; this bench runs no matmuls), interleaved, when the
  // default decode path is another one (AVX-512 f16 or VNNI): counter
  // vs_avx2 = default / avx2 time.
  const Isa best = best_isa();
  const std::string best_name = attention_kernel_name(fmt, fmt, sh.head_dim);
  set_isa_override(Isa::kAvx2);
  const bool cmp_avx2 = attention_kernel_name(fmt, fmt, sh.head_dim) != best_name;
  set_isa_override(best);
  auto step_avx2 = [&] {
    set_isa_override(Isa::kAvx2);
    const Timing tm = step(paged);
    set_isa_override(best);
    return tm;
  };
  // [wall, cpu] samples of paged, contig, f16, memory read, avx2-capped.
  std::vector<double> t[5][2];
  auto add = [&](int which, const Timing& tm) {
    t[which][0].push_back(tm.wall);
    t[which][1].push_back(tm.cpu);
  };
  int iter = 0;
  for (auto _ : state) {
    const Timing tp = step(paged);
    if (tp.wall < 0) {
      state.SkipWithError("paged_attention failed");
      break;
    }
    state.SetIterationTime(tp.wall);
    add(0, tp);
    add(1, step(contig));
    if (f16) add(2, step(*f16));
    if (cmp_avx2) add(4, step_avx2());
    if (iter++ % 8 == 0) add(3, mem.pass_seconds(pool));
  }
  // Ratios from wall time, and (suffix _cpu) from process CPU time.
  for (int c = 0; c < 2; ++c) {
    const std::string sfx = c == 0 ? "" : "_cpu";
    const double mp = median(t[0][c]);
    const double mem_bps = static_cast<double>(mem.bytes()) / median(t[3][c]);
    const double kv_bps = static_cast<double>(paged.payload_bytes) / mp;
    state.counters["paged/contig" + sfx] = median(t[1][c]) / mp;
    state.counters["kv_GB/s" + sfx] = kv_bps * 1e-9;
    state.counters["mem_GB/s" + sfx] = mem_bps * 1e-9;
    state.counters["bw_frac" + sfx] = kv_bps / mem_bps;
    state.counters["vs_f16" + sfx] = f16 ? mp / median(t[2][c]) : 1.0;
    state.counters["vs_avx2" + sfx] = cmp_avx2 ? mp / median(t[4][c]) : 1.0;
  }
  state.counters["kv_MiB"] = static_cast<double>(paged.payload_bytes) / (1 << 20);
  state.SetLabel(std::string(kv_dtype_name(fmt)) + "/" +
                 attention_kernel_name(fmt, fmt, sh.head_dim));
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ctx", "shape", "fmt", "threads"});
  for (int threads : {2, 1}) {
    for (int shape : {0, 1}) {
      for (int fmt : {1, 4, 5, 3, 0, 2}) {
        for (int ctx : {512, 1024, 4096, 16384, 32768}) b->Args({ctx, shape, fmt, threads});
      }
      // 128K: one layer of f16 KV (96 MiB on the SmolLM2 shape), the size
      // of a whole model's step at 4K.
      if (shape == 0) b->Args({131072, shape, 1, threads});
    }
  }
}

BENCHMARK(BM_DecodeAttention)->Apply(decode_args)->Unit(benchmark::kMicrosecond)->UseManualTime();

// BM_DecodeLayers/ctx/threads: one decode step's attention over every layer
// of the SmolLM2 shape (30 layers, f16 KV, blocks of 16 tokens holding all
// layers, in table order, as the engine's block pool lays out a sequence),
// i.e. what a whole-model decode step reads (4K: 90 MiB), flushed from
// the caches before each step (within a 480 MiB L3 otherwise).
// The reported time is the default kernels' median; counter vs_avx2 = that
// over the same step with the attention capped at AVX2, interleaved step by
// step (and _cpu from process CPU time).
void BM_DecodeLayers(benchmark::State& state) {
  const int ctx = static_cast<int>(state.range(0));
  ThreadPool pool(static_cast<int>(state.range(1)));
  const Shape sh = kShapes[0];
  constexpr int kLayers = 30;
  const int block_size = 16;
  const int n_blocks = (ctx + block_size - 1) / block_size;
  const KvLayout layout =
      *KvLayout::uniform(kLayers, sh.n_kv_heads, sh.head_dim, KvDtype::kF16, block_size);
  Bytes mem = alloc_bytes(static_cast<size_t>(layout.block_bytes()) * n_blocks);
  std::vector<int32_t> table(n_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(ctx) * sh.n_kv_heads * sh.head_dim), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (int l = 0; l < kLayers; ++l)
    write_kv(layout.layer_view(l, mem.get()), table, 0, k.data(), v.data(), ctx);
  std::vector<float> q(static_cast<size_t>(kLayers) * sh.n_q_heads * sh.head_dim);
  std::vector<float> out(q.size());
  for (float& x : q) x = nd(rng);
  const AttnParams p = attn_params(sh);
  const Isa best = best_isa();
  auto step = [&](Isa isa) {
    set_isa_override(isa);
    flush_lines(mem);  // the KV from memory, as a long context's step finds it
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    bool ok = true;
    for (int l = 0; l < kLayers; ++l) {
      const size_t off = static_cast<size_t>(l) * sh.n_q_heads * sh.head_dim;
      const AttnSeq seq{.block_table = table.data(),
                        .n_blocks = n_blocks,
                        .n_past = ctx - 1,
                        .n_new = 1,
                        .q = q.data() + off,
                        .out = out.data() + off};
      ok = ok && paged_attention(layout.layer_view(l, mem.get()), p,
                                 std::span<const AttnSeq>(&seq, 1), &pool)
                     .ok();
    }
    Timing tm{std::chrono::duration<double>(Clock::now() - t0).count(), process_cpu_seconds() - c0};
    benchmark::DoNotOptimize(out.data());
    set_isa_override(best);
    if (!ok) tm.wall = -1.0;
    return tm;
  };
  std::vector<double> t[2][2];
  for (auto _ : state) {
    const Timing a = step(best);
    if (a.wall < 0) {
      state.SkipWithError("paged_attention failed");
      break;
    }
    state.SetIterationTime(a.wall);
    const Timing b = step(Isa::kAvx2);
    t[0][0].push_back(a.wall);
    t[0][1].push_back(a.cpu);
    t[1][0].push_back(b.wall);
    t[1][1].push_back(b.cpu);
  }
  state.counters["vs_avx2"] = median(t[0][0]) / median(t[1][0]);
  state.counters["vs_avx2_cpu"] = median(t[0][1]) / median(t[1][1]);
  state.counters["avx2_ms"] = median(t[1][0]) * 1e3;
  state.counters["kv_GB/s"] =
      2.0 * kLayers * ctx * sh.n_kv_heads * sh.head_dim * 2 / median(t[0][0]) * 1e-9;
  state.SetLabel("f16/" + attention_kernel_name(KvDtype::kF16, KvDtype::kF16, sh.head_dim));
}

BENCHMARK(BM_DecodeLayers)
    ->ArgNames({"ctx", "threads"})
    ->ArgsProduct({{1024, 4096, 8192}, {2, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseManualTime();

// BM_DecodeBatch/ctx/fmt/threads: the attention of one 16-sequence decode
// step over every layer of the SmolLM2 shape (30 layers, blocks of 16
// tokens holding all layers, the 16 sequences' blocks shuffled through one
// pool as the engine's block pool hands them out), each sequence at `ctx`
// cached tokens: the attention half of `kvstack bench --batch 16` (whose
// 512-token prompts put each tile at 513..528 keys: two split-K pieces, the
// second 1..16 keys), its KV flushed from the caches before each step
// (97-189 MB, within a 480 MiB L3 otherwise). Reported: fmt's median; counter vs_f16 = that over
// the same step on f16 KV, interleaved step by step; kv_GB/s the fmt's KV
// bytes (codes + metadata) over its time.
void BM_DecodeBatch(benchmark::State& state) {
  const int ctx = static_cast<int>(state.range(0));
  const KvDtype fmt = kFormats[state.range(1)];
  ThreadPool pool(static_cast<int>(state.range(2)));
  const Shape sh = kShapes[0];
  constexpr int kLayers = 30;
  constexpr int kSeqs = 16;
  const int block_size = 16;
  const int per_seq = (ctx + block_size - 1) / block_size;
  struct Pool {
    KvLayout layout;
    Bytes mem;
  };
  std::vector<int32_t> perm(static_cast<size_t>(per_seq) * kSeqs);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(9));
  std::vector<std::vector<int32_t>> tables(kSeqs);
  for (int s = 0; s < kSeqs; ++s) {
    tables[s].assign(perm.begin() + static_cast<ptrdiff_t>(s) * per_seq,
                     perm.begin() + static_cast<ptrdiff_t>(s + 1) * per_seq);
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(ctx) * sh.n_kv_heads * sh.head_dim), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  auto make_pool = [&](KvDtype dt) {
    Pool pl{*KvLayout::uniform(kLayers, sh.n_kv_heads, sh.head_dim, dt, block_size),
            Bytes(nullptr, Unmap{0})};
    pl.mem = alloc_bytes(static_cast<size_t>(pl.layout.block_bytes()) * per_seq * kSeqs);
    for (int l = 0; l < kLayers; ++l) {
      for (int s = 0; s < kSeqs; ++s)
        write_kv(pl.layout.layer_view(l, pl.mem.get()), tables[s], 0, k.data(), v.data(), ctx);
    }
    return pl;
  };
  Pool qp = make_pool(fmt);
  Pool fp = make_pool(KvDtype::kF16);
  std::vector<float> q(static_cast<size_t>(kLayers) * kSeqs * sh.n_q_heads * sh.head_dim);
  std::vector<float> out(q.size());
  for (float& x : q) x = nd(rng);
  const AttnParams p = attn_params(sh);
  auto step = [&](const Pool& pl) {
    flush_lines(pl.mem);  // KV from memory (it would fit a large LLC)
    const auto t0 = Clock::now();
    bool ok = true;
    AttnSeq seqs[kSeqs];
    for (int l = 0; l < kLayers; ++l) {
      for (int s = 0; s < kSeqs; ++s) {
        const size_t off = (static_cast<size_t>(l) * kSeqs + s) * sh.n_q_heads * sh.head_dim;
        seqs[s] = AttnSeq{.block_table = tables[s].data(),
                          .n_blocks = per_seq,
                          .n_past = ctx - 1,
                          .n_new = 1,
                          .q = q.data() + off,
                          .out = out.data() + off};
      }
      ok = ok && paged_attention(pl.layout.layer_view(l, pl.mem.get()), p,
                                 std::span<const AttnSeq>(seqs, kSeqs), &pool)
                     .ok();
    }
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    benchmark::DoNotOptimize(out.data());
    return ok ? t : -1.0;
  };
  std::vector<double> tq, tf;
  for (auto _ : state) {
    const double a = step(qp);
    if (a < 0) {
      state.SkipWithError("paged_attention failed");
      break;
    }
    state.SetIterationTime(a);
    tq.push_back(a);
    tf.push_back(step(fp));
  }
  const KvRowGeometry geo = *kv_row_geometry(fmt, sh.head_dim);
  const double bytes = 2.0 * kLayers * kSeqs * sh.n_kv_heads *
                       (static_cast<double>(ctx) * (geo.row_bytes + geo.meta_row_bytes) +
                        static_cast<double>(per_seq) * geo.meta_block_bytes);
  state.counters["vs_f16"] = median(tq) / median(tf);
  state.counters["f16_ms"] = median(tf) * 1e3;
  state.counters["kv_GB/s"] = bytes / median(tq) * 1e-9;
  state.SetLabel(std::string(kv_dtype_name(fmt)) + "/" +
                 attention_kernel_name(fmt, fmt, sh.head_dim));
}

BENCHMARK(BM_DecodeBatch)
    ->ArgNames({"ctx", "fmt", "threads"})
    ->ArgsProduct({{520, 2048}, {4, 5}, {2, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseManualTime();

// BM_CacheRead/mib/threads: a streaming read of `mib` MiB, split over the
// pool's threads, that the previous read of the same bytes left in the
// caches: with a large LLC (480 MiB on session 18's host) the rate at which
// a 16-sequence step's KV (97 MiB int8, 189 MiB f16, at context 520) can be
// read where it stays cached between steps, the attention half's floor in
// `kvstack bench --batch 16`. Reported: GB/s (1e9 bytes per second, the
// median pass) and that pass's time.
void BM_CacheRead(benchmark::State& state) {
  ThreadPool pool(static_cast<int>(state.range(1)));
  MemReader mem(state.range(0) << 20);
  mem.pass_seconds(pool);  // into the caches
  std::vector<double> t;
  for (auto _ : state) {
    t.push_back(mem.pass_seconds(pool).wall);
    state.SetIterationTime(t.back());
  }
  state.counters["GB/s"] = static_cast<double>(mem.bytes()) / median(t) * 1e-9;
  state.counters["pass_ms"] = median(t) * 1e3;
}
BENCHMARK(BM_CacheRead)
    ->ArgNames({"mib", "threads"})
    ->ArgsProduct({{97, 189}, {2, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseManualTime();

// BM_KvEncodeRow/fmt: kv_encode_row on one row of d = 64 (the SmolLM2
// head), the KV write's per-row cost (a decode step writes K and V of every
// new token, KV head and layer: 2 x 3 x 30 = 180 rows per token, one after
// another in write_kv); counter step16 = that for the 16 tokens of a
// 16-sequence step.
void BM_KvEncodeRow(benchmark::State& state) {
  const KvDtype fmt = kFormats[state.range(0)];
  constexpr int kD = 64, kRows = 1024;
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(kRows) * kD);
  for (float& e : x) e = nd(rng);
  std::vector<uint8_t> row(4 * kD), meta(4 * kD);
  int r = 0;
  for (auto _ : state) {
    kv_encode_row(fmt, x.data() + static_cast<size_t>(r) * kD, kD, row.data(), meta.data());
    benchmark::DoNotOptimize(row.data());
    r = (r + 1) % kRows;
  }
  // elapsed / (iterations / 2880 rows): seconds per 2880 rows
  state.counters["step16"] =
      benchmark::Counter(static_cast<double>(state.iterations()) / (16.0 * 180),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetLabel(kv_dtype_name(fmt));
}

BENCHMARK(BM_KvEncodeRow)->ArgName("fmt")->Arg(1)->Arg(4)->Arg(5)->Unit(benchmark::kNanosecond);

// BM_DecodeMass/ctx/shape/fmt/threads: the H2O key-mass output's cost. The
// same paged step without and with AttnSeq::key_mass, interleaved run by
// run; the reported time is the plain median, the counter `mass/plain` the
// ratio of the medians (wall) and `mass/plain_cpu` of process CPU time.
// Also `budget/exact`: the step over a 1/8 prefix of the keys (the
// attention of a retention budget of ctx/8, e.g. 1K of 8K) / the full step.
void BM_DecodeMass(benchmark::State& state) {
  const int ctx = static_cast<int>(state.range(0));
  const Shape sh = kShapes[state.range(1)];
  const KvDtype fmt = kFormats[state.range(2)];
  ThreadPool pool(static_cast<int>(state.range(3)));
  KvSetup paged = make_kv(sh, fmt, ctx, true);
  std::vector<float> q(static_cast<size_t>(sh.n_q_heads) * sh.head_dim);
  std::vector<float> out(q.size()), mass(static_cast<size_t>(ctx));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (float& x : q) x = nd(rng);
  const AttnParams p = attn_params(sh);
  auto step = [&](bool with_mass, int n_keys) {
    std::fill(mass.begin(), mass.end(), 0.0f);
    const AttnSeq seq{.block_table = paged.table.data(),
                      .n_blocks = static_cast<int32_t>(paged.table.size()),
                      .n_past = n_keys - 1,
                      .n_new = 1,
                      .q = q.data(),
                      .out = out.data(),
                      .key_mass = with_mass ? mass.data() : nullptr};
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    const Status st = paged_attention(paged.view, p, std::span<const AttnSeq>(&seq, 1), &pool);
    Timing tm{std::chrono::duration<double>(Clock::now() - t0).count(), process_cpu_seconds() - c0};
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(mass.data());
    if (!st.ok()) tm.wall = -1.0;
    return tm;
  };
  std::vector<double> t[3][2];  // plain, mass, budget
  auto add = [&](int which, const Timing& tm) {
    t[which][0].push_back(tm.wall);
    t[which][1].push_back(tm.cpu);
  };
  for (auto _ : state) {
    const Timing tp = step(false, ctx);
    if (tp.wall < 0) {
      state.SkipWithError("paged_attention failed");
      break;
    }
    state.SetIterationTime(tp.wall);
    add(0, tp);
    add(1, step(true, ctx));
    add(2, step(false, std::max(1, ctx / 8)));
  }
  for (int c = 0; c < 2; ++c) {
    const std::string sfx = c == 0 ? "" : "_cpu";
    state.counters["mass/plain" + sfx] = median(t[1][c]) / median(t[0][c]);
    state.counters["budget/exact" + sfx] = median(t[2][c]) / median(t[0][c]);
  }
  state.SetLabel(std::string(kv_dtype_name(fmt)) + "/" +
                 attention_kernel_name(fmt, fmt, sh.head_dim));
}

void mass_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ctx", "shape", "fmt", "threads"});
  for (int threads : {2, 1}) {
    for (int fmt : {1, 4}) {
      for (int ctx : {1024, 8192, 32768}) b->Args({ctx, 0, fmt, threads});
    }
  }
}

BENCHMARK(BM_DecodeMass)->Apply(mass_args)->Unit(benchmark::kMicrosecond)->UseManualTime();

// BM_H2oSelect/n: the policy side of H2O, one h2o_keep_slots call (budget
// 512, window 512) over a KV group of n resident slots with random mass: the
// engine calls it once per layer (SmolLM2: 30) on the steps that compact.
void BM_H2oSelect(benchmark::State& state) {
  const auto n = static_cast<size_t>(state.range(0));
  RetentionConfig c;
  c.policy = RetentionPolicy::kH2o;
  c.budget = 512;
  c.window = 512;
  std::vector<float> mass(n);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> ud(0.0f, 4.0f);
  for (float& x : mass) x = ud(rng);
  for (auto _ : state) {
    std::vector<int64_t> keep = h2o_keep_slots(c, mass);
    benchmark::DoNotOptimize(keep.data());
  }
}
BENCHMARK(BM_H2oSelect)->Arg(1040)->Arg(8192)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvstack

BENCHMARK_MAIN();

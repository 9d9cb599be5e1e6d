// Decode attention of one MLA layer, latent against expanded (docs/benchmarks.md,
// "MLA"): one sequence of `ctx` cached tokens and one query row, DeepSeek-V2's
// per-layer widths with 16 heads (d_c 512, d_R 64; expanded: 16 KV heads of
// 192 dims, V padded to 192 as the engine's expanded cache stores it).
//   latent   mla_attention() on a [ctx][576] latent layer (f16, int8), the
//            kernel best_isa() picks (KVSTACK_ISA caps it), and the scalar
//            reference;
//   expanded paged_attention() on a standard 16 x 192 f16 layer.
// Prints, per case: bytes the step reads (the whole resident cache of the
// layer), the fastest and the median of --reps calls, and the read bandwidth
// of the fastest.
//
// --prefill 16,64,512: instead, a prefill chunk of n_new rows on top of ctx
// cached tokens (n_past = ctx), latent f16 and int8: the absorbed kernel
// (mla_attention; the engine's W_UK / W_UV matmuls around it, 2 n_new H
// qk_nope d_c multiply-adds, not included) against the expanded form
// (mla_attention_expanded: up-projection of all ctx + n_new latents, then the
// paged prefill kernel), fastest and median of --reps calls and the ratio.
//
// usage: mla_attention_bench [--ctx 4096,16384] [--threads 2] [--reps 20] [--prefill N,...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/mla_attention.h"
#include "attention/paged_attention.h"
#include "core/cpu_features.h"
#include "core/thread_pool.h"
#include "kv/kv_codec.h"
#include "kv/layout.h"

namespace {

using namespace kvstack;

constexpr int kHeads = 16, kDc = 512, kDr = 64, kHeadDim = 192, kBlock = 16;

struct Pool {
  std::vector<uint8_t> buf;
  uint8_t* base = nullptr;
  explicit Pool(int64_t bytes) : buf(static_cast<size_t>(bytes) + 64) {
    const auto a = reinterpret_cast<uintptr_t>(buf.data());
    base = buf.data() + ((64 - a % 64) % 64);
  }
};

struct Timing {
  double min_ms, median_ms;
};

template <typename F>
Timing time_ms(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

// Fills every row of a layer with N(0, 1) values through the format's encoder.
void fill(const PagedKvLayerView& v, int n_blocks, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(v.head_dim));
  for (int b = 0; b < n_blocks; ++b) {
    for (int h = 0; h < v.n_kv_heads; ++h) {
      for (int s = 0; s < v.block_size; ++s) {
        for (int which = 0; which < (v.v != nullptr ? 2 : 1); ++which) {
          for (float& e : x) e = nd(rng);
          uint8_t* base = which == 0 ? v.k : v.v;
          uint8_t* row = base + static_cast<int64_t>(b) * v.block_stride + h * v.head_stride +
                         s * v.slot_stride;
          uint8_t* meta =
              v.k_meta == nullptr || which == 1
                  ? nullptr
                  : v.k_meta + static_cast<int64_t>(b) * v.block_stride + s * v.k_meta_slot_stride;
          kv_encode_row(v.dtype, x.data(), v.head_dim, row, meta);
        }
      }
    }
  }
}

std::vector<int> int_list(char* p) {
  std::vector<int> v;
  while (*p != '\0') {
    v.push_back(static_cast<int>(std::strtol(p, &p, 10)));
    if (*p != ',') break;
    ++p;
  }
  return v;
}

// Prefill chunk of n_new rows after ctx cached ones, absorbed vs expanded.
int prefill_bench(const std::vector<int>& ctxs, const std::vector<int>& n_news, int reps,
                  ThreadPool& pool, std::mt19937& rng) {
  constexpr int kNope = 128, kV = 128;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> wkvb(static_cast<size_t>(kHeads) * (kNope + kV) * kDc);  // [d_c][H (nope + v)]
  for (float& x : wkvb) x = nd(rng) * 0.044f;                                 // ~1/sqrt(d_c)
  const MlaUpProjection up{.w_kv_b_t = wkvb.data(), .qk_nope = kNope, .v_dim = kV};
  const MlaAttnParams p{.n_heads = kHeads, .latent_dim = kDc, .rope_dim = kDr, .scale = 0.07f};
  std::printf("%-7s %-6s %-5s %12s %12s %12s %12s %8s\n", "n_past", "n_new", "dtype", "absorb min",
              "absorb med", "expand min", "expand med", "abs/exp");
  for (int ctx : ctxs) {
    for (int n_new : n_news) {
      const int n = ctx + n_new;
      const int n_blocks = (n + kBlock - 1) / kBlock;
      std::vector<int32_t> table(static_cast<size_t>(n_blocks));
      for (int b = 0; b < n_blocks; ++b) table[static_cast<size_t>(b)] = n_blocks - 1 - b;
      std::vector<float> qa(static_cast<size_t>(n_new) * kHeads * (kDc + kDr)),
          qe(static_cast<size_t>(n_new) * kHeads * (kNope + kDr)),
          oa(static_cast<size_t>(n_new) * kHeads * kDc),
          oe(static_cast<size_t>(n_new) * kHeads * kV);
      for (float& x : qa) x = nd(rng) * 0.05f;
      for (float& x : qe) x = nd(rng) * 0.05f;
      for (KvDtype dt : {KvDtype::kF16, KvDtype::kInt8}) {
        auto layout = KvLayout::create(
            {KvLayerSpec{
                .kind = KvLayerKind::kMlaLatent, .latent_dim = kDc, .rope_dim = kDr, .dtype = dt}},
            kBlock);
        if (!layout) return 1;
        Pool mem(layout->block_bytes() * n_blocks);
        const PagedKvLayerView view = layout->layer_view(0, mem.base);
        fill(view, n_blocks, rng);
        AttnSeq seq{.block_table = table.data(),
                    .n_blocks = n_blocks,
                    .n_past = ctx,
                    .n_new = n_new,
                    .q = qa.data(),
                    .out = oa.data()};
        const Timing a = time_ms(reps, [&] { (void)mla_attention(view, p, {&seq, 1}, &pool); });
        seq.q = qe.data();
        seq.out = oe.data();
        const Timing e = time_ms(reps, [&] {
          (void)mla_attention_expanded(view, p, up, {&seq, 1}, &pool);
        });
        std::printf("%-7d %-6d %-5s %12.3f %12.3f %12.3f %12.3f %8.2f\n", ctx, n_new,
                    kv_dtype_name(dt), a.min_ms, a.median_ms, e.min_ms, e.median_ms,
                    a.min_ms / e.min_ms);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ctxs = {4096, 16384}, prefill;
  int threads = 2, reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--ctx") {
      ctxs = int_list(argv[i + 1]);
    } else if (a == "--prefill") {
      prefill = int_list(argv[i + 1]);
    } else if (a == "--threads") {
      threads = std::atoi(argv[i + 1]);
    } else if (a == "--reps") {
      reps = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr,
                   "usage: mla_attention_bench [--ctx 4096,16384] [--threads 2] [--reps 20] "
                   "[--prefill N,...]\n");
      return 2;
    }
  }
  ThreadPool pool(threads);
  std::mt19937 rng(1);
  if (!prefill.empty()) {
    std::printf("mla_attention_bench --prefill: %d heads, latent %d + %d, %d threads, isa %s\n",
                kHeads, kDc, kDr, threads, isa_name(best_isa()));
    return prefill_bench(ctxs, prefill, reps, pool, rng);
  }
  std::printf(
      "mla_attention_bench: %d heads, latent %d + %d, expanded %d x %d (K and V), %d "
      "threads, isa %s, %d calls each\n",
      kHeads, kDc, kDr, kHeads, kHeadDim, threads, isa_name(best_isa()), reps);
  std::printf("%-8s %-26s %14s %10s %10s %9s\n", "ctx", "case", "bytes/step", "min ms", "median ms",
              "GB/s");
  for (int ctx : ctxs) {
    const int n_blocks = (ctx + kBlock - 1) / kBlock;
    std::vector<int32_t> table(static_cast<size_t>(n_blocks));
    for (int b = 0; b < n_blocks; ++b) table[static_cast<size_t>(b)] = n_blocks - 1 - b;
    // GB/s from the fastest call (on a shared machine the least disturbed).
    auto row = [&](const char* name, int64_t bytes, Timing t) {
      std::printf("%-8d %-26s %14lld %10.3f %10.3f %9.2f\n", ctx, name,
                  static_cast<long long>(bytes), t.min_ms, t.median_ms,
                  static_cast<double>(bytes) / t.min_ms / 1e6);
    };
    // Latent: q [H][576] -> out [H][512].
    std::vector<float> q(static_cast<size_t>(kHeads) * (kDc + kDr)),
        out(static_cast<size_t>(kHeads) * kDc);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& x : q) x = nd(rng) * 0.05f;
    for (KvDtype dt : {KvDtype::kF16, KvDtype::kInt8}) {
      auto layout = KvLayout::create(
          {KvLayerSpec{
              .kind = KvLayerKind::kMlaLatent, .latent_dim = kDc, .rope_dim = kDr, .dtype = dt}},
          kBlock);
      if (!layout) return 1;
      Pool mem(layout->block_bytes() * n_blocks);
      const PagedKvLayerView view = layout->layer_view(0, mem.base);
      fill(view, n_blocks, rng);
      const AttnSeq seq{.block_table = table.data(),
                        .n_blocks = n_blocks,
                        .n_past = ctx - 1,
                        .n_new = 1,
                        .q = q.data(),
                        .out = out.data()};
      const MlaAttnParams p{.n_heads = kHeads, .latent_dim = kDc, .rope_dim = kDr, .scale = 0.07f};
      const int64_t bytes = layout->payload_bytes(ctx);
      const std::string kernel = mla_attention_kernel_name(dt);
      row(("latent " + kernel).c_str(), bytes, time_ms(reps, [&] {
            (void)mla_attention(view, p, {&seq, 1}, &pool);
          }));
      if (dt == KvDtype::kF16) {
        row("latent f16 scalar ref", bytes, time_ms(std::max(1, reps / 10), [&] {
              (void)mla_attention_reference(view, p, {&seq, 1}, &pool);
            }));
      }
    }
    // Expanded: 16 KV heads x 192 (K and V), q/out [H][192].
    auto layout = KvLayout::uniform(1, kHeads, kHeadDim, KvDtype::kF16, kBlock);
    if (!layout) return 1;
    Pool mem(layout->block_bytes() * n_blocks);
    const PagedKvLayerView view = layout->layer_view(0, mem.base);
    fill(view, n_blocks, rng);
    std::vector<float> qe(static_cast<size_t>(kHeads) * kHeadDim), oe(qe.size());
    for (float& x : qe) x = nd(rng) * 0.05f;
    const AttnSeq seq{.block_table = table.data(),
                      .n_blocks = n_blocks,
                      .n_past = ctx - 1,
                      .n_new = 1,
                      .q = qe.data(),
                      .out = oe.data()};
    const AttnParams ap{
        .n_q_heads = kHeads, .n_kv_heads = kHeads, .head_dim = kHeadDim, .scale = 0.07f};
    row("expanded f16", layout->payload_bytes(ctx), time_ms(reps, [&] {
          (void)paged_attention(view, ap, {&seq, 1}, &pool);
        }));
  }
  return 0;
}

// `kvstack kv-bench`: speed of the KV cache formats (issue 7).
//   1. Decode attention kernel: one query token per sequence attending over
//      --ctx cached tokens in every one of --layers layers (cycled, so the
//      cache is read from memory as in a real decode step), per format,
//      median time per step and the ratio to f16.
//   2. End-to-end decode (--e2e-ctx): the engine with each format, its cache
//      filled with --e2e-ctx tokens of random K/V rows (decode speed does not
//      depend on the values; a real prefill of 8K tokens would dominate the
//      run time), then --e2e-steps decode steps; tokens per second, in
//      --e2e-reps rounds that run every format in turn (medians, paired
//      ratios to f16).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_kivi.h"
#include "attention/paged_attention.h"
#include "cli/args.h"
#include "cli/bench_stats.h"
#include "cli/engine_options.h"
#include "cli/progress.h"
#include "core/half.h"
#include "kv/block_pool.h"
#include "kv/kv_write.h"
#include "kv/layout.h"

namespace kvstack::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// Median seconds of one decode-attention step over all layers.
Result<double> kernel_step_seconds(KvDtype dtype, int n_layers, int n_q_heads, int n_kv_heads,
                                   int head_dim, int block_size, int64_t ctx, int iters,
                                   ThreadPool& threads) {
  auto layout = KvLayout::uniform(n_layers, n_kv_heads, head_dim, dtype, block_size);
  if (!layout) return layout.error();
  const int64_t n_blocks = (ctx + block_size - 1) / block_size;
  // The engine's own pool mapping (huge pages where the kernel gives them),
  // so the kernel reads memory as it does in a decode step; the blocks are
  // addressed by id without the pool's allocator (nothing else uses them).
  auto pool = BlockPool::create(*layout, BlockPoolConfig{.n_tokens = n_blocks * block_size});
  if (!pool) return pool.error();
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  for (int64_t i = 0; i < n_blocks; ++i) table[i] = static_cast<int32_t>(i);
  std::shuffle(table.begin(), table.end(), std::mt19937(1));  // scattered blocks
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  const int64_t chunk = 1024;
  std::vector<float> k(static_cast<size_t>(chunk) * n_kv_heads * head_dim), v(k.size());
  // KIVI: the newest tokens (R = 128 plus the partial group) are f16 rows of
  // a per-sequence residual, the rest quantized in the blocks.
  const bool kivi = layout->has_kivi();
  const int64_t g = kivi ? layout->kivi_group() : 1;
  const int64_t n_quant = kivi ? std::max<int64_t>(0, (ctx - 128) / g * g) : ctx;
  const int64_t row = int64_t{n_kv_heads} * head_dim;
  std::vector<std::vector<uint16_t>> res_k(n_layers), res_v(n_layers);
  for (int l = 0; l < n_layers; ++l) {
    const PagedKvLayerView view = (*pool)->layer_view(l);
    for (int64_t p = 0; p < n_quant; p += chunk) {
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      write_kv(view, table, p, k.data(), v.data(), std::min(chunk, n_quant - p));
    }
    res_k[l].resize(static_cast<size_t>((ctx - n_quant) * row));
    res_v[l].resize(res_k[l].size());
    for (auto& x : res_k[l]) x = f32_to_f16(nd(rng));
    for (auto& x : res_v[l]) x = f32_to_f16(nd(rng));
  }
  std::vector<float> q(static_cast<size_t>(n_q_heads) * head_dim), out(q.size());
  for (float& x : q) x = nd(rng);
  const AttnParams ap{.n_q_heads = n_q_heads,
                      .n_kv_heads = n_kv_heads,
                      .head_dim = head_dim,
                      .scale = 1.0f / std::sqrt(static_cast<float>(head_dim))};
  const AttnSeq seq{.block_table = table.data(),
                    .n_blocks = static_cast<int32_t>(n_blocks),
                    .n_past = static_cast<int32_t>(ctx - 1),
                    .n_new = 1,
                    .q = q.data(),
                    .out = out.data()};
  std::vector<double> times;
  for (int it = 0; it < iters + 1; ++it) {
    const auto t0 = Clock::now();
    for (int l = 0; l < n_layers; ++l) {
      if (kivi) {
        const KvResidualView res{.k = res_k[l].data(),
                                 .v = res_v[l].data(),
                                 .start = n_quant,
                                 .n_tokens = ctx - n_quant};
        KV_TRY_STATUS(paged_attention_kivi((*pool)->layer_view(l), ap,
                                           std::span<const AttnSeq>(&seq, 1),
                                           std::span<const KvResidualView>(&res, 1), &threads));
        continue;
      }
      KV_TRY_STATUS(
          paged_attention((*pool)->layer_view(l), ap, std::span<const AttnSeq>(&seq, 1), &threads));
    }
    if (it > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Decode tokens/s of the engine with its cache holding `ctx` random tokens.
// A context the model cannot hold with the warm-up step and `steps` more
// tokens is filled to the model's limit minus those instead (8192 on an 8K
// model: 8159 tokens, then 1 + 32 decode steps), said on stderr.
Result<double> e2e_tokens_per_s(EngineConfig cfg, int64_t ctx, int steps) {
  cfg.kv_cache_tokens = ctx + steps + cfg.block_size;
  cfg.kv_cache_mem = 0;
  auto e = Engine::create(cfg);
  if (!e) return e.error();
  Engine& eng = **e;
  const ModelConfig& mc = eng.model().config();
  if (ctx + 1 + steps > mc.n_ctx_train) {  // + 1: the warm-up step
    if (steps + 1 >= mc.n_ctx_train) {
      return make_error(Errc::kInvalidArgument, "kv-bench: --e2e-steps " + std::to_string(steps) +
                                                    " exceeds the model's context " +
                                                    std::to_string(mc.n_ctx_train));
    }
    const int64_t fill = mc.n_ctx_train - 1 - steps;
    std::fprintf(stderr,
                 "kv-bench: --e2e-ctx %lld + 1 + %d steps exceeds the model's context of %lld "
                 "tokens: filling %lld tokens instead\n",
                 static_cast<long long>(ctx), steps, static_cast<long long>(mc.n_ctx_train),
                 static_cast<long long>(fill));
    ctx = fill;
  }
  BlockTable table = eng.new_table();
  KV_TRY_STATUS(table.reserve(ctx));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int64_t chunk = 512;
  const int64_t kv_dim = int64_t{mc.n_kv_heads} * mc.head_dim;
  std::vector<float> k(static_cast<size_t>(chunk * kv_dim)), v(k.size());
  // Chunk by chunk, every layer, then commit (KIVI layouts append in order
  // and convert their groups at commit).
  for (int64_t p = 0; p < ctx; p += chunk) {
    const int64_t n = std::min(chunk, ctx - p);
    for (int l = 0; l < mc.n_layers; ++l) {
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      table.write(l, p, k.data(), v.data(), n);
    }
    table.commit(n);
  }
  std::vector<float> logits;
  int32_t tok = 1;
  // One warm-up step, then the timed ones.
  KV_TRY_STATUS(eng.prefill(table, std::span<const int32_t>(&tok, 1), LogitsMode::kLast, &logits));
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) {
    tok = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    KV_TRY_STATUS(
        eng.prefill(table, std::span<const int32_t>(&tok, 1), LogitsMode::kLast, &logits));
  }
  return steps / std::chrono::duration<double>(Clock::now() - t0).count();
}

int run_kv_bench(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"formats", 0, "LIST", "KV formats to compare (default f16,int8,fp8,int4)"});
  specs.push_back({"ctx", 'c', "LIST", "kernel context lengths (default 4096,16384,32768)"});
  specs.push_back({"layers", 0, "N", "kernel: layers per step (default: the model's, 30)"});
  specs.push_back({"iters", 0, "N", "kernel: timed steps per point, median reported (default 7)"});
  specs.push_back(
      {"e2e-ctx", 0, "LIST", "end-to-end context lengths (default 4096,8192; 0 = skip)"});
  specs.push_back({"e2e-steps", 0, "N", "end-to-end decode steps per point (default 32)"});
  specs.push_back({"e2e-reps", 0, "N",
                   "end-to-end rounds over all formats; median and paired ratio (default 3)"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("kv-bench", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack kv-bench [-m MODEL] [--formats LIST] [--ctx LIST]",
                           "Decode attention time per KV format relative to f16 (kernel only, "
                           "all layers of one step) and end-to-end decode tokens/s per format.",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  auto cfg = engine_config_from(*args);
  if (!cfg) return fail("kv-bench", cfg.error().message);
  std::vector<KvDtype> formats;
  for (const std::string& f : split_list(args->get_or("formats", "f16,int8,fp8,int4"))) {
    auto t = parse_kv_dtype(f);
    if (!t) return fail("kv-bench", "--formats: " + t.error().message);
    formats.push_back(*t);
  }
  std::vector<int64_t> ctxs, e2e;
  for (const std::string& s : split_list(args->get_or("ctx", "4096,16384,32768"))) {
    ctxs.push_back(std::atoll(s.c_str()));
  }
  for (const std::string& s : split_list(args->get_or("e2e-ctx", "4096,8192"))) {
    if (std::atoll(s.c_str()) > 0) e2e.push_back(std::atoll(s.c_str()));
  }
  auto layers = args->get_int("layers", 30, 1, 4096);
  auto iters = args->get_int("iters", 7, 1, 10000);
  auto steps = args->get_int("e2e-steps", 32, 1, 100000);
  if (!layers) return fail("kv-bench", layers.error().message);
  if (!iters) return fail("kv-bench", iters.error().message);
  if (!steps) return fail("kv-bench", steps.error().message);
  auto reps = args->get_int("e2e-reps", 3, 1, 1000);
  if (!reps) return fail("kv-bench", reps.error().message);
  const int n_threads = cfg->n_threads > 0 ? cfg->n_threads : 1;
  ThreadPool threads(n_threads);
  // Kernel shape: the default model's attention (9 q heads, 3 KV heads, d 64).
  std::printf(
      "decode attention, %lld layers x (9 q heads, 3 KV heads, d 64), block %d, %d "
      "threads, median of %lld steps\n",
      static_cast<long long>(*layers), cfg->block_size, n_threads, static_cast<long long>(*iters));
  std::printf("%-6s %8s %12s %10s\n", "format", "ctx", "ms/step", "vs f16");
  for (int64_t ctx : ctxs) {
    double f16_time = 0;
    for (KvDtype f : formats) {
      auto t = kernel_step_seconds(f, static_cast<int>(*layers), 9, 3, 64, cfg->block_size, ctx,
                                   static_cast<int>(*iters), threads);
      if (!t) return fail("kv-bench", t.error().message);
      if (f == KvDtype::kF16) f16_time = *t;
      std::printf("%-6s %8lld %12.3f %10s\n", kv_dtype_name(f), static_cast<long long>(ctx),
                  1e3 * *t,
                  f16_time > 0 ? (std::to_string(*t / f16_time).substr(0, 5) + "x").c_str() : "-");
      std::fflush(stdout);
    }
  }
  if (!e2e.empty()) {
    std::printf("\nend-to-end decode (model %s), tokens/s\n", cfg->model_path.c_str());
    std::printf("%-6s %8s %10s %10s\n", "format", "ctx", "tok/s", "vs f16 (range)");
  }
  // --e2e-reps rounds, each running every format once in turn, so a burst
  // of load on this shared machine hits all formats of one round alike:
  // tok/s is the median over rounds, "vs f16" the median of the rounds'
  // ratios to that round's f16 (the paired figure), with its range.
  Progress progress;
  for (int64_t ctx : e2e) {
    std::vector<std::vector<double>> rates(formats.size());
    for (int64_t rep = 0; rep < *reps; ++rep) {
      for (size_t fi = 0; fi < formats.size(); ++fi) {
        EngineConfig c = *cfg;
        c.kv_dtype = formats[fi];
        auto r = e2e_tokens_per_s(c, ctx, static_cast<int>(*steps));
        if (!r) return fail("kv-bench", r.error().message);
        rates[fi].push_back(*r);
        progress.update(strprintf("kv-bench: end-to-end ctx %lld, round %lld/%lld, %s: %.2f tok/s",
                                  static_cast<long long>(ctx), static_cast<long long>(rep) + 1,
                                  static_cast<long long>(*reps), kv_dtype_name(formats[fi]), *r));
      }
    }
    progress.finish();
    const auto f16 = std::find(formats.begin(), formats.end(), KvDtype::kF16);
    for (size_t fi = 0; fi < formats.size(); ++fi) {
      std::string vs = "-";
      if (f16 != formats.end()) {
        std::vector<double> ratios;
        const auto& base = rates[static_cast<size_t>(f16 - formats.begin())];
        for (size_t i = 0; i < base.size(); ++i) ratios.push_back(rates[fi][i] / base[i]);
        const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.3fx (%.2f-%.2f)", median(ratios), *lo, *hi);
        vs = buf;
      }
      std::printf("%-6s %8lld %10.2f %10s\n", kv_dtype_name(formats[fi]),
                  static_cast<long long>(ctx), median(rates[fi]), vs.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_kv_bench, "kv-bench", "speed of the KV cache formats (kernel and decode)",
                run_kv_bench);

}  // namespace kvstack::cli

// `kvstack prefix-bench`: prefix-cache benchmarks (docs/benchmarks.md).
//   --index   prefix index operations (match + insert + evict) on a synthetic
//             trace of requests with Zipf-distributed shared prefixes; no model.
//   --ttft    TTFT of a shared system prompt + question, cold vs warm cache,
//             and the KV memory of N such requests with and without sharing
//             against the spec's sharing formula (default model).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "cli/args.h"
#include "cli/engine_options.h"
#include "core/units.h"
#include "engine/generate.h"
#include "kv/prefix_index.h"

namespace kvstack::cli {
namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int run_index_bench(const Args& args) {
  auto n_req = args.get_int("requests", 100000, 1, int64_t{1} << 32);
  auto n_fam = args.get_int("prefixes", 2000, 1, 1 << 24);
  auto bs = args.get_int("block-size", 16, 1, 256);
  auto pool_blocks = args.get_int("pool-blocks", 20000, 16, int64_t{1} << 30);
  auto zipf_s = args.get_double("zipf", 1.0, 0.0, 10.0);
  for (auto* r : {&n_req, &n_fam, &bs, &pool_blocks}) {
    if (!*r) return fail("prefix-bench", r->error().message);
  }
  if (!zipf_s) return fail("prefix-bench", zipf_s.error().message);
  const int p = static_cast<int>(*bs);
  auto layout = KvLayout::uniform(1, 1, 1, KvDtype::kF16, p);  // metadata-only workload
  if (!layout) return fail("prefix-bench", layout.error().message);
  auto pool = BlockPool::create(*layout, {.n_tokens = *pool_blocks * p});
  if (!pool) return fail("prefix-bench", pool.error().message);
  PrefixIndex index(**pool);
  const NamespaceId ns = index.intern_namespace(hash128("bench", 5));

  // Families: a shared prefix of 4..64 blocks; requests add 1..8 private blocks.
  std::mt19937_64 rng(42);
  std::vector<std::vector<int32_t>> family(static_cast<size_t>(*n_fam));
  for (auto& f : family) {
    f.resize(static_cast<size_t>(std::uniform_int_distribution<int>(4, 64)(rng)) * p);
    for (auto& t : f) t = static_cast<int32_t>(rng() % 49152);
  }
  std::vector<double> cdf(family.size());
  double acc = 0;
  for (size_t i = 0; i < cdf.size(); ++i) cdf[i] = acc += 1.0 / std::pow(i + 1.0, *zipf_s);
  for (auto& c : cdf) c /= acc;
  // Pre-generate the trace so timing covers only cache operations.
  std::vector<std::vector<int32_t>> trace(static_cast<size_t>(*n_req));
  for (auto& req : trace) {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    const size_t f = std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
    req = family[std::min(f, family.size() - 1)];
    const int extra = std::uniform_int_distribution<int>(1, 8)(rng) * p;
    for (int i = 0; i < extra; ++i) req.push_back(static_cast<int32_t>(rng() % 49152));
  }
  double t_match = 0, t_total = 0;
  int64_t n_blocks = 0, n_hit_tokens = 0;
  const auto t0 = Clock::now();
  for (const auto& req : trace) {
    const auto a = Clock::now();
    PrefixMatch m = index.match(ns, req, static_cast<int64_t>(req.size()), /*find_partial=*/false);
    const auto b = Clock::now();
    t_match += secs(a, b);
    n_hit_tokens += m.n_tokens();
    BlockTable t(**pool);
    t.adopt_prefix(std::move(m.blocks));
    const int64_t n_adopted = t.n_blocks();
    const int64_t rest = static_cast<int64_t>(req.size()) - t.length();
    if (!t.reserve(rest).ok()) return fail("prefix-bench", "pool too small for one request");
    t.commit(rest);  // the forward would write K/V here; the index needs only tokens
    index.publish(ns, t, req, n_adopted);
    n_blocks += static_cast<int64_t>(req.size()) / p;
  }
  t_total = secs(t0, Clock::now());
  const PrefixIndexStats st = index.stats();
  std::printf(
      "prefix index: %lld requests, %lld prefixes (Zipf s=%.2f), P=%d, pool %lld blocks\n"
      "  blocks processed %lld, hit tokens %lld (hit rate %.3f), evictions %lld, nodes %lld\n"
      "  total (match + adopt + reserve/commit + publish + evict): %.3f s = %.1f ns/block, "
      "%.2f M tokens/s\n"
      "  match only: %.3f s = %.1f ns per matched block, %.2f M matched tokens/s\n",
      static_cast<long long>(*n_req), static_cast<long long>(*n_fam), *zipf_s, p,
      static_cast<long long>(*pool_blocks), static_cast<long long>(n_blocks),
      static_cast<long long>(n_hit_tokens), st.total.hit_rate(),
      static_cast<long long>(st.n_evictions), static_cast<long long>(st.n_nodes), t_total,
      1e9 * t_total / static_cast<double>(n_blocks),
      static_cast<double>(n_blocks) * p / t_total / 1e6, t_match,
      1e9 * t_match / std::max<double>(1.0, static_cast<double>(n_hit_tokens) / p),
      static_cast<double>(n_hit_tokens) / t_match / 1e6);
  return 0;
}

int run_ttft_bench(const Args& args) {
  auto n_sys = args.get_int("system-tokens", 2048, 1, 1 << 20);
  auto n_q = args.get_int("question-tokens", 64, 1, 1 << 20);
  auto n_req = args.get_int("requests", 32, 1, 4096);
  for (auto* r : {&n_sys, &n_q, &n_req}) {
    if (!*r) return fail("prefix-bench", r->error().message);
  }
  auto engine = load_engine(args);
  if (!engine) return fail("prefix-bench", engine.error().message);
  Engine& e = **engine;
  const int p = e.pool().block_size();
  const int n_vocab = e.model().config().n_vocab;
  std::mt19937 rng(7);
  // Ordinary-text-like ids (skip the first 1000 ids: control and byte tokens).
  auto random_tokens = [&](int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = 1000 + static_cast<int32_t>(rng() % (n_vocab - 1000));
    return v;
  };
  const std::vector<int32_t> sys = random_tokens(*n_sys);
  auto request = [&] {
    std::vector<int32_t> r = sys;
    const auto q = random_tokens(*n_q);
    r.insert(r.end(), q.begin(), q.end());
    return r;
  };
  GenerateOptions go;
  go.max_tokens = 1;
  go.sampling.temperature = 0;
  auto ttft = [&](Sequence& s, const std::vector<int32_t>& prompt, int64_t* cached) -> double {
    auto r = generate(e, s, prompt, go);
    if (!r) {
      std::fprintf(stderr, "kvstack prefix-bench: %s\n", r.error().message.c_str());
      std::exit(1);
    }
    *cached = r->stats.n_cached;
    return r->stats.ttft_s;
  };
  int64_t cached = 0;
  std::vector<Sequence> live;
  live.push_back(e.new_sequence());
  const double cold = ttft(live.back(), request(), &cached);
  std::printf("TTFT, %lld-token shared prompt + %lld-token question (P=%d, %d threads):\n",
              static_cast<long long>(*n_sys), static_cast<long long>(*n_q), p,
              e.threads().n_threads());
  std::printf("  cold: %.1f ms (%lld tokens from cache)\n", cold * 1e3,
              static_cast<long long>(cached));
  double warm_sum = 0;
  for (int64_t i = 1; i < *n_req; ++i) {
    live.push_back(e.new_sequence());
    const double w = ttft(live.back(), request(), &cached);
    warm_sum += w;
    if (i == 1) {
      std::printf("  warm: %.1f ms (%lld tokens from cache)\n", w * 1e3,
                  static_cast<long long>(cached));
    }
  }
  if (*n_req > 1) {
    std::printf("  warm mean over %lld requests: %.1f ms; speed-up %.1fx\n",
                static_cast<long long>(*n_req - 1), warm_sum / (*n_req - 1) * 1e3,
                cold / (warm_sum / (*n_req - 1)));
  }
  // Memory with sharing: every request alive at once, holding the shared blocks.
  const BlockPoolStats shared = e.pool().stats();
  const int64_t bb = shared.block_bytes;
  // Spec section 3: shared full blocks stored once, private tails per sequence.
  // Each request holds T = S + Q (+ 1 sampled token not yet written) tokens.
  const int64_t t_len = live[0].length();
  const int64_t n_shared = *n_sys / p;
  const int64_t private_per_req = (t_len - n_shared * p + p - 1) / p;
  const int64_t formula_shared = n_shared + *n_req * private_per_req;
  const int64_t formula_unshared = *n_req * ((t_len + p - 1) / p);
  std::printf("memory of %lld live requests of %lld tokens:\n", static_cast<long long>(*n_req),
              static_cast<long long>(t_len));
  std::printf(
      "  with sharing:    %lld blocks used = %s (formula floor(S/P) + N ceil((T - "
      "floor(S/P) P)/P) = %lld blocks) %s\n",
      static_cast<long long>(shared.n_blocks_used),
      format_bytes(static_cast<double>(shared.n_blocks_used * bb)).c_str(),
      static_cast<long long>(formula_shared),
      shared.n_blocks_used == formula_shared ? "MATCH" : "MISMATCH");
  // Without sharing: the same sequences as private copies (clone_private).
  std::vector<Sequence> clones;
  for (const Sequence& s : live) {
    auto c = s.clone_private();
    if (!c) return fail("prefix-bench", c.error().message);
    clones.push_back(std::move(*c));
  }
  const int64_t unshared_blocks = e.pool().stats().n_blocks_used - shared.n_blocks_used;
  std::printf("  without sharing: %lld blocks = %s (formula N ceil(T/P) = %lld blocks) %s\n",
              static_cast<long long>(unshared_blocks),
              format_bytes(static_cast<double>(unshared_blocks * bb)).c_str(),
              static_cast<long long>(formula_unshared),
              unshared_blocks == formula_unshared ? "MATCH" : "MISMATCH");
  std::printf("  saving: %.1fx\n", static_cast<double>(unshared_blocks) / shared.n_blocks_used);
  return shared.n_blocks_used == formula_shared && unshared_blocks == formula_unshared ? 0 : 1;
}

int run_prefix_bench(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"index", 0, "", "benchmark the prefix index on a synthetic trace (no model)"});
  specs.push_back({"ttft", 0, "", "TTFT cold vs warm and shared-prompt memory (model)"});
  specs.push_back({"requests", 0, "N", "requests (index: 100000; ttft: 32)"});
  specs.push_back({"prefixes", 0, "N", "index: distinct shared prefixes (default 2000)"});
  specs.push_back({"zipf", 0, "S", "index: Zipf exponent of prefix popularity (default 1.0)"});
  specs.push_back({"pool-blocks", 0, "N", "index: pool size in blocks (default 20000)"});
  specs.push_back({"system-tokens", 0, "N", "ttft: shared prompt tokens (default 2048)"});
  specs.push_back({"question-tokens", 0, "N", "ttft: per-request tokens (default 64)"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("prefix-bench", args.error().message);
  if (args->flag("help") || (!args->flag("index") && !args->flag("ttft"))) {
    std::fputs(format_help("kvstack prefix-bench --index [--requests N] [--prefixes N] [--zipf S] "
                           "[--block-size P] [--pool-blocks N]\n"
                           "       kvstack prefix-bench --ttft [-m MODEL] [--system-tokens N] "
                           "[--question-tokens N] [--requests N]",
                           "Prefix-cache benchmarks: index operations on a Zipf trace, and TTFT "
                           "/ memory of a shared system prompt.",
                           specs)
                   .c_str(),
               stdout);
    return args->flag("help") ? 0 : 2;
  }
  return args->flag("index") ? run_index_bench(*args) : run_ttft_bench(*args);
}

}  // namespace

KVSTACK_COMMAND(g_prefix_bench, "prefix-bench", "prefix-cache benchmarks (index ops, TTFT, memory)",
                run_prefix_bench);

}  // namespace kvstack::cli

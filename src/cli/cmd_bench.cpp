// `kvstack bench`: prefill and decode throughput on synthetic tokens, with
// the KV memory it used. Medians over --reps repetitions.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "cli/args.h"
#include "cli/bench_stats.h"
#include "cli/engine_options.h"
#include "cli/progress.h"
#include "core/proc_stats.h"
#include "core/units.h"

namespace kvstack::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

int run_bench(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"prompt-tokens", 0, "N", "prompt length in tokens (default 512)"});
  specs.push_back({"gen", 'n', "N", "tokens to generate (default 128)"});
  specs.push_back(
      {"ctx-fill", 0, "N", "tokens already in the cache before the prompt (default 0)"});
  specs.push_back({"reps", 0, "N", "repetitions; medians are reported (default 3)"});
  specs.push_back({"seed", 0, "N", "seed of the random prompt tokens (default 1)"});
  specs.push_back({"json", 0, "", "print one JSON object instead of a table"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("bench", args.error().message);
  if (args->flag("help")) {
    std::fputs(
        format_help("kvstack bench [-m MODEL] [--prompt-tokens N] [--gen N] [--ctx-fill N] "
                    "[--threads T] [--json]",
                    "Measure prefill and decode speed on random tokens through the paged KV "
                    "cache: TTFT, prefill tok/s, decode tok/s (medians over --reps), KV bytes.",
                    specs)
            .c_str(),
        stdout);
    return 0;
  }
  auto prompt_n = args->get_int("prompt-tokens", 512, 1, 1 << 20);
  auto gen_n = args->get_int("gen", 128, 1, 1 << 20);
  auto fill_n = args->get_int("ctx-fill", 0, 0, 1 << 20);
  auto reps = args->get_int("reps", 3, 1, 1000);
  auto seed = args->get_int("seed", 1, 0, INT64_MAX);
  for (const auto* r : {&prompt_n, &gen_n, &fill_n, &reps, &seed}) {
    if (!*r) return fail("bench", r->error().message);
  }
  const bool json = args->flag("json");
  auto cfg = engine_config_from(*args);
  if (!cfg) return fail("bench", cfg.error().message);
  const int64_t total = *fill_n + *prompt_n + *gen_n;
  if (cfg->kv_cache_mem == 0 && cfg->kv_cache_tokens == 0) cfg->kv_cache_tokens = total;
  const int64_t rss0 = process_rss_bytes();
  auto created = Engine::create(*cfg);
  if (!created) return fail("bench", created.error().message);
  Engine& engine = **created;
  const ModelConfig& mc = engine.model().config();
  if (total > mc.n_ctx_train) {
    return fail("bench", "ctx-fill + prompt-tokens + gen = " + std::to_string(total) +
                             " exceeds the model's context length " +
                             std::to_string(mc.n_ctx_train));
  }
  const int64_t rss_loaded = process_rss_bytes();

  std::mt19937 rng(static_cast<uint32_t>(*seed));
  std::uniform_int_distribution<int32_t> dist(0, mc.n_vocab - 1);
  std::vector<int32_t> fill(static_cast<size_t>(*fill_n)), prompt(static_cast<size_t>(*prompt_n));
  for (auto& t : fill) t = dist(rng);
  for (auto& t : prompt) t = dist(rng);

  std::vector<double> prefill_s, ttft_s, decode_s;
  BlockPoolStats last_stats{};
  int64_t rss_peak = 0;
  std::vector<float> logits;
  Progress progress;
  for (int64_t r = 0; r < *reps; ++r) {
    BlockTable table = engine.new_table();
    if (!fill.empty()) {
      if (!json)
        progress.update(strprintf("bench: rep %lld/%lld filling %lld tokens...",
                                  static_cast<long long>(r) + 1, static_cast<long long>(*reps),
                                  static_cast<long long>(*fill_n)));
      const Status st = engine.prefill(table, fill, LogitsMode::kNone, nullptr);
      if (!st.ok()) return fail("bench", st.error().message);
    }
    if (!json)
      progress.update(strprintf("bench: rep %lld/%lld prefill + decode...",
                                static_cast<long long>(r) + 1, static_cast<long long>(*reps)));
    const auto t0 = Clock::now();
    Status st = engine.prefill(table, prompt, LogitsMode::kLast, &logits);
    if (!st.ok()) return fail("bench", st.error().message);
    const double t_prefill = seconds_since(t0);
    int32_t next = argmax(logits.data(), mc.n_vocab);
    ttft_s.push_back(seconds_since(t0));
    prefill_s.push_back(t_prefill);
    const auto t1 = Clock::now();
    for (int64_t g = 1; g < *gen_n; ++g) {
      const StepSeq s{.table = &table, .tokens = std::span<const int32_t>(&next, 1)};
      st = engine.forward().step(std::span<const StepSeq>(&s, 1), &logits);
      if (!st.ok()) return fail("bench", st.error().message);
      next = argmax(logits.data(), mc.n_vocab);
    }
    decode_s.push_back(seconds_since(t1));
    last_stats = engine.pool().stats();
    rss_peak = std::max(rss_peak, process_rss_bytes());
  }
  progress.finish();

  const double prefill_tok_s = static_cast<double>(*prompt_n) / median(prefill_s);
  const double decode_tok_s = *gen_n > 1 ? static_cast<double>(*gen_n - 1) / median(decode_s) : 0.0;
  const double ttft_ms = median(ttft_s) * 1e3;
  const int64_t per_token = engine.layout().payload_bytes_per_token();
  if (json) {
    std::printf(
        "{\"model\": \"%s\", \"threads\": %d, \"kv_dtype\": \"%s\", \"block_size\": %d, "
        "\"prompt_tokens\": %lld, \"gen_tokens\": %lld, \"ctx_fill\": %lld, \"reps\": %lld, "
        "\"prefill_tok_s\": %.2f, \"decode_tok_s\": %.2f, \"ttft_ms\": %.2f, "
        "\"kv_bytes_per_token\": %lld, \"kv_payload_bytes\": %lld, \"kv_allocated_bytes\": %lld, "
        "\"kv_resident_bytes\": %lld, \"kv_blocks_used\": %lld, \"rss_bytes\": %lld, "
        "\"rss_model_loaded_bytes\": %lld, \"rss_start_bytes\": %lld}\n",
        cfg->model_path.c_str(), engine.threads().n_threads(), kv_dtype_name(cfg->kv_dtype),
        cfg->block_size, static_cast<long long>(*prompt_n), static_cast<long long>(*gen_n),
        static_cast<long long>(*fill_n), static_cast<long long>(*reps), prefill_tok_s, decode_tok_s,
        ttft_ms, static_cast<long long>(per_token),
        static_cast<long long>(last_stats.payload_bytes),
        static_cast<long long>(last_stats.allocated_bytes),
        static_cast<long long>(last_stats.resident_bytes),
        static_cast<long long>(last_stats.n_blocks_used), static_cast<long long>(rss_peak),
        static_cast<long long>(rss_loaded), static_cast<long long>(rss0));
  } else {
    std::printf("model              %s\n", cfg->model_path.c_str());
    std::printf("threads            %d\n", engine.threads().n_threads());
    std::printf("kv dtype / block   %s / %d tokens\n", kv_dtype_name(cfg->kv_dtype),
                cfg->block_size);
    std::printf("shape              ctx-fill %lld + prompt %lld + gen %lld tokens, %lld reps\n",
                static_cast<long long>(*fill_n), static_cast<long long>(*prompt_n),
                static_cast<long long>(*gen_n), static_cast<long long>(*reps));
    std::printf("prefill            %.1f tok/s (median)\n", prefill_tok_s);
    std::printf("ttft               %.1f ms (median)\n", ttft_ms);
    std::printf("decode             %.1f tok/s (median)\n", decode_tok_s);
    std::printf("kv bytes/token     %lld bytes\n", static_cast<long long>(per_token));
    std::printf("kv payload         %lld bytes (%s)\n",
                static_cast<long long>(last_stats.payload_bytes),
                format_bytes(static_cast<double>(last_stats.payload_bytes)).c_str());
    std::printf("kv allocated       %lld bytes (%s) in %lld blocks\n",
                static_cast<long long>(last_stats.allocated_bytes),
                format_bytes(static_cast<double>(last_stats.allocated_bytes)).c_str(),
                static_cast<long long>(last_stats.n_blocks_used));
    std::printf("rss                %s peak (%s after load)\n",
                format_bytes(static_cast<double>(rss_peak)).c_str(),
                format_bytes(static_cast<double>(rss_loaded)).c_str());
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_bench, "bench", "measure prefill/decode speed and KV memory on random tokens",
                run_bench);

}  // namespace kvstack::cli

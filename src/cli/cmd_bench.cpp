// `kvstack bench`: prefill and decode throughput on synthetic tokens, with
// the KV memory it used. Medians over --reps repetitions. With --batch N:
// the decode step time of N sequences decoded together against one sequence
// alone at the same context, measured interleaved in one run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "cli/args.h"
#include "cli/bench_stats.h"
#include "cli/engine_options.h"
#include "cli/progress.h"
#include "core/proc_stats.h"
#include "core/units.h"
#include "ops/elementwise.h"

namespace kvstack::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The greedy token (ops argmax: SIMD, the first largest like max_element).
int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(kvstack::argmax(row, n));
}

struct BatchBenchShape {
  int64_t n_seqs;     // sequences decoded together
  int64_t n_context;  // tokens in each sequence's cache when decoding starts
  int64_t n_steps;    // decode steps per measurement
  int64_t n_reps;
  uint32_t seed;
  bool json;
  // Prefill chunk lengths (tokens) measured in mixed steps: N decodes plus
  // one chunk of a new prompt per step.
  std::vector<int64_t> mix_chunks;
};

// Decodes `tables` (private copies of `base`, released afterwards) together
// for n_steps steps from their cached context; returns the seconds of each
// step. chunk > 0: every step also prefills the first `chunk` tokens of
// `prompt` as a new sequence (a new request's first prefill chunk beside
// the decodes; released after the step).
Result<std::vector<double>> decode_steps(Engine& engine, const std::vector<BlockTable>& base,
                                         int64_t n_steps, int64_t chunk = 0,
                                         std::span<const int32_t> prompt = {}) {
  std::vector<BlockTable> tables;
  tables.reserve(base.size());
  for (const BlockTable& b : base) {
    auto c = b.clone_private();
    if (!c) return c.error();
    tables.push_back(std::move(*c));
  }
  const int64_t n_vocab = engine.model().config().n_vocab;
  std::vector<int32_t> next(base.size(), 1);
  std::vector<StepSeq> batch(base.size());
  std::vector<float> logits;
  std::vector<double> step_s;
  for (int64_t g = 0; g < n_steps; ++g) {
    BlockTable fresh = engine.new_table();  // a new request's first chunk
    batch.resize(tables.size());
    for (size_t i = 0; i < tables.size(); ++i) {
      batch[i] = StepSeq{.table = &tables[i], .tokens = std::span<const int32_t>(&next[i], 1)};
    }
    if (chunk > 0) {
      batch.push_back({.table = &fresh,
                       .tokens = prompt.first(static_cast<size_t>(chunk)),
                       .logits = LogitsMode::kNone});
    }
    const auto t0 = Clock::now();
    const Status st = engine.forward().step(batch, &logits);
    if (!st.ok()) return st.error();
    step_s.push_back(seconds_since(t0));
    for (size_t i = 0; i < tables.size(); ++i) {
      next[i] = argmax(logits.data() + static_cast<int64_t>(i) * n_vocab, n_vocab);
    }
  }
  return step_s;
}

// `kvstack bench --batch N`: N sequences of n_context random tokens (distinct
// prompts, prefilled once), then per repetition n_steps decode steps of all N
// together and n_steps of sequence 0 alone, both from copies of the same
// cached context (so every repetition decodes at the same context), in
// alternating order; with mix_chunks, also the N decodes beside a prefill
// chunk of each length (the steps a serving scheduler builds while new
// requests prefill). Step times are medians over every measured step.
int run_batch_bench(EngineConfig cfg, const BatchBenchShape& shape) {
  // The prefilled contexts plus one private copy of each being decoded, and
  // the prompt prefilled beside them.
  const int64_t per_seq = shape.n_context + shape.n_steps + 2 * cfg.block_size;
  int64_t max_chunk = 0;
  for (int64_t c : shape.mix_chunks) max_chunk = std::max(max_chunk, c);
  const int64_t n_mix_prompt = max_chunk;
  if (cfg.kv_cache_mem == 0 && cfg.kv_cache_tokens == 0) {
    cfg.kv_cache_tokens = 2 * shape.n_seqs * per_seq + n_mix_prompt + cfg.block_size;
  }
  auto created = Engine::create(cfg);
  if (!created) return fail("bench", created.error().message);
  Engine& engine = **created;
  const ModelConfig& mc = engine.model().config();
  if (shape.n_context + shape.n_steps > mc.n_ctx_train) {
    return fail("bench", "context + gen = " + std::to_string(shape.n_context + shape.n_steps) +
                             " exceeds the model's context length " +
                             std::to_string(mc.n_ctx_train));
  }
  if (n_mix_prompt > mc.n_ctx_train) {
    return fail("bench", "--mix-prefill " + std::to_string(max_chunk) + " x gen " +
                             std::to_string(shape.n_steps) + " = " + std::to_string(n_mix_prompt) +
                             " prompt tokens exceeds the model's context length " +
                             std::to_string(mc.n_ctx_train));
  }
  std::mt19937 rng(shape.seed);
  std::uniform_int_distribution<int32_t> dist(0, mc.n_vocab - 1);
  std::vector<BlockTable> base;
  Progress progress;
  const auto t_fill = Clock::now();
  for (int64_t i = 0; i < shape.n_seqs; ++i) {
    if (!shape.json) {
      progress.update(strprintf("bench: prefilling sequence %lld/%lld (%lld tokens)...",
                                static_cast<long long>(i) + 1, static_cast<long long>(shape.n_seqs),
                                static_cast<long long>(shape.n_context)));
    }
    std::vector<int32_t> prompt(static_cast<size_t>(shape.n_context));
    for (auto& t : prompt) t = dist(rng);
    base.push_back(engine.new_table());
    const Status st = engine.prefill(base.back(), prompt, LogitsMode::kNone, nullptr);
    if (!st.ok()) return fail("bench", st.error().message);
  }
  const double prefill_tok_s =
      static_cast<double>(shape.n_seqs * shape.n_context) / seconds_since(t_fill);
  std::vector<int32_t> mix_prompt(static_cast<size_t>(n_mix_prompt));
  for (auto& t : mix_prompt) t = dist(rng);
  std::vector<BlockTable> solo;
  solo.push_back(base.front().fork());
  std::vector<double> one_s, many_s;
  std::vector<std::vector<double>> mix_s(shape.mix_chunks.size());
  for (int64_t r = 0; r < shape.n_reps; ++r) {
    if (!shape.json) {
      progress.update(strprintf("bench: rep %lld/%lld decoding...", static_cast<long long>(r) + 1,
                                static_cast<long long>(shape.n_reps)));
    }
    for (int k = 0; k < 2; ++k) {
      const bool batched = (k == 0) == (r % 2 == 0);
      auto s = decode_steps(engine, batched ? base : solo, shape.n_steps);
      if (!s) return fail("bench", s.error().message);
      auto& dst = batched ? many_s : one_s;
      dst.insert(dst.end(), s->begin(), s->end());
    }
    for (size_t j = 0; j < shape.mix_chunks.size(); ++j) {
      auto s = decode_steps(engine, base, shape.n_steps, shape.mix_chunks[j], mix_prompt);
      if (!s) return fail("bench", s.error().message);
      mix_s[j].insert(mix_s[j].end(), s->begin(), s->end());
    }
  }
  progress.finish();
  const double one_ms = median(one_s) * 1e3, many_ms = median(many_s) * 1e3;
  const double one_tok_s = 1e3 / one_ms;
  const double many_tok_s = 1e3 * static_cast<double>(shape.n_seqs) / many_ms;
  // Mixed steps: step time, decode and prefill tokens/s of each chunk length.
  std::string mix_json;
  std::string mix_table;
  for (size_t j = 0; j < shape.mix_chunks.size(); ++j) {
    const double ms = median(mix_s[j]) * 1e3;
    const auto c = static_cast<long long>(shape.mix_chunks[j]);
    const double dec = 1e3 * static_cast<double>(shape.n_seqs) / ms;
    const double pre = 1e3 * static_cast<double>(c) / ms;
    mix_json += strprintf(
        "%s{\"prefill_chunk\": %lld, \"step_ms\": %.3f, \"step_ratio\": %.3f, "
        "\"decode_tok_s\": %.2f, \"prefill_tok_s\": %.2f}",
        j == 0 ? "" : ", ", c, ms, ms / many_ms, dec, pre);
    mix_table += strprintf(
        "  + prefill %-5lld %.2f ms (median, %.2fx decode-only), %.1f decode + %.1f prefill "
        "tok/s\n",
        c, ms, ms / many_ms, dec, pre);
  }
  if (shape.json) {
    std::printf(
        "{\"model\": \"%s\", \"threads\": %d, \"kv_dtype\": \"%s\", \"batch\": %lld, "
        "\"context\": %lld, \"steps\": %lld, \"reps\": %lld, \"prefill_tok_s\": %.2f, "
        "\"step_ms_1\": %.3f, \"step_ms_batch\": %.3f, \"step_ratio\": %.3f, "
        "\"decode_tok_s_1\": %.2f, \"decode_tok_s_batch\": %.2f, \"mixed\": [%s]}\n",
        cfg.model_path.c_str(), engine.threads().n_threads(), kv_dtype_name(cfg.kv_dtype),
        static_cast<long long>(shape.n_seqs), static_cast<long long>(shape.n_context),
        static_cast<long long>(shape.n_steps), static_cast<long long>(shape.n_reps), prefill_tok_s,
        one_ms, many_ms, many_ms / one_ms, one_tok_s, many_tok_s, mix_json.c_str());
  } else {
    std::printf("model              %s\n", cfg.model_path.c_str());
    std::printf("threads            %d\n", engine.threads().n_threads());
    std::printf("kv dtype / block   %s / %d tokens\n", kv_dtype_name(cfg.kv_dtype), cfg.block_size);
    std::printf(
        "shape              %lld sequences at context %lld, %lld decode steps x %lld reps\n",
        static_cast<long long>(shape.n_seqs), static_cast<long long>(shape.n_context),
        static_cast<long long>(shape.n_steps), static_cast<long long>(shape.n_reps));
    std::printf("prefill            %.1f tok/s (%lld sequences, one after another)\n",
                prefill_tok_s, static_cast<long long>(shape.n_seqs));
    std::printf("decode step, 1     %.2f ms (median), %.1f tok/s\n", one_ms, one_tok_s);
    std::printf("decode step, %-5lld %.2f ms (median), %.1f tok/s in total\n",
                static_cast<long long>(shape.n_seqs), many_ms, many_tok_s);
    std::printf("step time ratio    %.2fx (batch %lld / 1)\n", many_ms / one_ms,
                static_cast<long long>(shape.n_seqs));
    if (!mix_table.empty()) {
      std::printf("mixed steps        %lld decodes plus one prefill chunk:\n%s",
                  static_cast<long long>(shape.n_seqs), mix_table.c_str());
    }
  }
  return 0;
}

// `kvstack bench --mass-ab` (bench only; REQUIRES --kv-retention h2o): the
// decode step time of H2O with and without its key-mass output, everything
// else the same. One prefill of n_context random tokens and one untimed
// decode step (H2O's first: the prompt-mass seeding and the first
// compaction), then per repetition n_steps decode steps from a private copy
// of that table with the mass on and n_steps from another with it off
// (BlockTable::set_mass_output: the kernels get no AttnSeq::key_mass, H2O
// still compacts every `slack` tokens on the mass it had), in alternating
// order. Step times are medians over every measured step of each side.
int run_mass_ab(EngineConfig cfg, int64_t n_context, int64_t n_steps, int64_t n_reps, uint32_t seed,
                bool json) {
  if (!cfg.kv_retention.is_h2o()) {
    return fail("bench",
                "--mass-ab compares H2O's step with and without its mass: it needs "
                "--kv-retention h2o:...");
  }
  // The prefilled table plus one private copy being decoded.
  if (cfg.kv_cache_mem == 0 && cfg.kv_cache_tokens == 0) {
    cfg.kv_cache_tokens = 2 * (n_context + n_steps + 2 * cfg.block_size) + cfg.block_size;
  }
  auto created = Engine::create(cfg);
  if (!created) return fail("bench", created.error().message);
  Engine& engine = **created;
  const ModelConfig& mc = engine.model().config();
  if (n_context + n_steps + 1 > mc.n_ctx_train) {
    return fail("bench", "prompt + gen = " + std::to_string(n_context + n_steps + 1) +
                             " exceeds the model's context length " +
                             std::to_string(mc.n_ctx_train));
  }
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, mc.n_vocab - 1);
  std::vector<int32_t> prompt(static_cast<size_t>(n_context));
  for (auto& t : prompt) t = dist(rng);
  Progress progress;
  if (!json) progress.update("bench: prefilling the prompt...");
  std::vector<BlockTable> base;
  base.push_back(engine.new_table());
  std::vector<float> logits;
  Status st = engine.prefill(base.back(), prompt, LogitsMode::kLast, &logits);
  if (!st.ok()) return fail("bench", st.error().message);
  int32_t next = argmax(logits.data(), mc.n_vocab);
  const StepSeq first{.table = &base.back(), .tokens = std::span<const int32_t>(&next, 1)};
  st = engine.forward().step(std::span<const StepSeq>(&first, 1), &logits);
  if (!st.ok()) return fail("bench", st.error().message);
  const int64_t resident = base.back().resident_length(0);
  std::vector<double> on_s, off_s;
  for (int64_t r = 0; r < n_reps; ++r) {
    if (!json) {
      progress.update(strprintf("bench: rep %lld/%lld decoding...", static_cast<long long>(r) + 1,
                                static_cast<long long>(n_reps)));
    }
    for (int k = 0; k < 2; ++k) {
      const bool on = (k == 0) == (r % 2 == 0);
      base.back().set_mass_output(on);
      auto s = decode_steps(engine, base, n_steps);
      if (!s) return fail("bench", s.error().message);
      auto& dst = on ? on_s : off_s;
      dst.insert(dst.end(), s->begin(), s->end());
    }
  }
  progress.finish();
  const double on_ms = median(on_s) * 1e3, off_ms = median(off_s) * 1e3;
  double on_mean = 0.0, off_mean = 0.0;
  for (double x : on_s) on_mean += x;
  for (double x : off_s) off_mean += x;
  on_mean *= 1e3 / static_cast<double>(on_s.size());
  off_mean *= 1e3 / static_cast<double>(off_s.size());
  if (json) {
    std::printf(
        "{\"model\": \"%s\", \"threads\": %d, \"kv_dtype\": \"%s\", \"context\": %lld, "
        "\"resident_layer0\": %lld, \"steps\": %lld, \"reps\": %lld, "
        "\"step_ms_mass\": %.3f, \"step_ms_no_mass\": %.3f, \"mass_ratio\": %.4f, "
        "\"mean_ms_mass\": %.3f, \"mean_ms_no_mass\": %.3f, \"mean_ratio\": %.4f}\n",
        cfg.model_path.c_str(), engine.threads().n_threads(), kv_dtype_name(cfg.kv_dtype),
        static_cast<long long>(n_context), static_cast<long long>(resident),
        static_cast<long long>(n_steps), static_cast<long long>(n_reps), on_ms, off_ms,
        on_ms / off_ms, on_mean, off_mean, on_mean / off_mean);
  } else {
    std::printf("model              %s\n", cfg.model_path.c_str());
    std::printf("threads            %d\n", engine.threads().n_threads());
    std::printf("kv dtype / block   %s / %d tokens\n", kv_dtype_name(cfg.kv_dtype), cfg.block_size);
    std::printf(
        "shape              prompt %lld (layer 0 resident %lld after the first step), "
        "%lld decode steps x %lld reps per side\n",
        static_cast<long long>(n_context), static_cast<long long>(resident),
        static_cast<long long>(n_steps), static_cast<long long>(n_reps));
    std::printf("decode step, mass  %.2f ms (median), %.2f ms (mean)\n", on_ms, on_mean);
    std::printf("decode step, none  %.2f ms (median), %.2f ms (mean)\n", off_ms, off_mean);
    std::printf("mass / no mass     %.3fx (median), %.3fx (mean)\n", on_ms / off_ms,
                on_mean / off_mean);
  }
  return 0;
}

int run_bench(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"prompt-tokens", 0, "N", "prompt length in tokens (default 512)"});
  specs.push_back({"gen", 'n', "N", "tokens to generate (default 128)"});
  specs.push_back(
      {"ctx-fill", 0, "N", "tokens already in the cache before the prompt (default 0)"});
  specs.push_back({"reps", 0, "N", "repetitions; medians are reported (default 3)"});
  specs.push_back({"seed", 0, "N", "seed of the random prompt tokens (default 1)"});
  specs.push_back({"batch", 0, "N",
                   "decode N sequences together (each at ctx-fill + prompt-tokens) and compare "
                   "the step time with one sequence alone (default 1: single-stream bench)"});
  specs.push_back({"mix-prefill", 0, "LIST",
                   "with --batch: also time steps of the N decodes plus one prefill chunk of each "
                   "length in LIST (comma-separated tokens, e.g. 16,48,112,240)"});
  specs.push_back({"mass-ab", 0, "",
                   "bench only, with --kv-retention h2o: decode step time with and without "
                   "H2O's key-mass output, alternated (--gen steps x --reps per side)"});
  specs.push_back({"json", 0, "", "print one JSON object instead of a table"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("bench", args.error().message);
  if (args->flag("help")) {
    std::fputs(
        format_help("kvstack bench [-m MODEL] [--prompt-tokens N] [--gen N] [--ctx-fill N] "
                    "[--threads T] [--batch N] [--json]",
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
  auto batch_n = args->get_int("batch", 1, 1, 4096);
  for (const auto* r : {&prompt_n, &gen_n, &fill_n, &reps, &seed, &batch_n}) {
    if (!*r) return fail("bench", r->error().message);
  }
  const bool json = args->flag("json");
  auto cfg = engine_config_from(*args);
  if (!cfg) return fail("bench", cfg.error().message);
  const int64_t total = *fill_n + *prompt_n + *gen_n;
  std::vector<int64_t> mix_chunks;
  if (auto list = args->get("mix-prefill")) {
    for (size_t at = 0; at <= list->size();) {
      const size_t comma = std::min(list->find(',', at), list->size());
      const std::string item = list->substr(at, comma - at);
      char* end = nullptr;
      const long long v = std::strtoll(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v < 1 || v > (1 << 20)) {
        return fail("bench", "--mix-prefill: '" + item +
                                 "' is not a chunk length in [1, 1048576] (a comma-separated "
                                 "list, e.g. 16,48,112)");
      }
      mix_chunks.push_back(v);
      at = comma + 1;
    }
    if (*batch_n < 2) return fail("bench", "--mix-prefill needs --batch N with N >= 2");
  }
  if (args->flag("mass-ab")) {
    if (*batch_n > 1 || *fill_n > 0 || !mix_chunks.empty()) {
      return fail("bench",
                  "--mass-ab takes --prompt-tokens, --gen and --reps only (no --batch, "
                  "--ctx-fill or --mix-prefill)");
    }
    return run_mass_ab(*cfg, *prompt_n, *gen_n, *reps, static_cast<uint32_t>(*seed), json);
  }
  if (*batch_n > 1) {
    BatchBenchShape shape{.n_seqs = *batch_n,
                          .n_context = *fill_n + *prompt_n,
                          .n_steps = *gen_n,
                          .n_reps = *reps,
                          .seed = static_cast<uint32_t>(*seed),
                          .json = json,
                          .mix_chunks = mix_chunks};
    return run_batch_bench(*cfg, shape);
  }
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

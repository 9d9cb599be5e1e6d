// `kvstack kv-eval`: quality of a KV cache format against the f32 cache on
// the same text (issue 7): perplexity and its relative change, mean and p99
// KL divergence of the next-token distributions, top-1 agreement, and
// greedy-continuation agreement over --gen tokens for a set of prompts.
// A bare format X runs X as `kvstack run --kv-dtype X` would, with its
// quality defaults (engine_options.h: rotation for fp8/int8/int4, key
// centring for int8/int4 keys). Suffixes say exactly what runs instead: X+rot
// with --kv-rotate only (Hadamard rotation of Q, K and V), X+ctr with
// --kv-center only (calibrated key means subtracted), X+ctr+rot both, and
// X+plain neither, so one invocation can compare a format with and without
// them; K/V (e.g. int8/int4, int8/int4+rot) gives K and V different formats.
// The f32 baseline is never rotated or centered. KIVI formats keep their
// newest tokens in f16, so a window in one prefill chunk would read them
// unquantized: with any KIVI format every entry is scored by one-token steps.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/args.h"
#include "cli/engine_options.h"
#include "cli/eval_input.h"
#include "cli/progress.h"
#include "cli/text_input.h"

namespace kvstack::cli {
namespace {

// log softmax of a logits row, in double.
void log_softmax(const float* row, int64_t n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  double mx = row[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(row[i]) - lse;
}

int64_t argmax(const float* row, int64_t n) {
  return std::max_element(row, row + n) - row;
}

// One entry of --kv-dtype: K[/V][+ctr][+rot][+plain] (suffixes in any order).
struct FormatSpec {
  KvDtype k = KvDtype::kF32;
  std::optional<KvDtype> v;  // V's format when it differs from K's
  bool rotate = false;
  bool center = false;
  bool plain = false;
  bool explicit_transforms() const { return rotate || center || plain; }
};

Result<FormatSpec> parse_format(std::string_view f) {
  FormatSpec spec;
  for (bool found = true; found;) {
    found = false;
    for (auto [suffix, flag] : {std::pair<std::string_view, bool*>{"+rot", &spec.rotate},
                                std::pair<std::string_view, bool*>{"+ctr", &spec.center},
                                std::pair<std::string_view, bool*>{"+plain", &spec.plain}}) {
      if (f.size() > suffix.size() && f.substr(f.size() - suffix.size()) == suffix) {
        *flag = true;
        f.remove_suffix(suffix.size());
        found = true;
      }
    }
  }
  const size_t slash = f.find('/');
  auto k = parse_kv_dtype(f.substr(0, slash));
  if (!k) return k.error();
  spec.k = *k;
  if (slash != std::string_view::npos) {
    auto v = parse_kv_dtype(f.substr(slash + 1));
    if (!v) return v.error();
    if (*v != *k) spec.v = *v;
  }
  if (spec.plain && (spec.rotate || spec.center)) {
    return make_error(Errc::kInvalidArgument, "+plain cannot be combined with +rot or +ctr");
  }
  return spec;
}

struct FormatStats {
  std::string name;
  double nll = 0;
  std::vector<double> kld;  // per scored position
  int64_t top1_same = 0;
  int64_t greedy_same = 0;      // position-wise identical continuation tokens
  double greedy_prefix = 0;     // sum over prompts of tokens before the first divergence
  int64_t bytes_per_token = 0;  // layout payload per token (all layers), per-token part
  int64_t block_bytes = 0;
  double bytes_per_element = 0;  // block bytes / (P * K and V elements per token)
};

// Greedy continuation of `prompt` for n_gen tokens.
Result<std::vector<int32_t>> greedy(Engine& e, std::span<const int32_t> prompt, int n_gen) {
  const int64_t n_vocab = e.model().config().n_vocab;
  BlockTable table = e.new_table();
  std::vector<float> logits;
  KV_TRY_STATUS(e.prefill(table, prompt, LogitsMode::kLast, &logits));
  std::vector<int32_t> out;
  for (int i = 0; i < n_gen; ++i) {
    const auto t = static_cast<int32_t>(argmax(logits.data(), n_vocab));
    out.push_back(t);
    if (i + 1 < n_gen)
      KV_TRY_STATUS(e.prefill(table, std::span<const int32_t>(&t, 1), LogitsMode::kLast, &logits));
  }
  return out;
}

int run_kv_eval(const std::vector<std::string>& argv_in) {
  // --kv-dtype may list several formats (repeated or comma-separated); they
  // are taken out before the shared engine options are parsed.
  std::vector<std::string> argv, formats;
  for (size_t i = 0; i < argv_in.size(); ++i) {
    std::string list;
    if (argv_in[i] == "--kv-dtype" && i + 1 < argv_in.size()) {
      list = argv_in[++i];
    } else if (argv_in[i].rfind("--kv-dtype=", 0) == 0) {
      list = argv_in[i].substr(11);
    } else {
      argv.push_back(argv_in[i]);
      continue;
    }
    size_t start = 0;
    while (start <= list.size()) {
      const size_t comma = std::min(list.find(',', start), list.size());
      if (comma > start) formats.push_back(list.substr(start, comma - start));
      start = comma + 1;
    }
  }
  const std::vector<OptionSpec> own = {
      {"file", 'f', "FILE", "text file to evaluate on (required)"},
      {"ctx", 'c', "N", "window length in tokens for perplexity/KLD (default 512)"},
      {"max-windows", 0, "N", "use at most N windows (default: all)"},
      {"prompts", 0, "N", "greedy-continuation prompts taken from FILE (default 8)"},
      {"prompt-len", 0, "N", "tokens per prompt (default 64)"},
      {"gen", 0, "N", "greedy tokens per prompt (default 128)"},
      {"score-steps", 0, "",
       "score each window with one-token forward steps (the decode kernels, as "
       "generation runs) instead of one prefill (always on when a KIVI format is "
       "listed)"},
      {"json", 0, "", "print one JSON object per format"}};
  auto input = parse_eval_input(
      argv, own, "kvstack kv-eval [-m MODEL] -f FILE --kv-dtype X[,Y...] [--ctx N]",
      "Compares each KV cache format X against the f32 cache on the same text: "
      "perplexity over non-overlapping --ctx windows and its relative change, mean "
      "and p99 KL(f32 || X) of next-token distributions, top-1 agreement, and "
      "agreement of --gen greedy tokens after --prompts prompts of --prompt-len "
      "tokens (taken at evenly spaced offsets of FILE). A bare X runs with X's "
      "quality defaults (as `run --kv-dtype X`: rotation for fp8/int8/int4, key "
      "centring for int8/int4 keys). X+rot (e.g. int4+rot) runs X with --kv-rotate "
      "only, X+ctr with --kv-center only, X+ctr+rot with both, X+plain with "
      "neither; --kv-rotate and --kv-center apply to every listed format, "
      "--no-kv-rotate and --no-kv-center to every bare one. K/V (e.g. "
      "int8/int4, int8/int4+rot) stores K as K and V as V; --kv-dtype-k/-v "
      "override that side of every listed format.");
  if (!input) return fail("kv-eval", input.error().message);
  if (!*input) return 0;  // --help
  const Args* args = &(*input)->args;
  if (formats.empty()) return fail("kv-eval", "--kv-dtype X is required (e.g. int8 or fp8,int4)");
  auto ctx = args->get_int("ctx", 512, 2, 1 << 20);
  if (!ctx) return fail("kv-eval", ctx.error().message);
  auto max_windows = args->get_int("max-windows", INT32_MAX, 1, INT32_MAX);
  if (!max_windows) return fail("kv-eval", max_windows.error().message);
  auto n_prompts = args->get_int("prompts", 8, 0, 1 << 16);
  if (!n_prompts) return fail("kv-eval", n_prompts.error().message);
  auto prompt_len = args->get_int("prompt-len", 64, 1, 1 << 20);
  if (!prompt_len) return fail("kv-eval", prompt_len.error().message);
  auto n_gen = args->get_int("gen", 128, 1, 1 << 20);
  if (!n_gen) return fail("kv-eval", n_gen.error().message);
  const bool json = args->flag("json");
  bool score_steps = args->flag("score-steps");
  EngineConfig* base_cfg = &(*input)->config;
  // --kv-rotate / --kv-center apply to every listed format (as a suffix
  // would), --no-kv-rotate / --no-kv-center to every bare one; none of them
  // to the f32 baseline (engine_config_from saw no --kv-dtype, so base_cfg
  // carries only the explicit flags).
  const bool rotate_all = args->flag("kv-rotate");
  const bool center_all = args->flag("kv-center") || args->has("kv-center-text");
  base_cfg->kv_rotation = KvRotation::kNone;
  base_cfg->kv_center = false;
  const bool rotation_ok = model_supports_rotation(base_cfg->model_path);
  // --kv-dtype-k/-v likewise override one side of every listed format only.
  const std::optional<KvDtype> k_all = base_cfg->kv_dtype_k, v_all = base_cfg->kv_dtype_v;
  base_cfg->kv_dtype_k.reset();
  base_cfg->kv_dtype_v.reset();
  if (base_cfg->kv_cache_tokens == 0 && base_cfg->kv_cache_mem == 0) {
    base_cfg->kv_cache_tokens = std::max(*ctx, *prompt_len + *n_gen);
  }
  // Engine 0 is the f32 baseline.
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<FormatStats> stats;
  formats.insert(formats.begin(), "f32");
  for (size_t fi = 0; fi < formats.size(); ++fi) {
    const std::string& f = formats[fi];
    auto spec = parse_format(f);
    if (!spec) return fail("kv-eval", "--kv-dtype " + f + ": " + spec.error().message);
    EngineConfig cfg = *base_cfg;
    // Sides given by --kv-dtype-k/-v win over the listed format's.
    const KvDtype k = fi > 0 && k_all ? *k_all : spec->k;
    const KvDtype v = fi > 0 && v_all ? *v_all : spec->v.value_or(spec->k);
    cfg.kv_dtype = k;
    cfg.kv_dtype_v = v != k ? std::optional<KvDtype>(v) : std::nullopt;
    bool rotate = false, center = false;
    if (fi > 0) {
      const KvQualityDefaults q = kv_quality_defaults(k, v);
      if (spec->explicit_transforms()) {
        rotate = spec->rotate;
        center = spec->center;
      } else {
        rotate = q.rotate && rotation_ok && !args->flag("no-kv-rotate");
        center = q.center && !args->flag("no-kv-center");
      }
      rotate = rotate || rotate_all;
      center = center || center_all;
      if (kv_dtype_is_kivi(k) || kv_dtype_is_kivi(v)) score_steps = true;
    }
    if (rotate) cfg.kv_rotation = KvRotation::kHadamard;
    cfg.kv_center = center;
    auto e = Engine::create(cfg);
    if (!e) return fail("kv-eval", "--kv-dtype " + f + ": " + e.error().message);
    FormatStats s;
    // The name says what ran: K/V when they differ, +ctr when centered, +rot
    // when rotated.
    s.name = kv_dtype_name(cfg.key_dtype());
    if (cfg.value_dtype() != cfg.key_dtype())
      s.name += std::string("/") + kv_dtype_name(cfg.value_dtype());
    if (center) s.name += "+ctr";
    if (rotate) s.name += "+rot";
    s.bytes_per_token = (*e)->layout().payload_bytes_per_token();
    s.block_bytes = (*e)->layout().block_bytes();
    const ModelConfig& mc = (*e)->model().config();
    const double elements_per_block =
        2.0 * mc.n_layers * mc.n_kv_heads * mc.head_dim * (*e)->layout().block_size();
    s.bytes_per_element = static_cast<double>(s.block_bytes) / elements_per_block;
    stats.push_back(std::move(s));
    engines.push_back(std::move(*e));
  }
  if (score_steps && !args->flag("score-steps") && !json) {
    std::fprintf(stderr,
                 "kvstack kv-eval: KIVI keeps the newest tokens in f16 (one prefill chunk would "
                 "read the whole window unquantized): scoring every format by one-token decode "
                 "steps\n");
  }
  Engine& base = *engines[0];
  const int64_t n_vocab = base.model().config().n_vocab;
  if (*ctx > base.model().config().n_ctx_train) {
    return fail("kv-eval", "--ctx " + std::to_string(*ctx) + " exceeds the model's context " +
                               std::to_string(base.model().config().n_ctx_train));
  }
  auto scored = eval_tokens(base, **input, *ctx);
  if (!scored) return fail("kv-eval", scored.error().message);
  const std::vector<int32_t>& tokens = *scored;
  const int64_t n_windows =
      std::min<int64_t>(static_cast<int64_t>(tokens.size()) / *ctx, *max_windows);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> base_logits, logits;
  std::vector<double> lp_base, lp;
  std::vector<float> step_row;  // --score-steps: one step's logits
  int64_t n_scored = 0;
  Progress progress;
  for (int64_t w = 0; w < n_windows; ++w) {
    const std::span<const int32_t> win(tokens.data() + w * *ctx, static_cast<size_t>(*ctx));
    for (size_t fi = 0; fi < engines.size(); ++fi) {
      BlockTable table = engines[fi]->new_table();
      std::vector<float>& out = fi == 0 ? base_logits : logits;
      out.clear();
      Status st;
      if (score_steps) {
        for (size_t j = 0; j < win.size() && st.ok(); ++j) {
          st = engines[fi]->prefill(table, win.subspan(j, 1), LogitsMode::kLast, &step_row);
          out.insert(out.end(), step_row.begin(), step_row.end());
        }
      } else {
        st = engines[fi]->prefill(table, win, LogitsMode::kAll, &out);
      }
      if (!st.ok()) return fail("kv-eval", st.error().message);
      if (fi == 0) continue;
      FormatStats& s = stats[fi];
      for (int64_t j = 0; j + 1 < *ctx; ++j) {
        const float* rb = base_logits.data() + j * n_vocab;
        const float* rx = logits.data() + j * n_vocab;
        log_softmax(rb, n_vocab, lp_base);
        log_softmax(rx, n_vocab, lp);
        double kld = 0;
        for (int64_t i = 0; i < n_vocab; ++i) kld += std::exp(lp_base[i]) * (lp_base[i] - lp[i]);
        s.kld.push_back(std::max(0.0, kld));
        s.nll -= lp[win[j + 1]];
        s.top1_same += argmax(rb, n_vocab) == argmax(rx, n_vocab) ? 1 : 0;
        if (fi == 1) stats[0].nll -= lp_base[win[j + 1]];
      }
    }
    n_scored += *ctx - 1;
    if (!json) {
      progress.update(strprintf("kv-eval: window %lld/%lld", static_cast<long long>(w) + 1,
                                static_cast<long long>(n_windows)),
                      /*force=*/w + 1 == n_windows);
    }
  }
  // Greedy continuations from prompts at evenly spaced offsets.
  const int64_t span_tokens = static_cast<int64_t>(tokens.size()) - *prompt_len;
  int64_t n_prompts_run = 0;
  for (int64_t pi = 0; pi < *n_prompts && span_tokens > 0; ++pi, ++n_prompts_run) {
    const int64_t off = span_tokens * pi / std::max<int64_t>(1, *n_prompts);
    const std::span<const int32_t> prompt(tokens.data() + off, static_cast<size_t>(*prompt_len));
    auto ref = greedy(base, prompt, static_cast<int>(*n_gen));
    if (!ref) return fail("kv-eval", ref.error().message);
    for (size_t fi = 1; fi < engines.size(); ++fi) {
      auto got = greedy(*engines[fi], prompt, static_cast<int>(*n_gen));
      if (!got) return fail("kv-eval", got.error().message);
      int64_t prefix = 0;
      bool diverged = false;
      for (size_t i = 0; i < ref->size(); ++i) {
        const bool same = (*ref)[i] == (*got)[i];
        stats[fi].greedy_same += same ? 1 : 0;
        if (!same) diverged = true;
        if (!diverged) ++prefix;
      }
      stats[fi].greedy_prefix += static_cast<double>(prefix);
    }
    if (!json) {
      progress.update(strprintf("kv-eval: greedy prompt %lld/%lld", static_cast<long long>(pi) + 1,
                                static_cast<long long>(*n_prompts)),
                      /*force=*/pi + 1 == *n_prompts);
    }
  }
  progress.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double ppl_base = std::exp(stats[0].nll / static_cast<double>(n_scored));
  if (!json) {
    std::printf(
        "kv-eval: %lld windows of %lld tokens (%lld scored%s), %lld prompts x %lld greedy "
        "tokens, %.0f s\n",
        static_cast<long long>(n_windows), static_cast<long long>(*ctx),
        static_cast<long long>(n_scored), score_steps ? " by one-token steps" : "",
        static_cast<long long>(n_prompts_run), static_cast<long long>(*n_gen), secs);
    std::printf("%-14s %7s %10s %12s %10s %9s %11s %11s %8s %12s %12s\n", "format", "B/elem",
                "B/token", "tokens/GiB", "ppl", "d_ppl", "mean KLD", "p99 KLD", "top-1", "greedy",
                "first-div");
    std::printf(
        "%-14s %7.4f %10lld %12.0f %10.4f %9s %11s %11s %8s %12s %12s\n", "f32",
        stats[0].bytes_per_element, static_cast<long long>(stats[0].bytes_per_token),
        1073741824.0 * base.layout().block_size() / static_cast<double>(stats[0].block_bytes),
        ppl_base, "-", "-", "-", "-", "-", "-");
  }
  for (size_t fi = 1; fi < stats.size(); ++fi) {
    FormatStats& s = stats[fi];
    const double ppl = std::exp(s.nll / static_cast<double>(n_scored));
    double mean_kld = 0;
    for (double k : s.kld) mean_kld += k;
    mean_kld /= static_cast<double>(s.kld.size());
    std::vector<double> sorted = s.kld;
    const size_t k99 = std::min(sorted.size() - 1, static_cast<size_t>(0.99 * sorted.size()));
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<long>(k99), sorted.end());
    const double p99 = sorted[k99];
    const double top1 = static_cast<double>(s.top1_same) / static_cast<double>(n_scored);
    const double n_greedy = static_cast<double>(n_prompts_run * *n_gen);
    const double greedy_frac = n_greedy > 0 ? static_cast<double>(s.greedy_same) / n_greedy : 0;
    const double first_div =
        n_prompts_run > 0 ? s.greedy_prefix / static_cast<double>(n_prompts_run) : 0;
    // Tokens per GiB of pool: whole blocks of P tokens.
    const double tokens_per_gib =
        1073741824.0 * engines[fi]->layout().block_size() / static_cast<double>(s.block_bytes);
    if (json) {
      std::printf(
          "{\"kv_dtype\": \"%s\", \"kv_rotate\": %s, \"kv_center\": %s, "
          "\"bytes_per_element\": %.4f, "
          "\"bytes_per_token\": %lld, \"block_bytes\": %lld, "
          "\"tokens_per_gib\": %.0f, \"ppl_f32\": %.6f, \"ppl\": %.6f, "
          "\"ppl_rel_change\": %.6f, \"kld_mean\": %.8f, \"kld_p99\": %.8f, "
          "\"top1_agreement\": %.6f, \"greedy_agreement\": %.6f, "
          "\"greedy_tokens_before_divergence\": %.2f, \"ctx\": %lld, \"score_steps\": %s, "
          "\"n_windows\": %lld, "
          "\"n_scored\": %lld, \"n_prompts\": %lld, \"gen\": %lld, \"seconds\": %.1f}\n",
          s.name.c_str(), engines[fi]->config().kv_rotation != KvRotation::kNone ? "true" : "false",
          engines[fi]->config().kv_center ? "true" : "false", s.bytes_per_element,
          static_cast<long long>(s.bytes_per_token), static_cast<long long>(s.block_bytes),
          tokens_per_gib, ppl_base, ppl, ppl / ppl_base - 1, mean_kld, p99, top1, greedy_frac,
          first_div, static_cast<long long>(*ctx), score_steps ? "true" : "false",
          static_cast<long long>(n_windows), static_cast<long long>(n_scored),
          static_cast<long long>(n_prompts_run), static_cast<long long>(*n_gen), secs);
    } else {
      char greedy_col[32] = "-", first_div_col[32] = "-";  // "-": no prompts were run
      if (n_prompts_run > 0) {
        std::snprintf(greedy_col, sizeof(greedy_col), "%.2f%%", 100 * greedy_frac);
        std::snprintf(first_div_col, sizeof(first_div_col), "%.1f", first_div);
      }
      std::printf("%-14s %7.4f %10lld %12.0f %10.4f %+8.3f%% %11.6f %11.6f %7.2f%% %12s %12s\n",
                  s.name.c_str(), s.bytes_per_element, static_cast<long long>(s.bytes_per_token),
                  tokens_per_gib, ppl, 100 * (ppl / ppl_base - 1), mean_kld, p99, 100 * top1,
                  greedy_col, first_div_col);
    }
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_kv_eval, "kv-eval", "quality of a KV cache format against the f32 cache",
                run_kv_eval);

}  // namespace kvstack::cli

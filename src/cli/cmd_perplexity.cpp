// `kvstack perplexity`: perplexity of a text over non-overlapping windows.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "cli/args.h"
#include "cli/engine_options.h"
#include "cli/progress.h"
#include "cli/text_input.h"

namespace kvstack::cli {
namespace {

// log softmax(row)[target], computed in double.
double log_prob(const float* row, int64_t n, int32_t target) {
  double mx = row[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  return static_cast<double>(row[target]) - mx - std::log(sum);
}

int run_perplexity(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"file", 'f', "FILE", "text file to score (required)"});
  specs.push_back({"ctx", 'c', "N", "window length in tokens (default 512)"});
  specs.push_back({"max-windows", 0, "N", "score at most N windows (default: all)"});
  specs.push_back({"score-steps", 0, "",
                   "score each window with one-token forward steps (the decode kernels, as "
                   "generation runs) instead of prefill chunks; always on for kivi2/kivi4"});
  specs.push_back({"json", 0, "", "print one JSON object"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("perplexity", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack perplexity [-m MODEL] -f FILE [--ctx N] [--json]",
                           "Split the tokenized text into non-overlapping windows of --ctx tokens; "
                           "in each window (a fresh sequence) score every token after the first "
                           "from the logits of its prefix. When the vocabulary adds a BOS token "
                           "(Gemma), each window's first token is replaced by BOS, as llama.cpp's "
                           "perplexity does. Prints exp(mean negative log-likelihood). "
                           "KIVI formats (kivi2/kivi4) are scored by one-token steps: their newest "
                           "tokens stay in f16, so one prefill chunk would read the whole window "
                           "unquantized.",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  if (!args->has("file")) return fail("perplexity", "-f FILE is required");
  auto ctx = args->get_int("ctx", 512, 2, 1 << 20);
  if (!ctx) return fail("perplexity", ctx.error().message);
  auto max_windows = args->get_int("max-windows", INT32_MAX, 1, INT32_MAX);
  if (!max_windows) return fail("perplexity", max_windows.error().message);
  const bool json = args->flag("json");
  auto text = read_file(*args->get("file"));
  if (!text) return fail("perplexity", text.error().message);
  auto engine = load_engine(*args, json);
  if (!engine) return fail("perplexity", engine.error().message);
  Engine& e = **engine;
  const int64_t n_vocab = e.model().config().n_vocab;
  if (*ctx > e.model().config().n_ctx_train) {
    return fail("perplexity", "--ctx " + std::to_string(*ctx) + " exceeds the model's context " +
                                  std::to_string(e.model().config().n_ctx_train));
  }
  std::vector<int32_t> tokens =
      e.tokenizer().tokenize(*text, {.add_special = false, .parse_special = false});
  const int64_t n_windows =
      std::min<int64_t>(static_cast<int64_t>(tokens.size()) / *ctx, *max_windows);
  if (n_windows < 1) {
    return fail("perplexity", *args->get("file") + " has " + std::to_string(tokens.size()) +
                                  " tokens, fewer than one window of " + std::to_string(*ctx));
  }
  // KIVI keeps the newest --kv-residual tokens of a sequence in f16 and
  // quantizes older ones as they age out, so a prefill chunk reads every
  // token of itself from the f16 residual: scoring a window in one chunk
  // would measure f16, not the format. One-token steps read the cache
  // exactly as generation does.
  const bool kivi =
      kv_dtype_is_kivi(e.config().key_dtype()) || kv_dtype_is_kivi(e.config().value_dtype());
  const bool score_steps = args->flag("score-steps") || kivi;
  if (kivi && !args->flag("score-steps") && !json) {
    std::fprintf(stderr,
                 "kvstack perplexity: %s keeps the newest tokens in f16 (one prefill chunk "
                 "would read the whole window unquantized): scoring by one-token decode "
                 "steps\n",
                 kv_dtype_name(e.config().key_dtype()));
  }
  double nll = 0;
  int64_t n_scored = 0;
  std::vector<float> logits, piece;
  // Progress inside a window: after each prefill chunk, or every 32 steps.
  const int64_t piece_len = score_steps ? 1 : e.config().prefill_chunk;
  const int64_t report_every = score_steps ? 32 : 1;
  Progress progress;
  const auto t0 = std::chrono::steady_clock::now();
  const bool window_bos = e.tokenizer().add_bos() && e.tokenizer().bos() != kNoToken;
  for (int64_t w = 0; w < n_windows; ++w) {
    // The first token is never scored; a BOS in its place gives the model
    // the start it was trained with (the window's second token is scored).
    if (window_bos) tokens[static_cast<size_t>(w * *ctx)] = e.tokenizer().bos();
    const std::span<const int32_t> win(tokens.data() + w * *ctx, static_cast<size_t>(*ctx));
    BlockTable table = e.new_table();
    logits.clear();
    // Pieces start at multiples of the prefill chunk, so prefill cuts them
    // exactly where one call over the window would.
    int64_t n_pieces = 0;
    for (int64_t b = 0; b < *ctx; b += piece_len, ++n_pieces) {
      const int64_t n = std::min<int64_t>(piece_len, *ctx - b);
      const Status st =
          e.prefill(table, win.subspan(static_cast<size_t>(b), static_cast<size_t>(n)),
                    LogitsMode::kAll, &piece);
      if (!st.ok()) return fail("perplexity", st.error().message);
      logits.insert(logits.end(), piece.begin(), piece.end());
      const int64_t n_done = b + n;
      if (!json && (n_pieces % report_every == 0 || n_done == *ctx)) {
        // The running perplexity covers the windows finished so far.
        const std::string running =
            n_scored > 0
                ? strprintf(", running ppl %.4f", std::exp(nll / static_cast<double>(n_scored)))
                : std::string();
        progress.update(strprintf("perplexity: window %lld/%lld, token %lld/%lld%s%s",
                                  static_cast<long long>(w) + 1, static_cast<long long>(n_windows),
                                  static_cast<long long>(n_done), static_cast<long long>(*ctx),
                                  score_steps ? " (steps)" : "", running.c_str()));
      }
    }
    for (int64_t j = 0; j + 1 < *ctx; ++j) {
      nll -= log_prob(logits.data() + j * n_vocab, n_vocab, win[j + 1]);
      ++n_scored;
    }
    if (!json) {
      progress.update(strprintf("perplexity: window %lld/%lld done, running ppl %.4f",
                                static_cast<long long>(w) + 1, static_cast<long long>(n_windows),
                                std::exp(nll / static_cast<double>(n_scored))),
                      /*force=*/w + 1 == n_windows);
    }
  }
  progress.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double ppl = std::exp(nll / static_cast<double>(n_scored));
  if (json) {
    std::printf(
        "{\"perplexity\": %.6f, \"nll_mean\": %.8f, \"ctx\": %lld, \"n_windows\": %lld, "
        "\"n_scored\": %lld, \"n_tokens\": %zu, \"kv_dtype\": \"%s\", \"kv_rotate\": \"%s\", "
        "\"kv_center\": %s, \"score_steps\": %s, \"seconds\": %.3f}\n",
        ppl, nll / static_cast<double>(n_scored), static_cast<long long>(*ctx),
        static_cast<long long>(n_windows), static_cast<long long>(n_scored), tokens.size(),
        kv_dtype_label(e.config()).c_str(), kv_rotation_name(e.config().kv_rotation),
        e.config().kv_center ? "true" : "false", score_steps ? "true" : "false", secs);
  } else {
    std::printf(
        "perplexity %.4f over %lld windows of %lld tokens (%lld tokens scored%s, %.1f s, "
        "%.0f tok/s)\n",
        ppl, static_cast<long long>(n_windows), static_cast<long long>(*ctx),
        static_cast<long long>(n_scored), score_steps ? " by one-token steps" : "", secs,
        static_cast<double>(n_windows * *ctx) / secs);
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_perplexity, "perplexity", "perplexity of a text file over fixed windows",
                run_perplexity);

}  // namespace kvstack::cli

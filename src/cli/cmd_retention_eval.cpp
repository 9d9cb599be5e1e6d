// `kvstack retention-eval`: what each retention policy (kv/retention.h)
// costs in quality and buys in memory and speed, against the full cache on
// the same model (issue 18).
//
// For every policy x budget (a budget B is the prompt tokens the policy may
// keep, a fraction of the prompt, "25%", or a count, "256"), on --windows
// windows of a long text: the window's first --ctx tokens are the prompt,
// the next --score tokens are fed one at a time (teacher forcing: one-token
// decode steps, where every policy has applied its selection), and
//   - perplexity of those tokens and its change against the full cache,
//   - mean KL(full || policy) of the next-token distributions, top-1 agreement,
//   - greedy agreement: --gen greedy tokens after the prompt, position-wise
//     equal to the full cache's,
//   - resident KV bytes of the sequence after the scored tokens (blocks held
//     x block bytes) and the tokens resident per layer,
//   - decode speed of the scored steps (tokens/s, wall clock),
// plus a passkey-retrieval task: a 5-digit key sentence hidden at each
// --passkey-depths fraction of filler text of each --passkey-lengths tokens,
// then "What is the pass key? The pass key is"; a row succeeds when its 8
// greedy tokens contain the key. The full cache is the first row.
//
// Budget B -> policy parameters: streamingllm sinks=4, window=B-4;
// snapkv / pyramidkv budget=B-32, window=32, kernel 7, gqa=mean (PyramidKV:
// B-32 is the mean per layer, beta 20); h2o budget=B/2 heavy hitters,
// window=B-B/2 recent, obs=32; topk (reads, not memory) k=ceil(B/P) blocks
// per decode query. Compacting policies keep up to slack - 1
// (the block size) more between compactions and SnapKV keeps the union of
// a layer's KV heads, so "kept" reports what stayed.
//
// The prompt is prefilled once per window for the full row and the
// prefill-end policies (snapkv, pyramidkv, h2o: exact until the first decode
// step; the engine keeps the prompt's last 32 queries per layer and gives
// every layer its own KV group, as under --kv-retention) and each row
// decodes from a copy-on-write fork of it; streamingllm rows prefill on
// their own (they compact between prefill chunks).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
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

using Clock = std::chrono::steady_clock;

constexpr int64_t kObs = 32;  // SnapKV / PyramidKV observation window, H2O's prompt queries
constexpr int kPasskeyGen = 8;

void log_softmax(const float* row, int64_t n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  double mx = row[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<double>(row[i]) - lse;
}

int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// One budget of --budgets: a fraction of the prompt or a token count.
struct Budget {
  double fraction = 0;  // > 0: fraction of the prompt
  int64_t tokens = 0;   // otherwise
  std::string text;
  int64_t resolve(int64_t n_prompt) const {
    return fraction > 0 ? std::max<int64_t>(1, static_cast<int64_t>(fraction * n_prompt)) : tokens;
  }
};

Result<std::vector<Budget>> parse_budgets(const std::string& list) {
  std::vector<Budget> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    std::string item = list.substr(at, comma - at);
    at = comma + 1;
    if (item.empty()) continue;
    Budget b;
    b.text = item;
    const bool pct = item.back() == '%';
    if (pct) item.pop_back();
    char* end = nullptr;
    const double x = std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size() || !(x > 0)) {
      return make_error(Errc::kInvalidArgument,
                        "--budgets: '" + b.text + "' is not a positive token count or percentage");
    }
    if (pct) {
      if (x > 100) return make_error(Errc::kInvalidArgument, "--budgets: " + b.text + " > 100%");
      b.fraction = x / 100;
    } else {
      if (x != std::floor(x) || x > (1 << 30)) {
        return make_error(Errc::kInvalidArgument,
                          "--budgets: '" + b.text + "' is not an integer token count");
      }
      b.tokens = static_cast<int64_t>(x);
    }
    out.push_back(b);
  }
  if (out.empty()) return make_error(Errc::kInvalidArgument, "--budgets: empty list");
  return out;
}

Result<std::vector<std::string>> split_list(const std::string& list, const char* what) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (comma > at) out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  if (out.empty()) return make_error(Errc::kInvalidArgument, std::string(what) + ": empty list");
  return out;
}

Result<std::vector<double>> parse_fractions(const std::string& list) {
  auto items = split_list(list, "--passkey-depths");
  if (!items) return items.error();
  std::vector<double> out;
  for (const std::string& s : *items) {
    char* end = nullptr;
    const double x = std::strtod(s.c_str(), &end);
    if (end != s.c_str() + s.size() || !(x >= 0 && x <= 1)) {
      return make_error(Errc::kInvalidArgument,
                        "--passkey-depths: '" + s + "' is not a fraction in [0, 1]");
    }
    out.push_back(x);
  }
  return out;
}

// The policy's parameters for a budget of B prompt tokens (see the header).
RetentionConfig policy_config(RetentionPolicy policy, int64_t b, int64_t block_size) {
  RetentionConfig c;
  c.policy = policy;
  switch (policy) {
    case RetentionPolicy::kNone:
      break;
    case RetentionPolicy::kStreamingLlm:
      c.sinks = std::min<int64_t>(4, b - 1);
      c.window = std::max<int64_t>(1, b - c.sinks);
      break;
    case RetentionPolicy::kSnapKv:
    case RetentionPolicy::kPyramidKv:
      c.window = kObs;
      c.budget = std::max<int64_t>(1, b - kObs);
      c.gqa = GqaRule::kMean;
      break;
    case RetentionPolicy::kTopK:  // reads, not memory: ceil(B / P) blocks per query
      c.topk = std::max<int64_t>(1, (b + block_size - 1) / block_size);
      break;
    case RetentionPolicy::kH2o:
      c.budget = std::max<int64_t>(1, b / 2);
      c.window = std::max<int64_t>(1, b - b / 2);
      c.obs = kObs;
      break;
  }
  return c;
}

struct Row {
  std::string policy;  // "full" or the policy name
  RetentionPolicy kind = RetentionPolicy::kNone;
  Budget budget;
  // Perplexity / KL task, summed over windows.
  double nll = 0;
  double kld = 0;
  int64_t n_scored = 0;
  int64_t top1_same = 0;
  int64_t greedy_same = 0;
  int64_t greedy_total = 0;
  double resident_bytes = 0;   // summed over windows
  double resident_tokens = 0;  // per full-attention layer group, mean, summed over windows
  double decode_seconds = 0;
  int64_t decode_steps = 0;
  std::string example;  // the first window's config text
  // Passkey: [length][depth] successes.
  std::vector<std::vector<int>> passkey;
};

struct Ctx {
  Engine* engine = nullptr;
  int64_t n_vocab = 0;
};

// A table ready to decode after `prompt` under row r's policy: a fork of
// `base` (already holding the prompt, first_logits its last row), or for
// streamingllm its own prefill. Writes that table's first logits row to
// *first.
Result<BlockTable> start_row(Ctx& c, const Row& r, const BlockTable& base,
                             const std::vector<float>& base_first, std::span<const int32_t> prompt,
                             std::vector<float>* first) {
  const RetentionConfig rc =
      r.kind == RetentionPolicy::kNone
          ? RetentionConfig{}
          : policy_config(r.kind, r.budget.resolve(static_cast<int64_t>(prompt.size())),
                          c.engine->pool().block_size());
  if (r.kind == RetentionPolicy::kStreamingLlm) {
    BlockTable t = c.engine->new_table();
    KV_TRY_STATUS(t.set_retention(rc));
    KV_TRY_STATUS(c.engine->prefill(t, prompt, LogitsMode::kLast, first));
    return t;
  }
  BlockTable t = base.fork();
  KV_TRY_STATUS(t.set_retention(rc));
  *first = base_first;
  return t;
}

// Greedy tokens from a table whose last logits row is `first`.
Result<std::vector<int32_t>> greedy_from(Ctx& c, BlockTable& t, const std::vector<float>& first,
                                         int n) {
  std::vector<int32_t> out;
  std::vector<float> logits = first;
  for (int i = 0; i < n; ++i) {
    const int32_t tok = argmax(logits.data(), c.n_vocab);
    out.push_back(tok);
    if (i + 1 < n) {
      KV_TRY_STATUS(
          c.engine->prefill(t, std::span<const int32_t>(&tok, 1), LogitsMode::kLast, &logits));
    }
  }
  return out;
}

int64_t resident_tokens_mean(const BlockTable& t) {
  int64_t sum = 0, n = 0;
  for (int g = 0; g < t.n_groups(); ++g) {
    if (t.pool().group(g).window > 0) continue;
    sum += t.group(g).length();
    ++n;
  }
  return n > 0 ? sum / n : 0;
}

// Filler + a key sentence at `depth` of n_tokens, ending in the question.
std::vector<int32_t> passkey_prompt(const Tokenizer& tok, int64_t n_tokens, double depth,
                                    const std::string& key) {
  const TokenizeOptions plain{.add_special = false, .parse_special = false};
  const std::vector<int32_t> head = tok.tokenize(
      "There is an important pass key hidden inside a lot of irrelevant text. Find it and "
      "memorize it. I will quiz you about the pass key.\n",
      plain);
  const std::vector<int32_t> needle = tok.tokenize(
      " The pass key is " + key + ". Remember it. " + key + " is the pass key.", plain);
  const std::vector<int32_t> question =
      tok.tokenize("\nWhat is the pass key? The pass key is", plain);
  std::string filler_text;
  for (int i = 0; i < 8; ++i) {
    filler_text +=
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There "
        "and back again. ";
  }
  const std::vector<int32_t> filler = tok.tokenize(filler_text, plain);
  const int64_t n_fill = std::max<int64_t>(
      0, n_tokens - static_cast<int64_t>(head.size() + needle.size() + question.size()));
  const auto before = static_cast<int64_t>(depth * static_cast<double>(n_fill));
  std::vector<int32_t> out = head;
  auto add_filler = [&](int64_t n) {
    for (int64_t i = 0; i < n; ++i) out.push_back(filler[static_cast<size_t>(i) % filler.size()]);
  };
  add_filler(before);
  out.insert(out.end(), needle.begin(), needle.end());
  add_filler(n_fill - before);
  out.insert(out.end(), question.begin(), question.end());
  return out;
}

int run_retention_eval(const std::vector<std::string>& argv) {
  const std::vector<OptionSpec> own = {
      {"file", 'f', "FILE", "long text to score on (required)"},
      {"ctx", 'c', "N", "prompt tokens per window (default 2048)"},
      {"score", 0, "N", "tokens scored by one-token steps after each prompt (64)"},
      {"windows", 0, "N", "windows of ctx + score tokens from FILE (default 1)"},
      {"gen", 0, "N", "greedy tokens compared with the full cache's (default 32)"},
      {"policies", 0, "LIST", "policies to compare (default streamingllm,snapkv,pyramidkv,h2o)"},
      {"budgets", 0, "LIST",
       "prompt tokens each policy keeps: percentages of the prompt and/or counts "
       "(default 10%,25%,50%,256)"},
      {"passkey-lengths", 0, "LIST",
       "passkey prompt lengths in tokens (default 1024,2048; 0: no passkey task)"},
      {"passkey-depths", 0, "LIST",
       "where the key sits, fractions of the filler (default 0.1,0.5,0.9)"},
      {"json", 0, "", "print one JSON object per row"}};
  auto input = parse_eval_input(
      argv, own,
      "kvstack retention-eval [-m MODEL] -f FILE [--ctx N] [--policies LIST] [--budgets LIST]",
      "Compares KV retention policies against the full cache: for each policy and "
      "budget (prompt tokens kept: 25% of the prompt, or 256), on windows of FILE "
      "(--ctx prompt tokens, then --score tokens fed one at a time as decode steps): "
      "perplexity and its change, mean KL(full || policy), top-1 agreement, agreement "
      "of --gen greedy tokens, resident KV bytes and tokens per layer after the scored "
      "tokens, decode tokens/s; and passkey retrieval (a 5-digit key at each "
      "--passkey-depths fraction of filler text of each --passkey-lengths tokens, "
      "answered by 8 greedy tokens). Budget B maps to streamingllm:sinks=4,window=B-4; "
      "snapkv/pyramidkv:budget=B-32,window=32,gqa=mean; h2o:budget=B/2,window=B-B/2; "
      "topk:k=ceil(B/P) (reads only: nothing is dropped). "
      "The full cache is the first row. --kv-retention is not used (the policies are "
      "the rows).");
  if (!input) return fail("retention-eval", input.error().message);
  if (!*input) return 0;  // --help
  const Args* args = &(*input)->args;
  if (args->has("kv-retention")) {
    return fail("retention-eval", "--kv-retention is not used here: list --policies and --budgets");
  }
  auto ctx = args->get_int("ctx", 2048, 16, 1 << 20);
  if (!ctx) return fail("retention-eval", ctx.error().message);
  auto n_score = args->get_int("score", 64, 2, 1 << 20);
  if (!n_score) return fail("retention-eval", n_score.error().message);
  auto n_windows = args->get_int("windows", 1, 1, 1 << 16);
  if (!n_windows) return fail("retention-eval", n_windows.error().message);
  auto n_gen = args->get_int("gen", 32, 1, 1 << 16);
  if (!n_gen) return fail("retention-eval", n_gen.error().message);
  auto budgets = parse_budgets(args->get("budgets").value_or("10%,25%,50%,256"));
  if (!budgets) return fail("retention-eval", budgets.error().message);
  auto policy_names =
      split_list(args->get("policies").value_or("streamingllm,snapkv,pyramidkv,h2o"), "--policies");
  if (!policy_names) return fail("retention-eval", policy_names.error().message);
  std::vector<int64_t> pk_lengths;
  {
    auto items =
        split_list(args->get("passkey-lengths").value_or("1024,2048"), "--passkey-lengths");
    if (!items) return fail("retention-eval", items.error().message);
    for (const std::string& s : *items) {
      char* end = nullptr;
      const long long x = std::strtoll(s.c_str(), &end, 10);
      if (end != s.c_str() + s.size() || x < 0 || x > (1 << 20)) {
        return fail("retention-eval", "--passkey-lengths: '" + s + "' is not a token count");
      }
      if (x > 0) pk_lengths.push_back(x);
    }
  }
  auto pk_depths = parse_fractions(args->get("passkey-depths").value_or("0.1,0.5,0.9"));
  if (!pk_depths) return fail("retention-eval", pk_depths.error().message);
  const bool json = args->flag("json");

  std::vector<Row> rows(1);
  rows[0].policy = "full";
  for (const std::string& name : *policy_names) {
    auto parsed = parse_retention(name == "streamingllm" ? name + ":window=8"
                                  : name == "h2o"        ? name + ":budget=8,window=8"
                                  : name == "topk"       ? name + ":k=1"
                                                         : name + ":budget=8");
    if (!parsed || !parsed->active()) {
      return fail("retention-eval", "--policies: unknown policy '" + name +
                                        "' (known: streamingllm, snapkv, pyramidkv, h2o, topk)");
    }
    for (const Budget& b : *budgets) {
      Row r;
      r.policy = name;
      r.kind = parsed->policy;
      r.budget = b;
      rows.push_back(r);
    }
  }
  for (Row& r : rows) {
    r.passkey.assign(pk_lengths.size(), std::vector<int>(pk_depths->size(), 0));
  }

  EngineConfig* cfg = &(*input)->config;
  // Every layer its own KV group, the prompt's last kObs queries kept (the
  // base tables never decode, so this selection never runs).
  cfg->kv_retention = RetentionConfig{.policy = RetentionPolicy::kSnapKv,
                                      .window = kObs,
                                      .budget = int64_t{1} << 30,
                                      .gqa = GqaRule::kMean};
  cfg->prefix_cache = false;
  const int64_t longest = std::max<int64_t>(
      *ctx + *n_score,
      pk_lengths.empty() ? 0 : *std::max_element(pk_lengths.begin(), pk_lengths.end()) + 64);
  if (cfg->kv_cache_tokens == 0 && cfg->kv_cache_mem == 0) {
    // The base prompt plus one fork's copies and its new tokens.
    cfg->kv_cache_tokens = 2 * (longest + *n_gen) + 512;
  }
  auto engine = Engine::create(*cfg);
  if (!engine) return fail("retention-eval", engine.error().message);
  Engine& e = **engine;
  Ctx c{&e, e.model().config().n_vocab};
  if (longest > e.model().config().n_ctx_train) {
    return fail("retention-eval", "--ctx + --score or a passkey length (" +
                                      std::to_string(longest) +
                                      " tokens) exceeds the model's context " +
                                      std::to_string(e.model().config().n_ctx_train));
  }
  const int64_t span = *ctx + *n_score;
  auto scored = eval_tokens(e, **input, span);
  if (!scored) return fail("retention-eval", scored.error().message);
  const std::vector<int32_t>& tokens = *scored;
  const int64_t windows = std::min<int64_t>(*n_windows, static_cast<int64_t>(tokens.size()) / span);
  const auto t_start = Clock::now();
  Progress progress;
  std::vector<float> base_first, first, logits, full_rows;
  std::vector<int32_t> full_greedy;
  std::vector<double> lp_full, lp;
  auto fail_on = [&](const Status& st) { return fail("retention-eval", st.error().message); };

  for (int64_t w = 0; w < windows; ++w) {
    const std::span<const int32_t> prompt(tokens.data() + w * span, static_cast<size_t>(*ctx));
    const std::span<const int32_t> cont(tokens.data() + w * span + *ctx,
                                        static_cast<size_t>(*n_score));
    BlockTable base = e.new_table();
    if (Status st = e.prefill(base, prompt, LogitsMode::kLast, &base_first); !st.ok()) {
      return fail_on(st);
    }
    for (size_t ri = 0; ri < rows.size(); ++ri) {
      Row& r = rows[ri];
      if (!json) {
        progress.update(strprintf("retention-eval: window %lld/%lld, row %zu/%zu",
                                  static_cast<long long>(w) + 1, static_cast<long long>(windows),
                                  ri + 1, rows.size()));
      }
      if (w == 0 && r.kind != RetentionPolicy::kNone) {
        r.example =
            retention_name(policy_config(r.kind, r.budget.resolve(*ctx), e.pool().block_size()));
      }
      // One start per row (streamingllm prefills here); the greedy run
      // decodes from a fork of it taken before any decode step.
      auto t = start_row(c, r, base, base_first, prompt, &first);
      if (!t) return fail("retention-eval", t.error().message);
      BlockTable tg = t->fork();
      // Teacher-forced scoring by decode steps.
      {
        std::vector<float> row_logits;
        const auto t0 = Clock::now();
        for (int64_t j = 0; j < *n_score; ++j) {
          if (Status st = e.prefill(*t, cont.subspan(static_cast<size_t>(j), 1), LogitsMode::kLast,
                                    &logits);
              !st.ok()) {
            return fail_on(st);
          }
          row_logits.insert(row_logits.end(), logits.begin(), logits.end());
        }
        r.decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
        r.decode_steps += *n_score;
        r.resident_bytes += static_cast<double>(t->n_resident_blocks() * e.pool().block_bytes());
        r.resident_tokens += static_cast<double>(resident_tokens_mean(*t));
        t->release();
        if (ri == 0) full_rows = row_logits;
        for (int64_t j = 0; j + 1 < *n_score; ++j) {
          const float* rf = full_rows.data() + j * c.n_vocab;
          const float* rx = row_logits.data() + j * c.n_vocab;
          log_softmax(rf, c.n_vocab, lp_full);
          log_softmax(rx, c.n_vocab, lp);
          double kld = 0;
          for (int64_t i = 0; i < c.n_vocab; ++i) {
            kld += std::exp(lp_full[static_cast<size_t>(i)]) *
                   (lp_full[static_cast<size_t>(i)] - lp[static_cast<size_t>(i)]);
          }
          r.kld += std::max(0.0, kld);
          r.nll -= lp[static_cast<size_t>(cont[static_cast<size_t>(j + 1)])];
          r.top1_same += argmax(rf, c.n_vocab) == argmax(rx, c.n_vocab) ? 1 : 0;
          ++r.n_scored;
        }
      }
      // Greedy continuation after the prompt.
      {
        auto g = greedy_from(c, tg, first, static_cast<int>(*n_gen));
        if (!g) return fail("retention-eval", g.error().message);
        if (ri == 0) full_greedy = *g;
        for (size_t i = 0; i < g->size(); ++i) r.greedy_same += (*g)[i] == full_greedy[i] ? 1 : 0;
        r.greedy_total += static_cast<int64_t>(g->size());
      }
    }
  }
  // Passkey retrieval.
  std::mt19937 rng(1234);
  for (size_t li = 0; li < pk_lengths.size(); ++li) {
    for (size_t di = 0; di < pk_depths->size(); ++di) {
      const std::string key = std::to_string(10000 + rng() % 90000);
      const std::vector<int32_t> prompt =
          passkey_prompt(e.tokenizer(), pk_lengths[li], (*pk_depths)[di], key);
      BlockTable base = e.new_table();
      if (Status st = e.prefill(base, prompt, LogitsMode::kLast, &base_first); !st.ok()) {
        return fail_on(st);
      }
      for (size_t ri = 0; ri < rows.size(); ++ri) {
        if (!json) {
          progress.update(strprintf("retention-eval: passkey %lld tokens depth %.2f, row %zu/%zu",
                                    static_cast<long long>(pk_lengths[li]), (*pk_depths)[di],
                                    ri + 1, rows.size()));
        }
        auto t = start_row(c, rows[ri], base, base_first, prompt, &first);
        if (!t) return fail("retention-eval", t.error().message);
        auto g = greedy_from(c, *t, first, kPasskeyGen);
        if (!g) return fail("retention-eval", g.error().message);
        auto answer = e.tokenizer().detokenize(*g);
        if (answer && answer->find(key) != std::string::npos) rows[ri].passkey[li][di] = 1;
      }
    }
  }
  progress.finish();
  const double secs = std::chrono::duration<double>(Clock::now() - t_start).count();

  const Row& full = rows[0];
  const double ppl_full = std::exp(full.nll / static_cast<double>(full.n_scored));
  if (!json) {
    std::printf(
        "retention-eval: %lld window(s) of %lld prompt + %lld scored tokens, %lld greedy tokens, "
        "passkey %zu length(s) x %zu depth(s), %.0f s\n",
        static_cast<long long>(windows), static_cast<long long>(*ctx),
        static_cast<long long>(*n_score), static_cast<long long>(*n_gen), pk_lengths.size(),
        pk_depths->size(), secs);
    std::string pk_head;
    for (int64_t len : pk_lengths) {
      for (double d : *pk_depths)
        pk_head += strprintf(" %4lld@%.1f", static_cast<long long>(len), d);
    }
    std::printf("%-13s %7s %7s %9s %9s %9s %9s %7s %7s %8s%s\n", "policy", "budget", "kept",
                "KV MiB", "ppl", "d_ppl", "mean KL", "top-1", "greedy", "tok/s", pk_head.c_str());
  }
  for (const Row& r : rows) {
    const double nw = static_cast<double>(windows);
    const double ppl = std::exp(r.nll / static_cast<double>(r.n_scored));
    const double kl = r.kld / static_cast<double>(r.n_scored);
    const double top1 = static_cast<double>(r.top1_same) / static_cast<double>(r.n_scored);
    const double greedy = static_cast<double>(r.greedy_same) / static_cast<double>(r.greedy_total);
    const double tok_s = static_cast<double>(r.decode_steps) / r.decode_seconds;
    const std::string budget = r.kind == RetentionPolicy::kNone ? "-" : r.budget.text;
    if (json) {
      std::string pk = "[";
      for (size_t li = 0; li < pk_lengths.size(); ++li) {
        for (size_t di = 0; di < pk_depths->size(); ++di) {
          pk += strprintf("%s{\"length\": %lld, \"depth\": %.3f, \"found\": %s}",
                          pk.size() > 1 ? ", " : "", static_cast<long long>(pk_lengths[li]),
                          (*pk_depths)[di], r.passkey[li][di] != 0 ? "true" : "false");
        }
      }
      pk += "]";
      std::printf(
          "{\"policy\": \"%s\", \"budget\": \"%s\", \"config\": \"%s\", \"ctx\": %lld, "
          "\"tokens_resident_per_layer\": %.1f, \"kv_resident_bytes\": %.0f, \"ppl\": %.6f, "
          "\"ppl_full\": %.6f, \"ppl_rel_change\": %.6f, \"kld_mean\": %.8f, "
          "\"top1_agreement\": %.6f, \"greedy_agreement\": %.6f, \"decode_tok_s\": %.2f, "
          "\"n_scored\": %lld, \"passkey\": %s}\n",
          r.policy.c_str(), budget.c_str(),
          r.kind == RetentionPolicy::kNone ? "none" : r.example.c_str(),
          static_cast<long long>(*ctx), r.resident_tokens / nw, r.resident_bytes / nw, ppl,
          ppl_full, ppl / ppl_full - 1, kl, top1, greedy, tok_s, static_cast<long long>(r.n_scored),
          pk.c_str());
    } else {
      std::string pk;
      for (size_t li = 0; li < pk_lengths.size(); ++li) {
        for (size_t di = 0; di < pk_depths->size(); ++di) {
          pk += strprintf(" %8s", r.passkey[li][di] != 0 ? "yes" : "no");
        }
      }
      std::printf("%-13s %7s %7.0f %9.2f %9.4f %+8.2f%% %9.5f %6.1f%% %6.1f%% %8.1f%s\n",
                  r.policy.c_str(), budget.c_str(), r.resident_tokens / nw,
                  r.resident_bytes / nw / 1048576.0, ppl, 100 * (ppl / ppl_full - 1), kl,
                  100 * top1, 100 * greedy, tok_s, pk.c_str());
    }
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_retention_eval, "retention-eval",
                "quality, memory and speed of KV retention policies against the full cache",
                run_retention_eval);

}  // namespace kvstack::cli

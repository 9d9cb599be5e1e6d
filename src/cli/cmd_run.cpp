// `kvstack run`: generate text for one prompt, streaming it to stdout.
#include <cstdio>

#include "cli/args.h"
#include "cli/chat_input.h"
#include "cli/engine_options.h"
#include "cli/text_input.h"
#include "core/json_string.h"
#include "core/units.h"
#include "engine/beam_search.h"

namespace kvstack::cli {
namespace {

int run_run(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"prompt", 'p', "TEXT", "prompt text (special-token text is parsed)"});
  specs.push_back({"file", 'f', "FILE", "read the prompt from a file"});
  specs.push_back({"tokens", 0, "IDS", "prompt as token ids: 1,2,3"});
  specs.push_back(
      {"chat", 0, "", "wrap the prompt as a user message in the model's chat template"});
  specs.push_back({"system", 0, "TEXT", "system message for --chat"});
  specs.push_back(
      {"chat-template", 0, "NAME", "override the template: chatml, llama3, mistral, gemma"});
  for (auto& s : sampling_options()) specs.push_back(s);
  specs.push_back({"json", 0, "", "print one JSON object (tokens, text, timings) at the end"});
  specs.push_back({"cache-salt", 0, "TEXT",
                   "prefix-cache namespace of this request (default: the deployment default)"});
  specs.push_back({"beams", 0, "K",
                   "beam search with K beams on copy-on-write forks (greedy scores, -n tokens); "
                   "prints every beam and the KV blocks used versus K independent sequences"});
  specs.push_back({"kv-stats", 0, "",
                   "print prefix-cache statistics at the end (stderr table; with --json a "
                   "\"kv_stats\" object)"});
  specs.push_back({"kv-events", 0, "FILE",
                   "write prefix-cache block stored / removed events to FILE as JSON lines"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("run", args.error().message);
  if (args->flag("help")) {
    std::fputs(
        format_help("kvstack run [-m MODEL] -p PROMPT [-n N] [--chat] [--temp T] [--top-k K] "
                    "[--top-p P] [--seed S] [--threads T] [--block-size P] "
                    "[--kv-cache-mem SIZE] [--kv-dtype " +
                        kv_dtype_choices("|") + "]",
                    "Generate a continuation of the prompt through the paged KV cache. Text "
                    "streams to stdout; timings and KV memory go to stderr.",
                    specs)
            .c_str(),
        stdout);
    return 0;
  }
  auto gen = generate_options_from(*args);
  if (!gen) return fail("run", gen.error().message);
  const bool json = args->flag("json");
  auto engine = load_engine(*args, json);
  if (!engine) return fail("run", engine.error().message);
  Engine& e = **engine;
  KvEventFile events;
  if (auto path = args->get("kv-events")) {
    if (Status o = events.open(e.kv(), *path); !o.ok()) return fail("run", o.error().message);
  }
  const bool kv_stats = args->flag("kv-stats");
  auto print_kv_stats = [&] {
    if (!kv_stats) return;
    std::fputs(format_prefix_stats(e.kv().prefix_stats()).c_str(), stderr);
    std::fputs(format_kv_tiers_stats(e.kv().tier_stats()).c_str(), stderr);
  };

  Result<std::vector<int32_t>> tokens = std::vector<int32_t>{};
  if (args->flag("chat")) {
    auto tmpl = chat_template_for(*args, e);
    if (!tmpl) return fail("run", tmpl.error().message);
    if (!args->has("prompt")) return fail("run", "--chat needs -p PROMPT");
    std::vector<ChatMessage> msgs;
    if (auto sys = args->get("system")) msgs.push_back({"system", *sys});
    msgs.push_back({"user", *args->get("prompt")});
    auto text = tmpl->render(msgs, true);
    if (!text) return fail("run", text.error().message);
    tokens = e.tokenizer().tokenize(
        *text, {.add_special = tmpl->bos_text().empty(), .parse_special = true});
    for (const auto& s : tmpl->stop_strings()) gen->stop.push_back(s);
  } else {
    tokens = prompt_tokens(*args, e);
  }
  if (!tokens) return fail("run", tokens.error().message);

  const std::string salt = args->get_or("cache-salt", "");
  if (args->has("beams")) {
    auto k = args->get_int("beams", 1, 1, 64);
    if (!k) return fail("run", k.error().message);
    BeamSearchOptions bo;
    bo.n_beams = static_cast<int>(*k);
    bo.max_tokens = gen->max_tokens;
    bo.ignore_eos = gen->ignore_eos;
    bo.cache_salt = salt;
    auto br = beam_search(e, *tokens, bo);
    if (!br) return fail("run", br.error().message);
    for (size_t i = 0; i < br->beams.size(); ++i) {
      const Beam& b = br->beams[i];
      auto text = e.tokenizer().detokenize(b.tokens);
      std::printf("beam %zu (logprob %.4f%s): %s\n", i, b.logprob, b.finished ? ", eos" : "",
                  text ? json_escape(*text).c_str() : "?");
    }
    std::fprintf(stderr,
                 "kvstack run: beam search K=%d, %zu prompt tokens (%lld from the prefix cache), "
                 "%lld steps; KV blocks at peak: %lld shared vs %lld for %d independent "
                 "sequences (%.1f%%), %lld copy-on-write copies\n",
                 bo.n_beams, tokens->size(), static_cast<long long>(br->n_prompt_cached),
                 static_cast<long long>(br->n_steps), static_cast<long long>(br->peak_blocks_used),
                 static_cast<long long>(br->peak_blocks_independent), bo.n_beams,
                 br->peak_blocks_independent > 0
                     ? 100.0 * br->peak_blocks_used / br->peak_blocks_independent
                     : 0.0,
                 static_cast<long long>(br->n_cow_copies));
    print_kv_stats();
    return 0;
  }

  Sequence seq = e.new_sequence(salt);
  BlockTable& table = seq.table();
  // Up front: the pool must hold the prompt and every token -n allows (the
  // prefix cache of this fresh engine holds at most the public prefixes,
  // which count as available only when evictable).
  if (Status fit = check_pool_fits(e, table, static_cast<int64_t>(tokens->size()), gen->max_tokens);
      !fit.ok()) {
    return fail("run", fit.error().message);
  }
  bool streamed = false, ends_in_newline = true;
  auto on_text = [&](std::string_view piece) {
    if (json || piece.empty()) return;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    streamed = true;
    ends_in_newline = piece.back() == '\n';
  };
  auto res = generate(e, seq, *tokens, *gen, on_text);
  if (!res) {
    // The error goes on its own line, never glued to the streamed text.
    if (streamed && !ends_in_newline) {
      std::fputc('\n', stdout);
      std::fflush(stdout);
    }
    return fail("run", res.error().message);
  }
  const GenerateStats& st = res->stats;
  const BlockPoolStats kv = e.pool().stats();
  if (json) {
    std::string ids;
    for (size_t i = 0; i < res->tokens.size(); ++i) {
      if (i) ids += ',';
      ids += std::to_string(res->tokens[i]);
    }
    std::printf(
        "{\"tokens\": [%s], \"text\": \"%s\", \"finish_reason\": \"%s\", \"prompt_tokens\": %lld, "
        "\"completion_tokens\": %lld, \"ttft_ms\": %.2f, \"prefill_tok_s\": %.2f, "
        "\"decode_tok_s\": %.2f, \"kv_payload_bytes\": %lld, \"kv_allocated_bytes\": %lld, "
        "\"cached_tokens\": %lld%s}\n",
        ids.c_str(), json_escape(res->text).c_str(), finish_reason_name(res->finish),
        static_cast<long long>(st.n_prompt), static_cast<long long>(st.n_generated),
        st.ttft_s * 1e3, st.prefill_tok_s(), st.decode_tok_s(),
        static_cast<long long>(kv.payload_bytes), static_cast<long long>(kv.allocated_bytes),
        static_cast<long long>(st.n_cached),
        kv_stats ? (", \"kv_stats\": " + prefix_stats_json(e.kv().prefix_stats()) +
                    ", \"kv_tiers\": " + kv_tiers_stats_json(e.kv().tier_stats()))
                       .c_str()
                 : "");
  } else {
    std::printf("\n");
    std::fprintf(stderr,
                 "\nkvstack run: %lld prompt tokens, %lld generated (%s); TTFT %.1f ms, prefill "
                 "%.1f tok/s, decode %.1f tok/s\nkvstack run: KV %lld tokens, payload %lld bytes "
                 "(%s), allocated %lld bytes (%s) in %lld blocks of %lld bytes\n",
                 static_cast<long long>(st.n_prompt), static_cast<long long>(st.n_generated),
                 finish_reason_name(res->finish), st.ttft_s * 1e3, st.prefill_tok_s(),
                 st.decode_tok_s(), static_cast<long long>(table.length()),
                 static_cast<long long>(kv.payload_bytes),
                 format_bytes(static_cast<double>(kv.payload_bytes)).c_str(),
                 static_cast<long long>(kv.allocated_bytes),
                 format_bytes(static_cast<double>(kv.allocated_bytes)).c_str(),
                 static_cast<long long>(kv.n_blocks_used), static_cast<long long>(kv.block_bytes));
    print_kv_stats();
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_run, "run", "generate text for a prompt (streams to stdout)", run_run);

}  // namespace kvstack::cli

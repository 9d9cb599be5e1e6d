// `kvstack chat`: a multi-turn REPL on the prefix cache. The conversation is a
// Sequence kept between turns: when the new prompt extends it, only the new
// tokens are prefilled; otherwise (/reset, or re-tokenization changed an
// earlier token) a new sequence adopts the longest cached prefix (every
// completed block of earlier turns and conversations stays cached until
// evicted) and prefills the rest.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "cli/args.h"
#include "cli/chat_input.h"
#include "cli/engine_options.h"
#include "cli/text_input.h"

namespace kvstack::cli {
namespace {

int run_chat(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"system", 0, "TEXT", "system message"});
  specs.push_back(
      {"chat-template", 0, "NAME", "override the template: chatml, llama3, mistral, gemma"});
  specs.push_back({"cache-salt", 0, "TEXT", "prefix-cache namespace of this conversation"});
  specs.push_back({"kv-stats", 0, "", "print prefix-cache statistics to stderr at exit"});
  specs.push_back({"kv-events", 0, "FILE",
                   "write prefix-cache block stored / removed events to FILE as JSON lines"});
  for (auto& s : sampling_options()) specs.push_back(s);
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("chat", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack chat [-m MODEL] [--system TEXT] [sampling options]",
                           "Chat with the model. Type a message and press enter; /reset starts a "
                           "new conversation, /exit (or end of input) quits. The conversation's KV "
                           "is kept between turns: only each turn's new tokens are prefilled "
                           "(per-turn statistics go to stderr).",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  auto gen = generate_options_from(*args);
  if (!gen) return fail("chat", gen.error().message);
  if (!args->has("n-predict")) gen->max_tokens = 512;
  auto engine = load_engine(*args);
  if (!engine) return fail("chat", engine.error().message);
  Engine& e = **engine;
  KvEventFile events;
  if (auto path = args->get("kv-events")) {
    if (Status o = events.open(e.kv(), *path); !o.ok()) return fail("chat", o.error().message);
  }
  auto tmpl = chat_template_for(*args, e);
  if (!tmpl) return fail("chat", tmpl.error().message);
  for (const auto& s : tmpl->stop_strings()) gen->stop.push_back(s);

  const bool interactive = isatty(STDIN_FILENO) != 0;
  std::vector<ChatMessage> messages;
  if (auto sys = args->get("system")) messages.push_back({"system", *sys});
  const size_t n_fixed = messages.size();
  const std::string salt = args->get_or("cache-salt", "");
  Sequence conv = e.new_sequence(salt);
  std::string line;
  for (;;) {
    if (interactive) {
      std::fputs("\n> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages.resize(n_fixed);
      conv.release();  // its completed blocks stay cached for later hits
      std::fprintf(stderr, "[conversation reset]\n");
      continue;
    }
    if (line.empty()) continue;
    if (Status u = check_utf8(line, "input line"); !u.ok()) {
      std::fprintf(stderr, "kvstack chat: error: %s\n", u.error().message.c_str());
      continue;
    }
    messages.push_back({"user", line});
    auto text = tmpl->render(messages, true);
    if (!text) return fail("chat", text.error().message);
    const std::vector<int32_t> full = e.tokenizer().tokenize(
        *text, {.add_special = tmpl->bos_text().empty(), .parse_special = true});
    // Continue the live conversation when the new prompt extends it exactly;
    // otherwise start a new sequence, which looks the prompt up in the cache.
    const std::vector<int32_t>& held = conv.tokens();
    const bool extends = !held.empty() && held.size() < full.size() &&
                         std::equal(held.begin(), held.end(), full.begin());
    size_t reused = 0;
    std::span<const int32_t> fresh(full);
    if (extends) {
      reused = held.size();
      fresh = fresh.subspan(reused);
    } else {
      conv = e.new_sequence(salt);
    }
    // Up front: a prompt the pool cannot hold is refused; a reply that could
    // outgrow the pool is capped to what fits (it then ends with "length").
    GenerateOptions turn = *gen;
    const int64_t room = pool_room_tokens(e, conv.table());
    const auto n_fresh = static_cast<int64_t>(fresh.size());
    if (n_fresh > room) {
      std::fprintf(stderr,
                   "kvstack chat: error: the KV pool has room for %lld more tokens, but this "
                   "turn's prompt needs %lld: /reset to start over, or raise --kv-cache-tokens "
                   "or --kv-cache-mem\n",
                   static_cast<long long>(room), static_cast<long long>(n_fresh));
      messages.pop_back();
      continue;
    }
    if (n_fresh + turn.max_tokens - 1 > room) {
      turn.max_tokens = room - n_fresh + 1;
      std::fprintf(stderr,
                   "[the KV pool has room for %lld more tokens: this reply is limited to %lld "
                   "tokens]\n",
                   static_cast<long long>(room), static_cast<long long>(turn.max_tokens));
    }
    auto res = generate(e, conv, fresh, turn, [](std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    });
    std::fputs("\n", stdout);
    std::fflush(stdout);
    if (!res) {
      std::fprintf(stderr, "kvstack chat: error: %s\n", res.error().message.c_str());
      messages.pop_back();
      conv.release();
      continue;
    }
    reused += static_cast<size_t>(res->stats.n_cached);
    messages.push_back({"assistant", res->text});
    std::fprintf(stderr,
                 "[turn: %zu tokens reused from the cache, %lld prefilled, %lld generated (%s); "
                 "TTFT %.1f ms, decode %.1f tok/s; KV holds %lld tokens]\n",
                 reused, static_cast<long long>(res->stats.n_prompt),
                 static_cast<long long>(res->stats.n_generated), finish_reason_name(res->finish),
                 res->stats.ttft_s * 1e3, res->stats.decode_tok_s(),
                 static_cast<long long>(conv.length()));
  }
  if (args->flag("kv-stats")) {
    std::fputs(format_prefix_stats(e.kv().prefix_stats()).c_str(), stderr);
    std::fputs(format_kv_tiers_stats(e.kv().tier_stats()).c_str(), stderr);
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_chat, "chat", "multi-turn chat; the conversation's KV is kept between turns",
                run_chat);

}  // namespace kvstack::cli

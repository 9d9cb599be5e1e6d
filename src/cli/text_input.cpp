#include "cli/text_input.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "tokenizer/stream_decoder.h"

namespace kvstack::cli {

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(Errc::kIo, path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return make_error(Errc::kIo, path + ": read failed");
  return ss.str();
}

int64_t pool_room_tokens(Engine& engine, const BlockTable& table) {
  const int64_t p = engine.layout().block_size();
  const int64_t in_tail = table.capacity() - table.length();
  return engine.pool().n_available() * p + in_tail;
}

Status check_pool_fits(Engine& engine, const BlockTable& table, int64_t n_prompt,
                       int64_t max_tokens) {
  const int64_t n_new = n_prompt + std::max<int64_t>(max_tokens - 1, 0);
  int64_t need = table.blocks_needed(n_new);
  // Under a compacting --kv-retention the table never holds more than its
  // policy keeps (BlockTable::retention_reserve_blocks): StreamingLLM and
  // H2O generate past the pool's size.
  if (table.retention().active()) {
    // The longest step: a prefill chunk of the prompt, at least one token.
    const int64_t chunk =
        std::clamp<int64_t>(n_prompt, 1, std::max<int64_t>(1, engine.config().prefill_chunk));
    need = std::min(need, table.retention_reserve_blocks(table.length() + n_prompt,
                                                         table.length() + n_new, chunk));
  }
  const int64_t have = engine.pool().n_available();
  if (need <= have) return {};
  const int64_t p = engine.layout().block_size();
  return make_error(Errc::kOutOfBlocks,
                    "the KV pool has room for " + std::to_string(have * p) + " tokens (" +
                        std::to_string(have) + " free blocks of " + std::to_string(p) +
                        "), but the prompt (" + std::to_string(n_prompt) + " tokens) plus up to " +
                        std::to_string(max_tokens) + " generated tokens (-n) needs " +
                        std::to_string(need) +
                        " blocks: raise --kv-cache-tokens or --kv-cache-mem, or lower -n");
}

Status check_utf8(const std::string& text, const std::string& what) {
  std::string out;
  if (append_valid_utf8(text, true, out) != text.size() || out != text) {
    return make_error(Errc::kInvalidArgument, what + " is not valid UTF-8");
  }
  return {};
}

Result<std::vector<int32_t>> prompt_tokens(const Args& args, const Engine& engine) {
  const Tokenizer& tok = engine.tokenizer();
  const int given = static_cast<int>(args.has("tokens")) + static_cast<int>(args.has("prompt")) +
                    static_cast<int>(args.has("file"));
  if (given != 1) {
    return make_error(Errc::kInvalidArgument,
                      "give exactly one of -p TEXT, -f FILE or --tokens IDS");
  }
  if (auto ids = args.get("tokens")) {
    auto t = parse_token_list(*ids);
    if (!t) return make_error(Errc::kInvalidArgument, "--tokens: " + t.error().message);
    KV_TRY_STATUS(tok.validate(*t));
    return t;
  }
  std::string text;
  if (auto p = args.get("prompt")) {
    text = *p;
  } else {
    auto f = read_file(*args.get("file"));
    if (!f) return f.error();
    text = std::move(*f);
  }
  return tok.tokenize(text, TokenizeOptions{.add_special = true, .parse_special = true});
}

std::vector<OptionSpec> sampling_options() {
  return {
      {"n-predict", 'n', "N", "max tokens to generate (default 128)"},
      {"temp", 0, "T", "sampling temperature, 0 = greedy (default 0.8)"},
      {"top-k", 0, "K", "keep the K most likely tokens, 0 = off (default 40)"},
      {"top-p", 0, "P", "nucleus sampling mass in (0, 1] (default 0.95)"},
      {"min-p", 0, "P", "drop tokens below P x the top probability (default 0.05)"},
      {"repeat-penalty", 0, "F", "repetition penalty, 1 = off (default 1)"},
      {"repeat-last-n", 0, "N", "tokens the penalties look back over, -1 = all (default 64)"},
      {"frequency-penalty", 0, "F", "OpenAI frequency penalty (default 0)"},
      {"presence-penalty", 0, "F", "OpenAI presence penalty (default 0)"},
      {"seed", 's', "N", "random seed; same seed, same output (default: random)"},
      {"stop", 0, "TEXT", "stop string (repeatable)", true},
      {"ignore-eos", 0, "", "do not stop at end-of-generation tokens"},
  };
}

Result<GenerateOptions> generate_options_from(const Args& args) {
  GenerateOptions o;
  auto n = args.get_int("n-predict", 128, 1, 1 << 24);
  if (!n) return n.error();
  o.max_tokens = *n;
  SamplingParams& s = o.sampling;
  auto temp = args.get_double("temp", 0.8, 0.0, 100.0);
  auto top_k = args.get_int("top-k", 40, 0, 1 << 24);
  auto top_p = args.get_double("top-p", 0.95, 1e-9, 1.0);
  auto min_p = args.get_double("min-p", 0.05, 0.0, 1.0);
  auto rep = args.get_double("repeat-penalty", 1.0, 1e-6, 100.0);
  auto last_n = args.get_int("repeat-last-n", 64, -1, 1 << 24);
  auto freq = args.get_double("frequency-penalty", 0.0, -2.0, 2.0);
  auto pres = args.get_double("presence-penalty", 0.0, -2.0, 2.0);
  if (!temp) return temp.error();
  if (!top_k) return top_k.error();
  if (!top_p) return top_p.error();
  if (!min_p) return min_p.error();
  if (!rep) return rep.error();
  if (!last_n) return last_n.error();
  if (!freq) return freq.error();
  if (!pres) return pres.error();
  s.temperature = static_cast<float>(*temp);
  s.top_k = static_cast<int>(*top_k);
  s.top_p = static_cast<float>(*top_p);
  s.min_p = static_cast<float>(*min_p);
  s.repetition_penalty = static_cast<float>(*rep);
  s.penalty_last_n = static_cast<int>(*last_n);
  s.frequency_penalty = static_cast<float>(*freq);
  s.presence_penalty = static_cast<float>(*pres);
  if (args.has("seed")) {
    auto seed = args.get_int("seed", 0, 0, INT64_MAX);
    if (!seed) return seed.error();
    s.seed = static_cast<uint64_t>(*seed);
    s.has_seed = true;
  }
  KV_TRY_STATUS(validate(s));
  o.stop = args.all("stop");
  for (const auto& st : o.stop) {
    if (st.empty()) return make_error(Errc::kInvalidArgument, "--stop: empty stop string");
  }
  o.ignore_eos = args.flag("ignore-eos");
  return o;
}

}  // namespace kvstack::cli

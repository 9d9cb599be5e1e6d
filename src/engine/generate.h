// The generation loop for one sequence: prefill the new prompt tokens on top
// of what the table already holds, then sample and decode until a stop
// string, an end-of-generation token or the token limit.
//
// State: tokens the table holds are "written"; the last sampled token is
// "sampled" but not written until the next forward (spec section 2), so a
// follow-up call (the next chat turn) must start its new tokens with it; the
// result's `pending_token` says which token that is.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "engine/engine.h"
#include "engine/sampler.h"

namespace kvstack {

struct GenerateOptions {
  int64_t max_tokens = 128;  // tokens to sample (>= 1)
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings (not included in the text)
  bool ignore_eos = false;        // keep going past end-of-generation tokens
  bool render_special = false;    // emit the text of control tokens
};

enum class FinishReason { kLength, kStop, kEos };
const char* finish_reason_name(FinishReason r);

struct GenerateStats {
  int64_t n_prompt = 0;     // new tokens prefilled by this call
  int64_t n_cached = 0;     // prompt tokens adopted from the prefix cache (not prefilled)
  int64_t n_generated = 0;  // tokens sampled
  double prefill_s = 0;     // time of the prefill forward(s)
  double ttft_s = 0;        // call start to first sampled token
  double decode_s = 0;      // first to last sampled token
  double prefill_tok_s() const { return prefill_s > 0 ? n_prompt / prefill_s : 0; }
  double decode_tok_s() const {
    return decode_s > 0 && n_generated > 1 ? (n_generated - 1) / decode_s : 0;
  }
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // sampled tokens (the EOG token included if sampled)
  std::string text;             // their text, cut before a stop string
  FinishReason finish = FinishReason::kLength;
  int32_t pending_token = -1;  // last sampled token, not yet written to the cache
  GenerateStats stats;
};

// Runs prompt + generation on `table`. `on_text` receives text as it becomes
// safe to emit (complete UTF-8, no possible stop-string prefix); may be empty.
// Errors: kInvalidArgument (empty prompt, bad options), kOutOfBlocks (the
// pool cannot hold the sequence); the table keeps what was committed.
Result<GenerateResult> generate(Engine& engine, BlockTable& table, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text = {});

// The same on a sequence, through the prefix cache: when the sequence is
// empty, the longest cached prefix of `prompt` is adopted first (stats.n_cached
// tokens; the rest is prefilled, stats.n_prompt). Every committed block is
// published as it completes, prompt and generated tokens alike, so a later
// request (the next chat turn) that repeats this conversation hits it. When
// the sequence is not empty, `prompt` continues it (no lookup).
Result<GenerateResult> generate(Engine& engine, Sequence& seq, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text = {});

}  // namespace kvstack

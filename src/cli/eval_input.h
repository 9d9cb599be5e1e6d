// The set-up the quality-evaluation commands share (kv-eval,
// retention-eval): the engine options plus the command's own, --help, the
// required -f FILE read whole, the EngineConfig the options describe, and
// the file's scoring tokens.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "core/result.h"
#include "engine/engine.h"

namespace kvstack::cli {

struct EvalInput {
  Args args;
  std::string file;     // the -f path
  std::string text;     // its contents
  EngineConfig config;  // engine_config_from(args)
};

// Parses argv against engine_options() + `own` + --help. With --help, prints
// format_help(usage, about) to stdout and returns nullopt (exit 0). Else
// requires -f FILE (kInvalidArgument "-f FILE is required"), reads it and
// builds the engine config; errors name the flag or the file.
Result<std::optional<EvalInput>> parse_eval_input(const std::vector<std::string>& argv,
                                                  const std::vector<OptionSpec>& own,
                                                  const std::string& usage,
                                                  const std::string& about);

// The file's text as scoring tokens (no special tokens, no BOS):
// kInvalidArgument naming the file when it has fewer than `min_tokens`
// (one window of `min_tokens`).
Result<std::vector<int32_t>> eval_tokens(const Engine& engine, const EvalInput& in,
                                         int64_t min_tokens);

}  // namespace kvstack::cli

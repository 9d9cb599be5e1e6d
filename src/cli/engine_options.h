// Engine options shared by every command that runs the model
// (run, chat, logits, perplexity, bench, serve).
#pragma once

#include <vector>

#include "cli/args.h"
#include "engine/engine.h"

namespace kvstack::cli {

// -m, --threads, --block-size, --kv-cache-mem, --kv-cache-tokens, --kv-dtype.
std::vector<OptionSpec> engine_options();

// Validates the options above into an EngineConfig (errors name the flag).
Result<EngineConfig> engine_config_from(const Args& args);

// Loads the engine, printing a one-line summary to stderr on success.
Result<std::unique_ptr<Engine>> load_engine(const Args& args, bool quiet = false);

}  // namespace kvstack::cli

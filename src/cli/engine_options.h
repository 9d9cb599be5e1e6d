// Engine options shared by every command that runs the model
// (run, chat, logits, perplexity, bench, serve).
#pragma once

#include <string>
#include <vector>

#include "cli/args.h"
#include "engine/engine.h"

namespace kvstack::cli {

// -m, --threads, --block-size, --kv-cache-mem, --kv-cache-tokens, --kv-dtype.
std::vector<OptionSpec> engine_options();

// Every KV format name in `sep`-joined form ("f32|f16|...|kivi4" for "|").
std::string kv_dtype_choices(const char* sep);

// The quality defaults of a quantized KV configuration (issue 22, measured
// in docs/benchmarks.md, "Quality defaults"): rotate Q/K/V when K or V is
// fp8, int8 or int4; also centre the keys when K is int8 or int4. Float and KIVI
// formats: neither. `--no-kv-rotate` / `--no-kv-center` opt out; the cache
// identity records both, so cached blocks never mix configurations.
struct KvQualityDefaults {
  bool rotate = false;
  bool center = false;
};
KvQualityDefaults kv_quality_defaults(KvDtype k, KvDtype v);

// True when the model at `model_path` has a head dimension the rotation
// supports (a power of two); false when it cannot be read (Engine::create
// then reports why).
bool model_supports_rotation(const std::string& model_path);

// "int4", or "int8/int4" when V differs from K.
std::string kv_dtype_label(const EngineConfig& c);

// Validates the options above into an EngineConfig (errors name the flag).
Result<EngineConfig> engine_config_from(const Args& args);

// Loads the engine, printing a one-line summary to stderr on success.
Result<std::unique_ptr<Engine>> load_engine(const Args& args, bool quiet = false);

}  // namespace kvstack::cli

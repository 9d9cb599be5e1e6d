// Prompt input shared by commands: --tokens, -p TEXT or -f FILE, and the
// sampling flags of run/chat.
#pragma once

#include <string>
#include <vector>

#include "cli/args.h"
#include "engine/engine.h"
#include "engine/generate.h"

namespace kvstack::cli {

// Tokens from --tokens IDS, else -p TEXT, else -f FILE (special-token text in
// prompts is parsed; the vocab's BOS is added if its metadata says so).
// Errors name the flag; ids are checked against the vocabulary.
Result<std::vector<int32_t>> prompt_tokens(const Args& args, const Engine& engine);

// Reads a whole file; error names it.
Result<std::string> read_file(const std::string& path);

// --temp --top-k --top-p --min-p --repeat-penalty --repeat-last-n
// --frequency-penalty --presence-penalty --seed -n --stop --ignore-eos
std::vector<OptionSpec> sampling_options();
Result<GenerateOptions> generate_options_from(const Args& args);

// Tokens `table` can still grow by from the pool's free and evictable
// blocks (whole free blocks plus the room left in its last block).
int64_t pool_room_tokens(Engine& engine, const BlockTable& table);

// Up-front check for run: kOutOfBlocks naming the numbers and the flags to
// change when the pool cannot hold n_prompt more tokens plus the max_tokens
// - 1 generated tokens that are stored (the last sampled one never is).
Status check_pool_fits(Engine& engine, const BlockTable& table, int64_t n_prompt,
                       int64_t max_tokens);

// Validates UTF-8; error names `what`.
Status check_utf8(const std::string& text, const std::string& what);

}  // namespace kvstack::cli

// Beam search on top of copy-on-write forks (kv-cache-spec.md section 5):
// the prompt is prefilled once (through the prefix cache), each beam is a
// fork of it, and a beam that is extended by several candidates is forked
// again, so beams share every common block and copy only a shared partial
// tail before appending. With share_kv = false every fork is a private copy
// (clone_private): the no-sharing reference, which must give the same beams.
//
// Scoring: sum of natural-log probabilities of the chosen tokens (float64
// log-softmax of each step's logits), no length penalty. A beam that samples
// an end-of-generation token is finished: it keeps its score and competes
// unchanged in later steps. Ties are broken by (parent beam, token id), so
// the result is deterministic.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/engine.h"

namespace kvstack {

struct BeamSearchOptions {
  int n_beams = 4;          // K >= 1
  int64_t max_tokens = 16;  // tokens per beam (>= 1)
  bool share_kv = true;     // forks share blocks (false: private copies)
  bool ignore_eos = false;  // keep extending past end-of-generation tokens
  std::string cache_salt;   // namespace of the prompt's prefix-cache lookup
};

struct Beam {
  std::vector<int32_t> tokens;  // generated tokens (an ending EOG token included)
  double logprob = 0;           // sum of log-probabilities of `tokens`
  bool finished = false;        // ended with an end-of-generation token
};

struct BeamSearchResult {
  std::vector<Beam> beams;      // best first
  int64_t n_prompt_cached = 0;  // prompt tokens adopted from the prefix cache
  int64_t n_steps = 0;          // decode forwards (batched over live beams)
  // KV blocks: the most held at once by the search (measured in the pool,
  // prompt included), versus what K independent sequences of the same
  // lengths would hold at that point (sum over beams of ceil(len / P)).
  int64_t peak_blocks_used = 0;
  int64_t peak_blocks_independent = 0;
  int64_t n_cow_copies = 0;  // shared partial tails copied before an append
};

// REQUIRES: prompt not empty. Errors: kInvalidArgument (bad options),
// kOutOfBlocks (the pool cannot hold the beams); every reference taken is
// released on return either way.
Result<BeamSearchResult> beam_search(Engine& engine, std::span<const int32_t> prompt,
                                     const BeamSearchOptions& options);

}  // namespace kvstack

// Token sampling for one sequence (penalties, truncation chain, seeded draw)
// and stop-string matching over streamed text.
//
// Chain order (the llama.cpp default order, minus the samplers we do not have):
//   1. penalties    over the tokens in the penalty window (see SamplingParams)
//   2. top-k        keep the k highest logits                     (k = 0: off)
//   3. top-p        keep the smallest prefix, by descending probability, whose
//                   mass is >= top_p; the token that crosses is kept (1: off)
//   4. min-p        keep tokens with p >= min_p * p_max            (0: off)
//   5. temperature  p_i ~ exp(logit_i / T) over the survivors, then one draw
// Steps 3 and 4 measure probabilities at temperature 1 (softmax of the
// penalised logits over the step-2 survivors), as llama.cpp does: temperature
// only reshapes the distribution among tokens that survived truncation.
// Ties in the ordering are broken by the lower token id, so the survivor set
// is a deterministic function of the logits.
//
// Temperature 0 is greedy: the argmax of the penalised logits, lowest token id
// on ties; truncation samplers cannot change the argmax and are skipped.
//
// Logits may hold -inf (a masked token: never sampled). NaN or +inf is a bug
// upstream (the forward pass) and aborts with KV_CHECK naming the token.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/result.h"

namespace kvstack {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy; else > 0
  int top_k = 0;             // 0 = off; >= n_vocab is the same as off
  float top_p = 1.0f;        // in (0, 1]; 1 = off
  float min_p = 0.0f;        // in [0, 1]; 0 = off
  // Penalties apply to every distinct token t seen in the window, with c(t)
  // its number of occurrences there, in this order:
  //   repetition (HF/llama.cpp): logit > 0 ? logit / r : logit * r   (once)
  //   frequency (OpenAI):        logit -= c(t) * f
  //   presence (OpenAI):         logit -= p                           (once)
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float frequency_penalty = 0.0f;   // in [-2, 2]; 0 = off
  float presence_penalty = 0.0f;    // in [-2, 2]; 0 = off
  int penalty_last_n = 64;          // window of most recent accepted tokens; 0 = no penalties,
                                    // -1 = whole history
  uint64_t seed = 0;                // same seed + same logits + same history -> same tokens
  bool has_seed = false;            // false: seeded from std::random_device
};

// Checks ranges; the error names the field and the value.
Status validate(const SamplingParams& params);

struct TokenLogprob {
  int32_t token;
  float logprob;  // natural log
};

// A survivor of the truncation chain and its probability in the draw.
struct TokenProb {
  int32_t token;
  float prob;
};

// LOGPROBS: the reported log-probabilities are those of the distribution after
// penalties and temperature but BEFORE truncation (top-k/top-p/min-p), i.e.
// log_softmax(penalised_logits / T) over the whole vocabulary (T = 1 when
// greedy). The chosen token's logprob is therefore always finite, and the
// alternatives may include tokens the truncation excluded, as with OpenAI's
// API. Use Sampler::distribution() for the truncated, renormalised one.
struct SampledToken {
  int32_t token = -1;
  float logprob = 0.0f;           // of `token`
  std::vector<TokenLogprob> top;  // the n_top most likely, descending (ties: lower id first)
};

// One per sequence. Not thread-safe: owned and called by one thread at a time.
class Sampler {
 public:
  static Result<Sampler> create(const SamplingParams& params);
  // REQUIRES: validate(params).ok() (checked).
  explicit Sampler(const SamplingParams& params);

  // Appends `token` to the history the penalties see (prompt tokens too, if
  // the caller wants them penalised). REQUIRES: token >= 0. Tokens outside the
  // vocabulary passed to sample() are ignored by the penalties.
  void accept(int32_t token);
  void clear_history();

  // Applies penalties and the chain to logits [n_vocab] and draws a token.
  // Does not accept() it. REQUIRES: n_vocab > 0, at least one finite logit.
  int32_t sample(const float* logits, int n_vocab);
  // Same draw (same RNG use, same token for the same state) plus logprobs of
  // the chosen token and the n_top most likely alternatives (see LOGPROBS).
  SampledToken sample_with_logprobs(const float* logits, int n_vocab, int n_top);

  // The distribution the next draw would use: survivors of the chain with
  // probabilities summing to 1, in the order the draw walks them. Consumes no
  // randomness. For greedy: the argmax with probability 1.
  std::vector<TokenProb> distribution(const float* logits, int n_vocab);

  // Copies logits to out [n_vocab] with the penalties applied.
  void apply_penalties(const float* logits, int n_vocab, float* out) const;

  const SamplingParams& params() const { return params_; }
  uint64_t seed() const { return seed_; }  // the seed in use (drawn when !has_seed)
  int64_t n_history() const { return n_history_; }

 private:
  // Fills work_ with penalised logits and returns the argmax (lowest id on ties).
  int32_t prepare(const float* logits, int n_vocab);
  // Builds cand_/prob_ (normalised) from work_: steps 2-5. REQUIRES: prepare().
  void build_candidates(int n_vocab, int32_t argmax);
  int32_t draw();
  uint64_t next_u64();

  SamplingParams params_;
  uint64_t seed_ = 0;
  uint64_t rng_[4] = {};  // xoshiro256** state

  std::deque<int32_t> window_;                   // last penalty_last_n tokens (unused for -1)
  std::unordered_map<int32_t, int32_t> counts_;  // occurrences in the window
  int64_t n_history_ = 0;

  std::vector<float> work_;    // [n_vocab] penalised logits
  std::vector<int32_t> cand_;  // surviving token ids, draw order
  std::vector<float> prob_;    // [cand_.size()] normalised probabilities
  std::vector<float> exp_;     // [n_vocab] exp(logit - max) of the top-p candidates
};

// Detects stop strings in streamed, detokenized text. Feed pieces in order;
// each push returns the text that can be emitted now: text that cannot be the
// start of a stop string, whatever comes next. The longest suffix that is a
// proper prefix of some stop string is held back, as is a trailing incomplete
// UTF-8 sequence (so emitted text never splits a character). Once a stop
// string is complete the text before it is released, stopped() becomes true,
// and later pushes return nothing. Matching is on bytes. The stop that wins
// is the first to complete in the byte stream (on the same byte, the longer
// one; then the first listed), so the result does not depend on how the text
// was split into pieces: generation stops as soon as any stop string appears.
class StopMatcher {
 public:
  // Errors if a stop string is empty.
  static Result<StopMatcher> create(std::vector<std::string> stops);
  StopMatcher() = default;  // no stop strings: only the UTF-8 holdback

  std::string push(std::string_view piece);
  // End of generation (EOS, length limit): releases whatever is held back.
  std::string flush();

  bool stopped() const { return stop_index_ >= 0; }
  int stop_index() const { return stop_index_; }  // index into the stops, -1 if none
  // Everything emitted so far: once stopped, the final text, truncated before the stop.
  const std::string& text() const { return emitted_; }
  size_t n_held() const { return held_.size(); }

 private:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string release(size_t n);

  std::vector<std::string> stops_;
  std::string held_;     // received, not yet emitted
  std::string emitted_;  // returned so far
  int stop_index_ = -1;
};

}  // namespace kvstack

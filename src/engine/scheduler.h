// Scheduler: iteration-level continuous batching over one Engine.
//
// Every step() builds one Forward::step batch from the running sequences:
// first one decode token for each sequence that is generating, then chunks
// of prompts still being prefilled (oldest first) until the per-step token
// budget (max_batch_tokens) is spent, so a long prompt never stalls the
// running decodes for its whole prefill (chunked prefill).
//
// Batch invariance: nothing a sequence computes may depend on what else is
// in its step. Prefill chunks are therefore cut at fixed absolute positions,
// by the rule Engine::prefill() uses too (prefill_chunk_end() in engine.h:
// multiples of L = min(engine prefill_chunk, max_batch_tokens - max_seqs +
// 1), the boundary before the last prompt token moved one token earlier),
// and a chunk that does not fit the step's remaining budget waits whole (L
// guarantees the oldest prefill always fits). Every token is computed in the
// entry shape a lone run (`kvstack run`) gives it, because the attention
// kernel's one-token (decode) path and its chunk (prefill) path round
// differently: prompt tokens always in chunks of >= 2 tokens (a prefix-cache
// hit stops at least two tokens before the prompt's end; the first chunk
// after it runs up to the next boundary), sampled tokens always as one-token
// entries, also when they are recomputed after a preemption (one per step).
// Where a chunk starts matters too for long prompts (the attention kernel's
// prefill rows depend on n_past there), so `kvstack run` matches only with
// the same chunk length L (`kvstack serve`'s default step budget, max_seqs
// + 63, gives L = 64: `kvstack run --prefill-chunk 64`). Logits are one row
// per entry. The rest is
// up to the kernels: a row's matmul and attention result must not depend on
// the other rows of the step (ops/, attention/; the BatchInvariance tests in
// scheduler_test.cpp require it bit for bit). Sequences whose chunk reaches
// the end of their known tokens get a logits row and sample their next token
// in the same step.
//
// Sequence state (spec section 2): `tokens` holds the prompt and every
// sampled token; the table holds the written prefix (table.length()). The
// last sampled token is "sampled, not written" until the next step writes it.
// Recompute is therefore just "write tokens[length..] again": a preempted
// sequence keeps its tokens and sampler and resumes by prefilling them.
//
// Admission (FCFS by arrival): a waiting request is admitted when
//   running choices + n <= max_seqs, and
//   available blocks - reserved(running) >= blocks(request)
// where blocks(x) = ceil(target / P) minus blocks already held, and a
// sequence's target is its known tokens plus min(remaining max_tokens,
// reserve_output_tokens) (-1 = the whole max_tokens: then a request never
// needs preemption). Requests that could never fit the pool or the context
// are rejected by validate_request() before they queue (400, not a wait).
// Under a retention policy that compacts (kv/retention.h) blocks(x) is what
// the policy keeps (BlockTable::retention_reserve_blocks): StreamingLLM its
// sinks + window + slack + a chunk; SnapKV, PyramidKV and H2O the whole
// prompt until their first one-token step (they never compact a prefill
// chunk), then their selection's bound (h2o: budget + window + slack;
// snapkv: what the selection kept plus the tokens still to decode). A
// running sequence's reservation therefore shrinks at its first decode step
// and the freed blocks admit more sequences; it never reserves less than it
// can take (compaction's copy-on-write of shared blocks included), so with
// reserve_output_tokens = -1 an admitted sequence is never preempted.
//
// Preemption (by recompute): when the planned step needs more blocks than the
// pool has, the lowest-priority running sequence (latest arrival, then the
// highest choice index) releases every block reference and goes back to the
// waiting queue ahead of newer requests; the step is planned again. Its
// tokens and sampler state are kept, so the resumed output is the same as
// without preemption. Its published full blocks stay in the prefix cache
// (evictable), so the resume usually re-hits them instead of recomputing.
//
// Prefix cache: every choice is an engine Sequence in the namespace of its
// request's cache_salt; admission adopts the longest cached prefix of the
// prompt (usage.cached_tokens) and every committed chunk is recorded so its
// full blocks are published.
//
// Parallel sampling (n > 1): the request is prefilled once; when its prompt's
// logits are ready the sequence forks n - 1 times (BlockTable::fork shares
// every block, the shared partial tail is copied on the next append) and each
// choice samples from the same logits with its own sampler (seed + index).
//
// Thread-safety: submit(), RequestHandle, metrics(), inspect(), n_waiting()
// and shutdown() may be called from any thread. step() and run() must be
// called from one thread only (the engine thread), which alone touches the
// Engine, the pool and the block tables.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "engine/sampler.h"
#include "tokenizer/stream_decoder.h"

namespace kvstack {

struct SchedulerConfig {
  int max_seqs = 16;                   // running sequences (choices) at once
  int64_t max_batch_tokens = 256;      // tokens per step, decode + prefill chunks (>= max_seqs)
  int64_t max_queue = 256;             // waiting requests before submit() refuses
  int64_t reserve_output_tokens = 32;  // output tokens reserved at admission, -1 = max_tokens
  // Called on the engine thread with every planned step just before it runs
  // (tests and tracing; an entry's first position is table->length()).
  std::function<void(std::span<const StepSeq>)> on_step;
};

struct SeqRequest {
  std::vector<int32_t> prompt;  // >= 1 token, ids checked by validate_request()
  int64_t max_tokens = 16;      // tokens to sample per choice (>= 1)
  int n = 1;                    // choices (parallel samples through forks)
  SamplingParams sampling;      // choice i uses seed + i when seeded
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int n_logprobs = -1;     // -1: no logprobs; 0..20: chosen token plus that many alternatives
  std::string cache_salt;  // prefix-cache namespace (empty: the deployment default)
  // Retention policy of this request's sequences (kv/retention.h); unset:
  // the deployment default (EngineConfig::kv_retention). Validated by the
  // caller (parse_request) against the engine's KV format.
  std::optional<RetentionConfig> kv_retention;
  // Non-zero: carried into this request's forward entries (StepSeq::watch)
  // so a layer hook can follow its prefill (P/D layer-wise streaming,
  // server/pd_agent.h).
  uint64_t watch_id = 0;
};

// Latency histogram with fixed upper bounds (seconds), Prometheus style.
struct Histogram {
  std::vector<double> bounds;    // ascending upper bounds
  std::vector<uint64_t> counts;  // [bounds.size() + 1], non-cumulative; last is +Inf
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {})
      : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v);
};

// Counters and gauges, copied out under a lock by metrics().
struct SchedulerMetrics {
  int64_t n_running = 0;  // running sequences (choices)
  int64_t n_waiting = 0;  // waiting requests (new and preempted)
  int64_t n_requests_finished = 0;
  int64_t n_requests_failed = 0;
  int64_t n_preemptions = 0;
  int64_t n_prompt_tokens = 0;      // prompt tokens of finished requests
  int64_t n_generation_tokens = 0;  // tokens sampled
  int64_t n_recomputed_tokens = 0;  // tokens prefilled again after a preemption
  int64_t n_prefix_queries = 0;     // prompt tokens looked up in the prefix cache
  int64_t n_prefix_hits = 0;        // of those, tokens found
  int64_t n_steps = 0;
  int64_t n_step_tokens = 0;  // tokens forwarded over all steps
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0}};
  Histogram itl{{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0}};
  Histogram e2e{{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0}};
};

struct RequestUsage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // over all choices
  int64_t cached_tokens = 0;      // prompt tokens served from the prefix cache
};

struct SeqEvent {
  enum class Kind : uint8_t { kToken, kFinish, kError };
  Kind kind = Kind::kToken;
  int index = 0;       // choice
  int32_t token = -1;  // kToken: the sampled token
  std::string text;    // kToken: text safe to emit now (may be empty); kFinish: the rest
  std::optional<SampledToken> logprob;          // kToken when logprobs were asked for
  FinishReason finish = FinishReason::kLength;  // kFinish
  Status error;                                 // kError (ends the whole request)
  bool request_done = false;                    // last event of the request
  RequestUsage usage;                           // set when request_done
};

// The channel between the engine thread and the request's owner.
// Thread-safety: every method is safe from any thread.
class RequestHandle {
 public:
  // Moves queued events into *out, waiting up to `timeout` for the first one.
  // Returns false when nothing arrived in time.
  bool wait(std::vector<SeqEvent>* out, std::chrono::milliseconds timeout);
  // Asks the engine thread to drop the request; its blocks are released within
  // one step and no more events follow except a final kError (kCancelled).
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  bool done() const { return done_.load(std::memory_order_acquire); }

 private:
  friend class Scheduler;
  void push(SeqEvent ev);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SeqEvent> events_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> done_{false};
};

class Scheduler {
 public:
  // REQUIRES: engine outlives the scheduler; config checked by create().
  static Result<std::unique_ptr<Scheduler>> create(Engine& engine, const SchedulerConfig& config);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Errors (kInvalidArgument) naming the field for a request that could never
  // run: empty prompt, token out of range, bad sampling, n out of [1, max_seqs],
  // prompt + max_tokens past the context, or more blocks than the pool has.
  Status validate_request(const SeqRequest& req) const;

  // Queues a request (validated first). kBusy when max_queue requests already
  // wait (retry later: HTTP 429), kCancelled after shutdown() (HTTP 503).
  Result<std::shared_ptr<RequestHandle>> submit(SeqRequest req);

  // One scheduling iteration on the calling (engine) thread: takes new
  // submissions, drops cancelled requests, admits, runs one forward step and
  // emits events. Returns the number of tokens forwarded (0 = idle).
  int64_t step();

  // Runs step() until shutdown(); sleeps while idle. Call on the engine thread.
  void run();

  // Stops run(): with drain, finishes the requests already submitted first;
  // without, cancels them. New submissions fail once this is called.
  void shutdown(bool drain);

  // Runs fn(engine) on the engine thread between steps (from any thread other
  // than the engine thread) and waits for it; e.g. pool statistics. Fails
  // with kCancelled once run() has returned.
  Status inspect(const std::function<void(Engine&)>& fn);

  SchedulerMetrics metrics() const;
  const SchedulerConfig& config() const { return config_; }
  Engine& engine() { return engine_; }

 private:
  struct Request;
  struct Choice;
  Scheduler(Engine& engine, const SchedulerConfig& config);

  void take_submissions();
  void drop_cancelled();
  void admit();
  void preempt(size_t running_index);
  // Blocks one more choice (a fork) of a request needs beyond what it shares,
  // and a whole request of n_choices choices growing to n_tokens tokens:
  // per KV group, window groups capped (KvGroups::peak_blocks).
  int64_t choice_blocks(int64_t n_prompt, int64_t n_tokens) const;
  int64_t request_blocks(int64_t n_prompt, int64_t n_tokens, int64_t n_choices) const;
  int64_t reserve_blocks(const Choice& s) const;
  // The longest entry a step gives one sequence (reserve_blocks' chunk).
  int64_t reserve_chunk() const;
  int64_t target_tokens(const Choice& s) const;
  // Prefill chunk length L for prefill_chunk_end() (see the header comment).
  int64_t prefill_chunk_tokens() const;
  // Tokens of the sequence's next prefill entry: prefill_chunk_end() for
  // prompt tokens, 1 for recomputed sampled tokens. REQUIRES: n_unwritten() > 1.
  int64_t prefill_take(const Choice& s, int64_t chunk) const;
  // Adopts the longest usable cached prefix of s.tokens; returns its tokens.
  int64_t adopt_prefix(Choice& s);
  // Re-adopts one token less when a prompt hit of `hit` tokens would make
  // the first prefill entry longer than L; returns the tokens adopted.
  int64_t trim_prefix_hit(Choice& s, int64_t hit);
  void sample_and_emit(Choice& s, const float* logits);
  void finish_seq(Choice& s, FinishReason reason, std::string tail);
  void fail_request(Request& r, const Status& st);
  void complete_if_done(Request& r);
  void run_inspections();
  void publish_gauges();

  Engine& engine_;
  const SchedulerConfig config_;
  const int n_vocab_;
  const int64_t n_ctx_;

  // Shared with other threads (mu_).
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> incoming_;
  std::deque<std::pair<const std::function<void(Engine&)>*, std::promise<void>*>> inspections_;
  bool stopping_ = false;
  bool drain_ = false;
  bool stopped_ = false;
  int64_t n_queued_ = 0;  // incoming + waiting requests
  SchedulerMetrics metrics_;
  uint64_t next_arrival_ = 0;

  // Engine thread only.
  std::deque<std::shared_ptr<Request>> waiting_;    // new requests, arrival order
  std::vector<std::unique_ptr<Choice>> running_;    // admitted choices, priority order
  std::vector<std::unique_ptr<Choice>> preempted_;  // released, resume before waiting_
  std::vector<float> logits_;
};

}  // namespace kvstack

#include "engine/scheduler.h"

#include <algorithm>
#include <string>

namespace kvstack {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  counts[i]++;
  sum += v;
  count++;
}

bool RequestHandle::wait(std::vector<SeqEvent>* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  while (!events_.empty()) {
    out->push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return true;
}

void RequestHandle::push(SeqEvent ev) {
  const bool last = ev.request_done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
  }
  if (last) done_.store(true, std::memory_order_release);
  cv_.notify_all();
}

// A request as the engine thread sees it. Owned by shared_ptr: the waiting
// queue and every sequence of the request hold one.
struct Scheduler::Request {
  SeqRequest req;
  std::shared_ptr<RequestHandle> handle;
  uint64_t arrival = 0;
  Clock::time_point t_arrival;
  int n_finished = 0;  // choices that finished
  bool first_token = false;
  bool ended = false;  // final event sent (done, failed or cancelled)
  RequestUsage usage;
};

// One choice of a request: its tokens, table and sampling state.
struct Scheduler::Choice {
  std::shared_ptr<Request> req;
  int index = 0;
  int pending_forks = 0;        // choices still to fork from this one at its first sample
  kvstack::Sequence kv;         // block table + committed token record (prefix cache)
  std::vector<int32_t> tokens;  // prompt + sampled; [0, kv.length()) written
  int64_t n_generated = 0;
  Sampler sampler;
  StreamDecoder decoder;
  StopMatcher stops;
  Clock::time_point t_last;  // last token's time
  bool done = false;

  Choice(std::shared_ptr<Request> r, int i, kvstack::Sequence t, const SamplingParams& p,
         const Tokenizer& tok, StopMatcher s)
      : req(std::move(r)),
        index(i),
        kv(std::move(t)),
        sampler(p),
        decoder(tok),
        stops(std::move(s)) {}
  int64_t n_unwritten() const { return static_cast<int64_t>(tokens.size()) - kv.length(); }
  bool before_priority(const Choice& o) const {
    return req->arrival != o.req->arrival ? req->arrival < o.req->arrival : index < o.index;
  }
};

Result<std::unique_ptr<Scheduler>> Scheduler::create(Engine& engine,
                                                     const SchedulerConfig& config) {
  if (config.max_seqs < 1) {
    return make_error(Errc::kInvalidArgument, "max seqs must be at least 1");
  }
  if (config.max_batch_tokens < config.max_seqs) {
    return make_error(Errc::kInvalidArgument,
                      "max batch tokens (" + std::to_string(config.max_batch_tokens) +
                          ") must be at least max seqs (" + std::to_string(config.max_seqs) +
                          ") so every running sequence can decode in each step");
  }
  if (config.max_queue < 1) {
    return make_error(Errc::kInvalidArgument, "max queue must be at least 1");
  }
  if (config.reserve_output_tokens < -1) {
    return make_error(Errc::kInvalidArgument, "reserve output tokens must be -1 or >= 0");
  }
  return std::unique_ptr<Scheduler>(new Scheduler(engine, config));
}

Scheduler::Scheduler(Engine& engine, const SchedulerConfig& config)
    : engine_(engine),
      config_(config),
      n_vocab_(engine.model().config().n_vocab),
      n_ctx_(engine.model().config().n_ctx_train) {}

Scheduler::~Scheduler() = default;

Status Scheduler::validate_request(const SeqRequest& r) const {
  const auto n_prompt = static_cast<int64_t>(r.prompt.size());
  if (n_prompt == 0) return make_error(Errc::kInvalidArgument, "prompt: the prompt has no tokens");
  for (int32_t t : r.prompt) {
    if (t < 0 || t >= n_vocab_) {
      return make_error(Errc::kInvalidArgument, "prompt: token id " + std::to_string(t) +
                                                    " is out of range [0, " +
                                                    std::to_string(n_vocab_) + ")");
    }
  }
  if (r.max_tokens < 1) {
    return make_error(Errc::kInvalidArgument,
                      "max_tokens: " + std::to_string(r.max_tokens) + " is less than 1");
  }
  if (r.n < 1 || r.n > config_.max_seqs) {
    return make_error(Errc::kInvalidArgument, "n: " + std::to_string(r.n) +
                                                  " is out of range [1, " +
                                                  std::to_string(config_.max_seqs) + "]");
  }
  if (r.n_logprobs > 20) {
    return make_error(Errc::kInvalidArgument,
                      "top_logprobs: " + std::to_string(r.n_logprobs) + " is more than 20");
  }
  for (const auto& s : r.stop) {
    if (s.empty()) return make_error(Errc::kInvalidArgument, "stop: empty stop string");
  }
  if (auto st = validate(r.sampling); !st.ok()) return st;
  if (n_prompt >= n_ctx_) {
    return make_error(Errc::kInvalidArgument,
                      "prompt: " + std::to_string(n_prompt) +
                          " tokens do not fit the model's context length of " +
                          std::to_string(n_ctx_) + " tokens (with room to generate)");
  }
  // The last sampled token is never written, so a sequence writes at most
  // prompt + max_tokens - 1 tokens.
  if (n_prompt + r.max_tokens > n_ctx_) {
    return make_error(Errc::kInvalidArgument, "max_tokens: prompt (" + std::to_string(n_prompt) +
                                                  ") + max_tokens (" +
                                                  std::to_string(r.max_tokens) +
                                                  ") exceeds the model's context length of " +
                                                  std::to_string(n_ctx_) + " tokens");
  }
  const int64_t n_written = n_prompt + r.max_tokens - 1;
  int64_t need = request_blocks(n_prompt, n_written, r.n);
  // A single choice under a compacting policy needs only what the policy
  // keeps (admission reserves the same, reserve_blocks): e.g. StreamingLLM
  // may generate past the pool's size.
  const RetentionConfig& retention =
      r.kv_retention ? *r.kv_retention : engine_.config().kv_retention;
  if (r.n == 1 && retention.active()) {
    need = std::min(need, BlockTable::fresh_reserve_blocks(engine_.pool(), retention, n_prompt,
                                                           n_written, reserve_chunk()));
  }
  if (need > engine_.pool().n_blocks()) {
    return make_error(Errc::kInvalidArgument,
                      "max_tokens: prompt (" + std::to_string(n_prompt) + ") + max_tokens (" +
                          std::to_string(r.max_tokens) + ") x n (" + std::to_string(r.n) +
                          ") needs " + std::to_string(need) + " KV blocks but the pool has " +
                          std::to_string(engine_.pool().n_blocks()));
  }
  return {};
}

Result<std::shared_ptr<RequestHandle>> Scheduler::submit(SeqRequest req) {
  if (auto st = validate_request(req); !st.ok()) return st.error();
  auto r = std::make_shared<Request>();
  r->req = std::move(req);
  r->handle = std::make_shared<RequestHandle>();
  r->t_arrival = Clock::now();
  auto handle = r->handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return make_error(Errc::kCancelled, "the server is shutting down");
    if (n_queued_ >= config_.max_queue) {
      return make_error(Errc::kBusy, "the request queue is full (" + std::to_string(n_queued_) +
                                         " requests waiting); retry later");
    }
    r->arrival = next_arrival_++;
    n_queued_++;
    incoming_.push_back(std::move(r));
  }
  cv_.notify_all();
  return handle;
}

void Scheduler::take_submissions() {
  std::vector<std::shared_ptr<Request>> fresh;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      if (engine_.kv().tiers() != nullptr) fresh.push_back(incoming_.front());
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  // Storage tiers: bring a new request's cached prefix up into the pool now,
  // while it waits for admission (free blocks only; kv_tiers.h).
  for (const auto& r : fresh) engine_.kv().prefetch(r->req.cache_salt, r->req.prompt);
}

void Scheduler::fail_request(Request& r, const Status& st) {
  if (r.ended) return;
  r.ended = true;
  for (auto* list : {&running_, &preempted_}) {
    for (auto& s : *list) {
      if (s->req.get() == &r) {
        s->kv.release();
        s->done = true;
      }
    }
  }
  SeqEvent ev;
  ev.kind = SeqEvent::Kind::kError;
  ev.error = st;
  ev.request_done = true;
  ev.usage = r.usage;
  r.handle->push(std::move(ev));
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.n_requests_failed++;
}

void Scheduler::drop_cancelled() {
  const Status cancelled = make_error(Errc::kCancelled, "the request was cancelled");
  for (auto* list : {&running_, &preempted_}) {
    for (auto& s : *list) {
      if (!s->done && s->req->handle->cancelled()) fail_request(*s->req, cancelled);
    }
  }
  int64_t n_dropped = 0;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->handle->cancelled()) {
      fail_request(**it, cancelled);
      it = waiting_.erase(it);
      n_dropped++;
    } else {
      ++it;
    }
  }
  if (n_dropped > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    n_queued_ -= n_dropped;
  }
  auto gone = [](const std::unique_ptr<Choice>& s) { return s->done; };
  std::erase_if(running_, gone);
  std::erase_if(preempted_, gone);
}

int64_t Scheduler::prefill_chunk_tokens() const {
  // A prefilling sequence is running, so at most max_seqs - 1 others decode
  // in a step and the budget left for chunks is at least this.
  const int64_t guaranteed = config_.max_batch_tokens - (config_.max_seqs - 1);
  return std::max<int64_t>(1, std::min<int64_t>(engine_.config().prefill_chunk, guaranteed));
}

int64_t Scheduler::prefill_take(const Choice& s, int64_t chunk) const {
  const auto n_prompt = static_cast<int64_t>(s.req->req.prompt.size());
  const int64_t from = s.kv.length();
  // Sampled tokens being recomputed after a preemption: one per step, the
  // shape they were first computed in (a one-token decode entry).
  if (from >= n_prompt) return 1;
  // Prompt tokens: the split Engine::prefill() makes (engine.h). It never
  // exceeds `chunk` (but for chunk 2, see step()), so the budget bound of
  // prefill_chunk_tokens() holds.
  return prefill_chunk_end(from, n_prompt, chunk) - from;
}

int64_t Scheduler::adopt_prefix(Choice& s) {
  const auto n_prompt = static_cast<int64_t>(s.req->req.prompt.size());
  const std::span<const int32_t> t(s.tokens);
  // At most n_prompt - 2 prompt tokens: the rest of the prompt is prefilled
  // as a chunk of >= 2 tokens, as in a lone run (see prefill_take()).
  const auto capped = t.first(static_cast<size_t>(std::max<int64_t>(1, n_prompt - 1)));
  if (static_cast<int64_t>(t.size()) == n_prompt) {
    return trim_prefix_hit(s, s.kv.adopt_cached_prefix(capped));
  }
  int64_t hit = s.kv.adopt_cached_prefix(t);
  if (hit == n_prompt - 1) {
    s.kv.release();
    hit = s.kv.adopt_cached_prefix(capped);
  }
  return trim_prefix_hit(s, hit);
}

int64_t Scheduler::trim_prefix_hit(Choice& s, int64_t hit) {
  // A hit one token before a chunk boundary makes the first entry one token
  // longer than L (prefill_chunk_end() joins that token to the next chunk),
  // which the step budget does not guarantee: adopt one token less instead
  // (a two-token first entry).
  const auto n_prompt = static_cast<int64_t>(s.req->req.prompt.size());
  const int64_t chunk = prefill_chunk_tokens();
  if (hit < 2 || hit >= n_prompt - 1) return hit;
  if (prefill_chunk_end(hit, n_prompt, chunk) - hit <= chunk) return hit;
  s.kv.release();
  return s.kv.adopt_cached_prefix(
      std::span<const int32_t>(s.tokens).first(static_cast<size_t>(hit)));
}

int64_t Scheduler::target_tokens(const Choice& s) const {
  const SeqRequest& q = s.req->req;
  const int64_t remaining = q.max_tokens - s.n_generated;
  const int64_t reserve = config_.reserve_output_tokens < 0
                              ? remaining
                              : std::min(remaining, config_.reserve_output_tokens);
  const auto n_prompt = static_cast<int64_t>(q.prompt.size());
  return std::min(n_prompt + q.max_tokens - 1, static_cast<int64_t>(s.tokens.size()) + reserve);
}

int64_t Scheduler::choice_blocks(int64_t n_prompt, int64_t n_tokens) const {
  // Per KV group (kv_groups.h): a fork shares the prompt's full blocks of
  // the groups that keep every block and copies one partial tail per group;
  // window groups hold at most their window's blocks.
  const KvGroups& groups = engine_.pool().groups();
  const int64_t P = engine_.pool().block_size();
  const int64_t chunk = engine_.config().prefill_chunk;
  int64_t n = 0;
  for (int g = 0; g < groups.n_groups(); ++g) {
    const int64_t peak = groups.peak_blocks(g, n_tokens, chunk);
    n += (groups.group(g).drops_blocks ? peak : peak - n_prompt / P) + 1;
  }
  return n;
}

int64_t Scheduler::request_blocks(int64_t n_prompt, int64_t n_tokens, int64_t n_choices) const {
  const int64_t chunk = engine_.config().prefill_chunk;
  return engine_.pool().groups().peak_blocks_for_sequence(n_tokens, chunk) +
         (n_choices - 1) * choice_blocks(n_prompt, n_tokens);
}

int64_t Scheduler::reserve_chunk() const {
  // The longest entry a step gives a sequence: L (3 tokens when L = 2, see
  // step()), never more than the engine's chunk.
  return std::min<int64_t>(engine_.config().prefill_chunk,
                           std::max<int64_t>(3, prefill_chunk_tokens()));
}

int64_t Scheduler::reserve_blocks(const Choice& s) const {
  const KvGroups& groups = engine_.pool().groups();
  const int64_t chunk = reserve_chunk();
  const int64_t target_tokens_now = target_tokens(s);
  const auto n_prompt = static_cast<int64_t>(s.req->req.prompt.size());
  const BlockTable& table = s.kv.table();
  // Per group: what the retention policy keeps (exactly the exact peak
  // without one), minus what the table already holds (block_table.h).
  int64_t n = table.retention_reserve_blocks(n_prompt, target_tokens_now, chunk);
  if (s.pending_forks > 0) {
    n += s.pending_forks * choice_blocks(n_prompt, target_tokens_now);
    // Under a compacting policy every choice compacts its own copy of the
    // shared prompt: each fork, and the parent's shared blocks, may need
    // every block its policy keeps (an over-estimate, never less).
    int64_t kept = 0;
    bool compacts = false;
    for (int g = 0; g < groups.n_groups(); ++g) {
      if (!table.retention_compacts(g)) continue;
      compacts = true;
      kept += table.retention_group_peak(g, n_prompt, target_tokens_now, chunk);
    }
    if (compacts) n += (s.pending_forks + 1) * (kept + 1);
  }
  return n;
}

void Scheduler::admit() {
  int64_t budget = engine_.pool().n_available();
  for (const auto& s : running_) budget -= reserve_blocks(*s);
  auto n_choices = [&] { return static_cast<int64_t>(running_.size()); };

  // Preempted sequences first (they arrived earlier than anything waiting).
  std::sort(preempted_.begin(), preempted_.end(),
            [](const auto& a, const auto& b) { return a->before_priority(*b); });
  while (!preempted_.empty() && n_choices() < config_.max_seqs) {
    Choice& s = *preempted_.front();
    const int64_t need = reserve_blocks(s);
    if (need > budget && !running_.empty()) return;
    budget -= need;
    // Resume: re-hit what the prefix cache kept of the released blocks, then
    // recompute the rest.
    const int64_t hit = adopt_prefix(s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      metrics_.n_recomputed_tokens += static_cast<int64_t>(s.tokens.size()) - hit;
    }
    running_.push_back(std::move(preempted_.front()));
    preempted_.erase(preempted_.begin());
  }
  if (!preempted_.empty()) return;

  while (!waiting_.empty()) {
    const std::shared_ptr<Request>& r = waiting_.front();
    const SeqRequest& q = r->req;
    if (n_choices() + q.n > config_.max_seqs) return;
    auto stops = StopMatcher::create(q.stop);
    if (!stops) {  // validate_request() checked the stops; kept for safety
      fail_request(*r, stops.error());
    } else {
      SamplingParams p = q.sampling;
      auto seq = std::make_unique<Choice>(r, 0, engine_.new_sequence(q.cache_salt), p,
                                          engine_.tokenizer(), std::move(*stops));
      seq->tokens = q.prompt;
      seq->pending_forks = q.n - 1;
      if (q.kv_retention) {
        // parse_request checked the config and the KV format; forks inherit it.
        KV_CHECK(seq->kv.table().set_retention(*q.kv_retention).ok(),
                 "kv_retention was validated before submission");
      }
      const int64_t need = reserve_blocks(*seq);
      if (need > budget && !running_.empty()) return;
      budget -= need;
      for (int32_t t : q.prompt) seq->sampler.accept(t);
      // Prefix cache: adopt the longest cached prefix in the request's
      // namespace (at most prompt - 2 tokens, see adopt_prefix()).
      const int64_t hit = adopt_prefix(*seq);
      r->usage.cached_tokens = hit;
      {
        std::lock_guard<std::mutex> lock(mu_);
        metrics_.n_prefix_queries += static_cast<int64_t>(q.prompt.size());
        metrics_.n_prefix_hits += hit;
      }
      r->usage.prompt_tokens = static_cast<int64_t>(q.prompt.size());
      running_.push_back(std::move(seq));
    }
    waiting_.pop_front();
    std::lock_guard<std::mutex> lock(mu_);
    n_queued_--;
  }
}

void Scheduler::preempt(size_t i) {
  std::unique_ptr<Choice> s = std::move(running_[i]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
  // Releasing every reference is all a preemption does: committed K/V are
  // recomputed on resume from s->tokens (or re-hit in the prefix cache).
  s->kv.release();
  preempted_.push_back(std::move(s));
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.n_preemptions++;
}

int64_t Scheduler::step() {
  take_submissions();
  drop_cancelled();
  admit();
  if (running_.empty()) {
    publish_gauges();
    return 0;
  }
  std::sort(running_.begin(), running_.end(),
            [](const auto& a, const auto& b) { return a->before_priority(*b); });

  const int64_t chunk = prefill_chunk_tokens();
  std::vector<StepSeq> batch;
  std::vector<Choice*> owners;
  std::vector<BlockTable*> tables;
  std::vector<int64_t> n_new;
  for (;;) {
    batch.clear();
    owners.clear();
    int64_t budget = config_.max_batch_tokens;
    // Decodes first: one token each, never held back by a prefill.
    for (auto& s : running_) {
      if (s->n_unwritten() != 1) continue;
      batch.push_back({.table = &s->kv.table(),
                       .tokens = std::span<const int32_t>(&s->tokens.back(), 1),
                       .logits = LogitsMode::kLast});
      owners.push_back(s.get());
      budget--;
    }
    // Then prompt (or recompute) chunks, oldest first, within the budget.
    // Chunk boundaries sit at fixed positions (multiples of `chunk`), so how
    // a prompt is split depends on the prompt only, never on what else runs
    // in the step: a chunk that does not fit the budget waits whole for the
    // next step instead of being cut. The oldest prefill always fits (see
    // prefill_chunk_tokens()).
    for (auto& s : running_) {
      const int64_t left = s->n_unwritten();
      if (left <= 1 || budget <= 0) continue;
      const int64_t from = s->kv.length();
      const int64_t take = prefill_take(*s, chunk);
      // A chunk that does not fit waits whole. Only with L = 2 can an entry
      // (3 tokens, see prefill_chunk_end()) exceed the guaranteed budget: it
      // runs anyway when nothing else is in the step, so it cannot starve.
      if (take > budget && !batch.empty()) continue;
      batch.push_back(
          {.table = &s->kv.table(),
           .tokens = std::span<const int32_t>(s->tokens.data() + from, static_cast<size_t>(take)),
           .logits = take == left ? LogitsMode::kLast : LogitsMode::kNone,
           .watch = s->req->req.watch_id});
      owners.push_back(s.get());
      budget -= take;
    }
    tables.clear();
    n_new.clear();
    for (const StepSeq& e : batch) {
      tables.push_back(e.table);
      n_new.push_back(static_cast<int64_t>(e.tokens.size()));
    }
    // What reserve_all does first (drop invisible window blocks, retention
    // compaction: SnapKV's selection and H2O's before a one-token step), so
    // the plan counts the blocks the step really takes: a sequence at its
    // first decode step holds its whole prompt until it compacts.
    for (size_t i = 0; i < tables.size(); ++i) tables[i]->prepare_step(n_new[i]);
    if (plan_reserve(tables, n_new) <= engine_.pool().n_available()) break;
    if (running_.size() == 1) {
      fail_request(
          *running_.front()->req,
          make_error(Errc::kOutOfBlocks, "the KV pool cannot hold this sequence even alone"));
      running_.clear();
      publish_gauges();
      return 0;
    }
    preempt(running_.size() - 1);
  }

  if (config_.on_step) config_.on_step(batch);
  const Status st = engine_.forward().step(batch, &logits_);
  if (!st.ok()) {
    // A row the cache cannot store (NaN/Inf K/V) fails only its own request;
    // nothing of the step was committed, so the others simply run again.
    const int64_t bad = engine_.forward().rejected_entry();
    if (bad >= 0 && static_cast<size_t>(bad) < owners.size()) {
      fail_request(*owners[static_cast<size_t>(bad)]->req, st);
    } else {
      for (Choice* s : owners) fail_request(*s->req, st);
    }
    std::erase_if(running_, [](const auto& s) { return s->done; });
    publish_gauges();
    return 0;
  }
  int64_t n_tok = 0;
  for (const auto& e : n_new) n_tok += e;
  // Record the committed tokens; full blocks are published for prefix hits.
  for (size_t i = 0; i < owners.size(); ++i) owners[i]->kv.on_committed(batch[i].tokens);
  size_t row = 0;
  const size_t n_owners = owners.size();
  for (size_t i = 0; i < n_owners; ++i) {
    if (batch[i].logits != LogitsMode::kLast) continue;
    sample_and_emit(*owners[i], logits_.data() + row * static_cast<size_t>(n_vocab_));
    row++;
  }
  std::erase_if(running_, [](const auto& s) { return s->done; });
  {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.n_steps++;
    metrics_.n_step_tokens += n_tok;
  }
  publish_gauges();
  return n_tok;
}

void Scheduler::sample_and_emit(Choice& s, const float* logits) {
  Request& r = *s.req;
  const SeqRequest& q = r.req;
  // Parallel sampling: fork the prefilled prompt into the other choices.
  if (s.pending_forks > 0) {
    for (int i = 1; i <= s.pending_forks; ++i) {
      SamplingParams p = q.sampling;
      p.seed += static_cast<uint64_t>(i);
      auto stops = StopMatcher::create(q.stop);
      auto f = std::make_unique<Choice>(s.req, s.index + i, s.kv.fork(), p, engine_.tokenizer(),
                                        std::move(*stops));
      f->tokens = s.tokens;
      for (int32_t t : q.prompt) f->sampler.accept(t);
      Choice& fr = *f;
      running_.push_back(std::move(f));
      sample_and_emit(fr, logits);
    }
    s.pending_forks = 0;
  }

  SampledToken tok;
  if (q.n_logprobs >= 0) {
    tok = s.sampler.sample_with_logprobs(logits, n_vocab_, q.n_logprobs);
  } else {
    tok.token = s.sampler.sample(logits, n_vocab_);
  }
  s.sampler.accept(tok.token);
  s.tokens.push_back(tok.token);
  s.n_generated++;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.n_generation_tokens++;
    if (!r.first_token) {
      metrics_.ttft.observe(std::chrono::duration<double>(now - r.t_arrival).count());
    } else if (s.n_generated > 1) {
      metrics_.itl.observe(std::chrono::duration<double>(now - s.t_last).count());
    }
  }
  r.first_token = true;
  s.t_last = now;

  const Tokenizer& tk = engine_.tokenizer();
  const bool eog = tk.is_eog(tok.token) && !q.ignore_eos;
  SeqEvent ev;
  ev.kind = SeqEvent::Kind::kToken;
  ev.index = s.index;
  ev.token = tok.token;
  if (q.n_logprobs >= 0) ev.logprob = tok;
  if (!eog) ev.text = s.stops.push(s.decoder.push(tok.token));
  r.handle->push(std::move(ev));

  if (eog) {
    finish_seq(s, FinishReason::kEos, {});
  } else if (s.stops.stopped()) {
    finish_seq(s, FinishReason::kStop, {});
  } else if (s.n_generated >= q.max_tokens || static_cast<int64_t>(s.tokens.size()) >= n_ctx_) {
    finish_seq(s, FinishReason::kLength, {});
  }
}

void Scheduler::finish_seq(Choice& s, FinishReason reason, std::string tail) {
  Request& r = *s.req;
  if (!s.stops.stopped()) {
    tail += s.stops.push(s.decoder.flush());
    tail += s.stops.flush();
  }
  s.kv.release();
  s.done = true;
  r.n_finished++;
  r.usage.completion_tokens += s.n_generated;
  SeqEvent ev;
  ev.kind = SeqEvent::Kind::kFinish;
  ev.index = s.index;
  ev.text = std::move(tail);
  ev.finish = reason;
  if (r.n_finished == r.req.n) {
    r.ended = true;
    ev.request_done = true;
    ev.usage = r.usage;
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.n_requests_finished++;
    metrics_.n_prompt_tokens += r.usage.prompt_tokens;
    metrics_.e2e.observe(seconds_since(r.t_arrival));
  }
  r.handle->push(std::move(ev));
}

void Scheduler::publish_gauges() {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.n_running = static_cast<int64_t>(running_.size());
  metrics_.n_waiting = n_queued_ + static_cast<int64_t>(preempted_.size());
}

SchedulerMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  return metrics_;
}

void Scheduler::run_inspections() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!inspections_.empty()) {
    auto [fn, done] = inspections_.front();
    inspections_.pop_front();
    lock.unlock();
    (*fn)(engine_);
    done->set_value();
    lock.lock();
  }
}

Status Scheduler::inspect(const std::function<void(Engine&)>& fn) {
  std::promise<void> done;
  std::future<void> f = done.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return make_error(Errc::kCancelled, "the scheduler has stopped");
    inspections_.emplace_back(&fn, &done);
  }
  cv_.notify_all();
  f.wait();
  return {};
}

void Scheduler::shutdown(bool drain) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    drain_ = drain;
  }
  cv_.notify_all();
}

void Scheduler::run() {
  for (;;) {
    run_inspections();
    bool stopping = false;
    bool drain = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
      drain = drain_;
    }
    if (stopping && !drain) {
      take_submissions();
      const Status st = make_error(Errc::kCancelled, "the server is shutting down");
      for (auto* list : {&running_, &preempted_}) {
        for (auto& s : *list) fail_request(*s->req, st);
      }
      for (auto& r : waiting_) fail_request(*r, st);
      running_.clear();
      preempted_.clear();
      {
        std::lock_guard<std::mutex> lock(mu_);
        n_queued_ -= static_cast<int64_t>(waiting_.size());
      }
      waiting_.clear();
      publish_gauges();
    }
    const int64_t n = step();
    if (n > 0) continue;
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_ && incoming_.empty() && waiting_.empty() && running_.empty() &&
        preempted_.empty()) {
      stopped_ = true;
      break;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(20),
                 [&] { return !incoming_.empty() || !inspections_.empty() || stopping_; });
  }
  run_inspections();
}

}  // namespace kvstack

// Continuous batching (scheduler.h) on the default model: batched, chunked
// and preempted greedy generation gives exactly the tokens of one sequence
// run alone with generate(); cancellation and completion release every
// block (pool invariants recomputed from the live holders); forks for n > 1;
// the threaded run() loop with concurrent submitters (also the TSan target).
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "attention/paged_attention.h"
#include "engine/testing/model_files.h"
#include "kv/rotation.h"
#include "ops/elementwise.h"

namespace kvstack {
namespace {

using testing::default_model_path;

std::unique_ptr<Engine> make_engine(int64_t kv_tokens, int prefill_chunk = 512) {
  const std::string path = default_model_path();
  if (path.empty() || !std::filesystem::exists(path)) return nullptr;
  EngineConfig c;
  c.model_path = path;
  c.n_threads = 2;
  c.block_size = 16;
  c.kv_cache_tokens = kv_tokens;
  c.prefill_chunk = prefill_chunk;
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.error().message;
  return e.ok() ? std::move(*e) : nullptr;
}

#define REQUIRE_ENGINE(e) \
  if (!(e)) GTEST_SKIP() << "default model not found (set KVSTACK_MODEL)"

std::vector<int32_t> tokens_of(Engine& e, const std::string& text) {
  return e.tokenizer().tokenize(text, {.add_special = true, .parse_special = true});
}

// Reference: the single-sequence generation loop.
std::vector<int32_t> generate_alone(Engine& e, const std::vector<int32_t>& prompt, int64_t n) {
  BlockTable t = e.new_table();
  GenerateOptions o;
  o.max_tokens = n;
  o.sampling.temperature = 0;
  auto r = generate(e, t, prompt, o);
  EXPECT_TRUE(r.ok());
  return r.ok() ? r->tokens : std::vector<int32_t>{};
}

SchedulerConfig config(int max_seqs, int64_t max_batch_tokens, int64_t max_queue = 256,
                       int64_t reserve_output_tokens = 32) {
  SchedulerConfig c;
  c.max_seqs = max_seqs;
  c.max_batch_tokens = max_batch_tokens;
  c.max_queue = max_queue;
  c.reserve_output_tokens = reserve_output_tokens;
  return c;
}

SeqRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens, int n = 1) {
  SeqRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.n = n;
  r.sampling.temperature = 0;
  return r;
}

struct Collected {
  std::map<int, std::vector<int32_t>> tokens;  // per choice
  std::map<int, std::string> text;
  std::map<int, FinishReason> finish;
  bool done = false;
  std::optional<Error> error;
  RequestUsage usage;
};

void drain(RequestHandle& h, Collected* c) {
  std::vector<SeqEvent> evs;
  h.wait(&evs, std::chrono::milliseconds(0));
  for (auto& ev : evs) {
    if (ev.kind == SeqEvent::Kind::kToken) {
      c->tokens[ev.index].push_back(ev.token);
      c->text[ev.index] += ev.text;
    } else if (ev.kind == SeqEvent::Kind::kFinish) {
      c->text[ev.index] += ev.text;
      c->finish[ev.index] = ev.finish;
    } else {
      c->error = ev.error.error();
    }
    if (ev.request_done) {
      c->done = true;
      c->usage = ev.usage;
    }
  }
}

// Steps until every handle is done (bounded).
void run_until_done(Scheduler& s, std::vector<std::shared_ptr<RequestHandle>>& hs,
                    std::vector<Collected>& out) {
  out.resize(hs.size());
  for (int it = 0; it < 20000; ++it) {
    s.step();
    bool all = true;
    for (size_t i = 0; i < hs.size(); ++i) {
      drain(*hs[i], &out[i]);
      all = all && out[i].done;
    }
    if (all) return;
  }
  FAIL() << "requests did not finish";
}

void expect_pool_idle(Engine& e) {
  e.pool().check_invariants();
  const BlockPoolStats st = e.pool().stats();
  EXPECT_EQ(st.n_blocks_used, 0);
  EXPECT_EQ(st.n_tables, 0);
  EXPECT_EQ(st.n_blocks_free + st.n_blocks_cached, st.n_blocks_total);
}

// One long prompt (kPrompts[4]), split over two lines by design: named
// rather than concatenated inside the list, so that it cannot be mistaken for
// two prompts with a missing comma.
constexpr char kLongPrompt[] =
    "Water boils at a temperature of one hundred degrees Celsius at sea level, but at higher "
    "altitudes the boiling point is lower because the air pressure is lower. This means that";
const char* kPrompts[] = {
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colors:",
    kLongPrompt,
    "Hello",
};

TEST(Scheduler, BatchedChunkedGreedyEqualsSequential) {
  auto e = make_engine(4096);
  REQUIRE_ENGINE(e);
  constexpr int64_t kN = 8;
  std::vector<std::vector<int32_t>> prompts, want;
  for (const char* p : kPrompts) {
    prompts.push_back(tokens_of(*e, p));
    want.push_back(generate_alone(*e, prompts.back(), kN));
  }
  // A small step budget forces the long prompts through several chunks that
  // share steps with other sequences' decodes.
  auto s = Scheduler::create(*e, config(8, 12));
  ASSERT_TRUE(s.ok());
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (auto& p : prompts) {
    auto h = (*s)->submit(greedy(p, kN));
    ASSERT_TRUE(h.ok()) << h.error().message;
    hs.push_back(*h);
  }
  std::vector<Collected> got;
  run_until_done(**s, hs, got);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_FALSE(got[i].error) << got[i].error->message;
    EXPECT_EQ(got[i].tokens[0], want[i]) << kPrompts[i];
    EXPECT_EQ(got[i].usage.prompt_tokens, static_cast<int64_t>(prompts[i].size()));
    EXPECT_EQ(got[i].usage.completion_tokens, static_cast<int64_t>(want[i].size()));
  }
  const SchedulerMetrics m = (*s)->metrics();
  EXPECT_EQ(m.n_requests_finished, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(m.n_preemptions, 0);
  EXPECT_EQ(m.n_running, 0);
  EXPECT_GT(m.n_steps, 0);
  // Batching happened: fewer steps than the tokens forwarded.
  EXPECT_LT(m.n_steps, m.n_step_tokens / 2);
  expect_pool_idle(*e);
}

TEST(Scheduler, PreemptionByRecomputeKeepsGreedyTokens) {
  // 10 blocks of 16 tokens for 6 sequences of up to ~60 tokens each: the
  // running set outgrows the pool and must preempt.
  auto e = make_engine(10 * 16);
  REQUIRE_ENGINE(e);
  constexpr int64_t kN = 16;
  std::vector<std::vector<int32_t>> prompts, want;
  for (const char* p : kPrompts) {
    prompts.push_back(tokens_of(*e, p));
    want.push_back(generate_alone(*e, prompts.back(), kN));
  }
  auto s = Scheduler::create(*e, config(6, 64, 256, 0));
  ASSERT_TRUE(s.ok());
  std::vector<std::shared_ptr<RequestHandle>> hs;
  hs.reserve(prompts.size());
  for (auto& p : prompts) hs.push_back(*(*s)->submit(greedy(p, kN)));
  std::vector<Collected> got;
  run_until_done(**s, hs, got);
  // Every request runs to its length with exactly the lone run's tokens: a
  // resumed sequence recomputes its prompt in the same chunk shapes and its
  // sampled tokens as one-token entries, as the lone decode computed them.
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_FALSE(got[i].error) << got[i].error->message;
    EXPECT_EQ(got[i].tokens[0].size(), static_cast<size_t>(kN));
    EXPECT_EQ(got[i].tokens[0], want[i]) << kPrompts[i];
  }
  const SchedulerMetrics m = (*s)->metrics();
  EXPECT_GT(m.n_preemptions, 0);
  expect_pool_idle(*e);
}

TEST(Scheduler, CancellationReleasesBlocksWithinOneStep) {
  auto e = make_engine(4096);
  REQUIRE_ENGINE(e);
  auto s = Scheduler::create(*e, config(4, 32));
  ASSERT_TRUE(s.ok());
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (const char* p : kPrompts) hs.push_back(*(*s)->submit(greedy(tokens_of(*e, p), 200)));
  for (int i = 0; i < 6; ++i) (*s)->step();
  EXPECT_GT(e->pool().stats().n_blocks_used, 0);
  for (auto& h : hs) h->cancel();
  (*s)->step();
  expect_pool_idle(*e);
  for (auto& h : hs) {
    Collected c;
    drain(*h, &c);
    EXPECT_TRUE(c.done);
    ASSERT_TRUE(c.error);
    EXPECT_EQ(c.error->code, Errc::kCancelled);
  }
  EXPECT_EQ((*s)->metrics().n_running, 0);
  EXPECT_EQ((*s)->metrics().n_waiting, 0);
}

TEST(Scheduler, ParallelSamplingForksShareThePrompt) {
  auto e = make_engine(4096);
  REQUIRE_ENGINE(e);
  const auto prompt = tokens_of(*e, kPrompts[4]);
  const auto want = generate_alone(*e, prompt, 6);
  auto s = Scheduler::create(*e, config(4, 64));
  ASSERT_TRUE(s.ok());
  std::vector<std::shared_ptr<RequestHandle>> hs{*(*s)->submit(greedy(prompt, 6, 3))};
  std::vector<Collected> got;
  run_until_done(**s, hs, got);
  // Sampled choices with seeds, each request alone: same seed, same choices.
  SeqRequest sampled = greedy(prompt, 6, 3);
  sampled.sampling.temperature = 1.0f;
  sampled.sampling.seed = 7;
  sampled.sampling.has_seed = true;
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<std::shared_ptr<RequestHandle>> one{*(*s)->submit(sampled)};
    std::vector<Collected> out;
    run_until_done(**s, one, out);
    got.push_back(out[0]);
  }
  ASSERT_EQ(got[0].tokens.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(got[0].tokens[i], want);
  EXPECT_EQ(got[0].usage.completion_tokens, 18);
  EXPECT_EQ(got[1].tokens, got[2].tokens);
  if (prompt.size() % 16 != 0) {
    EXPECT_GT(e->pool().stats().n_cow_copies, 0);
  }
  expect_pool_idle(*e);
}

TEST(Scheduler, RejectsRequestsThatCouldNeverRun) {
  auto e = make_engine(64);
  REQUIRE_ENGINE(e);
  auto s = Scheduler::create(*e, config(2, 16, 1));
  ASSERT_TRUE(s.ok());
  auto bad = [&](const SeqRequest& r, const char* field) {
    auto st = (*s)->validate_request(r);
    ASSERT_FALSE(st.ok()) << field;
    EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
    EXPECT_NE(st.error().message.find(field), std::string::npos) << st.error().message;
  };
  bad(greedy({}, 4), "prompt");
  bad(greedy({1, 2, 999999}, 4), "prompt");
  bad(greedy({1, 2}, 0), "max_tokens");
  bad(greedy({1, 2}, 100), "max_tokens");  // 64-token pool
  bad(greedy({1, 2}, 4, 3), "n");
  SeqRequest r = greedy({1, 2}, 4);
  r.sampling.top_p = 2;
  bad(r, "top_p");
  EXPECT_FALSE(Scheduler::create(*e, config(8, 4)).ok());
  // Queue limit: one waiting request, the second is refused.
  ASSERT_TRUE((*s)->submit(greedy({1, 2}, 4)).ok());
  auto full = (*s)->submit(greedy({1, 2}, 4));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, Errc::kBusy);
  EXPECT_NE(full.error().message.find("queue is full"), std::string::npos);
}

TEST(Scheduler, ThreadedLoopWithConcurrentClients) {
  auto e = make_engine(20 * 16);
  REQUIRE_ENGINE(e);
  auto s = Scheduler::create(*e, config(4, 32, 64));
  ASSERT_TRUE(s.ok());
  Scheduler& sch = **s;
  std::thread engine_thread([&] { sch.run(); });
  const auto prompt = tokens_of(*e, kPrompts[0]);
  constexpr int kClients = 6;
  std::vector<std::thread> clients;
  clients.reserve(kClients);
  std::atomic<int> n_ok{0};
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto h = sch.submit(greedy(prompt, 4 + c));
      if (!h.ok()) return;
      if (c == kClients - 1) (*h)->cancel();
      Collected col;
      for (int i = 0; i < 2000 && !col.done; ++i) {
        std::vector<SeqEvent> evs;
        if ((*h)->wait(&evs, std::chrono::milliseconds(50))) {
          for (auto& ev : evs) col.done = col.done || ev.request_done;
        }
      }
      if (col.done) n_ok++;
    });
  }
  BlockPoolStats mid;
  ASSERT_TRUE(sch.inspect([&](Engine& en) { mid = en.pool().stats(); }).ok());
  for (auto& t : clients) t.join();
  sch.shutdown(/*drain=*/true);
  engine_thread.join();
  EXPECT_EQ(n_ok.load(), kClients);
  EXPECT_FALSE(sch.submit(greedy(prompt, 4)).ok());
  EXPECT_FALSE(sch.inspect([](Engine&) {}).ok());
  EXPECT_EQ(mid.n_blocks_total, 20);
  expect_pool_idle(*e);
}

// Prefill chunking is a function of the prompt: the same prompt is split at
// the same positions whether it runs alone or beside decodes and other
// prefills (a chunk that does not fit a step waits whole).
TEST(Scheduler, PrefillChunksDependOnThePromptOnly) {
  auto e = make_engine(4096);
  REQUIRE_ENGINE(e);
  const auto prompt =
      tokens_of(*e, std::string(kPrompts[4]) + " " + kPrompts[1] + " " + kPrompts[4]);
  ASSERT_GT(prompt.size(), 60u);
  using Chunk = std::pair<int64_t, int64_t>;  // (first position, tokens)
  auto chunks_of_prompt = [&](int n_others, const std::string& salt) {
    std::vector<Chunk> chunks;
    SchedulerConfig c = config(4, 24);
    c.on_step = [&](std::span<const StepSeq> batch) {
      for (const StepSeq& q : batch) {
        const int64_t from = q.table->length();
        const auto n = static_cast<int64_t>(q.tokens.size());
        if (from + n > static_cast<int64_t>(prompt.size())) continue;
        if (std::equal(q.tokens.begin(), q.tokens.end(), prompt.begin() + from)) {
          chunks.emplace_back(from, n);
        }
      }
    };
    auto s = Scheduler::create(*e, c);
    EXPECT_TRUE(s.ok());
    std::vector<std::shared_ptr<RequestHandle>> hs;
    for (int i = 0; i < n_others; ++i) {
      SeqRequest o = greedy(tokens_of(*e, kPrompts[i % 4]), 40);
      o.cache_salt = salt;
      hs.push_back(*(*s)->submit(o));
    }
    for (int i = 0; i < 3; ++i) (*s)->step();  // the others decode (or still prefill)
    SeqRequest r = greedy(prompt, 2);
    r.cache_salt = salt;  // no prefix hits across runs
    hs.push_back(*(*s)->submit(r));
    std::vector<Collected> got;
    run_until_done(**s, hs, got);
    for (const auto& g : got) EXPECT_FALSE(g.error);
    return chunks;
  };
  const std::vector<Chunk> alone = chunks_of_prompt(0, "alone");
  ASSERT_GE(alone.size(), 3u);
  // Fixed boundaries: every chunk but the last ends at a multiple of the
  // chunk length min(prefill_chunk, max_batch_tokens - max_seqs + 1) = 21.
  int64_t pos = 0;
  for (size_t i = 0; i < alone.size(); ++i) {
    EXPECT_EQ(alone[i].first, pos);
    pos += alone[i].second;
    // The boundary before the last prompt token moves one token earlier.
    if (pos < static_cast<int64_t>(prompt.size()) - 2) {
      EXPECT_EQ(pos % 21, 0) << i;
    }
  }
  std::string listing;
  for (const Chunk& ch : alone) {
    listing += std::to_string(ch.first);
    listing += '+';
    listing += std::to_string(ch.second);
    listing += ' ';
  }
  EXPECT_GE(alone.back().second, 2) << "prompt of " << prompt.size() << ": " << listing;
  // The scheduler's split is the shared rule's (Engine::prefill cuts so too).
  for (const Chunk& ch : alone) {
    EXPECT_EQ(ch.first + ch.second,
              prefill_chunk_end(ch.first, static_cast<int64_t>(prompt.size()), 21))
        << listing;
  }
  EXPECT_EQ(pos, static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(chunks_of_prompt(3, "busy"), alone);
  EXPECT_EQ(chunks_of_prompt(2, "busier"), alone);
  expect_pool_idle(*e);
}

// The shared chunking rule, exhaustively on small sizes: entries of 2..chunk
// tokens (1 only for chunk 1 or one token left; 3 for chunk 2; one more
// when the entry starts between boundaries, after a prefix hit), boundaries
// at the multiples of chunk except n_end - 1 (moved to n_end - 2), and a
// split that starts at a prefix hit h runs to the first boundary of the
// split from 0 past h (the one after it when that would leave one token).
TEST(PrefillChunks, SharedRuleCutsAtAbsolutePositions) {
  for (int64_t chunk = 1; chunk <= 9; ++chunk) {
    for (int64_t n = 1; n <= 40; ++n) {
      std::vector<int64_t> from0;
      for (int64_t b = 0; b < n; b = from0.back()) from0.push_back(prefill_chunk_end(b, n, chunk));
      for (int64_t from = 0; from < n; ++from) {
        const int64_t end = prefill_chunk_end(from, n, chunk);
        const std::string at = "chunk " + std::to_string(chunk) + ", n_end " + std::to_string(n) +
                               ", from " + std::to_string(from) + " -> " + std::to_string(end);
        ASSERT_GT(end, from) << at;
        ASSERT_LE(end, n) << at;
        const int64_t most = chunk == 2 ? 3 : chunk;
        EXPECT_LE(end - from, from % chunk == 0 ? most : most + 1) << at;
        if (chunk >= 2 && from < n - 1) {
          EXPECT_GE(end - from, 2) << at;
        }
        const bool moved = chunk >= 2 && end == n - 2 && (n - 1) % chunk == 0;
        EXPECT_TRUE(end == n || end % chunk == 0 || moved) << at;
        if (chunk >= 2) {
          EXPECT_NE(end, n - 1) << at;
        }
        if (from < n - 1) {
          const auto next = std::upper_bound(from0.begin(), from0.end(), from);
          ASSERT_NE(next, from0.end()) << at;
          const bool skips_one =
              chunk >= 2 && *next - from == 1 && next + 1 != from0.end() && end == *(next + 1);
          EXPECT_TRUE(end == *next || skips_one) << at;
        }
      }
    }
  }
}

// Engine::prefill (kvstack run, chat, bench, perplexity) cuts prompts at
// those absolute positions, also on top of a prefix: its logits are bit for
// bit the one-piece prefill's, for every length around the boundaries (a
// split that left the last token alone would take the decode path).
TEST(PrefillChunks, EnginePrefillMatchesOnePiece) {
  constexpr int kChunk = 8;
  auto e = make_engine(4096, kChunk);
  REQUIRE_ENGINE(e);
  const int64_t n_vocab = e->model().config().n_vocab;
  const auto prompt = tokens_of(*e, kLongPrompt);
  ASSERT_GT(prompt.size(), 26u);
  auto one_piece = [&](int64_t n, LogitsMode mode) {
    BlockTable t = e->new_table();
    std::vector<float> lg;
    const StepSeq p{.table = &t,
                    .tokens = std::span<const int32_t>(prompt.data(), static_cast<size_t>(n)),
                    .logits = mode};
    EXPECT_TRUE(e->forward().step(std::span<const StepSeq>(&p, 1), &lg).ok());
    return lg;
  };
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  const std::span<const int32_t> all(prompt);
  for (int64_t n : {int64_t{8}, int64_t{9}, int64_t{10}, int64_t{17}, int64_t{25}, int64_t{26}}) {
    const std::vector<float> ref = one_piece(n, LogitsMode::kLast);
    ASSERT_EQ(ref.size(), static_cast<size_t>(n_vocab));
    {
      BlockTable t = e->new_table();
      std::vector<float> lg;
      ASSERT_TRUE(e->prefill(t, all.first(static_cast<size_t>(n)), LogitsMode::kLast, &lg).ok());
      EXPECT_TRUE(same_bits(lg, ref)) << "prompt of " << n << " tokens, chunk " << kChunk;
    }
    // On top of a prefix (as after a prefix-cache hit of h tokens).
    for (int64_t h : {int64_t{3}, int64_t{7}, int64_t{8}, int64_t{15}}) {
      if (n - h < 2) continue;  // one token left: the decode path by necessity
      BlockTable t = e->new_table();
      std::vector<float> lg;
      ASSERT_TRUE(
          e->prefill(t, all.first(static_cast<size_t>(h)), LogitsMode::kNone, nullptr).ok());
      ASSERT_TRUE(e->prefill(t, all.subspan(static_cast<size_t>(h), static_cast<size_t>(n - h)),
                             LogitsMode::kLast, &lg)
                      .ok());
      EXPECT_TRUE(same_bits(lg, ref)) << "prompt of " << n << " tokens after " << h;
    }
  }
  // Every row (kAll, as perplexity asks).
  {
    const std::vector<float> ref = one_piece(25, LogitsMode::kAll);
    BlockTable t = e->new_table();
    std::vector<float> lg;
    ASSERT_TRUE(e->prefill(t, all.first(25), LogitsMode::kAll, &lg).ok());
    EXPECT_TRUE(same_bits(lg, ref));
  }
  expect_pool_idle(*e);
}

// ---------------------------------------------------------------------------
// Batch invariance. For greedy output under load to equal a lone run, a
// row's result must not depend on the other rows of its step. The scheduler
// guarantees the structure (fixed chunk boundaries, one logits row per
// entry, every token in the entry shape a lone run gives it); these tests
// check the numerics bit for bit, op by op on real activations of the
// default model (forward order: rms_norm, Q/K/V matmul, rope, attention, wo
// matmul, add, rms_norm, gate/up matmul, swiglu, down matmul, add, ...,
// output rms_norm, output matmul) and end to end through Forward::step. The
// table names the first op of the forward order that is not batch-invariant:
// that is where a batched run first diverges.
//
// Every row is required to be bit-identical except those labelled "path:",
// which compare the attention kernel's one-token (decode) path with the same
// row inside a chunk (prefill path): they round differently by design, so
// prefill_chunk_end() and the scheduler never compute a token in the other
// path than a lone run does; those rows are reported and bounded only.
// KVSTACK_REQUIRE_BATCH_INVARIANCE=0 reports without failing (bringing up a
// new kernel); the default is strict.

bool require_batch_invariance() {
  const char* v = std::getenv("KVSTACK_REQUIRE_BATCH_INVARIANCE");
  return v == nullptr || std::string(v) != "0";
}

struct Divergence {
  std::string op;
  std::string context;
  int64_t n_checked = 0;
  int64_t n_differ = 0;  // rows (or cases) whose bits differ from the lone run
  double max_abs = 0;
};

struct InvarianceReport {
  std::vector<Divergence> rows;
  void add(std::string op, std::string context, const float* alone, const float* other, int64_t n) {
    Divergence* d = nullptr;
    for (auto& r : rows) {
      if (r.op == op && r.context == context) d = &r;
    }
    if (d == nullptr) {
      rows.push_back({std::move(op), std::move(context)});
      d = &rows.back();
    }
    d->n_checked++;
    if (std::memcmp(alone, other, static_cast<size_t>(n) * sizeof(float)) != 0) {
      d->n_differ++;
      for (int64_t i = 0; i < n; ++i) {
        d->max_abs = std::max(d->max_abs, static_cast<double>(std::fabs(alone[i] - other[i])));
      }
    }
  }
  void print(const char* title) const {
    std::printf("\n%s\n%-28s %-44s %8s %8s %12s\n", title, "op", "alone vs", "checked", "differ",
                "max |diff|");
    const Divergence* first = nullptr;
    for (const auto& r : rows) {
      std::printf("%-28s %-44s %8lld %8lld %12.3g\n", r.op.c_str(), r.context.c_str(),
                  static_cast<long long>(r.n_checked), static_cast<long long>(r.n_differ),
                  r.max_abs);
      if (first == nullptr && r.n_differ > 0 && r.op.rfind("path:", 0) != 0) first = &r;
    }
    if (first != nullptr) {
      std::printf("FIRST DIVERGENT OP: %s (%s)\n", first->op.c_str(), first->context.c_str());
    } else {
      std::printf("every required op is batch-invariant (\"path:\" rows: reported only)\n");
    }
  }
  int64_t n_differ(const std::string& op_prefix) const {
    int64_t n = 0;
    for (const auto& r : rows) {
      if (r.op.rfind(op_prefix, 0) == 0) n += r.n_differ;
    }
    return n;
  }
  // Rows that must be bit-identical: every row but the "path:" ones.
  int64_t n_differ_required() const { return n_differ("") - n_differ("path:"); }
};

std::vector<float> random_rows(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

TEST(BatchInvariance, OpByOpOnRealActivations) {
  auto e = make_engine(4096);
  REQUIRE_ENGINE(e);
  const ModelConfig& c = e->model().config();
  const LayerWeights& w = e->model().layers()[0];
  ThreadPool* tp = &e->threads();
  InvarianceReport rep;
  std::mt19937 rng(5);

  // 64 real rows: embeddings of real text, normed as layer 0 does.
  std::vector<int32_t> toks;
  for (const char* p : kPrompts) {
    const auto t = tokens_of(*e, p);
    toks.insert(toks.end(), t.begin(), t.end());
  }
  while (toks.size() < 64) toks.insert(toks.end(), toks.begin(), toks.end());
  toks.resize(64);
  const int64_t n_rows = 64, d = c.n_embd;
  std::vector<float> x(static_cast<size_t>(n_rows * d)), h(x.size());
  e->model().embed(toks.data(), n_rows, x.data());
  // The row alone vs in batches of m rows at every position the check picks.
  const int64_t kSizes[] = {2, 3, 8, 17, 64};
  auto rows_of = [&](int64_t m, int64_t at, int64_t target, const std::vector<float>& src,
                     int64_t width) {
    // m rows from src with the target row placed at index `at`.
    std::vector<float> b(static_cast<size_t>(m * width));
    for (int64_t r = 0, k = 0; r < m; ++r) {
      const int64_t from = r == at ? target : (k++ + target + 1) % n_rows;
      std::copy_n(src.data() + from * width, width, b.data() + r * width);
    }
    return b;
  };

  {  // rms_norm
    rms_norm(x.data(), w.attn_norm, n_rows, d, c.norm_eps, h.data());
    for (int64_t r = 0; r < n_rows; r += 7) {
      std::vector<float> one(static_cast<size_t>(d));
      rms_norm(x.data() + r * d, w.attn_norm, d, c.norm_eps, one.data());
      rep.add("rms_norm", "rows of a 64-row call", one.data(), h.data() + r * d, d);
    }
  }
  // Inputs for the down projection: real swiglu(gate, up) of the normed rows.
  std::vector<float> gate(static_cast<size_t>(n_rows * c.n_ff)), up(gate.size());
  matmul(w.w_gate, h.data(), n_rows, gate.data(), tp);
  matmul(w.w_up, h.data(), n_rows, up.data(), tp);
  std::vector<float> act(gate.size());
  swiglu(gate.data(), up.data(), act.data(), n_rows * c.n_ff);
  for (int64_t r = 0; r < n_rows; r += 5) {
    std::vector<float> one(static_cast<size_t>(c.n_ff));
    swiglu(gate.data() + r * c.n_ff, up.data() + r * c.n_ff, one.data(), c.n_ff);
    rep.add("swiglu", "row at its offset in a 64-row call", one.data(), act.data() + r * c.n_ff,
            c.n_ff);
    std::vector<float> sum(static_cast<size_t>(d)), all(static_cast<size_t>(n_rows * d));
    add(x.data() + r * d, h.data() + r * d, sum.data(), d);
    add(x.data(), h.data(), all.data(), n_rows * d);
    rep.add("add", "row at its offset in a 64-row call", sum.data(), all.data() + r * d, d);
  }
  {  // rope
    const int64_t qd = static_cast<int64_t>(c.n_heads) * c.head_dim;
    auto q = random_rows(rng, n_rows * qd);
    std::vector<int32_t> pos(static_cast<size_t>(n_rows));
    for (int64_t r = 0; r < n_rows; ++r) pos[r] = static_cast<int32_t>(3 * r + 1);
    const RopeParams rp{.style = c.rope_neox ? RopeStyle::kNeox : RopeStyle::kNormal,
                        .n_rot = c.n_rot,
                        .freq_base = c.rope_freq_base,
                        .freq_scale = c.rope_freq_scale};
    std::vector<float> all = q;
    rope(all.data(), pos.data(), n_rows, c.n_heads, c.head_dim, rp);
    for (int64_t r = 0; r < n_rows; r += 9) {
      std::vector<float> one(q.begin() + r * qd, q.begin() + (r + 1) * qd);
      rope(one.data(), &pos[r], 1, c.n_heads, c.head_dim, rp);
      rep.add("rope", "token of a 64-token call", one.data(), all.data() + r * qd, qd);
    }
  }

  // Matmuls: every weight of layer 0 and the output projection, row alone
  // (m = 1) vs the same row at several positions of m-row calls.
  struct Named {
    const char* name;
    const WeightView* w;
    const std::vector<float>* in;
  };
  std::vector<float> out_in(h.size());
  rms_norm(x.data(), e->model().output_norm(), n_rows, d, c.norm_eps, out_in.data());
  const Named mats[] = {
      {"matmul wq", &w.wq, &h},           {"matmul wk", &w.wk, &h},
      {"matmul wv", &w.wv, &h},           {"matmul wo", &w.wo, &h},
      {"matmul w_gate", &w.w_gate, &h},   {"matmul w_up", &w.w_up, &h},
      {"matmul w_down", &w.w_down, &act}, {"matmul output", &e->model().output(), &out_in}};
  for (const Named& mt : mats) {
    const WeightView& wv = *mt.w;
    ASSERT_EQ(wv.n_in * n_rows, static_cast<int64_t>(mt.in->size())) << mt.name;
    const std::string ctx_base = std::string(ggml_type_name(wv.type)) + " " +
                                 std::to_string(wv.n_out) + "x" + std::to_string(wv.n_in);
    const int64_t kTargets[] = {0, 13};
    for (int64_t target : kTargets) {
      std::vector<float> one(static_cast<size_t>(wv.n_out));
      matmul(wv, mt.in->data() + target * wv.n_in, 1, one.data(), tp);
      for (int64_t m : kSizes) {
        for (int64_t at : {int64_t{0}, m / 2, m - 1}) {
          const auto in = rows_of(m, at, target, *mt.in, wv.n_in);
          std::vector<float> y(static_cast<size_t>(m * wv.n_out));
          matmul(wv, in.data(), m, y.data(), tp);
          rep.add(mt.name, ctx_base + ", m=1 vs m in {2,3,8,17,64}", one.data(),
                  y.data() + at * wv.n_out, wv.n_out);
        }
      }
    }
  }

  // Attention on K/V the model wrote: a target sequence of 300 tokens and
  // others of various lengths, random queries.
  std::string long_text;
  while (long_text.size() < 1400) long_text += std::string(kPrompts[4]) + " " + kPrompts[1] + " ";
  auto target_tokens = tokens_of(*e, long_text);
  target_tokens.resize(300);
  std::vector<BlockTable> tables;
  std::vector<int64_t> lengths = {300, 17, 120, 480, 64, 33, 250, 9};
  for (int64_t len : lengths) {
    tables.push_back(e->new_table());
    std::vector<int32_t> t(target_tokens.begin(), target_tokens.end());
    while (static_cast<int64_t>(t.size()) < len)
      t.insert(t.end(), target_tokens.begin(), target_tokens.end());
    t.resize(static_cast<size_t>(len));
    if (&tables.back() != &tables.front()) std::rotate(t.begin(), t.begin() + 1, t.end());
    ASSERT_TRUE(e->prefill(tables.back(), t, LogitsMode::kNone, nullptr).ok());
  }
  const int64_t qd = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const AttnParams ap{.n_q_heads = c.n_heads,
                      .n_kv_heads = c.n_kv_heads,
                      .head_dim = c.head_dim,
                      .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                      .window = c.window(0)};  // the synthetic model has one window for all layers
  for (int layer : {0, c.n_layers - 1}) {
    const PagedKvLayerView view = e->pool().layer_view(layer);
    // q rows per sequence: up to 32 chunk rows, the last is the decode query.
    std::vector<std::vector<float>> qs;
    for (size_t i = 0; i < tables.size(); ++i) qs.push_back(random_rows(rng, 32 * qd));
    auto entry = [&](size_t i, int32_t n_new, float* out) {
      const auto len = static_cast<int32_t>(tables[i].length());
      return AttnSeq{.block_table = tables[i].data(),
                     .n_blocks = static_cast<int32_t>(tables[i].n_blocks()),
                     .n_past = len - n_new,
                     .n_new = n_new,
                     .q = qs[i].data() + (32 - n_new) * qd,
                     .out = out};
    };
    std::vector<float> alone(static_cast<size_t>(qd));
    const AttnSeq a1 = entry(0, 1, alone.data());
    ASSERT_TRUE(paged_attention(view, ap, std::span<const AttnSeq>(&a1, 1), tp).ok());
    const std::string lname = "layer " + std::to_string(layer);
    // Decode beside k other decodes.
    for (size_t k = 1; k < tables.size(); ++k) {
      std::vector<std::vector<float>> outs(k + 1, std::vector<float>(32 * qd));
      std::vector<AttnSeq> seqs;
      for (size_t i = 0; i <= k; ++i) seqs.push_back(entry(i, 1, outs[i].data()));
      std::rotate(seqs.begin(), seqs.begin() + static_cast<long>(k / 2), seqs.end());
      ASSERT_TRUE(paged_attention(view, ap, seqs, tp).ok());
      rep.add("attention decode", lname + ", 1 seq vs beside 1..7 decodes", alone.data(),
              outs[0].data(), qd);
    }
    // Decode beside another sequence's prefill chunk.
    for (int32_t n_other : {2, 8, 32}) {
      std::vector<float> o0(32 * qd), o1(32 * qd);
      const AttnSeq seqs[2] = {entry(3, n_other, o1.data()), entry(0, 1, o0.data())};
      ASSERT_TRUE(paged_attention(view, ap, seqs, tp).ok());
      rep.add("attention decode", lname + ", 1 seq vs beside a prefill chunk", alone.data(),
              o0.data(), qd);
    }
    // The same query row (the last one) inside prefill chunks of any length,
    // alone and beside decodes and other chunks: where a chunk starts must
    // not matter (prefill_chunk_end() after a prefix hit, a server chunk
    // length that differs from `kvstack run --prefill-chunk`).
    std::vector<float> in_chunk2(32 * qd);
    {
      const AttnSeq s2 = entry(0, 2, in_chunk2.data());
      ASSERT_TRUE(paged_attention(view, ap, std::span<const AttnSeq>(&s2, 1), tp).ok());
    }
    for (int32_t n_new : {3, 5, 16, 32}) {
      std::vector<float> o(32 * qd), o_other(32 * qd), o_dec(32 * qd);
      const AttnSeq s1 = entry(0, n_new, o.data());
      ASSERT_TRUE(paged_attention(view, ap, std::span<const AttnSeq>(&s1, 1), tp).ok());
      rep.add("attention prefill row", lname + ", last row of n_new=2 vs 3..32",
              in_chunk2.data() + qd, o.data() + (n_new - 1) * qd, qd);
      const AttnSeq mixed[3] = {entry(3, 7, o_other.data()), entry(0, n_new, o.data()),
                                entry(5, 1, o_dec.data())};
      ASSERT_TRUE(paged_attention(view, ap, mixed, tp).ok());
      rep.add("attention prefill row", lname + ", n_new=2 alone vs beside chunk+decode",
              in_chunk2.data() + qd, o.data() + (n_new - 1) * qd, qd);
    }
    // The same row in the other kernel path: reported, not required.
    for (int32_t n_new : {2, 5, 16, 32}) {
      std::vector<float> o(32 * qd);
      const AttnSeq s1 = entry(0, n_new, o.data());
      ASSERT_TRUE(paged_attention(view, ap, std::span<const AttnSeq>(&s1, 1), tp).ok());
      rep.add("path: attention", lname + ", decode vs last row of n_new=2..32", alone.data(),
              o.data() + (n_new - 1) * qd, qd);
    }
  }
  tables.clear();

  rep.print("Batch invariance, op by op (bit-exact comparison with the row alone)");
  for (const char* op : {"rms_norm", "rope", "swiglu", "add"}) {
    EXPECT_EQ(rep.n_differ(op), 0) << op << " must be row-local";
  }
  if (require_batch_invariance()) {
    EXPECT_EQ(rep.n_differ("matmul"), 0);
    EXPECT_EQ(rep.n_differ("attention"), 0);
    EXPECT_EQ(rep.n_differ_required(), 0);
  }
  // The two attention paths differ by rounding only (measured ~1e-6).
  for (const auto& r : rep.rows) EXPECT_LT(r.max_abs, 1e-4) << r.op << " " << r.context;
  expect_pool_idle(*e);
}

// End to end through Forward::step: the target sequence's logits alone vs in
// the batch shapes the scheduler builds.
TEST(BatchInvariance, ForwardLogitsAloneVsBatched) {
  auto e = make_engine(4096);
  REQUIRE_ENGINE(e);
  const int64_t n_vocab = e->model().config().n_vocab;
  Forward& fwd = e->forward();
  const auto prompt = tokens_of(*e, kPrompts[1]);
  const int32_t next = prompt[3];  // any token: the decode input
  std::vector<std::vector<int32_t>> others;
  for (int i : {0, 2, 4, 5}) others.push_back(tokens_of(*e, kPrompts[i]));
  InvarianceReport rep;

  // Reference: the prompt prefilled in one chunk, then one decode, alone.
  auto lone = [&](std::vector<float>* prefill_logits, std::vector<float>* decode_logits) {
    BlockTable t = e->new_table();
    const StepSeq p{.table = &t, .tokens = prompt, .logits = LogitsMode::kLast};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&p, 1), prefill_logits).ok());
    const StepSeq q{.table = &t, .tokens = std::span<const int32_t>(&next, 1)};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&q, 1), decode_logits).ok());
  };
  std::vector<float> ref_prefill, ref_decode;
  lone(&ref_prefill, &ref_decode);

  // Decode beside k other decodes (others prefilled first), target at every slot.
  for (size_t k = 1; k <= others.size(); ++k) {
    for (size_t at = 0; at <= k; at += k) {
      BlockTable t = e->new_table();
      std::vector<BlockTable> ot;
      for (size_t i = 0; i < k; ++i) ot.push_back(e->new_table());
      std::vector<float> lg;
      const StepSeq p{.table = &t, .tokens = prompt, .logits = LogitsMode::kLast};
      ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&p, 1), &lg).ok());
      for (size_t i = 0; i < k; ++i) {
        const StepSeq o{.table = &ot[i], .tokens = others[i], .logits = LogitsMode::kNone};
        ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&o, 1), nullptr).ok());
      }
      std::vector<StepSeq> batch;
      for (size_t i = 0; i < k; ++i) {
        batch.push_back({.table = &ot[i], .tokens = std::span<const int32_t>(&others[i][0], 1)});
      }
      batch.insert(batch.begin() + static_cast<long>(at),
                   StepSeq{.table = &t, .tokens = std::span<const int32_t>(&next, 1)});
      ASSERT_TRUE(fwd.step(batch, &lg).ok());
      rep.add("decode logits", "alone vs beside 1..4 decodes", ref_decode.data(),
              lg.data() + at * n_vocab, n_vocab);
    }
  }
  // Decode beside another sequence's prefill chunk (chunked prefill).
  for (size_t i = 0; i < others.size(); ++i) {
    BlockTable t = e->new_table(), o = e->new_table();
    std::vector<float> lg;
    const StepSeq p{.table = &t, .tokens = prompt, .logits = LogitsMode::kLast};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&p, 1), &lg).ok());
    const StepSeq batch[2] = {{.table = &t, .tokens = std::span<const int32_t>(&next, 1)},
                              {.table = &o, .tokens = others[i], .logits = LogitsMode::kNone}};
    ASSERT_TRUE(fwd.step(batch, &lg).ok());
    rep.add("decode logits", "alone vs beside a prefill chunk", ref_decode.data(), lg.data(),
            n_vocab);
  }
  // The prompt prefilled beside other prompts in the same step.
  for (size_t i = 0; i < others.size(); ++i) {
    BlockTable t = e->new_table(), o = e->new_table();
    std::vector<float> lg;
    const StepSeq batch[2] = {{.table = &o, .tokens = others[i], .logits = LogitsMode::kLast},
                              {.table = &t, .tokens = prompt, .logits = LogitsMode::kLast}};
    ASSERT_TRUE(fwd.step(batch, &lg).ok());
    rep.add("prefill logits", "alone vs beside another prompt", ref_prefill.data(),
            lg.data() + n_vocab, n_vocab);
  }
  // The prompt in chunks instead of one piece: cut by prefill_chunk_end()
  // (required: a row inside any chunk of >= 2 tokens), and as one-token
  // entries (the decode path: reported only).
  auto chunked = [&](const std::vector<int32_t>& toks, int64_t chunk, std::vector<float>* lg) {
    BlockTable t = e->new_table();
    const auto n = static_cast<int64_t>(toks.size());
    for (int64_t b = 0, end = 0; b < n; b = end) {
      end = chunk == 1 ? b + 1 : prefill_chunk_end(b, n, chunk);
      const StepSeq p{.table = &t,
                      .tokens = std::span<const int32_t>(toks.data() + b, end - b),
                      .logits = end == n ? LogitsMode::kLast : LogitsMode::kNone};
      ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&p, 1), lg).ok());
    }
  };
  for (int64_t chunk : {2, 3, 5, 8}) {
    std::vector<float> lg;
    chunked(prompt, chunk, &lg);
    rep.add("prefill logits", "one piece vs prefill_chunk_end, L=" + std::to_string(chunk),
            ref_prefill.data(), lg.data(), n_vocab);
  }
  {
    std::vector<float> lg;
    chunked(prompt, 1, &lg);
    rep.add("path: prefill logits", "one piece vs one-token entries", ref_prefill.data(), lg.data(),
            n_vocab);
  }
  // A long prompt cut at other positions (L = 241 vs one piece): the rows
  // past 241 see a different n_past, and the attention kernel's prefill
  // result for a row depends on it at this length (measured: logits differ
  // by up to ~0.4; not at the short lengths above). Reported only: this is
  // why Engine::prefill and the scheduler must cut at the same positions
  // (a server's L = max_batch_tokens - max_seqs + 1 matches `kvstack run
  // --prefill-chunk L`).
  {
    std::string text;
    while (text.size() < 1500) text += std::string(kLongPrompt) + " " + kPrompts[1] + " ";
    auto long_prompt = tokens_of(*e, text);
    long_prompt.resize(300);
    std::vector<float> one, split;
    chunked(long_prompt, 512, &one);
    chunked(long_prompt, 241, &split);
    rep.add("path: prefill logits", "300 tokens, L=512 vs L=241", one.data(), split.data(),
            n_vocab);
  }
  rep.print("Batch invariance through Forward::step (bit-exact logits of one sequence)");
  if (require_batch_invariance()) {
    EXPECT_EQ(rep.n_differ_required(), 0);
  }
  // Whatever the kernels do, the results must stay close (rounding
  // differences compound over 30 layers; a wrong position or a K/V mix-up
  // between sequences moves logits by several units).
  for (const auto& r : rep.rows) EXPECT_LT(r.max_abs, 1.0) << r.op << " " << r.context;
  expect_pool_idle(*e);
}

// The batched decode path (one weight pass over every decode row, tiled
// matmuls for m >= 4, attention work items over all sequences): a decode
// row's logits are bit-identical alone and in steps of 1..32 decode rows,
// with and without a prefill chunk in the same step, at the first, middle
// and last entry. The other sequences have different lengths (9..~120
// tokens), so the step's matmuls see every row count from 1 to 32 + chunk.
TEST(BatchInvariance, BatchedDecodeOf1To32WithMixedPrefill) {
  auto e = make_engine(16384);
  REQUIRE_ENGINE(e);
  const int64_t n_vocab = e->model().config().n_vocab;
  Forward& fwd = e->forward();
  std::string text;
  while (text.size() < 800) text += std::string(kLongPrompt) + " " + kPrompts[1] + " ";
  const auto long_tokens = tokens_of(*e, text);
  ASSERT_GE(long_tokens.size(), 160u);
  const std::vector<int32_t> prompt(long_tokens.begin(), long_tokens.begin() + 150);
  const int32_t next = prompt[5];

  // The target's context and 31 others, prefilled once; each trial decodes
  // forks of them (copy-on-append of the shared tail), so every trial starts
  // from the same state.
  InvarianceReport rep;
  int64_t n_trials = 0;
  {
    BlockTable target = e->new_table();
    ASSERT_TRUE(e->prefill(target, prompt, LogitsMode::kNone, nullptr).ok());
    constexpr int kMaxBatch = 32;
    std::vector<BlockTable> others;
    std::vector<int32_t> other_next;
    for (int i = 0; i < kMaxBatch - 1; ++i) {
      const size_t len = 9 + static_cast<size_t>(i * 37 % 113);
      std::vector<int32_t> t(long_tokens.begin() + 1 + i, long_tokens.begin() + 1 + i + len);
      others.push_back(e->new_table());
      ASSERT_TRUE(e->prefill(others.back(), t, LogitsMode::kNone, nullptr).ok());
      other_next.push_back(t[0]);
    }
    std::vector<float> ref;
    {
      BlockTable t = target.fork();
      const StepSeq q{.table = &t, .tokens = std::span<const int32_t>(&next, 1)};
      ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&q, 1), &ref).ok());
    }

    for (int n_dec = 1; n_dec <= kMaxBatch; ++n_dec) {
      // 0: decodes only; else a fresh prompt's chunk of that many tokens.
      for (int chunk : {0, 7, 33}) {
        if (chunk == 33 && n_dec % 4 != 1) continue;  // keep the test short
        for (int at : {0, (n_dec - 1) / 2, n_dec - 1}) {
          if (at != 0 && at == (n_dec - 1) / 2 && n_dec < 3) continue;  // same slot twice
          BlockTable t = target.fork();
          std::vector<BlockTable> ot;
          for (int i = 0; i + 1 < n_dec; ++i) ot.push_back(others[static_cast<size_t>(i)].fork());
          BlockTable fresh = e->new_table();
          std::vector<StepSeq> batch;
          for (int i = 0; i + 1 < n_dec; ++i) {
            batch.push_back({.table = &ot[static_cast<size_t>(i)],
                             .tokens = std::span<const int32_t>(&other_next[i], 1)});
          }
          batch.insert(batch.begin() + at,
                       StepSeq{.table = &t, .tokens = std::span<const int32_t>(&next, 1)});
          if (chunk > 0) {
            batch.insert(batch.begin() + (n_dec + at) % (n_dec + 1),
                         StepSeq{.table = &fresh,
                                 .tokens = std::span<const int32_t>(long_tokens.data() + 3,
                                                                    static_cast<size_t>(chunk)),
                                 .logits = LogitsMode::kNone});
          }
          // The target's logits row: one row per entry before it with kLast.
          int64_t row = 0;
          for (const StepSeq& b : batch) {
            if (b.table == &t) break;
            if (b.logits == LogitsMode::kLast) ++row;
          }
          std::vector<float> lg;
          ASSERT_TRUE(fwd.step(batch, &lg).ok());
          rep.add("decode logits",
                  chunk == 0 ? "alone vs among 1..32 decodes"
                             : "alone vs among 1..32 decodes + a prefill chunk",
                  ref.data(), lg.data() + row * n_vocab, n_vocab);
          ++n_trials;
        }
      }
    }
  }  // every table released
  rep.print("Batch invariance of batched decode (bit-exact logits, 1..32 decode rows)");
  EXPECT_GT(n_trials, 90);
  if (require_batch_invariance()) {
    EXPECT_EQ(rep.n_differ_required(), 0);
  }
  for (const auto& r : rep.rows) EXPECT_LT(r.max_abs, 1.0) << r.op << " " << r.context;
  expect_pool_idle(*e);
}

// Quantized K/V rows of a step with 4 or more entries are written on the
// pool (Forward::layer): the rows a batch wrote must be the rows each
// sequence writes alone. 8 sequences decode 3 steps together and alone
// (forks of the same prefilled contexts); steps 2 and 3 read the K/V the
// earlier steps wrote, so every logits row bit-identical to the lone run
// shows the parallel writes stored what the serial ones store.
// The second pass adds the CLI's defaults for these formats (--kv-rotate and
// --kv-center), whose per-row work runs on the pool for 4 or more rows.
TEST(BatchInvariance, QuantizedKvWrittenOnThePoolMatchesAlone) {
  for (int variant = 0; variant < 4; ++variant) {
    const KvDtype dt = variant % 2 == 0 ? KvDtype::kInt8 : KvDtype::kInt4;
    const bool rotate_center = variant >= 2;
    SCOPED_TRACE(std::string(kv_dtype_name(dt)) + (rotate_center ? " rotated, centred" : ""));
    const std::string path = default_model_path();
    if (path.empty() || !std::filesystem::exists(path)) GTEST_SKIP() << "default model not found";
    EngineConfig c;
    c.model_path = path;
    c.n_threads = 2;
    c.block_size = 16;
    c.kv_cache_tokens = 4096;
    c.kv_dtype = dt;
    if (rotate_center) {
      c.kv_rotation = KvRotation::kHadamard;
      c.kv_center = true;
    }
    auto created = Engine::create(c);
    ASSERT_TRUE(created.ok()) << created.error().message;
    Engine& e = **created;
    const int64_t n_vocab = e.model().config().n_vocab;
    std::string text;
    while (text.size() < 600) text += std::string(kLongPrompt) + " ";
    const auto toks = tokens_of(e, text);
    constexpr int kSeqs = 8, kSteps = 3;
    std::vector<BlockTable> base;
    for (int i = 0; i < kSeqs; ++i) {
      const std::vector<int32_t> p(toks.begin() + i, toks.begin() + i + 20 + 9 * i);
      base.push_back(e.new_table());
      ASSERT_TRUE(e.prefill(base.back(), p, LogitsMode::kNone, nullptr).ok());
    }
    auto decode = [&](const std::vector<int>& who, std::vector<std::vector<float>>* out) {
      std::vector<BlockTable> t;
      t.reserve(who.size());
      for (int i : who) t.push_back(base[static_cast<size_t>(i)].fork());
      std::vector<int32_t> next(who.size());
      for (size_t j = 0; j < who.size(); ++j) next[j] = toks[static_cast<size_t>(who[j]) + 1];
      for (int s = 0; s < kSteps; ++s) {
        std::vector<StepSeq> batch;
        batch.reserve(who.size());
        for (size_t j = 0; j < who.size(); ++j) {
          batch.push_back({.table = &t[j], .tokens = std::span<const int32_t>(&next[j], 1)});
        }
        std::vector<float> lg;
        ASSERT_TRUE(e.forward().step(batch, &lg).ok());
        for (size_t j = 0; j < who.size(); ++j) {
          out->emplace_back(lg.begin() + static_cast<int64_t>(j) * n_vocab,
                            lg.begin() + static_cast<int64_t>(j + 1) * n_vocab);
          next[j] = toks[static_cast<size_t>(who[j]) + 2 + static_cast<size_t>(s)];
        }
      }
    };
    std::vector<int> all(kSeqs);
    for (int i = 0; i < kSeqs; ++i) all[static_cast<size_t>(i)] = i;
    std::vector<std::vector<float>> together;  // [step][seq]
    decode(all, &together);
    for (int i = 0; i < kSeqs; ++i) {
      std::vector<std::vector<float>> alone;  // [step]
      decode({i}, &alone);
      for (int s = 0; s < kSteps; ++s) {
        const auto& a = alone[static_cast<size_t>(s)];
        const auto& b = together[(static_cast<size_t>(s) * kSeqs) + static_cast<size_t>(i)];
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << kv_dtype_name(dt) << " sequence " << i << " step " << s;
      }
    }
  }
}

}  // namespace
}  // namespace kvstack

// Admission under retention policies (scheduler.h, kv/retention.h): the
// scheduler reserves what a policy keeps after compaction, so a pool that
// runs two exact sequences at once runs more StreamingLLM, SnapKV,
// PyramidKV and H2O sequences at once, and none of them is ever preempted
// or refused a block (reserve_output_tokens = -1: every reservation covers
// the whole request). Pool invariants are recomputed after every step.
// Needs the default model (MODEL_TESTS).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/scheduler.h"
#include "engine/testing/model_files.h"

namespace kvstack {
namespace {

constexpr int64_t kPrompt = 160;  // prompt tokens per request
constexpr int64_t kGen = 16;      // tokens sampled per request
constexpr int64_t kBlock = 16;
constexpr int kRequests = 6;

// Every layer its own KV group (a deployment default of h2o), prefill
// chunks of 16 tokens, a pool of exactly two exact requests per group.
std::unique_ptr<Engine> make_engine() {
  const std::string path = testing::default_model_path();
  if (path.empty() || !std::filesystem::exists(path)) return nullptr;
  EngineConfig c;
  c.model_path = path;
  c.n_threads = 2;
  c.block_size = kBlock;
  const int64_t per_request = (kPrompt + kGen - 1 + kBlock - 1) / kBlock;  // blocks per group
  c.kv_cache_tokens = 2 * per_request * kBlock;
  c.prefill_chunk = 16;
  c.kv_retention = {.policy = RetentionPolicy::kH2o, .window = 16, .budget = 16};
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.error().message;
  return e.ok() ? std::move(*e) : nullptr;
}

std::vector<int32_t> random_prompt(uint32_t seed, int n_vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(100, n_vocab - 1);
  std::vector<int32_t> p(static_cast<size_t>(kPrompt));
  for (int32_t& t : p) t = tok(rng);
  return p;
}

struct Outcome {
  int64_t max_running = 0;
  int64_t n_preemptions = 0;
  int64_t n_deferred = 0;  // compactions that found no block for copy-on-write
};

// Submits kRequests greedy requests (the last with n = 2 when `fork`), steps
// until all are done, checking the pool after every step; every request
// must finish with kGen tokens per choice.
Outcome run(Engine& e, const RetentionConfig& rc, bool same_prompt, bool fork) {
  SchedulerConfig sc;
  sc.max_seqs = 8;
  sc.max_batch_tokens = 64;
  sc.reserve_output_tokens = -1;
  auto s = Scheduler::create(e, sc);
  EXPECT_TRUE(s.ok());
  if (!s.ok()) return {};
  const int64_t deferred_before = e.pool().stats().retention.n_deferred;
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < kRequests; ++i) {
    SeqRequest r;
    r.prompt =
        random_prompt(same_prompt ? 7 : 11 + static_cast<uint32_t>(i), e.tokenizer().n_vocab());
    r.max_tokens = kGen;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    r.n = fork && i == kRequests - 1 ? 2 : 1;
    r.kv_retention = rc;
    auto h = (*s)->submit(std::move(r));
    EXPECT_TRUE(h.ok()) << h.error().message;
    if (!h.ok()) return {};
    hs.push_back(*h);
  }
  Outcome out;
  std::vector<std::vector<SeqEvent>> events(hs.size());
  for (int it = 0; it < 5000; ++it) {
    (*s)->step();
    e.pool().check_invariants();
    out.max_running = std::max(out.max_running, (*s)->metrics().n_running);
    bool all = true;
    for (size_t i = 0; i < hs.size(); ++i) {
      hs[i]->wait(&events[i], std::chrono::milliseconds(0));
      all = all && hs[i]->done();
    }
    if (all) break;
  }
  for (size_t i = 0; i < hs.size(); ++i) {
    hs[i]->wait(&events[i], std::chrono::milliseconds(0));
    EXPECT_TRUE(hs[i]->done()) << "request " << i << " did not finish";
    std::vector<int64_t> n_tokens(2, 0);
    for (const SeqEvent& ev : events[i]) {
      EXPECT_NE(ev.kind, SeqEvent::Kind::kError) << ev.error.error().message;
      if (ev.kind == SeqEvent::Kind::kToken) n_tokens[static_cast<size_t>(ev.index)]++;
    }
    EXPECT_EQ(n_tokens[0], kGen) << "request " << i;
  }
  out.n_preemptions = (*s)->metrics().n_preemptions;
  out.n_deferred = e.pool().stats().retention.n_deferred - deferred_before;
  EXPECT_EQ((*s)->metrics().n_requests_failed, 0);
  s->reset();
  e.pool().check_invariants();
  EXPECT_EQ(e.pool().stats().n_blocks_used, 0) << "blocks leaked";
  return out;
}

struct Case {
  const char* name;
  RetentionConfig rc;
};

const Case kCases[] = {
    {"streamingllm", {.policy = RetentionPolicy::kStreamingLlm, .sinks = 4, .window = 28}},
    {"snapkv",
     {.policy = RetentionPolicy::kSnapKv, .window = 16, .budget = 16, .gqa = GqaRule::kMean}},
    {"pyramidkv",
     {.policy = RetentionPolicy::kPyramidKv, .window = 16, .budget = 16, .gqa = GqaRule::kMean}},
    {"h2o", {.policy = RetentionPolicy::kH2o, .window = 16, .budget = 16}},
};

TEST(SchedulerRetention, PoliciesAdmitMoreThanExactAndNeverRunOut) {
  auto e = make_engine();
  if (!e) GTEST_SKIP() << "default model not found (set KVSTACK_MODEL)";
  const Outcome exact = run(*e, RetentionConfig{}, false, false);
  EXPECT_LE(exact.max_running, 2) << "the pool holds two exact requests";
  EXPECT_EQ(exact.n_preemptions, 0);
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const Outcome o = run(*e, c.rc, false, false);
    std::printf("%-12s at most %lld running at once (exact: %lld)\n", c.name,
                static_cast<long long>(o.max_running), static_cast<long long>(exact.max_running));
    // Exact admission would refuse a third request; the policy's runs at once.
    EXPECT_GT(o.max_running, exact.max_running);
    EXPECT_GE(o.max_running, 3);
    EXPECT_EQ(o.n_preemptions, 0) << "an admitted sequence ran out of blocks";
    EXPECT_EQ(o.n_deferred, 0);
  }
}

// The same prompt for every request: later ones adopt the earlier ones'
// published blocks (prefix hits), so compaction copies blocks other tables
// hold; one request forks (n = 2) after its prompt. Admission covers those
// copies too.
TEST(SchedulerRetention, SharedPrefixAndForksNeverRunOut) {
  auto e = make_engine();
  if (!e) GTEST_SKIP() << "default model not found (set KVSTACK_MODEL)";
  for (const Case& c : {kCases[1], kCases[3]}) {
    SCOPED_TRACE(c.name);
    const Outcome o = run(*e, c.rc, true, true);
    EXPECT_GE(o.max_running, 3);
    EXPECT_EQ(o.n_preemptions, 0) << "an admitted sequence ran out of blocks";
    EXPECT_EQ(o.n_deferred, 0);
  }
}

// A request longer than the whole pool (prompt + max_tokens > the pool's
// tokens per group) is refused under the exact cache, named with its block
// count, but admitted under a policy that keeps less: StreamingLLM and H2O
// generate past the pool's size, never preempted, every block back at the
// end.
TEST(SchedulerRetention, PolicyRequestLongerThanThePoolRuns) {
  auto e = make_engine();
  if (!e) GTEST_SKIP() << "default model not found (set KVSTACK_MODEL)";
  const int64_t pool_tokens = e->pool().n_blocks() / e->pool().n_groups() * kBlock;
  const int64_t gen = pool_tokens + 64 - kPrompt;  // the sequence ends 64 tokens past the pool
  SchedulerConfig sc;
  sc.reserve_output_tokens = -1;
  auto s = Scheduler::create(*e, sc);
  ASSERT_TRUE(s.ok());
  auto request = [&](const RetentionConfig& rc) {
    SeqRequest r;
    r.prompt = random_prompt(5, e->tokenizer().n_vocab());
    r.max_tokens = gen;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    r.kv_retention = rc;
    return r;
  };
  auto refused = (*s)->submit(request(RetentionConfig{}));
  ASSERT_FALSE(refused.ok()) << "the exact cache cannot hold " << kPrompt + gen << " tokens";
  EXPECT_EQ(refused.error().code, Errc::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("KV blocks but the pool has"), std::string::npos)
      << refused.error().message;
  for (const Case& c : {kCases[0], kCases[3]}) {
    SCOPED_TRACE(c.name);
    auto h = (*s)->submit(request(c.rc));
    ASSERT_TRUE(h.ok()) << h.error().message;
    std::vector<SeqEvent> events;
    for (int it = 0; it < 20000 && !(*h)->done(); ++it) {
      (*s)->step();
      e->pool().check_invariants();
      (*h)->wait(&events, std::chrono::milliseconds(0));
    }
    (*h)->wait(&events, std::chrono::milliseconds(0));
    ASSERT_TRUE((*h)->done());
    int64_t n_tokens = 0;
    for (const SeqEvent& ev : events) {
      ASSERT_NE(ev.kind, SeqEvent::Kind::kError) << ev.error.error().message;
      if (ev.kind == SeqEvent::Kind::kToken) n_tokens++;
    }
    EXPECT_EQ(n_tokens, gen);
    EXPECT_EQ((*s)->metrics().n_preemptions, 0);
  }
  s->reset();
  e->pool().check_invariants();
  EXPECT_EQ(e->pool().stats().n_blocks_used, 0) << "blocks leaked";
}

}  // namespace
}  // namespace kvstack

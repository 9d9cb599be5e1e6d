// PdAgent end to end inside one process: two engines (a prefill and a decode
// worker), each with its scheduler thread, UCX over TCP on loopback. A pull
// publishes the offered prefix so that the decode side's request hits it and
// generates what the prefill side generates; a block corrupted after the
// offer, and an offer of another model, are errors that leave no block held.
#include "server/pd_agent.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

namespace kvstack::server {
namespace {

using json = nlohmann::json;

struct Worker {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Scheduler> sched;
  std::unique_ptr<PdAgent> agent;
  std::thread thread;
  ~Worker() {
    if (agent) agent->stop();
    if (sched) sched->shutdown(false);
    if (thread.joinable()) thread.join();
    agent.reset();
  }
};

std::unique_ptr<Worker> make_worker(PdRole role) {
  const char* path = std::getenv("KVSTACK_MODEL");
  if (path == nullptr || !std::filesystem::exists(path)) return nullptr;
  setenv("UCX_TLS", "tcp", 0);
  auto w = std::make_unique<Worker>();
  EngineConfig c;
  c.model_path = path;
  c.n_threads = 1;
  c.kv_cache_tokens = 1024;
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.error().message;
  if (!e.ok()) return nullptr;
  w->engine = std::move(*e);
  SchedulerConfig sc;
  auto s = Scheduler::create(*w->engine, sc);
  EXPECT_TRUE(s.ok());
  w->sched = std::move(*s);
  PdConfig pc;
  pc.role = role;
  pc.transfer_host = "127.0.0.1";
  pc.lease_timeout = std::chrono::milliseconds(5000);
  pc.transfer_timeout = std::chrono::milliseconds(3000);
  auto a = PdAgent::create(*w->engine, pc);
  EXPECT_TRUE(a.ok()) << a.error().message;
  if (!a.ok()) return nullptr;
  w->agent = std::move(*a);
  w->thread = std::thread([s = w->sched.get()] { s->run(); });
  w->agent->start(*w->sched);
  return w;
}

// Greedy tokens of `prompt` (max_tokens n) and the request's usage.
std::pair<std::vector<int32_t>, RequestUsage> generate(Scheduler& s,
                                                       const std::vector<int32_t>& prompt,
                                                       int64_t n) {
  SeqRequest q;
  q.prompt = prompt;
  q.max_tokens = n;
  q.sampling.temperature = 0;
  q.ignore_eos = true;
  auto h = s.submit(q);
  EXPECT_TRUE(h.ok());
  std::vector<int32_t> out;
  RequestUsage usage;
  bool done = false;
  while (!done) {
    std::vector<SeqEvent> evs;
    (*h)->wait(&evs, std::chrono::milliseconds(100));
    for (const SeqEvent& ev : evs) {
      if (ev.kind == SeqEvent::Kind::kToken) out.push_back(ev.token);
      EXPECT_NE(ev.kind, SeqEvent::Kind::kError) << ev.error.error().message;
      if (ev.request_done) {
        done = true;
        usage = ev.usage;
      }
    }
  }
  return {out, usage};
}

int64_t blocks_used(Worker& w) {
  int64_t n = -1;
  EXPECT_TRUE(w.sched->inspect([&](Engine& e) { n = e.pool().stats().n_blocks_used; }).ok());
  return n;
}

std::vector<int32_t> prompt_of(Worker& w, const std::string& text) {
  return w.engine->tokenizer().tokenize(text, {.add_special = true, .parse_special = true});
}

TEST(PdAgent, PullPublishesThePrefixAndCorruptionOrMismatchIsAnError) {
  auto pre = make_worker(PdRole::kPrefill);
  if (!pre) GTEST_SKIP() << "default model not found (set KVSTACK_MODEL)";
  auto dec = make_worker(PdRole::kDecode);
  ASSERT_TRUE(dec);
  const std::vector<int32_t> prompt =
      prompt_of(*pre,
                "The history of the Roman Empire began when Augustus became the first emperor, and "
                "over the following centuries the empire grew to cover the lands around the sea, "
                "from the rivers of the north to the deserts of the south and the east.");
  ASSERT_GT(prompt.size(), 33u);  // at least two full blocks to move
  const int64_t n_expect = (static_cast<int64_t>(prompt.size()) - 1) / 16 * 16;

  // Prefill: run it (publishes), then offer.
  (void)generate(*pre->sched, prompt, 1);
  auto offer = pre->agent->offer(*pre->sched, prompt, "");
  ASSERT_TRUE(offer.ok()) << offer.error().message;
  ASSERT_TRUE((*offer)["do_remote_prefill"].get<bool>());
  EXPECT_EQ((*offer)["n_tokens"].get<int64_t>(), n_expect);
  EXPECT_EQ(pre->agent->stats().leases.n_open, 1);
  EXPECT_EQ(blocks_used(*pre), n_expect / 16);  // pinned by the lease

  // Decode: pull, then the request hits the pulled blocks.
  {
    auto pin = dec->agent->pull(*dec->sched, *offer, prompt, "");
    ASSERT_TRUE(pin.ok()) << pin.error().message;
    EXPECT_EQ((*pin)->n_tokens(), n_expect);
  }
  auto [got, usage] = generate(*dec->sched, prompt, 8);
  EXPECT_EQ(usage.cached_tokens, n_expect);
  auto [want, usage_pre] = generate(*pre->sched, prompt, 8);
  EXPECT_EQ(got, want);
  const PdStats ds = dec->agent->stats();
  EXPECT_EQ(ds.n_pulls_ok, 1);
  EXPECT_EQ(ds.n_blocks_pulled, n_expect / 16);
  EXPECT_EQ(ds.n_bytes_pulled, n_expect / 16 * dec->engine->pool().block_bytes());
  for (int i = 0; i < 100 && pre->agent->stats().leases.n_pending_release > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pre->agent->stats().leases.n_completed, 1);
  EXPECT_EQ(blocks_used(*pre), 0);
  EXPECT_EQ(blocks_used(*dec), 0);

  // A block changed after the offer (its record's payload checksum no longer
  // holds): the pull fails and frees what it reserved.
  const std::vector<int32_t> p2 = prompt_of(
      *pre,
      "A second prompt about rivers, stones and clouds, long enough to fill two blocks of "
      "sixteen tokens each before its last token.");
  (void)generate(*pre->sched, p2, 1);
  auto offer2 = pre->agent->offer(*pre->sched, p2, "");
  ASSERT_TRUE(offer2.ok());
  const int32_t victim = (*offer2)["remote_block_ids"][0].get<int32_t>();
  ASSERT_TRUE(
      pre->sched->inspect([&](Engine& e) { e.pool().block_data(BlockId{victim})[100] ^= 0x40; })
          .ok());
  auto bad = dec->agent->pull(*dec->sched, *offer2, p2, "");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Errc::kCorruptFile);
  EXPECT_NE(bad.error().message.find("payload"), std::string::npos) << bad.error().message;
  EXPECT_EQ(blocks_used(*dec), 0);
  EXPECT_EQ(dec->agent->stats().n_pulls_failed, 1);

  // An offer of another model: refused before any read, the lease ended.
  const std::vector<int32_t> p3 = prompt_of(*pre, "Third prompt: " + std::string(200, 'x'));
  (void)generate(*pre->sched, p3, 1);
  auto offer3 = pre->agent->offer(*pre->sched, p3, "");
  ASSERT_TRUE(offer3.ok());
  json other = *offer3;
  other["model_digest"] = std::string(32, '0');
  auto mism = dec->agent->pull(*dec->sched, other, p3, "");
  ASSERT_FALSE(mism.ok());
  EXPECT_EQ(mism.error().code, Errc::kInvalidArgument);
  EXPECT_NE(mism.error().message.find("model digest"), std::string::npos);
  EXPECT_EQ(dec->agent->stats().n_layout_mismatches, 1);
  for (int i = 0; i < 200 && (pre->agent->stats().leases.n_open > 0 ||
                              pre->agent->stats().leases.n_pending_release > 0);
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pre->agent->stats().leases.n_open, 0);
  EXPECT_EQ(pre->agent->stats().leases.n_cancelled, 2);
  EXPECT_EQ(blocks_used(*pre), 0);
  EXPECT_EQ(blocks_used(*dec), 0);
}

}  // namespace
}  // namespace kvstack::server

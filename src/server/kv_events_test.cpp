// KvEventPublisher without a subscriber: push() never waits for the
// publisher thread, a full queue drops (and counts) instead, and every
// pushed event is either published or counted as dropped.
#include "server/kv_events.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace kvstack::server {
namespace {

KvEvent stored(uint64_t i, const int32_t* tokens) {
  KvEvent e;
  e.kind = KvEvent::Kind::kStored;
  e.hash = {i + 1, 0};
  e.n_tokens = 16;
  e.ns = 0;
  e.tokens = tokens;
  return e;
}

TEST(KvEventPublisher, FullQueueDropsAndCountsWithoutBlocking) {
  KvEventPublisherConfig c;
  c.endpoint = "tcp://127.0.0.1:*";
  c.queue_capacity = 8;
  auto p = KvEventPublisher::create(c);
  ASSERT_TRUE(p.ok()) << p.error().message;
  const std::vector<int32_t> tokens(16, 7);
  constexpr int kN = 5000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kN; ++i) (*p)->push(stored(i, tokens.data()), Hash128{1, 2});
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  // A push is a copy under a mutex: far below the 20 ms the thread sleeps.
  EXPECT_LT(us / kN, 200.0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  KvEventPublisherStats s;
  do {
    s = (*p)->stats();
    if (s.n_events + s.n_dropped == kN) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } while (std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(s.n_events + s.n_dropped, kN);
  EXPECT_GT(s.n_dropped, 0);  // 8 slots cannot hold 5000 events pushed at once
  EXPECT_GT(s.n_batches, 0);
  EXPECT_LE(s.n_events, s.n_batches * c.queue_capacity);
}

TEST(KvEventPublisher, BadEndpointIsAnErrorNamingIt) {
  KvEventPublisherConfig c;
  c.endpoint = "tcp://no-such-interface-x:1";
  auto p = KvEventPublisher::create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message.find("tcp://no-such-interface-x:1"), std::string::npos);
}

}  // namespace
}  // namespace kvstack::server

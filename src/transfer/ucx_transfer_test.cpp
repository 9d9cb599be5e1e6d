// TransferServer + PullSession in one process over UCX (the transports
// UCX_TLS allows; the test forces tcp unless UCX_TLS is set): exact bytes,
// lease completion, refusals, expiry during a pull and a vanished server
// all end in an error or a completed lease, never a hang.
#include "transfer/ucx_transfer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>

namespace kvstack::transfer {
namespace {

using std::chrono::milliseconds;

class UcxTransfer : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "tcp", 1);
    auto u = UcxContext::create();
    ASSERT_TRUE(u.ok()) << u.error().message;
    ucx = std::move(*u);
    pool.resize(kBlocks * kBlockBytes);
    for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 131 + 7);
    TransferServerConfig c;
    c.host = "127.0.0.1";
    c.io_timeout = milliseconds(3000);
    auto s = TransferServer::create(*ucx, leases, pool.data(), pool.size(), c);
    ASSERT_TRUE(s.ok()) << s.error().message;
    server = std::move(*s);
  }

  // A lease over blocks `ids` of the fake pool.
  uint64_t lease(const std::vector<int32_t>& ids, milliseconds timeout = milliseconds(5000)) {
    Lease l;
    for (int32_t b : ids) {
      l.block_ids.push_back(b);
      l.addrs.push_back(
          reinterpret_cast<uint64_t>(pool.data() + static_cast<size_t>(b) * kBlockBytes));
    }
    l.block_bytes = kBlockBytes;
    l.header_bytes = 16;
    l.headers.resize(ids.size() * 16);
    std::iota(l.headers.begin(), l.headers.end(), uint8_t{1});
    l.n_tokens = static_cast<int64_t>(ids.size()) * 16;
    return leases.add(std::move(l), timeout);
  }

  static constexpr size_t kBlocks = 64;
  static constexpr int64_t kBlockBytes = 8192;
  std::vector<uint8_t> pool;
  LeaseTable leases;
  std::unique_ptr<UcxContext> ucx;
  std::unique_ptr<TransferServer> server;
};

TEST_F(UcxTransfer, PullsExactBytesAndCompletesTheLease) {
  const std::vector<int32_t> ids = {3, 4, 5, 9, 1, 2};  // runs are coalesced
  const uint64_t id = lease(ids);
  auto s = PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000));
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_EQ((*s)->offer().n_blocks, 6);
  EXPECT_EQ((*s)->offer().headers.size(), 6u * 16);
  EXPECT_EQ((*s)->offer().headers[0], 1);
  std::vector<uint8_t> local(ids.size() * kBlockBytes, 0);
  std::vector<uint8_t*> dst;
  for (size_t i = 0; i < ids.size(); ++i) dst.push_back(local.data() + i * kBlockBytes);
  ASSERT_TRUE((*s)->read(dst, milliseconds(3000)).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(dst[i], pool.data() + ids[i] * kBlockBytes, kBlockBytes)) << i;
  }
  EXPECT_EQ((*s)->timings().n_gets, 3);  // {3,4,5} {9} {1,2}
  EXPECT_EQ((*s)->timings().n_bytes, 6 * kBlockBytes);
  ASSERT_TRUE((*s)->finish(true).ok());
  s->reset();
  for (int i = 0; i < 200 && leases.is_open(id); ++i) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_FALSE(leases.is_open(id));
  EXPECT_EQ(leases.stats().n_completed, 1);
  EXPECT_EQ(server->stats().n_pulls_ok, 1);
  EXPECT_EQ(server->stats().n_bytes_offered, 6 * kBlockBytes);
  // Pulled once: a second pull of the id is refused.
  auto again = PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().code, Errc::kNotFound);
}

TEST_F(UcxTransfer, LayerMajorReadGivesTheSameBytesAndTimesEachRange) {
  const std::vector<int32_t> ids = {10, 11, 20, 5};
  const uint64_t id = lease(ids);
  auto s = PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000));
  ASSERT_TRUE(s.ok()) << s.error().message;
  // Ranges that do not tile the block are refused.
  EXPECT_EQ((*s)->set_layer_ranges({{0, 4096}}).error().code, Errc::kInvalidArgument);
  EXPECT_FALSE((*s)->set_layer_ranges({{0, 4096}, {4000, 4192}}).ok());
  EXPECT_FALSE((*s)->set_layer_ranges({{0, 8192}, {8192, 64}}).ok());
  EXPECT_FALSE((*s)->set_layer_ranges({{0, 0}, {0, 8192}}).ok());
  // Three "layers" of 1000, 3000 and 4192 bytes.
  ASSERT_TRUE((*s)->set_layer_ranges({{0, 1000}, {1000, 3000}, {4000, 4192}}).ok());
  std::vector<uint8_t> local(ids.size() * kBlockBytes, 0);
  std::vector<uint8_t*> dst;
  for (size_t i = 0; i < ids.size(); ++i) dst.push_back(local.data() + i * kBlockBytes);
  ASSERT_TRUE((*s)->read(dst, milliseconds(3000)).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(dst[i], pool.data() + ids[i] * kBlockBytes, kBlockBytes)) << i;
  }
  EXPECT_EQ((*s)->timings().n_gets, 3 * 4);  // one per block and range
  EXPECT_EQ((*s)->timings().n_bytes, 4 * kBlockBytes);
  ASSERT_EQ((*s)->timings().layer_get_s.size(), 3u);
  for (double t : (*s)->timings().layer_get_s) EXPECT_GT(t, 0.0);
  ASSERT_TRUE((*s)->finish(true).ok());
}

TEST_F(UcxTransfer, PullerKeepsOneEndpointPerPeerAcrossPulls) {
  auto puller = UcxPuller::create(*ucx);
  ASSERT_TRUE(puller.ok()) << puller.error().message;
  for (int round = 0; round < 3; ++round) {
    const std::vector<int32_t> ids = {round, 10 + round};
    const uint64_t id = lease(ids);
    auto s =
        PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000), puller->get());
    ASSERT_TRUE(s.ok()) << s.error().message;
    std::vector<uint8_t> local(2 * kBlockBytes, 0);
    std::vector<uint8_t*> dst = {local.data(), local.data() + kBlockBytes};
    ASSERT_TRUE((*s)->read(dst, milliseconds(3000)).ok());
    for (size_t i = 0; i < 2; ++i) {
      ASSERT_EQ(0, std::memcmp(dst[i], pool.data() + ids[i] * kBlockBytes, kBlockBytes));
    }
    ASSERT_TRUE((*s)->finish(true).ok());
  }
  EXPECT_EQ((*puller)->n_endpoints_created(), 1);
  EXPECT_EQ((*puller)->n_peers(), 1u);
  // Another server (a restarted prefill worker: another worker address).
  server.reset();
  TransferServerConfig c;
  c.host = "127.0.0.1";
  c.io_timeout = milliseconds(3000);
  auto s2 = TransferServer::create(*ucx, leases, pool.data(), pool.size(), c);
  ASSERT_TRUE(s2.ok());
  server = std::move(*s2);
  const uint64_t id = lease({7});
  auto s =
      PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000), puller->get());
  ASSERT_TRUE(s.ok());
  std::vector<uint8_t> local(kBlockBytes, 0);
  std::vector<uint8_t*> dst = {local.data()};
  ASSERT_TRUE((*s)->read(dst, milliseconds(3000)).ok());
  EXPECT_EQ(0, std::memcmp(dst[0], pool.data() + 7 * kBlockBytes, kBlockBytes));
  EXPECT_EQ((*puller)->n_endpoints_created(), 2);
}

TEST_F(UcxTransfer, PullerThatGoesAwayCancelsTheLease) {
  const uint64_t id = lease({0, 1});
  {
    auto s = PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000));
    ASSERT_TRUE(s.ok());
  }  // destroyed without finish(): the connection closes
  for (int i = 0; i < 400 && leases.is_open(id); ++i) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_FALSE(leases.is_open(id));
  EXPECT_EQ(leases.stats().n_cancelled, 1);
}

TEST_F(UcxTransfer, ExpiredLeaseFailsThePull) {
  const uint64_t id = lease({0, 1, 2}, milliseconds(50));
  auto s = PullSession::open(*ucx, "127.0.0.1", server->port(), id, milliseconds(3000));
  ASSERT_TRUE(s.ok());
  std::this_thread::sleep_for(milliseconds(80));
  EXPECT_EQ(leases.expire().size(), 1u);
  // The server drops the connection; DONE cannot count as a completion.
  std::vector<uint8_t> local(3 * kBlockBytes);
  std::vector<uint8_t*> dst = {local.data(), local.data() + kBlockBytes,
                               local.data() + 2 * kBlockBytes};
  (void)(*s)->read(dst, milliseconds(1000));
  (void)(*s)->finish(true);
  EXPECT_EQ(leases.stats().n_expired, 1);
  EXPECT_EQ(leases.stats().n_completed, 0);
}

TEST_F(UcxTransfer, UnreachableServerIsABoundedError) {
  const auto t0 = Clock::now();
  server.reset();  // nobody listens on the port any more
  auto s = PullSession::open(*ucx, "127.0.0.1", 1, 1, milliseconds(500));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, Errc::kIo);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  auto bad = PullSession::open(*ucx, "not-an-address", 1, 1, milliseconds(500));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Errc::kInvalidArgument);
}

}  // namespace
}  // namespace kvstack::transfer

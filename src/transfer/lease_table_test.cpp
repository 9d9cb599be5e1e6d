// LeaseTable: every lease ends exactly once (completed, cancelled or
// expired), pulls are exclusive, and references are dropped only by
// drain_ended() (on the pool owner's thread).
#include "transfer/lease_table.h"

#include <gtest/gtest.h>

#include "kv/layout.h"

namespace kvstack::transfer {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<BlockPool> small_pool() {
  auto layout = KvLayout::uniform(/*n_layers=*/2, /*n_kv_heads=*/1, /*head_dim=*/8, KvDtype::kF16,
                                  /*block_size=*/4);
  KV_CHECK(layout.ok(), "layout");
  BlockPoolConfig pc;
  pc.n_tokens = 64;
  auto pool = BlockPool::create(*layout, pc);
  KV_CHECK(pool.ok(), "pool");
  return std::move(*pool);
}

Lease lease_of(BlockPool& pool, int n) {
  Lease l;
  for (int i = 0; i < n; ++i) {
    auto r = pool.allocate();
    KV_CHECK(r.ok(), "allocate");
    l.block_ids.push_back(r->id().value);
    l.addrs.push_back(reinterpret_cast<uint64_t>(pool.block_data(r->id())));
    l.refs.push_back(std::move(*r));
  }
  l.block_bytes = pool.block_bytes();
  l.header_bytes = 8;
  l.headers.assign(static_cast<size_t>(n) * 8, 7);
  l.n_tokens = n * pool.block_size();
  return l;
}

TEST(LeaseTable, CompletedPullReleasesOnDrainOnly) {
  auto pool = small_pool();
  LeaseTable t;
  const auto now = Clock::now();
  const uint64_t id = t.add(lease_of(*pool, 3), milliseconds(1000), now);
  EXPECT_EQ(pool->n_free(), pool->n_blocks() - 3);
  EXPECT_EQ(t.stats().n_open, 1);
  EXPECT_EQ(t.stats().n_pinned_blocks, 3);
  auto v = t.begin_pull(id);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->addrs.size(), 3u);
  EXPECT_EQ(v->headers.size(), 24u);
  // A second puller is refused while the first holds it.
  auto v2 = t.begin_pull(id);
  ASSERT_FALSE(v2.ok());
  EXPECT_EQ(v2.error().code, Errc::kBusy);
  EXPECT_TRUE(t.end(id, LeaseEnd::kCompleted));
  EXPECT_FALSE(t.end(id, LeaseEnd::kCancelled));  // exactly once
  EXPECT_FALSE(t.is_open(id));
  // Still pinned until the owner drains.
  EXPECT_EQ(pool->n_free(), pool->n_blocks() - 3);
  EXPECT_EQ(t.stats().n_pending_release, 1);
  {
    auto ended = t.drain_ended();
    ASSERT_EQ(ended.size(), 1u);
    EXPECT_EQ(*ended[0].ended, LeaseEnd::kCompleted);
  }
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
  const LeaseStats s = t.stats();
  EXPECT_EQ(s.n_open, 0);
  EXPECT_EQ(s.n_pinned_blocks, 0);
  EXPECT_EQ(s.n_completed, 1);
  EXPECT_EQ(s.n_refused, 1);
  EXPECT_EQ(s.n_pending_release, 0);
  pool->check_invariants();
  // An ended id is unknown.
  auto v3 = t.begin_pull(id);
  ASSERT_FALSE(v3.ok());
  EXPECT_EQ(v3.error().code, Errc::kNotFound);
}

TEST(LeaseTable, ExpiryEndsOnlyPastDeadline) {
  auto pool = small_pool();
  LeaseTable t;
  const auto now = Clock::now();
  const uint64_t a = t.add(lease_of(*pool, 2), milliseconds(100), now);
  const uint64_t b = t.add(lease_of(*pool, 1), milliseconds(500), now);
  EXPECT_NE(a, b);
  EXPECT_EQ(t.next_deadline(), now + milliseconds(100));
  EXPECT_TRUE(t.expire(now + milliseconds(99)).empty());
  auto gone = t.expire(now + milliseconds(100));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0], a);
  EXPECT_TRUE(t.is_open(b));
  // A pull in progress expires too (its server drops the connection).
  ASSERT_TRUE(t.begin_pull(b).ok());
  EXPECT_EQ(t.expire(now + milliseconds(600)).size(), 1u);
  EXPECT_FALSE(t.end(b, LeaseEnd::kCompleted));  // too late: already expired
  (void)t.drain_ended();
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
  EXPECT_EQ(t.stats().n_expired, 2);
  EXPECT_EQ(t.stats().n_completed, 0);
  EXPECT_FALSE(t.next_deadline().has_value());
}

TEST(LeaseTable, EndAllCancelsAndUnknownIdsAreRefused) {
  auto pool = small_pool();
  LeaseTable t;
  (void)t.add(lease_of(*pool, 2), milliseconds(1000));
  (void)t.add(lease_of(*pool, 2), milliseconds(1000));
  EXPECT_FALSE(t.end(999, LeaseEnd::kCompleted));
  EXPECT_EQ(t.begin_pull(999).error().code, Errc::kNotFound);
  t.end_all();
  EXPECT_EQ(t.stats().n_open, 0);
  EXPECT_EQ(t.stats().n_cancelled, 2);
  EXPECT_EQ(t.drain_ended().size(), 2u);
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
  pool->check_invariants();
}

}  // namespace
}  // namespace kvstack::transfer

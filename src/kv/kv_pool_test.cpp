#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_memory.h"

namespace kvstack {
namespace {

KvLayout smol_layout(int block_size) {
  auto r = KvLayout::uniform(30, 3, 64, KvDtype::kF16, block_size);
  KV_CHECK(r.ok(), "layout");
  return std::move(r).value();
}

std::unique_ptr<BlockPool> make_pool(const KvLayout& layout, int64_t n_tokens) {
  auto r = BlockPool::create(layout, {.n_tokens = n_tokens});
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return std::move(r).value();
}

TEST(BlockPool, SizingFromBytesOrTokens) {
  const KvLayout l = smol_layout(16);  // 368640 bytes per block
  {
    auto p = BlockPool::create(l, {.mem_bytes = 368640 * 3 + 368640 / 2});
    ASSERT_TRUE(p.ok());
    EXPECT_EQ((*p)->n_blocks(), 3);  // floor(3.5)
    EXPECT_EQ((*p)->stats().pool_bytes, 3 * 368640);
  }
  {
    auto p = BlockPool::create(l, {.n_tokens = 17});
    ASSERT_TRUE(p.ok());
    EXPECT_EQ((*p)->n_blocks(), 2);  // ceil(17 / 16)
  }
  auto none = BlockPool::create(l, {});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, Errc::kInvalidArgument);
  auto both = BlockPool::create(l, {.mem_bytes = 1 << 30, .n_tokens = 100});
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.error().message.find("exactly one"), std::string::npos);
  auto tiny = BlockPool::create(l, {.mem_bytes = 1000});
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.error().message.find("smaller than one block (368640 bytes"), std::string::npos)
      << tiny.error().message;
}

TEST(BlockPool, BlocksAre64ByteAligned) {
  // 1 head x 3 dims f16, P=1: 6-byte regions padded to 64 -> 128-byte blocks.
  auto l = KvLayout::uniform(1, 1, 3, KvDtype::kF16, 1);
  ASSERT_TRUE(l.ok());
  auto pool = make_pool(*l, 100);
  for (int32_t i = 0; i < pool->n_blocks(); ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->block_data(BlockId{i})) % 64, 0u);
  }
  EXPECT_EQ(pool->block_data(BlockId{5}) - pool->block_data(BlockId{0}), 5 * 128);
}

TEST(BlockPool, AllocateUntilExhaustion) {
  const KvLayout l = smol_layout(4);
  auto pool = make_pool(l, 4 * 10);  // 10 blocks
  std::vector<BlockRef> refs;
  for (int i = 0; i < 10; ++i) {
    auto r = pool->allocate();
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(pool->ref_count(r->id()), 1);
    EXPECT_EQ(pool->state(r->id()), BlockState::kUsed);
    refs.push_back(std::move(r).value());
  }
  auto fail = pool->allocate();
  ASSERT_FALSE(fail.ok());
  EXPECT_EQ(fail.error().code, Errc::kOutOfBlocks);
  EXPECT_EQ(pool->n_free(), 0);
  EXPECT_EQ(pool->stats().n_out_of_blocks, 1);
  pool->check_invariants();
  refs.pop_back();
  EXPECT_EQ(pool->n_free(), 1);
  refs.clear();
  EXPECT_EQ(pool->n_free(), 10);
  pool->check_invariants();
}

TEST(BlockTable, ReserveIsAllOrNothing) {
  const KvLayout l = smol_layout(4);
  auto pool = make_pool(l, 4 * 10);  // 10 blocks
  BlockTable a(*pool), b(*pool);
  EXPECT_EQ(a.blocks_needed(9), 3);  // ceil(9 / 4)
  ASSERT_TRUE(a.reserve(9).ok());
  a.commit(9);
  // 9 committed -> 3 blocks, tail has 3 free slots: 3 more tokens fit, 4 need a block.
  EXPECT_EQ(a.blocks_needed(3), 0);
  EXPECT_EQ(a.blocks_needed(4), 1);
  EXPECT_EQ(pool->n_free(), 7);
  // b wants 29 tokens = 8 blocks > 7 free: refused, nothing taken.
  EXPECT_EQ(b.blocks_needed(29), 8);
  const Status s = b.reserve(29);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, Errc::kOutOfBlocks);
  EXPECT_NE(s.error().message.find("8 more blocks"), std::string::npos) << s.error().message;
  EXPECT_EQ(b.n_blocks(), 0);
  EXPECT_EQ(pool->n_free(), 7);
  ASSERT_TRUE(b.reserve(28).ok());
  EXPECT_EQ(pool->n_free(), 0);
  pool->check_invariants();
}

TEST(BlockTable, BatchReserveAllOrNothing) {
  const KvLayout l = smol_layout(8);
  auto pool = make_pool(l, 8 * 6);  // 6 blocks
  BlockTable a(*pool), b(*pool), c(*pool);
  ASSERT_TRUE(a.reserve(5).ok());
  a.commit(5);  // 1 block, 3 free slots
  std::vector<BlockTable*> batch = {&a, &b, &c};
  std::vector<int64_t> n_new = {4, 16, 17};  // a: 1, b: 2, c: 3 = 6 > 5 free
  EXPECT_EQ(plan_reserve(batch, n_new), 6);
  const Status s = reserve_all(batch, n_new);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, Errc::kOutOfBlocks);
  EXPECT_EQ(a.n_blocks(), 1);
  EXPECT_EQ(b.n_blocks(), 0);
  EXPECT_EQ(c.n_blocks(), 0);
  EXPECT_EQ(pool->n_free(), 5);
  n_new = {3, 16, 17};  // 0 + 2 + 3 = 5
  ASSERT_TRUE(reserve_all(batch, n_new).ok());
  EXPECT_EQ(pool->n_free(), 0);
  for (size_t i = 0; i < batch.size(); ++i) batch[i]->commit(n_new[i]);
  EXPECT_EQ(a.length(), 8);
  EXPECT_EQ(pool->stats().n_tokens_committed, 8 + 16 + 17);
  pool->check_invariants();
}

TEST(BlockTable, RollbackReturnsOnlyUncommittedBlocks) {
  const KvLayout l = smol_layout(4);
  auto pool = make_pool(l, 4 * 8);
  BlockTable t(*pool);
  ASSERT_TRUE(t.reserve(6).ok());  // 2 blocks
  t.commit(6);
  const std::vector<int32_t> before(t.ids().begin(), t.ids().end());
  ASSERT_TRUE(t.reserve(11).ok());  // 17 tokens -> 5 blocks
  EXPECT_EQ(t.n_blocks(), 5);
  t.commit(3);  // length 9 -> keeps 3 blocks
  EXPECT_EQ(t.rollback(), 2);
  EXPECT_EQ(t.n_blocks(), 3);
  EXPECT_EQ(t.length(), 9);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), t.ids().begin()));
  EXPECT_EQ(t.rollback(), 0);
  EXPECT_EQ(pool->n_free(), 5);
  const BlockPoolStats st = pool->stats();
  EXPECT_EQ(st.n_tokens_reserved, 3);  // 12 slots - 9 committed
  pool->check_invariants();
  t.release();
  EXPECT_EQ(t.length(), 0);
  EXPECT_EQ(pool->n_free(), 8);
  pool->check_invariants();
}

TEST(BlockRefs, MovedFromHandlesReleaseNothing) {
  const KvLayout l = smol_layout(4);
  auto pool = make_pool(l, 4 * 4);
  {
    BlockRef a = std::move(pool->allocate()).value();
    const BlockId id = a.id();
    BlockRef b(std::move(a));
    EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_TRUE(b.valid());
    EXPECT_EQ(b.id(), id);
    EXPECT_EQ(pool->ref_count(id), 1);
    a.reset();  // no-op
    EXPECT_EQ(pool->ref_count(id), 1);
    BlockRef c = std::move(pool->allocate()).value();
    const BlockId id2 = c.id();
    c = std::move(b);  // releases id2, takes id
    EXPECT_EQ(pool->state(id2), BlockState::kFree);
    EXPECT_EQ(pool->ref_count(id), 1);
    EXPECT_EQ(pool->n_free(), 3);
    pool->check_invariants();
  }
  EXPECT_EQ(pool->n_free(), 4);
  // Tables: moved-from table owns nothing; the destination releases once.
  {
    BlockTable t(*pool);
    ASSERT_TRUE(t.reserve(10).ok());
    t.commit(10);
    BlockTable u(std::move(t));
    EXPECT_EQ(t.n_blocks(), 0);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(t.length(), 0);    // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(u.length(), 10);
    EXPECT_EQ(pool->stats().n_tables, 2);
    pool->check_invariants();
    BlockTable w(*pool);
    ASSERT_TRUE(w.reserve(1).ok());
    w = std::move(u);  // w's block is released, u's 3 blocks move
    EXPECT_EQ(pool->n_free(), 1);
    EXPECT_EQ(w.length(), 10);
    pool->check_invariants();
  }
  EXPECT_EQ(pool->n_free(), 4);
  EXPECT_EQ(pool->stats().n_tables, 0);
  pool->check_invariants();
}

TEST(BlockRefs, SharedFullBlocksCountEveryHolder) {
  const KvLayout l = smol_layout(4);
  auto pool = make_pool(l, 4 * 8);
  BlockTable a(*pool);
  ASSERT_TRUE(a.reserve(10).ok());
  a.commit(10);  // blocks 0,1 full, block 2 partial
  std::vector<BlockRef> prefix;
  prefix.push_back(a.share_block(0));
  prefix.push_back(a.share_block(1));
  EXPECT_EQ(pool->ref_count(BlockId{a.ids()[0]}), 2);
  pool->check_invariants();
  BlockTable b(*pool);
  std::vector<BlockRef> for_b;
  for_b.push_back(a.share_block(0));
  for_b.push_back(a.share_block(1));
  b.adopt_prefix(std::move(for_b));
  EXPECT_EQ(b.length(), 8);
  EXPECT_EQ(b.ids()[0], a.ids()[0]);
  EXPECT_EQ(pool->ref_count(BlockId{a.ids()[0]}), 3);  // a, b, prefix[0]
  // b appends privately after the shared prefix.
  ASSERT_TRUE(b.reserve(3).ok());
  EXPECT_NE(b.ids()[2], a.ids()[2]);
  b.commit(3);
  EXPECT_EQ(pool->n_free(), 8 - 4);
  pool->check_invariants();
  // Releasing a keeps shared blocks alive for b and the loose refs.
  const int32_t shared0 = a.ids()[0];
  a.release();
  EXPECT_EQ(pool->ref_count(BlockId{shared0}), 2);
  EXPECT_EQ(pool->n_free(), 8 - 3);
  prefix.clear();
  EXPECT_EQ(pool->ref_count(BlockId{shared0}), 1);
  pool->check_invariants();
  b.release();
  EXPECT_EQ(pool->state(BlockId{shared0}), BlockState::kFree);
  EXPECT_EQ(pool->n_free(), 8);
  pool->check_invariants();
}

TEST(BlockTableDeathTest, ContractViolationsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const KvLayout l = smol_layout(4);
  auto pool = make_pool(l, 4 * 8);
  BlockTable t(*pool);
  ASSERT_TRUE(t.reserve(6).ok());
  t.commit(6);
  std::vector<float> rows(3 * 64, 1.0f);
  EXPECT_DEATH(t.write(0, 5, rows.data(), rows.data(), 1), "committed");
  EXPECT_DEATH(t.write(0, 8, rows.data(), rows.data(), 1), "reserved capacity");
  EXPECT_DEATH(t.commit(3), "more tokens than reserved");
  EXPECT_DEATH((void)t.share_block(1), "full committed");
  EXPECT_DEATH(t.adopt_prefix({}), "partial tail");
  EXPECT_DEATH(
      {
        auto p = make_pool(l, 16);
        BlockTable x(*p);
        p.reset();
      },
      "tables are alive");
}

// Memory truth: the pool's live numbers equal the formulas exactly.
TEST(BlockPool, MemoryTruth) {
  for (int p : {1, 16, 64}) {
    const KvLayout l = smol_layout(p);
    auto pool = make_pool(l, 4096);
    const std::vector<int64_t> lengths = {1, 15, 16, 17, 300, 1000};
    std::vector<BlockTable> tables;
    for (int64_t len : lengths) {
      tables.emplace_back(*pool);
      ASSERT_TRUE(tables.back().reserve(len).ok());
      tables.back().commit(len);
    }
    const KvFootprint f = kv_footprint(l, lengths);
    BlockPoolStats s = pool->stats();
    EXPECT_EQ(s.payload_bytes, f.payload_bytes);
    EXPECT_EQ(s.payload_bytes, 23040 * (1 + 15 + 16 + 17 + 300 + 1000));
    EXPECT_EQ(s.n_blocks_used, f.n_blocks);
    EXPECT_EQ(s.allocated_bytes, f.allocated_bytes);
    EXPECT_EQ(s.allocated_bytes, s.n_blocks_used * l.block_bytes());
    EXPECT_EQ(s.n_tokens_committed, f.n_tokens);
    EXPECT_EQ(s.n_tokens_reserved, f.n_waste_slots);
    EXPECT_EQ(s.n_blocks_free + s.n_blocks_used + s.n_blocks_cached, s.n_blocks_total);
    // Reserved but uncommitted tokens are allocated, not payload.
    ASSERT_TRUE(tables[0].reserve(2 * p).ok());
    s = pool->stats();
    EXPECT_EQ(s.payload_bytes, f.payload_bytes);
    EXPECT_GT(s.allocated_bytes, f.allocated_bytes);
    tables[0].rollback();
    EXPECT_EQ(pool->stats().allocated_bytes, f.allocated_bytes);
    pool->check_invariants();
    tables.clear();
    s = pool->stats();
    EXPECT_EQ(s.n_blocks_free, s.n_blocks_total);
    EXPECT_EQ(s.payload_bytes, 0);
    EXPECT_EQ(s.allocated_bytes, 0);
    EXPECT_EQ(s.n_allocations, s.n_releases);
    pool->check_invariants();
  }
}

TEST(BlockPool, ResidentBytesFollowWrites) {
  const KvLayout l = smol_layout(16);  // 368640-byte blocks = 90 pages
  auto lazy = BlockPool::create(l, {.n_tokens = 16 * 64});
  ASSERT_TRUE(lazy.ok());
  BlockPool& pool = **lazy;
  const int64_t untouched = pool.stats().resident_bytes;
  ASSERT_GE(untouched, 0);
  EXPECT_LT(untouched, pool.stats().pool_bytes / 4);  // lazily mapped
  for (int32_t i = 0; i < 32; ++i) std::memset(pool.block_data(BlockId{i}), 1, l.block_bytes());
  const int64_t touched = pool.stats().resident_bytes;
  EXPECT_GE(touched, 32 * l.block_bytes());
  auto eager = BlockPool::create(l, {.n_tokens = 16 * 8, .populate = true});
  ASSERT_TRUE(eager.ok());
  EXPECT_GE((*eager)->stats().resident_bytes, (*eager)->stats().pool_bytes);
}

// Randomized operations against a reference model of ref counts and lengths.
TEST(BlockPool, RandomizedAgainstReferenceModel) {
  for (int p : {1, 4, 16}) {
    const KvLayout l = smol_layout(p);
    const int64_t n_blocks = 24;
    auto pool = make_pool(l, n_blocks * p);
    std::mt19937_64 rng(1234 + p);
    auto rand = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    struct Model {
      std::vector<int32_t> ids;
      int64_t length = 0;
    };
    std::vector<BlockTable> tables;
    std::vector<Model> model;
    std::vector<BlockRef> loose;
    std::map<int32_t, int32_t> refs;  // expected ref count per block (absent = 0)
    int64_t n_oob = 0, n_shared = 0, n_adopted = 0, n_batches = 0;
    auto add_ids = [&](const std::vector<int32_t>& ids) {
      for (int32_t id : ids) ++refs[id];
    };
    auto drop_ids = [&](const std::vector<int32_t>& ids) {
      for (int32_t id : ids) {
        if (--refs[id] == 0) refs.erase(id);
      }
    };
    for (int step = 0; step < 4000; ++step) {
      int op = static_cast<int>(rand(0, 9));
      if ((op == 0 || op == 8) && tables.size() >= 12) op = 5;  // bound the live sequences
      if (op == 0 || tables.empty()) {                          // new sequence
        tables.emplace_back(*pool);                             // may move (reallocate) every table
        model.emplace_back();
      } else {
        const size_t i = static_cast<size_t>(rand(0, static_cast<int64_t>(tables.size()) - 1));
        BlockTable& t = tables[i];
        Model& m = model[i];
        switch (op) {
          case 1:
          case 2: {  // reserve
            const int64_t n_new = rand(0, 5 * p + 2);
            const int64_t want = (m.length + n_new + p - 1) / p;
            const int64_t need = std::max<int64_t>(0, want - static_cast<int64_t>(m.ids.size()));
            EXPECT_EQ(t.blocks_needed(n_new), need);
            const Status s = t.reserve(n_new);
            if (need > n_blocks - static_cast<int64_t>(refs.size())) {
              ASSERT_FALSE(s.ok());
              EXPECT_EQ(s.error().code, Errc::kOutOfBlocks);
              ++n_oob;
            } else {
              ASSERT_TRUE(s.ok());
              std::vector<int32_t> fresh(t.ids().begin() + static_cast<int64_t>(m.ids.size()),
                                         t.ids().end());
              for (int32_t id : fresh) EXPECT_EQ(refs.count(id), 0u) << "reused a live block";
              add_ids(fresh);
              m.ids.insert(m.ids.end(), fresh.begin(), fresh.end());
            }
            break;
          }
          case 3: {  // commit part of the reservation
            const int64_t room = static_cast<int64_t>(m.ids.size()) * p - m.length;
            const int64_t n = rand(0, room);
            t.commit(n);
            m.length += n;
            break;
          }
          case 4: {  // rollback
            const size_t keep = static_cast<size_t>((m.length + p - 1) / p);
            EXPECT_EQ(t.rollback(), static_cast<int64_t>(m.ids.size() - keep));
            drop_ids(std::vector<int32_t>(m.ids.begin() + keep, m.ids.end()));
            m.ids.resize(keep);
            break;
          }
          case 5: {  // end the sequence (destroy, or release and keep the table)
            drop_ids(m.ids);
            if (rand(0, 1) == 0) {
              tables.erase(tables.begin() + static_cast<int64_t>(i));  // move-assigns the rest
              model.erase(model.begin() + static_cast<int64_t>(i));
            } else {
              t.release();
              m = Model{};
            }
            break;
          }
          case 6: {  // share a full committed block
            const int64_t full = m.length / p;
            if (full > 0) {
              const int64_t j = rand(0, full - 1);
              loose.push_back(t.share_block(j));
              ++refs[m.ids[j]];
              ++n_shared;
            }
            break;
          }
          case 7: {  // drop a loose reference
            if (!loose.empty()) {
              const size_t j = static_cast<size_t>(rand(0, static_cast<int64_t>(loose.size()) - 1));
              drop_ids({loose[j].id().value});
              loose.erase(loose.begin() + static_cast<int64_t>(j));
            }
            break;
          }
          case 8: {  // a new sequence adopting some loose refs as its prefix
            const int64_t k = std::min<int64_t>(rand(0, 3), static_cast<int64_t>(loose.size()));
            std::vector<BlockRef> pre;
            Model nm;
            for (int64_t j = 0; j < k; ++j) {
              nm.ids.push_back(loose.back().id().value);
              pre.push_back(std::move(loose.back()));
              loose.pop_back();
            }
            nm.length = k * p;
            n_adopted += k;
            BlockTable nt(*pool);
            nt.adopt_prefix(std::move(pre));
            tables.push_back(std::move(nt));
            model.push_back(nm);
            break;
          }
          case 9: {  // batch reserve over up to 3 distinct tables
            std::vector<BlockTable*> batch;
            std::vector<int64_t> n_new;
            std::vector<size_t> idx;
            for (size_t j = i; j < tables.size() && batch.size() < 3; ++j) {
              batch.push_back(&tables[j]);
              idx.push_back(j);
              n_new.push_back(rand(0, 2 * p));
            }
            int64_t need = 0;
            for (size_t j = 0; j < batch.size(); ++j) {
              const Model& mj = model[idx[j]];
              need += std::max<int64_t>(
                  0, (mj.length + n_new[j] + p - 1) / p - static_cast<int64_t>(mj.ids.size()));
            }
            EXPECT_EQ(plan_reserve(batch, n_new), need);
            const Status s = reserve_all(batch, n_new);
            ++n_batches;
            if (need > n_blocks - static_cast<int64_t>(refs.size())) {
              ASSERT_FALSE(s.ok());
              ++n_oob;
            } else {
              ASSERT_TRUE(s.ok());
            }
            for (size_t j = 0; j < batch.size(); ++j) {
              Model& mj = model[idx[j]];
              std::vector<int32_t> fresh(
                  batch[j]->ids().begin() + static_cast<int64_t>(mj.ids.size()),
                  batch[j]->ids().end());
              if (!s.ok()) {
                EXPECT_TRUE(fresh.empty());
              }
              add_ids(fresh);
              mj.ids.insert(mj.ids.end(), fresh.begin(), fresh.end());
            }
            break;
          }
          default:
            break;
        }
      }
      // Compare with the model.
      ASSERT_EQ(tables.size(), model.size());
      int64_t committed = 0;
      std::vector<int64_t> lengths;
      for (size_t i = 0; i < tables.size(); ++i) {
        ASSERT_EQ(tables[i].length(), model[i].length) << "step " << step;
        ASSERT_TRUE(std::equal(tables[i].ids().begin(), tables[i].ids().end(), model[i].ids.begin(),
                               model[i].ids.end()))
            << "step " << step;
        committed += model[i].length;
        lengths.push_back(model[i].length);
      }
      for (int32_t b = 0; b < n_blocks; ++b) {
        auto it = refs.find(b);
        const int32_t want = it == refs.end() ? 0 : it->second;
        ASSERT_EQ(pool->ref_count(BlockId{b}), want) << "block " << b << " step " << step;
        ASSERT_EQ(pool->state(BlockId{b}), want > 0 ? BlockState::kUsed : BlockState::kFree);
      }
      const BlockPoolStats s = pool->stats();
      ASSERT_EQ(s.n_blocks_free, n_blocks - static_cast<int64_t>(refs.size()));
      ASSERT_EQ(s.n_tokens_committed, committed);
      ASSERT_EQ(s.payload_bytes, kv_footprint(l, lengths).payload_bytes);
      ASSERT_EQ(s.n_out_of_blocks, n_oob);
      pool->check_invariants();
    }
    EXPECT_GT(n_oob, 0) << "the run never exhausted the pool";
    EXPECT_GT(n_shared, 0);
    EXPECT_GT(n_adopted, 0);
    EXPECT_GT(n_batches, 0);
    std::printf("P=%d: %lld refused reservations, %lld shared, %lld adopted, %lld batches\n", p,
                static_cast<long long>(n_oob), static_cast<long long>(n_shared),
                static_cast<long long>(n_adopted), static_cast<long long>(n_batches));
    tables.clear();
    loose.clear();
    EXPECT_EQ(pool->n_free(), n_blocks);
    pool->check_invariants();
  }
}

}  // namespace
}  // namespace kvstack

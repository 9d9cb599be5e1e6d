// KV groups (kv_groups.h) and the per-sequence coordinator (block_table.h):
// how layers are grouped, that a single-class model is one group laid out
// exactly as before, and random operation sequences across groups (start,
// extend, cancel/rollback, fork, clone, preempt) against a simple reference
// model of every group's table, with the pool's invariants checked after
// every operation.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>

#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_groups.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

KvLayout windowed(const std::vector<int>& windows, int block_size, int n_kv_heads = 1,
                  int head_dim = 8) {
  std::vector<KvLayerSpec> layers;
  layers.reserve(windows.size());
  for (int w : windows) {
    layers.push_back({.n_kv_heads = n_kv_heads,
                      .head_dim_k = head_dim,
                      .head_dim_v = head_dim,
                      .dtype = KvDtype::kF16,
                      .window = w});
  }
  auto l = KvLayout::create(layers, block_size);
  KV_CHECK(l.ok(), "windowed: bad layout");
  return std::move(*l);
}

TEST(KvGroups, GemmaPatternIsSixGroupsOfThree) {
  // Gemma 3 270M: 18 layers, window 512, every sixth layer global.
  std::vector<int> w(18, 512);
  for (int l = 5; l < 18; l += 6) w[l] = 0;
  auto groups = KvGroups::create(windowed(w, 16, 1, 256));
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->n_groups(), 6);
  EXPECT_EQ(groups->group(0).window, 0);
  EXPECT_FALSE(groups->group(0).drops_blocks);
  EXPECT_EQ(groups->group(0).layers, (std::vector<int>{5, 11, 17}));
  for (int g = 1; g < 6; ++g) {
    EXPECT_EQ(groups->group(g).window, 512);
    EXPECT_TRUE(groups->group(g).drops_blocks);
    EXPECT_EQ(groups->group(g).layers.size(), 3u);
    EXPECT_EQ(groups->group(g).layout.block_bytes(), groups->block_bytes());
  }
  // Window layers 0-4, 6-10, 12-16 in threes: layer 6 is the last of the
  // second window group, layer 7 the first of the third.
  EXPECT_EQ(groups->slot(6).group, 2);
  EXPECT_EQ(groups->slot(6).index, 2);
  EXPECT_EQ(groups->slot(7).group, 3);
  EXPECT_EQ(groups->slot(7).index, 0);
  EXPECT_EQ(groups->slot(17).group, 0);
  EXPECT_EQ(groups->slot(17).index, 2);
  // Residency formula: full T / P; window blocks the next chunk can see.
  EXPECT_EQ(groups->blocks_for(0, 8192, 0), 512);
  EXPECT_EQ(groups->blocks_for(1, 8192, 0), 512 - (8192 - 511) / 16);
  EXPECT_LE(groups->blocks_for(1, 8192, 512), (511 + 512 + 15) / 16 + 1);  // 65
  EXPECT_EQ(groups->blocks_for(1, 100, 28), 8);                            // short: everything
  // Admission: the peak over a sequence's life, window groups capped.
  EXPECT_EQ(groups->peak_blocks(0, 8192, 512), 512);
  EXPECT_EQ(groups->peak_blocks(1, 8192, 512), (511 + 512 + 15) / 16 + 1);  // 65
  EXPECT_EQ(groups->peak_blocks(1, 100, 512), 7);
  EXPECT_EQ(groups->peak_blocks_for_sequence(8192, 512), 512 + 5 * 65);
  const int64_t t = groups->max_tokens_in(512 + 5 * 65, 512);
  EXPECT_EQ(t, 8192);
  EXPECT_GT(groups->peak_blocks_for_sequence(t + 1, 512), 512 + 5 * 65);
  // A pool sized for 8192 tokens holds exactly that peak, not 6 x 512.
  auto pool = BlockPool::create(windowed(w, 16, 1, 256), {.n_tokens = 8192, .prefill_chunk = 512});
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->n_blocks(), 512 + 5 * 65);
}

TEST(KvGroups, OneClassIsTheModelLayoutItself) {
  const KvLayout uniform = windowed({0, 0, 0}, 8, 2, 16);
  auto groups = KvGroups::create(uniform);
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->n_groups(), 1);
  EXPECT_TRUE(groups->group(0).layout.same_format(uniform));
  EXPECT_EQ(groups->block_bytes(), uniform.block_bytes());
  // All layers windowed alike: still one group, and it keeps every block.
  auto swa = KvGroups::create(windowed({64, 64}, 8));
  ASSERT_TRUE(swa.ok());
  ASSERT_EQ(swa->n_groups(), 1);
  EXPECT_FALSE(swa->group(0).drops_blocks);
  auto pool = BlockPool::create(uniform, {.n_tokens = 64});
  ASSERT_TRUE(pool.ok());
  const PagedKvLayerView a = (*pool)->layer_view(2);
  const PagedKvLayerView b = uniform.layer_view(2, (*pool)->block_data(BlockId{0}));
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.block_stride, b.block_stride);
}

TEST(KvGroups, ShapesThatDifferArePaddedToOneBlockSize) {
  // A full layer with 4 KV heads and two window layers with 1: gcd(1, 2) = 1.
  std::vector<KvLayerSpec> layers = {
      {.n_kv_heads = 4, .head_dim_k = 16, .head_dim_v = 16, .dtype = KvDtype::kF16},
      {.n_kv_heads = 1, .head_dim_k = 16, .head_dim_v = 16, .dtype = KvDtype::kF16, .window = 8},
      {.n_kv_heads = 1, .head_dim_k = 16, .head_dim_v = 16, .dtype = KvDtype::kF16, .window = 8}};
  auto layout = KvLayout::create(layers, 4);
  ASSERT_TRUE(layout.ok());
  auto groups = KvGroups::create(*layout);
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->n_groups(), 3);
  for (int g = 0; g < 3; ++g)
    EXPECT_EQ(groups->group(g).layout.block_bytes(), groups->block_bytes());
  EXPECT_EQ(groups->block_bytes(), 4 * 2 * 4 * 16 * 2);  // the 4-head layer's block
}

// Reference model of one sequence: committed length, the length at its last
// reservation attempt (window groups drop what that step could not see) and
// the reserved capacity.
struct RefSeq {
  std::unique_ptr<BlockTable> table;
  int64_t length = 0;
  int64_t attempt = 0;
  int64_t n_blocks = 0;
};

void expect_matches(const RefSeq& r, const KvGroups& groups, const std::string& where) {
  const int64_t p = groups.block_size();
  ASSERT_EQ(r.table->length(), r.length) << where;
  for (int g = 0; g < groups.n_groups(); ++g) {
    const GroupTable& t = r.table->group(g);
    const KvGroup& gr = groups.group(g);
    const int64_t dropped =
        gr.drops_blocks ? std::max<int64_t>(0, r.attempt - gr.window + 1) / p : 0;
    ASSERT_EQ(t.length(), r.length) << where << " group " << g;
    ASSERT_EQ(t.n_blocks(), r.n_blocks) << where << " group " << g;
    ASSERT_EQ(t.n_dropped(), std::min(dropped, r.n_blocks)) << where << " group " << g;
    for (int64_t j = 0; j < t.n_blocks(); ++j) {
      ASSERT_EQ(t.ids()[j] == kNullBlock, j < t.n_dropped()) << where << " group " << g;
    }
  }
}

TEST(KvGroups, RandomOperationsAcrossGroupsMatchTheReference) {
  for (int block_size : {1, 4, 8}) {
    const KvLayout layout = windowed({0, 5, 5, 13, 0, 13}, block_size);
    auto pool_r =
        BlockPool::create(layout, {.mem_bytes = 160 * windowed({0}, block_size).block_bytes()});
    ASSERT_TRUE(pool_r.ok());
    BlockPool& pool = **pool_r;
    const KvGroups& groups = pool.groups();
    ASSERT_EQ(groups.n_groups(), 3);  // classes of 2 layers: full, w5, w13
    std::mt19937 rng(static_cast<uint32_t>(block_size) * 7919u);
    std::vector<RefSeq> seqs;
    auto pick = [&]() { return std::uniform_int_distribution<size_t>(0, seqs.size() - 1)(rng); };
    const int64_t p = block_size;
    for (int step = 0; step < 1500; ++step) {
      const int op = std::uniform_int_distribution<int>(0, 9)(rng);
      const std::string where = "block " + std::to_string(p) + " step " + std::to_string(step) +
                                " op " + std::to_string(op);
      if (seqs.empty() || op == 0) {  // start
        seqs.push_back(RefSeq{.table = std::make_unique<BlockTable>(pool)});
      } else if (op <= 5) {  // extend: reserve, then commit or cancel
        RefSeq& r = seqs[pick()];
        const int64_t n = std::uniform_int_distribution<int64_t>(1, 3 * p + 2)(rng);
        const int64_t free_before = pool.n_available();
        const int64_t need_max = r.table->blocks_needed(n);
        r.attempt = r.length;
        const Status st = r.table->reserve(n);
        if (!st.ok()) {
          ASSERT_EQ(st.error().code, Errc::kOutOfBlocks) << where;
          // Only the invisible window blocks went back; nothing was reserved.
          ASSERT_GE(pool.n_available(), free_before) << where;
        } else {
          // It took at most what it planned (the drop may have given some back).
          ASSERT_LE(free_before - pool.n_available(), need_max) << where;
          r.n_blocks = std::max(r.n_blocks, (r.length + n + p - 1) / p);
          if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) {
            r.table->rollback();  // cancelled step
            r.n_blocks = (r.length + p - 1) / p;
          } else {
            r.table->commit(n);
            r.length += n;
          }
        }
      } else if (op == 6) {  // fork
        const RefSeq& r = seqs[pick()];
        RefSeq f{.table = std::make_unique<BlockTable>(r.table->fork()),
                 .length = r.length,
                 .attempt = r.attempt,
                 .n_blocks = (r.length + p - 1) / p};
        seqs.push_back(std::move(f));
      } else if (op == 7) {  // private clone
        const RefSeq& r = seqs[pick()];
        auto c = r.table->clone_private();
        if (c.ok()) {
          seqs.push_back(RefSeq{.table = std::make_unique<BlockTable>(std::move(*c)),
                                .length = r.length,
                                .attempt = r.attempt,
                                .n_blocks = (r.length + p - 1) / p});
        } else {
          ASSERT_EQ(c.error().code, Errc::kOutOfBlocks) << where;
        }
      } else if (op == 8) {  // preempt by recompute: release, keep the sequence
        RefSeq& r = seqs[pick()];
        r.table->release();
        r = RefSeq{.table = std::move(r.table)};
      } else {  // finish
        const size_t i = pick();
        seqs.erase(seqs.begin() + static_cast<long>(i));
      }
      pool.check_invariants();
      const BlockPoolStats st = pool.stats();
      ASSERT_EQ(st.n_blocks_free + st.n_blocks_used + st.n_blocks_cached, st.n_blocks_total);
      int64_t group_used = 0;
      for (const BlockPoolGroupStats& g : st.groups) group_used += g.n_blocks_used;
      ASSERT_EQ(group_used, st.n_blocks_used) << where;
      for (const RefSeq& r : seqs) expect_matches(r, groups, where);
    }
    seqs.clear();
    pool.check_invariants();
    EXPECT_EQ(pool.n_free(), pool.n_blocks());
  }
}

}  // namespace
}  // namespace kvstack

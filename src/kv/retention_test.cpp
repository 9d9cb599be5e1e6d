// Retention (retention.h) at the block-table level: the --kv-retention
// parser's errors, StreamingLLM's selection against its definition (ties
// at the boundaries, windows larger than the sequence), and compaction:
// survivors keep their bytes and logical positions, whole blocks return to
// the pool (free count, used blocks, resident bytes stay bounded), pool
// invariants hold after every step, shared blocks are copied instead of
// written, a compaction that cannot get its copies changes nothing, and
// unsupported formats are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "core/half.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_write.h"
#include "kv/prefix_index.h"
#include "kv/retention.h"

namespace kvstack {
namespace {

std::unique_ptr<BlockPool> make_pool(KvDtype dtype, int block_size, int64_t n_tokens) {
  auto l = KvLayout::uniform(2, 2, 32, dtype, block_size);
  KV_CHECK(l.ok(), "layout");
  auto p = BlockPool::create(*l, {.n_tokens = n_tokens});
  KV_CHECK(p.ok(), "pool");
  return std::move(p).value();
}

// K/V rows [n, 2 heads, 32] for logical positions [pos, pos + n) of layer l:
// distinct per (layer, position, K/V, element).
void rows_for(int l, int64_t pos, int64_t n, std::vector<float>& k, std::vector<float>& v) {
  k.resize(static_cast<size_t>(n * 64));
  v.resize(k.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int i = 0; i < 64; ++i) {
      const double base = std::sin(0.37 * static_cast<double>(pos + t) + 0.11 * i + 1.3 * l);
      k[static_cast<size_t>(t * 64 + i)] = static_cast<float>(base);
      v[static_cast<size_t>(t * 64 + i)] = static_cast<float>(0.5 * base + 0.01 * i);
    }
  }
}

// Appends n tokens to t (reserve, write every layer, commit).
void append(BlockTable& t, int64_t n) {
  ASSERT_TRUE(t.reserve(n).ok());
  std::vector<float> k, v;
  for (int l = 0; l < 2; ++l) {
    rows_for(l, t.length(), n, k, v);
    t.write(l, t.length(), k.data(), v.data(), n);
  }
  t.commit(n);
}

// What the pool stores for logical position pos of layer l (decoded), by
// the table's slot map.
std::vector<float> stored(const BlockTable& t, int l, int64_t pos) {
  const GroupTable& g = t.group(0);
  const int64_t slot = g.slot_of(pos);
  KV_CHECK(slot >= 0, "position not resident");
  std::vector<float> kv(128);
  read_kv(t.pool().group_layer_view(0, l), g.ids(), slot, 1, kv.data(), kv.data() + 64);
  return kv;
}

TEST(RetentionParse, AcceptsPoliciesAndNamesEveryError) {
  auto c = parse_retention("streamingllm:sinks=4,window=1024");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->policy, RetentionPolicy::kStreamingLlm);
  EXPECT_EQ(c->sinks, 4);
  EXPECT_EQ(c->window, 1024);
  EXPECT_EQ(c->slack, 0);
  EXPECT_EQ(retention_name(*c), "streamingllm:sinks=4,window=1024");
  auto d = parse_retention("streamingllm:window=8,slack=1,sinks=0");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(retention_name(*d), "streamingllm:sinks=0,window=8,slack=1");
  auto h = parse_retention("h2o:window=16,budget=64,slack=2");
  ASSERT_TRUE(h.ok()) << h.error().message;
  EXPECT_TRUE(h->is_h2o());
  EXPECT_EQ(h->budget, 64);
  EXPECT_EQ(h->window, 16);
  EXPECT_EQ(h->obs, 32);
  EXPECT_TRUE(h->per_layer_groups());
  EXPECT_EQ(retention_name(*h), "h2o:budget=64,window=16,slack=2,obs=32");
  auto h0 = parse_retention("h2o:budget=8,window=4,obs=0");
  ASSERT_TRUE(h0.ok());
  EXPECT_EQ(h0->observed_rows(), 0);
  auto none = parse_retention("none");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->active());
  const std::pair<const char*, const char*> bad[] = {
      {"lru:budget=3", "unknown policy 'lru'"},
      {"h2o:budget=3", "h2o needs budget=N (heavy hitters) and window=N"},
      {"h2o:window=3", "h2o needs budget=N"},
      {"h2o:budget=0,window=3", "budget=0 must be >= 1"},
      {"h2o:budget=2,window=3,obs=-1", "obs=-1 must be in"},
      {"h2o:budget=2,window=3,sinks=1", "unknown h2o parameter 'sinks'"},
      {"h2o:budget=2,window=3,gqa=union", "unknown h2o parameter 'gqa'"},
      {"streamingllm:sinks=4", "needs window=N"},
      {"streamingllm:window=0", "window=0 must be >= 1"},
      {"streamingllm:window=x", "window='x' is not an integer"},
      {"streamingllm:window=8,sinks=-1", "sinks=-1 must be >= 0"},
      {"streamingllm:window=8,slack=0", "slack=0 must be >= 1"},
      {"streamingllm:window=8,budget=3", "unknown streamingllm parameter 'budget'"},
      {"streamingllm:window", "'window' is not key=value"},
      {"none:window=3", "takes no parameters"},
  };
  for (const auto& [spec, msg] : bad) {
    auto r = parse_retention(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.error().code, Errc::kInvalidArgument);
    EXPECT_NE(r.error().message.find(msg), std::string::npos) << spec << ": " << r.error().message;
  }
}

// StreamingLLM from its definition: a query at position >= L sees the sinks
// [0, S) and [L - W + 1, L); every other resident position may go.
TEST(RetentionSelect, StreamingLlmMatchesDefinition) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t sinks = static_cast<int64_t>(rng() % 6);
    const int64_t window = 1 + static_cast<int64_t>(rng() % 40);
    const int64_t length = static_cast<int64_t>(rng() % 80);
    // Resident positions: a random ascending subset of [0, length).
    std::vector<int32_t> pos;
    for (int32_t p = 0; p < length; ++p) {
      if (trial % 2 == 0 || rng() % 3 != 0) pos.push_back(p);
    }
    const RetentionConfig c{
        .policy = RetentionPolicy::kStreamingLlm, .sinks = sinks, .window = window};
    const std::vector<int64_t> keep = retention_keep_slots(c, pos, length);
    std::vector<int64_t> want;
    for (size_t i = 0; i < pos.size(); ++i) {
      const bool sink = pos[i] < sinks;
      const bool recent = pos[i] + window - 1 >= length;  // visible from query position `length`
      if (sink || recent) want.push_back(static_cast<int64_t>(i));
    }
    EXPECT_EQ(keep, want) << "trial " << trial;
    if (sinks + window - 1 >= length) {
      EXPECT_EQ(keep.size(), pos.size()) << "window covers everything";
    }
  }
}

// SnapKV's selection written from the paper's definition, independently of
// snapkv_mark_unit: votes summed in double, max-pooling over a -inf padded
// array, and "kept" = fewer than `budget` keys rank strictly before it
// (higher pooled vote, or equal and earlier).
std::vector<int64_t> snapkv_reference(const RetentionConfig& c, const std::vector<float>& attn,
                                      int64_t n_units, int group, int64_t n_obs, int64_t n_keys) {
  const int64_t n_prefix = n_keys - n_obs;
  std::set<int64_t> kept;
  for (int64_t j = n_prefix; j < n_keys; ++j) kept.insert(j);
  auto select = [&](const std::vector<double>& vote) {
    if (n_prefix <= c.budget) {
      for (int64_t j = 0; j < n_prefix; ++j) kept.insert(j);
      return;
    }
    const int64_t half = c.kernel / 2;
    std::vector<double> padded(static_cast<size_t>(n_prefix + 2 * half),
                               -std::numeric_limits<double>::infinity());
    for (int64_t j = 0; j < n_prefix; ++j) padded[static_cast<size_t>(j + half)] = vote[j];
    std::vector<double> pooled(static_cast<size_t>(n_prefix));
    for (int64_t j = 0; j < n_prefix; ++j) {
      pooled[j] = *std::max_element(padded.begin() + j, padded.begin() + j + c.kernel);
    }
    for (int64_t j = 0; j < n_prefix; ++j) {
      int64_t before = 0;
      for (int64_t t = 0; t < n_prefix; ++t) {
        before += pooled[t] > pooled[j] || (pooled[t] == pooled[j] && t < j);
      }
      if (before < c.budget) kept.insert(j);
    }
  };
  auto at = [&](int64_t u, int h, int64_t r, int64_t j) {
    return static_cast<double>(
        attn[static_cast<size_t>(((u * group + h) * n_obs + r) * n_keys + j)]);
  };
  for (int64_t u = 0; u < n_units; ++u) {
    if (c.gqa == GqaRule::kMean) {
      std::vector<double> vote(static_cast<size_t>(n_prefix), 0.0);
      for (int64_t j = 0; j < n_prefix; ++j) {
        for (int h = 0; h < group; ++h) {
          for (int64_t r = 0; r < n_obs; ++r) vote[j] += at(u, h, r, j);
        }
        vote[j] /= group;
      }
      select(vote);
    } else {
      for (int h = 0; h < group; ++h) {
        std::vector<double> vote(static_cast<size_t>(n_prefix), 0.0);
        for (int64_t j = 0; j < n_prefix; ++j) {
          for (int64_t r = 0; r < n_obs; ++r) vote[j] += at(u, h, r, j);
        }
        select(vote);
      }
    }
  }
  return {kept.begin(), kept.end()};
}

// Synthetic attention: causal rows of probabilities that are multiples of
// 1/1024 (sums exact in double whatever the order), drawn from few values so
// that votes tie; some rows put all mass on one key.
TEST(RetentionSelect, SnapKvMatchesDefinition) {
  std::mt19937 rng(17);
  int n_checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int group = 1 << (trial % 3);  // 1, 2, 4 query heads per KV head
    const int64_t n_units = 1 + trial % 3;
    const int64_t n_keys = 1 + static_cast<int64_t>(rng() % 40);
    // Windows larger than the context are clamped by the caller to n_keys.
    const int64_t window = 1 + static_cast<int64_t>(rng() % 12);
    const int64_t n_obs = std::min(window, n_keys);
    RetentionConfig c{.policy = RetentionPolicy::kSnapKv,
                      .window = window,
                      .budget = 1 + static_cast<int64_t>(rng() % 10),
                      .kernel = 1 + 2 * static_cast<int64_t>(rng() % 4),
                      .gqa = trial % 2 == 0 ? GqaRule::kUnion : GqaRule::kMean};
    std::vector<float> attn(static_cast<size_t>(n_units * group * n_obs * n_keys), 0.0f);
    for (int64_t row = 0; row < n_units * group * n_obs; ++row) {
      const int64_t r = row % n_obs;
      const int64_t visible = n_keys - n_obs + r + 1;
      std::vector<int> w(static_cast<size_t>(visible));
      if (rng() % 5 == 0) {
        w[rng() % visible] = 1024;
      } else {
        int left = 1024;
        for (int64_t j = 0; j + 1 < visible; ++j) {
          const int x = std::min(left, static_cast<int>(rng() % 4) * 16);
          w[j] = x;
          left -= x;
        }
        w[visible - 1] += left;
      }
      for (int64_t j = 0; j < visible; ++j) {
        attn[static_cast<size_t>(row * n_keys + j)] = static_cast<float>(w[j] / 1024.0);
      }
    }
    const std::vector<int64_t> got = snapkv_select(c, attn, n_units, group, n_obs, n_keys);
    const std::vector<int64_t> want = snapkv_reference(c, attn, n_units, group, n_obs, n_keys);
    ASSERT_EQ(got, want) << "trial " << trial << " group " << group << " keys " << n_keys << " obs "
                         << n_obs << " budget " << c.budget << " kernel " << c.kernel;
    if (n_keys - n_obs <= c.budget) {
      EXPECT_EQ(static_cast<int64_t>(got.size()), n_keys) << "budget covers the prefix";
    }
    if (c.gqa == GqaRule::kMean && n_keys - n_obs > c.budget) {
      EXPECT_EQ(static_cast<int64_t>(got.size()) <= n_obs + n_units * c.budget, true);
    }
    ++n_checked;
  }
  EXPECT_EQ(n_checked, 300);
  // PyramidKV's per-layer budgets: linear from 2B - B/beta down to B/beta.
  for (auto [budget, beta, n_layers] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {1024, 20, 30}, {64, 4, 7}, {5, 20, 3}, {100, 1, 12}, {7, 3, 1}}) {
    const RetentionConfig pc{
        .policy = RetentionPolicy::kPyramidKv, .window = 8, .budget = budget, .beta = beta};
    const int64_t last = std::max<int64_t>(1, budget / beta);
    int64_t sum = 0;
    for (int l = 0; l < n_layers; ++l) {
      const int64_t k = retention_layer_budget(pc, l, n_layers);
      if (l > 0) {
        EXPECT_LE(k, retention_layer_budget(pc, l - 1, n_layers)) << "decreasing";
      }
      EXPECT_GE(k, 1);
      sum += k;
    }
    if (n_layers > 1) {
      EXPECT_EQ(retention_layer_budget(pc, 0, n_layers), 2 * budget - last);
      EXPECT_EQ(retention_layer_budget(pc, n_layers - 1, n_layers), last);
      // The mean is the budget up to the rounding down of each layer.
      EXPECT_LE(sum, budget * n_layers);
      EXPECT_GE(sum, budget * n_layers - n_layers);
    } else {
      EXPECT_EQ(sum, budget);
    }
    EXPECT_EQ(
        retention_layer_budget({.policy = RetentionPolicy::kSnapKv, .budget = budget}, 0, n_layers),
        budget);
  }
  EXPECT_EQ(retention_name(*parse_retention("pyramidkv:budget=128,beta=10,gqa=mean")),
            "pyramidkv:budget=128,beta=10,window=32,kernel=7,gqa=mean");
  EXPECT_NE(parse_retention("pyramidkv:budget=8,beta=0").error().message.find("beta=0"),
            std::string::npos);
  EXPECT_NE(parse_retention("pyramidkv:window=8").error().message.find("pyramidkv needs budget"),
            std::string::npos);
  // A parse round trip of every SnapKV parameter.
  auto p = parse_retention("snapkv:budget=64,window=16,kernel=5,gqa=mean");
  ASSERT_TRUE(p.ok()) << p.error().message;
  EXPECT_EQ(retention_name(*p), "snapkv:budget=64,window=16,kernel=5,gqa=mean");
  EXPECT_EQ(retention_name(*parse_retention("snapkv:budget=8")),
            "snapkv:budget=8,window=32,kernel=7,gqa=union");
  for (const auto& [spec, msg] : std::vector<std::pair<const char*, const char*>>{
           {"snapkv:window=8", "needs budget=N"},
           {"snapkv:budget=8,kernel=4", "kernel=4 must be odd"},
           {"snapkv:budget=8,gqa=max", "gqa='max' must be union or mean"},
           {"snapkv:budget=0", "budget=0 must be >= 1"},
           {"snapkv:budget=8,sinks=2", "unknown snapkv parameter 'sinks'"}}) {
    auto r = parse_retention(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_NE(r.error().message.find(msg), std::string::npos) << spec << ": " << r.error().message;
  }
}

class Compaction : public ::testing::TestWithParam<KvDtype> {};

// Random keep sets on a table with scattered blocks: every survivor's stored
// bytes and logical position survive, the freed blocks go back, new tokens
// take position = logical length, and the pool's invariants hold.
TEST_P(Compaction, SurvivorsKeepBytesAndPositionsAndBlocksReturn) {
  for (int block_size : {1, 4, 8}) {
    auto pool = make_pool(GetParam(), block_size, 4096);
    // `ref` receives the same tokens and is never compacted.
    BlockTable junk(*pool), t(*pool), ref(*pool);
    std::mt19937 rng(static_cast<unsigned>(block_size));
    for (int round = 0; round < 6; ++round) {
      append(junk, 3);  // interleave blocks of another table
      const int64_t n = 5 + static_cast<int64_t>(rng() % 23);
      append(t, n);
      append(ref, n);
      const GroupTable& g = t.group(0);
      std::vector<int64_t> keep;
      std::vector<int64_t> kept_pos;
      for (int64_t s = 0; s < g.length(); ++s) {
        if (rng() % 3 != 0) {
          keep.push_back(s);
          kept_pos.push_back(g.position(s));
        }
      }
      std::vector<std::vector<float>> before;
      for (int64_t p : kept_pos) {
        for (int l = 0; l < 2; ++l) before.push_back(stored(t, l, p));
      }
      const int64_t logical = t.length();
      const int64_t free_before = pool->n_free();
      const int64_t blocks_before = g.n_blocks();
      const int64_t slots_before = g.length();
      RetentionStats st;
      ASSERT_TRUE(t.group(0).compact(keep, &st).ok());
      pool->check_invariants();
      const auto n_keep = static_cast<int64_t>(keep.size());
      EXPECT_EQ(t.length(), logical) << "logical length never shrinks";
      EXPECT_EQ(g.length(), n_keep);
      EXPECT_EQ(g.n_blocks(), (n_keep + block_size - 1) / block_size);
      EXPECT_EQ(st.n_blocks_freed, blocks_before - g.n_blocks());
      EXPECT_EQ(pool->n_free() - free_before, st.n_blocks_freed);
      EXPECT_EQ(st.n_tokens_dropped, slots_before - n_keep);
      EXPECT_EQ(g.n_evicted(), logical - n_keep);
      size_t bi = 0;
      for (size_t i = 0; i < kept_pos.size(); ++i) {
        EXPECT_EQ(g.position(static_cast<int64_t>(i)), kept_pos[i]);
        for (int l = 0; l < 2; ++l) {
          const std::vector<float> now = stored(t, l, kept_pos[i]);
          EXPECT_EQ(std::memcmp(now.data(), before[bi].data(), now.size() * 4), 0)
              << "block " << block_size << " round " << round << " position " << kept_pos[i];
          ++bi;
        }
      }
      // A dropped position is gone from the slot map.
      for (int64_t p = 0; p < logical; ++p) {
        const bool kept = std::find(kept_pos.begin(), kept_pos.end(), p) != kept_pos.end();
        EXPECT_EQ(g.slot_of(p) >= 0, kept) << p;
      }
      // The next tokens continue at the logical length; every resident
      // position holds what the uncompacted table holds for it.
      append(t, 2);
      append(ref, 2);
      EXPECT_EQ(g.position(g.length() - 1), logical + 1);
      for (int64_t s = 0; s < g.length(); ++s) {
        for (int l = 0; l < 2; ++l) {
          EXPECT_EQ(stored(t, l, g.position(s)), stored(ref, l, g.position(s)))
              << "slot " << s << " layer " << l;
        }
      }
      pool->check_invariants();
    }
    t.release();
    junk.release();
    ref.release();
    EXPECT_EQ(pool->n_free(), pool->n_blocks());
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Compaction,
                         ::testing::Values(KvDtype::kF32, KvDtype::kF16, KvDtype::kInt8,
                                           KvDtype::kInt4));

// A fork shares every block: compacting one side copies the blocks it writes
// (copy-on-write) and leaves the other side's bytes alone; with no block to
// copy into, compaction fails and changes nothing.
TEST(Compaction, SharedBlocksAreCopiedNotWrittenAndFailureChangesNothing) {
  const int p = 4;
  auto pool = make_pool(KvDtype::kF16, p, 16 * p);
  BlockTable a(*pool);
  append(a, 10 * p);
  BlockTable b = a.fork();
  std::vector<std::vector<float>> b_rows;
  for (int64_t pos = 0; pos < b.length(); ++pos) b_rows.push_back(stored(b, 0, pos));
  // Keep positions 0, 1 and the last 2p: destinations in blocks 0..2 move.
  std::vector<int64_t> keep = {0, 1};
  for (int64_t s = 8 * p; s < 10 * p; ++s) keep.push_back(s);
  // Exhaust the pool: 6 blocks free, then take them all.
  BlockTable filler(*pool);
  ASSERT_TRUE(filler.reserve(pool->n_free() * p).ok());
  const int64_t used = pool->stats().n_blocks_used;
  RetentionStats st;
  const Status fail = a.group(0).compact(keep, &st);
  ASSERT_FALSE(fail.ok());
  EXPECT_EQ(fail.error().code, Errc::kOutOfBlocks);
  EXPECT_EQ(a.group(0).length(), 10 * p);
  EXPECT_FALSE(a.compacted());
  EXPECT_EQ(pool->stats().n_blocks_used, used);
  EXPECT_EQ(st.n_compactions, 0);
  pool->check_invariants();
  // Through apply_retention the failure is a deferral, retried later.
  ASSERT_TRUE(
      a.set_retention({.policy = RetentionPolicy::kStreamingLlm, .sinks = 2, .window = 2 * p + 1})
          .ok());
  EXPECT_EQ(a.apply_retention(), 0);
  EXPECT_EQ(a.retention_stats().n_deferred, 1);
  filler.release();
  EXPECT_GT(a.apply_retention(), 0);
  pool->check_invariants();
  EXPECT_TRUE(a.compacted());
  EXPECT_EQ(a.group(0).length(), 2 + 2 * p);
  EXPECT_GT(a.retention_stats().n_bytes_moved, 0);
  for (int64_t pos = 0; pos < b.length(); ++pos) {
    EXPECT_EQ(stored(b, 0, pos), b_rows[static_cast<size_t>(pos)]) << "fork's position " << pos;
  }
  for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{8 * p}, int64_t{10 * p - 1}}) {
    EXPECT_EQ(stored(a, 0, pos), b_rows[static_cast<size_t>(pos)]) << "compacted position " << pos;
  }
  a.release();
  b.release();
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
}

// A table whose every full block is published (a prompt before its first
// compaction) compacted on a full pool: each copy-on-write copy takes the
// block an earlier copy just released, which must be evictable at once
// (the copies run newest first, so every released original is a leaf of
// the prefix tree). Ascending copies left the released originals above a
// still-held published block and aborted in take_free. With a published
// block past the survivors still held, each copy needs its own block: on a
// full pool that is a clean kOutOfBlocks, nothing changed.
TEST(Compaction, PublishedBlocksAreCopiedOnAFullPool) {
  const int p = 4;
  for (const bool tail_published : {false, true}) {
    SCOPED_TRACE(tail_published ? "published tail" : "partial tail");
    auto pool = make_pool(KvDtype::kF16, p, 20 * p);
    PrefixIndex index(*pool);
    BlockTable t(*pool);
    // 9 blocks: all full and published, or the ninth partly filled.
    const int64_t n = tail_published ? 9 * p : 8 * p + 3;
    append(t, n);
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(100 + i);
    const NamespaceId ns = index.intern_namespace(Hash128{7, 7});
    index.acquire_namespace(ns);  // as a live Sequence does
    ASSERT_EQ(index.publish(ns, t, tokens, 0), n / p);
    // Leave one block free, nothing cached.
    BlockTable filler(*pool);
    ASSERT_TRUE(filler.reserve((pool->n_free() - 1) * p).ok());
    ASSERT_EQ(pool->n_available(), 1);
    // Drop slots 1..(3 or 5): the survivors fill blocks 0..7, all published
    // (each copied), and block 8 is released after the moves.
    std::vector<int64_t> keep = {0};
    for (int64_t s = tail_published ? 6 : 4; s < n; ++s) keep.push_back(s);
    ASSERT_EQ((static_cast<int64_t>(keep.size()) + p - 1) / p, 8);
    std::vector<std::vector<float>> rows;
    rows.reserve(keep.size());
    for (int64_t s : keep) rows.push_back(stored(t, 0, s));
    RetentionStats st;
    const Status c = t.group(0).compact(keep, &st);
    pool->check_invariants();
    index.check_invariants();
    if (tail_published) {
      // Block 8 stays published and held until the moves are done, so
      // blocks 0..7's originals cannot be evicted before: 8 blocks needed.
      ASSERT_FALSE(c.ok());
      EXPECT_EQ(c.error().code, Errc::kOutOfBlocks);
      EXPECT_EQ(t.group(0).length(), n);
      EXPECT_FALSE(t.compacted());
      filler.release();
      ASSERT_TRUE(t.group(0).compact(keep, &st).ok()) << "after the pool has room";
      pool->check_invariants();
      index.check_invariants();
    } else {
      ASSERT_TRUE(c.ok()) << c.error().message;
    }
    EXPECT_EQ(t.group(0).length(), static_cast<int64_t>(keep.size()));
    for (size_t i = 0; i < keep.size(); ++i) {
      EXPECT_EQ(stored(t, 0, keep[i]), rows[i]) << "survivor at position " << keep[i];
    }
    for (int32_t b : t.group(0).ids()) EXPECT_FALSE(index.is_published(b)) << "block " << b;
    t.release();
    filler.release();
    index.release_namespace(ns);
    pool->check_invariants();
    EXPECT_EQ(pool->n_available(), pool->n_blocks());
  }
}

// A long StreamingLLM run through reserve/commit: resident slots and used
// blocks stay bounded by the budget while
// the logical length grows; invariants after every step; counters add up.
TEST(Compaction, StreamingRunStaysWithinBudget) {
  const int p = 8;
  const int64_t sinks = 4, window = 40, n_steps = 600;
  auto pool = make_pool(KvDtype::kF16, p, 4096);
  BlockTable t(*pool);
  ASSERT_TRUE(
      t.set_retention({.policy = RetentionPolicy::kStreamingLlm, .sinks = sinks, .window = window})
          .ok());
  const int64_t max_slots = sinks + window - 1 + p - 1 + 1;  // + slack - 1, + the new token
  const int64_t max_blocks = (max_slots + p - 1) / p + 1;
  const RetentionConfig rc{
      .policy = RetentionPolicy::kStreamingLlm, .sinks = sinks, .window = window};
  // What the scheduler reserves for one-token steps covers every step here.
  EXPECT_GE(retention_peak_blocks(rc, 1000, p, 1), (max_slots + p - 1) / p);
  EXPECT_EQ(retention_peak_blocks(rc, 2, p, 1), 2) << "never more than the exact cache";
  EXPECT_EQ(retention_peak_blocks({}, 77, p, 1), 77);
  int64_t peak_blocks = 0;
  append(t, 30);  // a prompt, then decode
  for (int64_t i = 0; i < n_steps; ++i) {
    append(t, 1);
    pool->check_invariants();
    const GroupTable& g = t.group(0);
    ASSERT_LE(g.length(), max_slots) << "step " << i;
    peak_blocks = std::max(peak_blocks, pool->stats().n_blocks_used);
    // The sinks and the last window - 1 positions are resident.
    for (int64_t s = 0; s < sinks; ++s) ASSERT_GE(g.slot_of(s), 0);
    for (int64_t q = std::max<int64_t>(0, t.length() - window + 1); q < t.length(); ++q) {
      ASSERT_GE(g.slot_of(q), 0) << "step " << i << " position " << q;
    }
  }
  EXPECT_EQ(t.length(), 30 + n_steps);
  EXPECT_LE(peak_blocks, max_blocks);
  const BlockPoolStats s = pool->stats();
  // Freed blocks are reused (LIFO): the blocks ever handed out stay few.
  // (resident_bytes is checked end to end on a real model, where blocks are
  // larger than a transparent huge page's rounding: test_kv_retention_cli.)
  EXPECT_LE(s.n_allocations - s.n_releases, max_blocks);
  const RetentionStats& rs = t.retention_stats();
  EXPECT_EQ(rs.n_tokens_dropped, t.length() - t.group(0).length());
  EXPECT_EQ(s.retention.n_tokens_dropped, rs.n_tokens_dropped);
  EXPECT_EQ(s.retention.n_blocks_freed, rs.n_blocks_freed);
  EXPECT_GE(rs.n_blocks_freed, (t.length() - max_slots) / p - 1);
  EXPECT_GT(rs.n_bytes_moved, 0);
  t.release();
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
}

// H2O's selection from its definition: the `window` most recent slots stay;
// an older slot stays when fewer than `budget` older slots rank strictly
// before it (higher mass, or equal mass and earlier). Masses from a small
// set of values (many exact ties), windows and budgets larger than the
// sequence.
TEST(RetentionSelect, H2oKeepSlotsMatchesDefinition) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = static_cast<int64_t>(rng() % 70);
    const int64_t budget = 1 + static_cast<int64_t>(rng() % 30);
    const int64_t window = 1 + static_cast<int64_t>(rng() % 40);
    std::vector<float> mass(static_cast<size_t>(n));
    for (float& m : mass)
      m = trial % 3 == 0 ? static_cast<float>(rng() % 4) * 0.25f : (rng() % 1000) / 7.0f;
    const RetentionConfig c{.policy = RetentionPolicy::kH2o, .window = window, .budget = budget};
    const std::vector<int64_t> keep = h2o_keep_slots(c, mass);
    std::vector<int64_t> want;
    const int64_t n_old = std::max<int64_t>(0, n - window);
    for (int64_t i = 0; i < n; ++i) {
      if (i >= n_old) {
        want.push_back(i);
        continue;
      }
      int64_t before = 0;
      for (int64_t j = 0; j < n_old; ++j) {
        const double mj = mass[static_cast<size_t>(j)], mi = mass[static_cast<size_t>(i)];
        before += (mj > mi || (mj == mi && j < i)) ? 1 : 0;
      }
      if (before < budget) want.push_back(i);
    }
    EXPECT_EQ(keep, want) << "trial " << trial << " n " << n << " budget " << budget << " window "
                          << window;
    EXPECT_EQ(static_cast<int64_t>(keep.size()), std::min(n, budget + window));
  }
}

// H2O on a table: compaction keeps h2o_keep_slots' slots with their mass and
// positions; prompts (multi-token steps) never compact.
TEST(Compaction, H2oCarriesMassAndPositions) {
  auto pool = make_pool(KvDtype::kF16, 4, 256);
  BlockTable t(*pool);
  const RetentionConfig rc{
      .policy = RetentionPolicy::kH2o, .window = 3, .slack = 1, .budget = 4, .obs = 0};
  ASSERT_TRUE(t.set_retention(rc).ok());
  append(t, 12);  // a prompt: nothing dropped
  EXPECT_FALSE(t.compacted());
  // Decode-time mass (what the kernels would add), then a one-token step.
  float* m = t.key_mass(0, 12);
  const float vals[12] = {5, 1, 9, 9, 0, 2, 7, 3, 8, 1, 1, 1};
  std::copy(vals, vals + 12, m);
  std::vector<std::vector<float>> before;
  for (int64_t p = 0; p < 12; ++p) before.push_back(stored(t, 0, p));
  append(t, 1);
  EXPECT_TRUE(t.compacted());
  const GroupTable& g = t.group(0);
  // Kept: the top 4 of the older 9 (masses 9, 9, 8, 7: positions 2, 3, 8,
  // 6), the recent 9, 10, 11, then the new 12.
  const std::vector<int64_t> want_pos = {2, 3, 6, 8, 9, 10, 11, 12};
  ASSERT_EQ(g.length(), static_cast<int64_t>(want_pos.size()));
  for (size_t i = 0; i < want_pos.size(); ++i) {
    EXPECT_EQ(g.position(static_cast<int64_t>(i)), want_pos[i]) << i;
    if (want_pos[i] < 12) {
      EXPECT_EQ(stored(t, 0, want_pos[i]), before[static_cast<size_t>(want_pos[i])])
          << "position " << want_pos[i];
    }
  }
  const std::span<const float> mass = t.group_mass(0);
  const std::vector<float> want_mass = {9, 9, 7, 8, 1, 1, 1};
  for (size_t i = 0; i < want_mass.size(); ++i) EXPECT_EQ(mass[i], want_mass[i]) << i;
  EXPECT_EQ(t.retention_stats().n_tokens_dropped, 5);
  pool->check_invariants();
  t.release();
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
}

// The bench-only switch (kvstack bench --mass-ab): with the mass output off
// the table asks for no key mass (its forks and clones neither), and H2O
// still compacts on the mass it had, keeping the same number of tokens.
TEST(Compaction, H2oMassOutputOffStillCompacts) {
  auto pool = make_pool(KvDtype::kF16, 4, 256);
  BlockTable t(*pool);
  const RetentionConfig rc{
      .policy = RetentionPolicy::kH2o, .window = 3, .slack = 1, .budget = 4, .obs = 0};
  ASSERT_TRUE(t.set_retention(rc).ok());
  append(t, 12);
  float* m = t.key_mass(0, 12);
  const float vals[12] = {5, 1, 9, 9, 0, 2, 7, 3, 8, 1, 1, 1};
  std::copy(vals, vals + 12, m);
  EXPECT_TRUE(t.wants_mass());
  t.set_mass_output(false);
  EXPECT_FALSE(t.wants_mass());
  EXPECT_FALSE(t.fork().wants_mass());
  auto c = t.clone_private();
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->wants_mass());
  c->release();
  append(t, 1);
  EXPECT_TRUE(t.compacted());
  const std::vector<int64_t> want_pos = {2, 3, 6, 8, 9, 10, 11, 12};  // as with the output on
  ASSERT_EQ(t.group(0).length(), static_cast<int64_t>(want_pos.size()));
  for (size_t i = 0; i < want_pos.size(); ++i)
    EXPECT_EQ(t.group(0).position(static_cast<int64_t>(i)), want_pos[i]) << i;
  t.set_mass_output(true);
  EXPECT_TRUE(t.wants_mass());
  pool->check_invariants();
  t.release();
  EXPECT_EQ(pool->n_free(), pool->n_blocks());
}

// f16 key bounds: f16_bound_down(x) is the largest f16 <= x and
// f16_bound_up(x) the smallest >= x (adjacent f16 values around x, equal
// when x is one), over normal, subnormal, zero and out-of-range values.
TEST(RetentionSelect, F16BoundsRoundOutwards) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> xs = {0.0f, -0.0f, 1.0f,  -1.0f,  65504.0f, -65504.0f, 65505.0f, -65505.0f,
                           1e6f, -1e6f, 6e-8f, -6e-8f, 1e-10f,   -1e-10f,   3.0e-5f,  0.1f};
  for (int i = 0; i < 20000; ++i) {
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 50) - 30);
    xs.push_back(nd(rng) * scale);
  }
  for (const float x : xs) {
    const uint16_t lo = f16_bound_down(x), hi = f16_bound_up(x);
    const float l = f16_to_f32(lo), h = f16_to_f32(hi);
    ASSERT_LE(l, x) << x;
    ASSERT_GE(h, x) << x;
    if (l == x) {
      EXPECT_EQ(h, x) << x;
    } else {
      // No f16 strictly between: round-to-nearest gives one of the two.
      const uint16_t nearest = f32_to_f16(x);
      EXPECT_TRUE(nearest == lo || nearest == hi) << x;
    }
  }
  EXPECT_EQ(f16_to_f32(f16_bound_up(1e6f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_to_f32(f16_bound_down(1e6f)), 65504.0f);
}

// Quest's block choice: the bound from the f16 summary is an upper bound of
// every q.k in the block (for every q head); the choice is the sink blocks,
// the recent blocks and the best-bound rest (ties: the earlier block),
// ascending, k blocks in all.
TEST(RetentionSelect, TopKBlocksBoundAndChoice) {
  auto c = parse_retention("topk:k=4");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_TRUE(c->is_topk());
  EXPECT_EQ(c->topk, 4);
  EXPECT_EQ(c->topk_sink, 1);
  EXPECT_EQ(c->topk_recent, 1);
  EXPECT_EQ(retention_name(*c), "topk:k=4,sink=1,recent=1");
  auto c2 = parse_retention("topk:recent=3,k=9,sink=0");
  ASSERT_TRUE(c2.ok()) << c2.error().message;
  EXPECT_EQ(c2->topk, 9);
  EXPECT_EQ(c2->topk_sink, 0);
  EXPECT_EQ(c2->topk_recent, 3);
  EXPECT_EQ(retention_name(*c2), "topk:k=9,sink=0,recent=3");
  for (const char* bad : {"topk", "topk:k=0", "topk:k=x", "topk:n=3", "topk:k=2,window=3",
                          "topk:sink=1", "topk:k=3,sink=-1", "topk:k=3,recent=y"}) {
    EXPECT_FALSE(parse_retention(bad).ok()) << bad;
  }
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int n_q = 6, n_kv = 2, d = 8, P = 4, g = n_q / n_kv;
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n_full = 1 + static_cast<int64_t>(rng() % 12);
    const int64_t k = 1 + static_cast<int64_t>(rng() % 14);
    const int64_t n_sink = trial % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 3);
    const int64_t n_recent = trial % 4 == 1 ? 0 : static_cast<int64_t>(rng() % 3);
    std::vector<float> keys(static_cast<size_t>(n_full * P * n_kv * d)), q(n_q * d);
    for (float& x : keys) x = trial % 5 == 0 ? static_cast<float>(rng() % 3) : nd(rng) * 7.3f;
    for (float& x : q) x = nd(rng);
    std::vector<uint16_t> summ(static_cast<size_t>(n_full * n_kv * 2 * d));
    for (int64_t b = 0; b < n_full; ++b) {
      for (int h = 0; h < n_kv; ++h) {
        for (int ch = 0; ch < d; ++ch) {
          float mn = INFINITY, mx = -INFINITY;
          for (int t = 0; t < P; ++t) {
            const float x = keys[static_cast<size_t>(((b * P + t) * n_kv + h) * d + ch)];
            mn = std::min(mn, x);
            mx = std::max(mx, x);
          }
          summ[static_cast<size_t>(((b * n_kv + h) * 2) * d + ch)] = f16_bound_down(mn);
          summ[static_cast<size_t>(((b * n_kv + h) * 2 + 1) * d + ch)] = f16_bound_up(mx);
        }
      }
    }
    // Reference bound per block (float64 over the f16 summary) and the choice.
    auto bound_of = [&](int64_t b, int h, int ch, int which) {
      return double{
          f16_to_f32(summ[static_cast<size_t>(((b * n_kv + h / g) * 2 + which) * d + ch)])};
    };
    std::vector<double> ub(static_cast<size_t>(n_full));
    for (int64_t b = 0; b < n_full; ++b) {
      double best = -INFINITY;
      for (int h = 0; h < n_q; ++h) {
        double bound = 0;
        for (int ch = 0; ch < d; ++ch) {
          const double qc = q[static_cast<size_t>(h) * d + ch];
          bound += std::max(qc * bound_of(b, h, ch, 0), qc * bound_of(b, h, ch, 1));
        }
        best = std::max(best, bound);
        for (int t = 0; t < P; ++t) {  // the bound bounds every key of the block
          double dot = 0;
          for (int ch = 0; ch < d; ++ch) {
            dot += double{q[static_cast<size_t>(h) * d + ch]} *
                   keys[static_cast<size_t>(((b * P + t) * n_kv + h / g) * d + ch)];
          }
          EXPECT_LE(dot, bound + 1e-9 * (1 + std::abs(bound)));
        }
      }
      ub[static_cast<size_t>(b)] = best;
    }
    const std::vector<int64_t> got =
        topk_blocks(q, n_q, n_kv, d, summ, n_full, k, n_sink, n_recent);
    std::vector<int64_t> want;
    if (n_full <= k) {
      for (int64_t b = 0; b < n_full; ++b) want.push_back(b);
    } else {
      const int64_t s = std::min(n_sink, k), r = std::min(n_recent, k - s);
      const int64_t rest = k - s - r;
      for (int64_t b = 0; b < n_full; ++b) {
        if (b < s || b >= n_full - r) {
          want.push_back(b);
          continue;
        }
        int64_t before = 0;  // ranked candidates ahead of b
        for (int64_t o = s; o < n_full - r; ++o) {
          // float sums: compare with the tolerance of their rounding
          const bool higher = ub[static_cast<size_t>(o)] > ub[static_cast<size_t>(b)] + 1e-4;
          const bool tie =
              std::abs(ub[static_cast<size_t>(o)] - ub[static_cast<size_t>(b)]) <= 1e-4;
          before += (higher || (tie && o < b)) ? 1 : 0;
        }
        if (before < rest) want.push_back(b);
      }
    }
    EXPECT_EQ(got, want) << "trial " << trial;
    EXPECT_EQ(static_cast<int64_t>(got.size()), std::min(n_full, k));
    EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
  }
}

TEST(Compaction, UnsupportedFormatsAreRefused) {
  for (KvDtype d : {KvDtype::kFp8, KvDtype::kKivi2}) {
    auto l = KvLayout::uniform(1, 1, 32, d, 32);
    ASSERT_TRUE(l.ok());
    const Status s = retention_supported(*l);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, Errc::kUnsupported);
    EXPECT_NE(s.error().message.find(kv_dtype_name(d)), std::string::npos) << s.error().message;
  }
  auto pool = make_pool(KvDtype::kF16, 4, 64);
  BlockTable t(*pool);
  EXPECT_FALSE(t.set_retention({.policy = RetentionPolicy::kStreamingLlm, .window = 0}).ok());
  EXPECT_FALSE(t.retention().active());
}

}  // namespace
}  // namespace kvstack

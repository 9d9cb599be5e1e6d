// Prefix-cache observability (KvManager::prefix_stats, the event sink) on a
// scripted scenario with exact expected counts, and the child table's
// verification path under forced lookup-hash collisions.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "engine/sequence.h"

namespace kvstack {
namespace {

CacheIdentity test_identity() {
  CacheIdentity id;
  id.weights_digest = Hash128{3, 4};
  id.arch_revision = "test";
  id.kv_format = "test";
  return id;
}

// Reserve, "write" (contents are not read here), commit, publish.
void step(Sequence& s, const std::vector<int32_t>& add) {
  ASSERT_TRUE(s.table().reserve(static_cast<int64_t>(add.size())).ok());
  s.table().commit(static_cast<int64_t>(add.size()));
  s.on_committed(add);
}

TEST(KvStats, ScriptedScenarioCountsExactly) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 32});  // 8 blocks of 4 tokens
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {});
  std::vector<KvEvent> events;
  ASSERT_TRUE(kv.set_event_sink([&](const KvEvent& e) { events.push_back(e); }).ok());
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  {
    Sequence a = kv.new_sequence(kv.namespace_for(""));
    EXPECT_EQ(a.adopt_cached_prefix(prompt), 0);  // query 1: 9 tokens offered, no hit
    step(a, prompt);                              // publishes 2 blocks
    Sequence b = kv.new_sequence(kv.namespace_for(""));
    EXPECT_EQ(b.adopt_cached_prefix(prompt), 8);  // query 2: 9 offered, 2 blocks hit
    step(b, {9, 10});
    Sequence f = b.fork();
    step(f, {11});  // the shared partial tail is copied first
    Sequence c = kv.new_sequence(kv.namespace_for("x"));
    EXPECT_EQ(c.adopt_cached_prefix(prompt), 0);  // query 3: other namespace, no hit
    step(c, prompt);                              // publishes 2 blocks of its own
    const KvPrefixStats s = kv.prefix_stats();
    EXPECT_TRUE(s.enabled);
    EXPECT_EQ(s.n_queries, 3);
    EXPECT_EQ(s.n_query_tokens, 27);
    EXPECT_EQ(s.n_hit_blocks, 2);
    EXPECT_EQ(s.n_hit_tokens, 8);
    EXPECT_DOUBLE_EQ(s.hit_rate, 8.0 / 27.0);
    EXPECT_EQ(s.n_published, 4);
    EXPECT_EQ(s.n_nodes, 4);
    EXPECT_EQ(s.n_cached_blocks, 0);
    EXPECT_EQ(s.n_cow_copies, 1);
    EXPECT_EQ(s.n_evictions, 0);
    ASSERT_EQ(s.namespaces.size(), 2u);
    EXPECT_EQ(s.namespaces[0].name, "default");
    EXPECT_EQ(s.namespaces[0].counts.n_queries, 2);
    EXPECT_EQ(s.namespaces[0].counts.n_hit_tokens, 8);
    EXPECT_EQ(s.namespaces[0].counts.n_nodes, 2);
    EXPECT_EQ(s.namespaces[1].name, "salt:x");
    EXPECT_EQ(s.namespaces[1].counts.n_queries, 1);
    EXPECT_EQ(s.namespaces[1].counts.n_hit_tokens, 0);
    EXPECT_EQ(s.namespaces[1].counts.n_nodes, 2);
  }
  // Everything released: the 4 published blocks stay cached.
  EXPECT_EQ(kv.prefix_stats().n_cached_blocks, 4);
  ASSERT_EQ(events.size(), 4u);
  for (const KvEvent& e : events) EXPECT_EQ(e.kind, KvEvent::Kind::kStored);
  EXPECT_EQ(events[0].parent_hash, Hash128{});
  EXPECT_EQ(events[1].parent_hash, events[0].hash);
  EXPECT_EQ(events[0].n_tokens, 4);
  // A late consumer sees the same tree, parents first.
  std::vector<KvEvent> replay;
  kv.index()->replay_stored([&](const KvEvent& e) { replay.push_back(e); });
  ASSERT_EQ(replay.size(), 4u);
  std::set<std::pair<uint64_t, uint64_t>> seen = {{0, 0}};
  for (const KvEvent& e : replay) {
    EXPECT_TRUE(seen.count({e.parent_hash.lo, e.parent_hash.hi})) << "child before its parent";
    seen.insert({e.hash.lo, e.hash.hi});
  }
  // A new 8-block sequence needs the whole pool: all 4 cached blocks are
  // evicted (4 removed events), then its 8 blocks are published.
  events.clear();
  Sequence y = kv.new_sequence(kv.namespace_for("y"));
  std::vector<int32_t> big(32);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(100 + i);
  step(y, big);
  const KvPrefixStats s = kv.prefix_stats();
  EXPECT_EQ(s.n_evictions, 4);
  EXPECT_EQ(s.n_nodes, 8);
  EXPECT_EQ(s.n_published, 12);
  // "default" and "x" lost their last blocks with no sequence using them:
  // they expired, and only y is listed (lifetime totals keep their counts).
  ASSERT_EQ(s.namespaces.size(), 1u);
  EXPECT_EQ(s.namespaces[0].name, "salt:y");
  EXPECT_EQ(s.namespaces[0].counts.n_nodes, 8);
  EXPECT_EQ(s.n_queries, 3);
  EXPECT_EQ(kv.index()->n_namespaces_expired(), 2);
  int n_removed = 0, n_stored = 0;
  for (const KvEvent& e : events) (e.kind == KvEvent::Kind::kRemoved ? n_removed : n_stored)++;
  EXPECT_EQ(n_removed, 4);
  EXPECT_EQ(n_stored, 8);
  // The formatted views carry the same numbers.
  const std::string json = prefix_stats_json(s);
  EXPECT_NE(json.find("\"evictions\": 4"), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\": \"salt:y\""), std::string::npos) << json;
  EXPECT_NE(format_prefix_stats(s).find("4 blocks"), std::string::npos);
  EXPECT_EQ(kv_event_json(events.back()).rfind("{\"event\":\"stored\",\"hash\":\"", 0), 0u);
  pool.check_invariants();
}

TEST(KvStats, DisabledCacheReportsOffAndRefusesEvents) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 32});
  ASSERT_TRUE(pool_r.ok());
  KvManager kv(**pool_r, test_identity(), {.prefix_cache = false});
  EXPECT_FALSE(kv.prefix_stats().enabled);
  EXPECT_FALSE(kv.set_event_sink([](const KvEvent&) {}).ok());
  KvEventFile f;
  const Status st = f.open(kv, "/dev/null");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("prefix cache"), std::string::npos);
}

// With every lookup hash equal (0 bits kept), each lookup walks one long
// probe run and must still find exactly the verified block; every other
// block with the same parent and namespace counts as a rejected collision.
TEST(PrefixIndexChildTable, ForcedLookupCollisionsStayCorrect) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 2);
  ASSERT_TRUE(layout.ok());
  for (int bits : {0, 3, 64}) {
    auto pool_r = BlockPool::create(*layout, {.n_tokens = 128});  // 64 blocks
    ASSERT_TRUE(pool_r.ok());
    BlockPool& pool = **pool_r;
    PrefixIndex index(pool, {.lookup_hash_bits = bits});
    const NamespaceId ns = index.intern_namespace(Hash128{9, 9});
    std::map<std::vector<int32_t>, std::vector<int32_t>> published;  // prompt -> blocks
    {
      std::vector<BlockTable> tables;
      for (int i = 0; i < 12; ++i) {
        // Siblings under one parent: same first block, different second.
        const std::vector<int32_t> toks = {7, 7, i, i + 1, 3, 3};
        BlockTable t(pool);
        ASSERT_TRUE(t.reserve(6).ok());
        t.commit(6);
        ASSERT_EQ(index.publish(ns, t, toks, 0), i == 0 ? 3 : 0);
        if (i > 0) {
          // The equal first block is a duplicate: adopt the published one.
          PrefixMatch m = index.match(ns, toks, 2, false);
          ASSERT_EQ(m.blocks.size(), 1u);
          BlockTable u(pool);
          u.adopt_prefix(std::move(m.blocks));
          ASSERT_TRUE(u.reserve(4).ok());
          u.commit(4);
          ASSERT_EQ(index.publish(ns, u, toks, 1), 3);
          t = std::move(u);
        }
        published[toks] = std::vector<int32_t>(t.ids().begin(), t.ids().end());
        tables.push_back(std::move(t));
      }
      pool.check_invariants();
    }
    // Every chain is found exactly (blocks now cached), and a near miss is a miss.
    for (const auto& [toks, ids] : published) {
      PrefixMatch m = index.match(ns, toks, 6, false);
      ASSERT_EQ(m.blocks.size(), 3u) << "bits " << bits;
      for (size_t j = 0; j < 3; ++j) EXPECT_EQ(m.blocks[j].id().value, ids[j]);
      std::vector<int32_t> other = toks;
      other[5] = 4;
      PrefixMatch n = index.match(ns, other, 6, false);
      EXPECT_EQ(n.blocks.size(), 2u);
    }
    if (bits == 0) {
      EXPECT_GT(index.stats().n_collisions, 0);
    }
    // Evict everything through the table's deletion path, checking as we go.
    while (index.evict(1) == 1) pool.check_invariants();
    EXPECT_EQ(index.stats().n_nodes, 0);
  }
}

}  // namespace
}  // namespace kvstack

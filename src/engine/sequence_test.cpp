// The prefix cache and sequence lifecycle (kv-cache-spec.md sections 5-6):
//  - a randomized operation sequence (start with a shared-family prefix,
//    extend, fork, cancel mid-step, finish, evict, across namespaces and the
//    public namespace) checked after every operation against a reference
//    model of the cache and against the pool/index invariants, with K/V
//    contents simulated as a hash of the whole prefix so that any wrong
//    sharing, copy or eviction shows up as wrong data;
//  - isolation between cache salts;
//  - logits through cached paths (full hit, hit ending inside a block, hit
//    covering all but one token, forks) against uncached runs, on the
//    synthetic random-weight model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "core/check.h"
#include "engine/forward.h"
#include "engine/sequence.h"
#include "engine/testing/synthetic_model.h"

namespace kvstack {
namespace {

CacheIdentity test_identity() {
  CacheIdentity id;
  id.weights_digest = Hash128{1, 2};
  id.arch_revision = "test";
  id.kv_format = "test";
  return id;
}

// ------------------------------------------------ simulated K/V contents

// The value a correct cache holds at position t of a sequence: a hash of
// tokens[0..t] (what K/V depend on).
uint64_t prefix_value(const std::vector<int32_t>& tokens, size_t t) {
  return hash128(tokens.data(), 4 * (t + 1), 7).lo;
}

uint64_t* slot(BlockPool& pool, const BlockTable& table, int64_t pos) {
  const int p = pool.block_size();
  return reinterpret_cast<uint64_t*>(pool.block_data(BlockId{table.ids()[pos / p]})) + pos % p;
}

// One simulated forward: reserve (copy-on-write included), write every new
// position's value, commit, publish. Returns false (nothing changed) when
// the pool is out of blocks.
bool sim_step(BlockPool& pool, Sequence& s, const std::vector<int32_t>& add) {
  if (!s.table().reserve(static_cast<int64_t>(add.size())).ok()) return false;
  std::vector<int32_t> all = s.tokens();
  all.insert(all.end(), add.begin(), add.end());
  for (size_t i = 0; i < add.size(); ++i) {
    const int64_t pos = s.length() + static_cast<int64_t>(i);
    *slot(pool, s.table(), pos) = prefix_value(all, static_cast<size_t>(pos));
  }
  s.table().commit(static_cast<int64_t>(add.size()));
  s.on_committed(add);
  return true;
}

void expect_contents(BlockPool& pool, const Sequence& s) {
  ASSERT_EQ(static_cast<int64_t>(s.tokens().size()), s.length());
  for (int64_t t = 0; t < s.length(); ++t) {
    ASSERT_EQ(*slot(pool, s.table(), t), prefix_value(s.tokens(), static_cast<size_t>(t)))
        << "position " << t << " of a sequence of " << s.length();
  }
}

// ------------------------------------------------ the reference model
//
// Keys are (namespace, token prefix of whole blocks); the reference knows
// which prefixes are published, which block holds each, and applies the
// documented rules: match walks whole blocks (private key first, public key
// while the path is public), publish inserts a sequence's completed blocks
// until the first one already present elsewhere, eviction (learned from the
// index's events) must remove a leaf that no table holds.
struct RefCache {
  struct Entry {
    int32_t block;
    int32_t parent;  // block, or -1
  };
  NamespaceId pub = kNoNamespace;
  // (namespace, token prefix, parent block): the same tokens may be cached
  // twice in one namespace, under a public and under a private parent.
  using Key = std::tuple<NamespaceId, std::vector<int32_t>, int32_t>;
  std::map<Key, Entry> entries;
  std::map<std::pair<uint64_t, uint64_t>, Key> by_hash;

  // Expected full-block match of tokens[0, max) in ns, as (blocks, n_blocks).
  std::vector<int32_t> match(NamespaceId ns, const std::vector<int32_t>& tokens, int64_t max,
                             int p) const {
    std::vector<int32_t> out;
    bool path_public = true;
    for (int64_t j = 0; (j + 1) * p <= max; ++j) {
      std::vector<int32_t> pre(tokens.begin(), tokens.begin() + (j + 1) * p);
      const int32_t parent = out.empty() ? -1 : out.back();
      auto it = entries.find({ns, pre, parent});
      if (it != entries.end()) {
        out.push_back(it->second.block);
        path_public = false;
        continue;
      }
      if (pub != kNoNamespace && pub != ns && path_public) {
        it = entries.find({pub, pre, parent});
        if (it != entries.end()) {
          out.push_back(it->second.block);
          continue;
        }
      }
      break;
    }
    return out;
  }
};

class RandomOps : public ::testing::TestWithParam<int> {};

TEST_P(RandomOps, InvariantsAndContentsAgainstReference) {
  const int p = GetParam();
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, p);  // 32 * P bytes per block
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 48 * p});
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {.event_capacity = 1 << 20});
  PrefixIndex& index = *kv.index();
  RefCache ref;
  ref.pub = kv.public_namespace();
  const NamespaceId spaces[3] = {kv.namespace_for(""), kv.namespace_for("tenant-a"),
                                 kv.namespace_for("tenant-b")};
  // Empty sequences keep the three namespaces (and so their ids, which the
  // reference keys on) alive; a namespace nobody uses expires.
  std::vector<Sequence> anchors;
  for (NamespaceId ns : spaces) anchors.push_back(kv.new_sequence(ns));

  std::mt19937 rng(1234 + p);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // A small shared family: 4 base prefixes of 0..3 blocks + a few tokens.
  std::vector<std::vector<int32_t>> family;
  for (int f = 0; f < 4; ++f) {
    std::vector<int32_t> v(static_cast<size_t>(f * p + rnd(0, p)));
    for (auto& t : v) t = rnd(0, 5);
    family.push_back(v);
  }
  std::vector<Sequence> live;
  std::set<int32_t> pinned_blocks;
  std::map<int32_t, int32_t> pinned_holders;  // references held by pinned public sequences
  int n_pinned = 0;
  int64_t n_hits = 0, n_partial = 0, n_forks = 0, n_cancels = 0, n_oob = 0, n_evicted = 0;
  int64_t n_clears = 0, n_all_cleared = 0;

  auto apply_events = [&] {
    for (const KvEvent& e : index.drain_events()) {
      if (e.kind == KvEvent::Kind::kAllCleared) {  // a clear left nothing published
        n_evicted += static_cast<int64_t>(ref.entries.size());
        ref.entries.clear();
        ref.by_hash.clear();
        ++n_all_cleared;
        continue;
      }
      if (e.kind != KvEvent::Kind::kRemoved) continue;
      auto it = ref.by_hash.find({e.hash.lo, e.hash.hi});
      ASSERT_NE(it, ref.by_hash.end()) << "removed an unknown block";
      auto ent = ref.entries.find(it->second);
      ASSERT_NE(ent, ref.entries.end());
      const int32_t b = ent->second.block;
      // Leaf-first: no remaining entry has it as parent; never a held block.
      for (const auto& [k, v] : ref.entries) ASSERT_NE(v.parent, b) << "evicted a non-leaf";
      ASSERT_EQ(pinned_blocks.count(b), 0u) << "evicted a pinned public block";
      ref.entries.erase(ent);
      ref.by_hash.erase(it);
      ++n_evicted;
    }
  };
  auto sync_reference = [&](const Sequence& s, int64_t before, int64_t full_before) {
    apply_events();  // evictions of this step first: their block ids may be reused
    // Blocks the sequence published in its last step join the reference.
    const auto ids = s.table().ids();
    for (int64_t j = before; j < s.n_published_blocks(); ++j) {
      const int32_t b = ids[j];
      ASSERT_TRUE(index.is_published(b));
      std::vector<int32_t> pre(s.tokens().begin(), s.tokens().begin() + (j + 1) * p);
      const NamespaceId ns = index.block_namespace(b);
      ASSERT_EQ(ns, s.ns());
      const int32_t parent = j == 0 ? -1 : ids[j - 1];
      auto [it, fresh] =
          ref.entries.emplace(RefCache::Key{ns, pre, parent}, RefCache::Entry{b, parent});
      if (!fresh) {
        ASSERT_EQ(it->second.block, b);
      }
      const Hash128 h = index.block_hash(b);
      ref.by_hash[{h.lo, h.hi}] = RefCache::Key{ns, pre, parent};
    }
    // Publishing stops at a block only when an equal one is published (and
    // then for good: later blocks of the sequence stay private).
    const int64_t n_full = s.length() / p;
    if (s.n_published_blocks() < n_full && s.n_published_blocks() >= full_before) {
      std::vector<int32_t> pre(s.tokens().begin(),
                               s.tokens().begin() + (s.n_published_blocks() + 1) * p);
      const int64_t j = s.n_published_blocks();
      EXPECT_TRUE(ref.entries.count({s.ns(), pre, j == 0 ? -1 : s.table().ids()[j - 1]}) == 1)
          << "publish stopped without a duplicate";
    }
  };
  auto check_all = [&] {
    pool.check_invariants();  // states, ref counts vs holders, index tree, LRU
    const BlockPoolStats st = pool.stats();
    ASSERT_EQ(st.n_blocks_free + st.n_blocks_used + st.n_blocks_cached, st.n_blocks_total);
    std::map<int32_t, int32_t> holders;
    for (const Sequence& s : live) {
      for (int32_t id : s.table().ids()) ++holders[id];
    }
    // Pinned public sequences hold their blocks too (KvManager-owned tables).
    for (int32_t b = 0; b < pool.n_blocks(); ++b) {
      const int32_t want =
          (holders.count(b) ? holders[b] : 0) + (pinned_holders.count(b) ? pinned_holders[b] : 0);
      ASSERT_EQ(pool.ref_count(BlockId{b}), want) << "block " << b;
    }
    for (const Sequence& s : live) {
      expect_contents(pool, s);
      // Published blocks of a table hold exactly its own tokens.
      for (int64_t j = 0; j < s.n_published_blocks(); ++j) {
        const auto bt = index.block_tokens(s.table().ids()[j]);
        ASSERT_TRUE(std::equal(bt.begin(), bt.end(), s.tokens().begin() + j * p));
      }
    }
    ASSERT_EQ(index.stats().n_nodes, static_cast<int64_t>(ref.entries.size()));
  };

  // With KV_DCHECK on, the pool also checks itself after every mutation
  // (O(pool) each), so the sanitizer build runs a shorter sequence.
  const int kOps = KV_DCHECK_IS_ON ? 5000 : 20000;
  for (int op = 0; op < kOps; ++op) {
    int kind = rnd(0, 99);
    // Keep the working set churning: past 8 live sequences, finish one
    // instead of starting, extending or forking (else the pool stays full).
    if (live.size() > 8 && kind < 72) kind = 80;
    SCOPED_TRACE("op " + std::to_string(op) + " kind " + std::to_string(kind));
    const int64_t free_before = pool.n_free();
    const int64_t alloc_before = pool.stats().n_allocations;
    const int64_t evict_before = pool.stats().n_evictions;
    if (kind < 30 || live.empty()) {
      // Start a request: a family prefix + a random suffix, in a random namespace.
      // A few public prefixes get pinned (pinned blocks are never freed).
      const bool make_public = rnd(0, 19) == 0 && n_pinned < 3;
      const NamespaceId ns = make_public ? ref.pub : spaces[rnd(0, 2)];
      std::vector<int32_t> prompt = family[rnd(0, 3)];
      for (int i = rnd(1, 2 * p); i > 0; --i) prompt.push_back(rnd(0, 5));
      Sequence s = kv.new_sequence(ns);
      const std::vector<int32_t> want =
          ref.match(ns, prompt, static_cast<int64_t>(prompt.size()) - 1, p);
      const int64_t partial_before = pool.stats().n_partial_copies;
      const int64_t got = s.adopt_cached_prefix(prompt);
      const auto ids = s.table().ids();
      ASSERT_GE(got / p, static_cast<int64_t>(want.size()));
      for (size_t j = 0; j < want.size(); ++j) ASSERT_EQ(ids[j], want[j]) << "match block " << j;
      const int64_t n_full = static_cast<int64_t>(want.size());
      ASSERT_EQ(got - n_full * p, s.length() - n_full * p);
      if (got > n_full * p) {
        ++n_partial;
        ASSERT_EQ(pool.stats().n_partial_copies, partial_before + 1);
        ASSERT_LT(got, static_cast<int64_t>(prompt.size()));
      }
      if (got > 0) ++n_hits;
      const int64_t pub_before = s.n_published_blocks();
      const int64_t full_before = s.length() / p;
      if (rnd(0, 9) == 0) {
        // Cancelled during prefill: reserve, write part, then drop.
        if (s.table().reserve(static_cast<int64_t>(prompt.size()) - got).ok()) {
          *slot(pool, s.table(), s.length()) = 0xdeadbeef;
        }
        s.rollback();
        { Sequence dropped = std::move(s); }  // cancelled: every reference released
        ++n_cancels;
        apply_events();
        check_all();
        if (HasFatalFailure()) return;
        continue;  // nothing of the cancelled step was published
      }
      std::vector<int32_t> rest(prompt.begin() + got, prompt.end());
      if (!sim_step(pool, s, rest)) {
        ++n_oob;
      } else {
        sync_reference(s, pub_before, full_before);
        if (make_public) {
          for (int32_t id : s.table().ids()) {
            pinned_blocks.insert(id);
            ++pinned_holders[id];
          }
          kv.pin_public(std::move(s));
          ++n_pinned;
        } else {
          live.push_back(std::move(s));
        }
      }
    } else if (kind < 60) {
      // Extend (a decode step or a new chunk).
      Sequence& s = live[rnd(0, static_cast<int>(live.size()) - 1)];
      std::vector<int32_t> add(static_cast<size_t>(rnd(1, p + 1)));
      for (auto& t : add) t = rnd(0, 5);
      const int64_t pub_before = s.n_published_blocks();
      const int64_t full_before = s.length() / p;
      if (!sim_step(pool, s, add)) {
        ++n_oob;
      } else {
        sync_reference(s, pub_before, full_before);
      }
    } else if (kind < 72) {
      // Fork; sometimes cancelled right away (dropped in the middle of a fork).
      const int i = rnd(0, static_cast<int>(live.size()) - 1);
      Sequence f = live[i].fork();
      ++n_forks;
      if (rnd(0, 3) != 0) live.push_back(std::move(f));
    } else if (kind < 90) {
      // Finish or cancel between steps.
      const int i = rnd(0, static_cast<int>(live.size()) - 1);
      live.erase(live.begin() + i);
    } else if (kind < 98) {
      index.evict(rnd(0, 4));
    } else {
      // Clear the cache: every unreferenced block goes, held ones stay.
      const PrefixIndex::ClearResult r = index.clear_cached();
      ++n_clears;
      ASSERT_EQ(pool.n_cached(), 0);
      ASSERT_EQ(r.n_kept, index.stats().n_nodes);
      ASSERT_EQ(r.all_cleared, r.n_kept == 0);
      for (int32_t b = 0; b < pool.n_blocks(); ++b) {
        if (index.is_node(b)) {
          ASSERT_GT(pool.ref_count(BlockId{b}), 0) << "kept a cached block";
        }
      }
    }
    apply_events();
    // Eviction only when an allocation needed space beyond the free list.
    const int64_t evicted_in_op = pool.stats().n_evictions - evict_before;
    const int64_t taken_in_op = pool.stats().n_allocations - alloc_before;
    if (kind < 90 && evicted_in_op > 0) {
      ASSERT_LE(evicted_in_op, taken_in_op - free_before) << "evicted without need";
    }
    check_all();
    if (HasFatalFailure()) return;
  }
  live.clear();
  apply_events();
  pool.check_invariants();
  EXPECT_GT(n_hits, 100);
  if (p > 1) {
    EXPECT_GT(n_partial, 20);
  }
  EXPECT_GT(n_forks, 100);
  EXPECT_GT(n_cancels, 20);
  EXPECT_GT(n_evicted, 20);
  EXPECT_GT(n_clears, 50);
  if (p > 1) {
    EXPECT_GT(pool.stats().n_cow_copies, 20);
  }
  std::printf(
      "P=%d: %lld hits (%lld partial), %lld forks, %lld cancels, %lld refused, %lld "
      "evicted, %lld cow copies; hit rate %.2f\n",
      p, static_cast<long long>(n_hits), static_cast<long long>(n_partial),
      static_cast<long long>(n_forks), static_cast<long long>(n_cancels),
      static_cast<long long>(n_oob), static_cast<long long>(n_evicted),
      static_cast<long long>(pool.stats().n_cow_copies), index.stats().total.hit_rate());
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, RandomOps, ::testing::Values(1, 4, 16));

TEST(PrefixCache, SaltsAreIsolated) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 256});
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {});
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
  Sequence a = kv.new_sequence(kv.namespace_for("salt-a"));
  ASSERT_EQ(a.adopt_cached_prefix(prompt), 0);
  ASSERT_TRUE(sim_step(pool, a, prompt));
  ASSERT_EQ(a.n_published_blocks(), 3);
  // Same prompt, other salt: zero hit tokens, disjoint blocks (live or not).
  for (bool drop_a : {false, true}) {
    Sequence b = kv.new_sequence(kv.namespace_for(drop_a ? "salt-c" : "salt-b"));
    EXPECT_EQ(b.adopt_cached_prefix(prompt), 0);
    ASSERT_TRUE(sim_step(pool, b, prompt));
    for (int32_t x : b.table().ids()) {
      for (int32_t y : a.table().ids()) EXPECT_NE(x, y);
    }
    if (drop_a) a.release();
  }
  // The default namespace is a namespace too.
  Sequence d = kv.new_sequence(kv.namespace_for(""));
  EXPECT_EQ(d.adopt_cached_prefix(prompt), 0);
  // Same salt: hits (a's blocks are cached now) up to the last prompt token.
  Sequence a2 = kv.new_sequence(kv.namespace_for("salt-a"));
  EXPECT_EQ(a2.adopt_cached_prefix(prompt), 12);  // 3 full blocks (the tail was never published)
  const PrefixIndexStats st = kv.index()->stats();
  for (const auto& [ns, s] : st.per_namespace) {
    if (ns == kv.namespace_for("salt-b") || ns == kv.namespace_for("salt-c") ||
        ns == kv.namespace_for("")) {
      EXPECT_EQ(s.n_hit_tokens, 0);
    }
  }
  // A public prefix is visible from every namespace.
  const std::vector<int32_t> sys = {40, 41, 42, 43, 44, 45, 46, 47, 48};
  Sequence pub = kv.new_sequence(kv.public_namespace());
  ASSERT_TRUE(sim_step(pool, pub, sys));
  EXPECT_EQ(kv.pin_public(std::move(pub)), 2);
  std::vector<int32_t> q = sys;
  q.insert(q.end(), {1, 2, 3});
  for (const char* salt : {"salt-a", "salt-b", "x"}) {
    Sequence s = kv.new_sequence(kv.namespace_for(salt));
    EXPECT_GE(s.adopt_cached_prefix(q), 8) << salt;
    // Private continuations stay private.
    ASSERT_TRUE(sim_step(pool, s, std::vector<int32_t>(q.begin() + s.length(), q.end())));
    std::vector<int32_t> more(8, 9);
    ASSERT_TRUE(sim_step(pool, s, more));
  }
  std::vector<int32_t> q2 = q;
  q2.insert(q2.end(), 8, 9);
  q2.push_back(1);
  Sequence other = kv.new_sequence(kv.namespace_for("y"));
  EXPECT_EQ(other.adopt_cached_prefix(q2), 8);  // public blocks only, no partial from others
  pool.check_invariants();
}

// Issue 22: every distinct cache salt made a namespace that was never freed.
// A namespace now lives while a sequence uses it or it holds published
// blocks; then its id is reused, and a reused id never shows the old
// namespace's blocks.
TEST(PrefixCache, UnusedNamespacesExpire) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 64});
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {});
  PrefixIndex& index = *kv.index();
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  // Salts whose requests publish nothing (a 3-token prompt fills no block).
  for (int i = 0; i < 3000; ++i) {
    Sequence s = kv.new_sequence(kv.namespace_for("tenant-" + std::to_string(i)));
    ASSERT_TRUE(sim_step(pool, s, {1, 2, 3}));
    EXPECT_EQ(index.n_namespaces(), 1);  // only this one, while it lives
  }
  EXPECT_EQ(index.n_namespaces(), 0);
  EXPECT_EQ(index.n_namespaces_expired(), 3000);
  // A namespace holding published blocks stays after its sequence ends...
  {
    Sequence a = kv.new_sequence(kv.namespace_for("keeper"));
    ASSERT_TRUE(sim_step(pool, a, prompt));
    ASSERT_EQ(a.n_published_blocks(), 2);
  }
  EXPECT_EQ(index.n_namespaces(), 1);
  EXPECT_EQ(index.stats().total.n_queries, 0);  // sim_step adopts nothing: no lookups
  {
    Sequence again = kv.new_sequence(kv.namespace_for("keeper"));
    EXPECT_EQ(again.adopt_cached_prefix(prompt), 8);
  }
  // ...until its blocks are evicted: then it expires too, and the id that
  // is handed to the next salt finds nothing of keeper's.
  {
    Sequence filler = kv.new_sequence(kv.namespace_for("filler"));
    ASSERT_TRUE(sim_step(pool, filler, std::vector<int32_t>(64, 5)));  // takes every block
    EXPECT_EQ(index.n_namespaces(), 1);  // keeper expired when its last block went
    filler.rollback();
  }
  Sequence fresh = kv.new_sequence(kv.namespace_for("fresh"));
  EXPECT_EQ(index.n_namespaces(), 2);  // fresh + filler (filler's blocks are cached)
  EXPECT_EQ(fresh.adopt_cached_prefix(prompt), 0);
  Sequence k2 = kv.new_sequence(kv.namespace_for("keeper"));
  EXPECT_EQ(k2.adopt_cached_prefix(prompt), 0);  // its blocks were evicted
  // Lifetime totals keep what expired namespaces counted.
  EXPECT_EQ(index.stats().total.n_queries, 3);
  pool.check_invariants();
  index.check_invariants();
}

// clear_cached (POST /flush_cache): unreferenced blocks go with one
// BlockRemoved each while something stays published; held blocks and their
// contents stay and still hit; a clear that empties the index sends one
// AllBlocksCleared and no per-block event.
TEST(PrefixCache, ClearDropsUnreferencedBlocksAndKeepsHeldOnes) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 2);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 16});  // 8 blocks
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {.event_capacity = 100});
  PrefixIndex& index = *kv.index();
  const NamespaceId ns = kv.namespace_for("");
  const std::vector<int32_t> a_tokens = {1, 1, 2, 2, 3, 3};
  Sequence a = kv.new_sequence(ns);
  ASSERT_TRUE(sim_step(pool, a, a_tokens));  // held: 3 blocks
  {
    Sequence b = kv.new_sequence(ns);
    ASSERT_TRUE(sim_step(pool, b, {4, 4, 5, 5}));  // released: 2 cached blocks
  }
  ASSERT_EQ(pool.n_cached(), 2);
  index.drain_events();
  const PrefixIndex::ClearResult r = index.clear_cached();
  EXPECT_EQ(r.n_freed, 2);
  EXPECT_EQ(r.n_kept, 3);
  EXPECT_FALSE(r.all_cleared);
  auto ev = index.drain_events();
  ASSERT_EQ(ev.size(), 2u);
  for (const KvEvent& e : ev) EXPECT_EQ(e.kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(ev[0].parent_hash, ev[1].hash);  // leaf first
  EXPECT_EQ(pool.n_cached(), 0);
  EXPECT_EQ(pool.n_free(), 5);
  pool.check_invariants();
  expect_contents(pool, a);  // a running sequence is untouched
  ASSERT_TRUE(sim_step(pool, a, {6, 6}));
  expect_contents(pool, a);
  {
    Sequence hit = kv.new_sequence(ns);  // a's blocks are still published
    EXPECT_EQ(hit.adopt_cached_prefix(std::vector<int32_t>{1, 1, 2, 2, 3, 3, 9}), 6);
    Sequence miss = kv.new_sequence(ns);  // b's are gone
    EXPECT_EQ(miss.adopt_cached_prefix(std::vector<int32_t>{4, 4, 5, 5, 9}), 0);
  }
  { Sequence done = std::move(a); }  // a finishes: all its blocks become cached
  index.drain_events();
  const PrefixIndex::ClearResult all = index.clear_cached();
  EXPECT_EQ(all.n_freed, 4);
  EXPECT_EQ(all.n_kept, 0);
  EXPECT_TRUE(all.all_cleared);
  ev = index.drain_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEvent::Kind::kAllCleared);
  EXPECT_EQ(pool.n_free(), pool.n_blocks());
  EXPECT_EQ(index.stats().n_nodes, 0);
  pool.check_invariants();
  // An empty cache clears again: nothing freed, AllBlocksCleared again.
  EXPECT_EQ(index.clear_cached().n_freed, 0);
  EXPECT_EQ(index.drain_events().size(), 1u);
}

TEST(PrefixCache, EvictionIsLeafFirstLruAndNeverTouchesReferencedBlocks) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 2);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 16});  // 8 blocks
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {.event_capacity = 100});
  const NamespaceId ns = kv.namespace_for("");
  auto run = [&](const std::vector<int32_t>& toks) {
    Sequence s = kv.new_sequence(ns);
    EXPECT_TRUE(sim_step(pool, s, toks));
    return s;
  };
  {
    Sequence a = run({1, 1, 2, 2, 3, 3});  // chain A: 3 blocks
    Sequence b = run({4, 4, 5, 5});        // chain B: 2 blocks
    // Scope end: b is released first (tail first), then a.
  }
  EXPECT_EQ(pool.n_cached(), 5);
  EXPECT_EQ(pool.n_free(), 3);
  Sequence keep = kv.new_sequence(ns);
  EXPECT_EQ(keep.adopt_cached_prefix(std::vector<int32_t>{1, 1, 2, 2, 9}), 4);  // revives A0, A1
  EXPECT_EQ(pool.n_cached(), 3);
  const int32_t a0 = keep.table().ids()[0];
  const Hash128 a0_hash = kv.index()->block_hash(a0);
  kv.index()->drain_events();
  // 5 blocks: 3 free + 2 evicted, the least recently released leaves first:
  // B1, then B0 (now a leaf); A2 stays cached, A0/A1 are held.
  Sequence big = kv.new_sequence(ns);
  ASSERT_TRUE(sim_step(pool, big, std::vector<int32_t>(10, 7)));
  auto ev = kv.index()->drain_events();
  std::vector<KvEvent> removed;
  for (const KvEvent& e : ev) {
    if (e.kind == KvEvent::Kind::kRemoved) removed.push_back(e);
  }
  ASSERT_EQ(removed.size(), 2u);
  EXPECT_EQ(removed[0].parent_hash, removed[1].hash);  // B1 (child of B0) first
  EXPECT_EQ(removed[1].parent_hash, Hash128{});
  EXPECT_EQ(pool.stats().n_evictions, 2);
  EXPECT_EQ(pool.n_cached(), 1);  // A2
  EXPECT_EQ(kv.index()->block_hash(a0), a0_hash);
  EXPECT_EQ(keep.table().length(), 4);
  // Everything else held: the next 2-block allocation fails cleanly, no side effect.
  Sequence more = kv.new_sequence(ns);
  EXPECT_FALSE(sim_step(pool, more, std::vector<int32_t>(4, 8)));
  EXPECT_EQ(pool.n_cached(), 1);
  pool.check_invariants();
}

TEST(PrefixCache, ForkCopiesSharedPartialTailOnAppend) {
  auto layout = KvLayout::uniform(1, 1, 8, KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 64});
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {});
  Sequence a = kv.new_sequence(kv.namespace_for(""));
  ASSERT_TRUE(sim_step(pool, a, {1, 2, 3, 4, 5, 6}));
  Sequence b = a.fork();
  EXPECT_EQ(pool.ref_count(BlockId{a.table().ids()[1]}), 2);
  EXPECT_TRUE(b.table().tail_shared());
  EXPECT_EQ(b.table().blocks_needed(1), 1);  // the copy
  ASSERT_TRUE(sim_step(pool, b, {9}));
  ASSERT_TRUE(sim_step(pool, a, {7, 7, 7}));
  EXPECT_EQ(pool.stats().n_cow_copies, 1);  // only b copied; a's tail became private
  EXPECT_EQ(a.table().ids()[0], b.table().ids()[0]);
  EXPECT_NE(a.table().ids()[1], b.table().ids()[1]);
  expect_contents(pool, a);
  expect_contents(pool, b);
  pool.check_invariants();
}

// ------------------------------------------------ logits through cached paths

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double{a[i]} - b[i]));
  return d;
}

TEST(PrefixCache, CachedLogitsEqualUncached) {
  testing::SyntheticSpec spec{
      .n_layers = 2, .n_embd = 64, .n_heads = 4, .n_kv_heads = 2, .n_vocab = 40, .seed = 11};
  auto w = testing::make_synthetic_model(spec);
  auto model = Model::load(w.path);
  ASSERT_TRUE(model.ok()) << model.error().message;
  std::remove(w.path.c_str());
  ThreadPool threads(2);
  Forward fwd(**model, threads);
  const int p = 8;
  auto layout =
      KvLayout::uniform(spec.n_layers, spec.n_kv_heads, spec.head_dim(), KvDtype::kF32, p);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 4096});
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  KvManager kv(pool, test_identity(), {});
  const NamespaceId ns = kv.namespace_for("");

  std::mt19937 rng(5);
  std::vector<int32_t> base(40);
  for (auto& t : base) t = static_cast<int32_t>(rng() % spec.n_vocab);

  // Uncached logits of the last token of `prompt` (fresh table, one step).
  auto uncached = [&](const std::vector<int32_t>& prompt) {
    BlockTable t(pool);
    std::vector<float> logits;
    const StepSeq s{.table = &t, .tokens = prompt};
    EXPECT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
    return logits;
  };
  // Cached path: adopt, then forward the rest (in chunks of `chunk`).
  auto cached = [&](const std::vector<int32_t>& prompt, int64_t* adopted, int chunk = 1000) {
    Sequence s = kv.new_sequence(ns);
    *adopted = s.adopt_cached_prefix(prompt);
    std::vector<float> logits;
    for (int64_t b = *adopted; b < static_cast<int64_t>(prompt.size()); b += chunk) {
      const int64_t e = std::min<int64_t>(prompt.size(), b + chunk);
      const std::span<const int32_t> part(prompt.data() + b, static_cast<size_t>(e - b));
      const StepSeq st{.table = &s.table(), .tokens = part};
      EXPECT_TRUE(fwd.step(std::span<const StepSeq>(&st, 1), &logits).ok());
      s.on_committed(part);
    }
    return std::make_pair(std::move(s), logits);
  };
  // Warm the cache with 33 tokens in chunks (4 full blocks published + 1).
  {
    std::vector<int32_t> warm(base.begin(), base.begin() + 33);
    int64_t adopted = 0;
    auto [s, l] = cached(warm, &adopted, 5);
    EXPECT_EQ(adopted, 0);
    EXPECT_EQ(s.n_published_blocks(), 4);
  }
  const double kTol = 1e-5;
  struct Case {
    const char* name;
    size_t len;
    int64_t want_adopted;
  };
  for (const Case& c : {
           Case{"full hit, block-aligned prompt (last token recomputed from a copy)", 32, 31},
           Case{"full hit ending one past a block (no copy)", 33, 32},
           Case{"hit ending inside a block", 29, 28},
           Case{"hit covering all but one token", 25, 24},
           Case{"hit then new tokens", 40, 32},
       }) {
    std::vector<int32_t> prompt(base.begin(), base.begin() + static_cast<long>(c.len));
    int64_t adopted = 0;
    auto [s, got] = cached(prompt, &adopted);
    EXPECT_EQ(adopted, c.want_adopted) << c.name;
    const std::vector<float> want = uncached(prompt);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_LT(max_abs_diff(got, want), kTol) << c.name;
    const auto ref = testing::reference_last_logits(w, prompt, KvDtype::kF32);
    double e = 0;
    for (size_t i = 0; i < ref.size(); ++i) e = std::max(e, std::fabs(got[i] - ref[i]));
    EXPECT_LT(e, 1e-3) << c.name;
  }
  // A partial match against a different continuation: the copied slots then
  // new tokens written into the private copy.
  {
    std::vector<int32_t> prompt(base.begin(), base.begin() + 20);
    prompt.push_back((base[20] + 1) % spec.n_vocab);
    prompt.push_back(3);
    int64_t adopted = 0;
    auto [s, got] = cached(prompt, &adopted);
    EXPECT_EQ(adopted, 20);
    EXPECT_LT(max_abs_diff(got, uncached(prompt)), kTol);
  }
  // Forks decoding different tokens give the logits of independent runs.
  {
    std::vector<int32_t> prompt(base.begin(), base.begin() + 13);
    int64_t adopted = 0;
    auto [s, l0] = cached(prompt, &adopted);
    Sequence f = s.fork();
    const int32_t ta = 1, tb = 2;
    std::vector<float> la, lb;
    const StepSeq sa{.table = &s.table(), .tokens = std::span<const int32_t>(&ta, 1)};
    const StepSeq sb{.table = &f.table(), .tokens = std::span<const int32_t>(&tb, 1)};
    const StepSeq both[2] = {sa, sb};
    std::vector<float> lab;
    ASSERT_TRUE(fwd.step(both, &lab).ok());
    auto pa = prompt, pb = prompt;
    pa.push_back(ta);
    pb.push_back(tb);
    const auto ua = uncached(pa), ub = uncached(pb);
    EXPECT_LT(max_abs_diff(std::vector<float>(lab.begin(), lab.begin() + spec.n_vocab), ua), kTol);
    EXPECT_LT(max_abs_diff(std::vector<float>(lab.begin() + spec.n_vocab, lab.end()), ub), kTol);
    EXPECT_GE(pool.stats().n_cow_copies, 1);
  }
  pool.check_invariants();
}

}  // namespace
}  // namespace kvstack

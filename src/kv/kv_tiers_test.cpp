// Storage tiers (kv_tiers.h): random operation sequences across pool, host
// and disk against a reference model, bit-identical promotion, cancelled
// fetches, warm restart from disk and fault injection (corrupt, truncated,
// foreign and unwritable files).
#include "kv/kv_tiers.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/cache_identity.h"
#include "kv/host_format.h"
#include "kv/prefix_index.h"

namespace kvstack {
namespace {

constexpr int kP = 4;  // tokens per block

KvLayout make_layout(bool hybrid) {
  // Single group: 2 full layers. Hybrid: one full and one window-8 layer
  // (two groups; the window group drops blocks and keeps checkpoints).
  std::vector<KvLayerSpec> layers;
  for (int w : hybrid ? std::vector<int>{0, 8} : std::vector<int>{0, 0}) {
    layers.push_back({.kind = KvLayerKind::kStandard,
                      .n_kv_heads = 1,
                      .head_dim_k = 8,
                      .head_dim_v = 8,
                      .dtype = KvDtype::kF16,
                      .window = w});
  }
  auto l = KvLayout::create(std::move(layers), kP);
  KV_CHECK(l.ok(), "layout");
  return std::move(l).value();
}

CacheIdentity make_identity(const KvLayout& layout, uint64_t weights = 1) {
  CacheIdentity id;
  id.weights_digest = Hash128{weights, 77};
  id.arch_revision = "tiers-test";
  id.kv_format = kv_format_key(layout);
  id.ns = "default";
  return id;
}

KvTierConfig host_cfg(int64_t bytes) {
  KvTierConfig c;
  c.host_bytes = bytes;
  return c;
}
KvTierConfig disk_cfg(const std::string& dir, int64_t bytes) {
  KvTierConfig c;
  c.disk_dir = dir;
  c.disk_bytes = bytes;
  return c;
}

// The bytes a block must hold: a function of its whole token prefix and group
// (what a forward pass would compute), so any copy can be checked exactly.
void fill_expected(std::span<const int32_t> prefix, int group, uint8_t* out, int64_t n) {
  uint64_t h = XXH3_64bits_withSeed(prefix.data(), 4 * prefix.size(), 1000 + group);
  for (int64_t i = 0; i < n; i += 8) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    std::memcpy(out + i, &h, static_cast<size_t>(std::min<int64_t>(8, n - i)));
  }
}

bool block_matches(const BlockPool& pool, int32_t b, std::span<const int32_t> prefix, int group) {
  std::vector<uint8_t> want(static_cast<size_t>(pool.block_bytes()));
  fill_expected(prefix, group, want.data(), pool.block_bytes());
  return std::memcmp(want.data(), pool.block_data(BlockId{b}), want.size()) == 0;
}

// A pool, its index and tiers, and the engine's request flow (what
// Sequence::adopt_cached_prefix and Engine::prefill do) without a model.
struct Rig {
  KvLayout layout;
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<PrefixIndex> index;
  std::unique_ptr<KvTiers> tiers;
  CacheIdentity identity;
  NamespaceId ns = kNoNamespace;

  Rig(bool hybrid, int64_t n_blocks, const KvTierConfig& cfg, uint64_t weights = 1)
      : layout(make_layout(hybrid)), identity(make_identity(layout, weights)) {
    auto p = BlockPool::create(layout, {.mem_bytes = n_blocks * layout.block_bytes()});
    KV_CHECK(p.ok(), "pool");
    pool = std::move(*p);
    index = std::make_unique<PrefixIndex>(*pool);
    auto t = KvTiers::create(*index, identity, cfg);
    KV_CHECK(t.ok(), t.ok() ? "" : t.error().message.c_str());
    tiers = std::move(*t);
    ns = index->intern_namespace(identity.digest());
    index->acquire_namespace(ns);  // as a live Sequence does
  }
  ~Rig() {
    if (index) index->release_namespace(ns);
    tiers.reset();
    index.reset();
  }

  struct Outcome {
    BlockTable table;
    int64_t n_adopted = 0;  // tokens adopted (pool + tiers)
    int64_t n_from_tiers = 0;
    bool bytes_ok = true;  // every adopted block holds the expected bytes
  };

  // Looks up `tokens` (all but the last token), adopts the hit, "computes"
  // the rest (writes the expected bytes), commits and publishes.
  Outcome request(std::span<const int32_t> tokens) {
    Outcome o{.table = BlockTable(*pool)};
    BlockTable& t = o.table;
    const auto max_tokens = static_cast<int64_t>(tokens.size()) - 1;
    PrefixMatch m = index->match(ns, tokens, max_tokens, /*find_partial=*/false);
    const auto n_nodes = static_cast<int64_t>(m.blocks.size());
    o.n_from_tiers = tiers->extend_match(ns, tokens, max_tokens, m);
    const auto k = static_cast<int64_t>(m.blocks.size());
    for (int64_t i = 0; i < k; ++i) {
      o.bytes_ok &= block_matches(*pool, m.blocks[static_cast<size_t>(i)].id().value,
                                  tokens.first(static_cast<size_t>((i + 1) * kP)), 0);
    }
    for (int g = 1; g < pool->n_groups() && k > 0; ++g) {
      const auto& gb = m.group_blocks[static_cast<size_t>(g - 1)];
      const int64_t first = m.group_first[static_cast<size_t>(g - 1)];
      for (size_t i = 0; i < gb.size(); ++i) {
        o.bytes_ok &= block_matches(*pool, gb[i].id().value,
                                    tokens.first(static_cast<size_t>((first + i + 1) * kP)), g);
      }
    }
    t.group(0).adopt_prefix(std::move(m.blocks));
    for (int g = 1; g < pool->n_groups(); ++g) {
      if (k == 0) break;
      t.group(g).adopt_prefix_after(m.group_first[static_cast<size_t>(g - 1)],
                                    std::move(m.group_blocks[static_cast<size_t>(g - 1)]));
    }
    o.n_adopted = k * kP;
    const auto n = static_cast<int64_t>(tokens.size());
    const int64_t from = t.length();
    if (!t.reserve(n - from).ok()) return o;  // pool full: the caller releases
    for (int g = 0; g < pool->n_groups(); ++g) {
      const auto ids = t.group(g).ids();
      for (int64_t j = from / kP; j < static_cast<int64_t>(ids.size()); ++j) {
        if (ids[static_cast<size_t>(j)] == kNullBlock) continue;
        const int64_t end = std::min<int64_t>((j + 1) * kP, n);
        fill_expected(tokens.first(static_cast<size_t>(end)), g,
                      pool->block_data(BlockId{ids[static_cast<size_t>(j)]}), pool->block_bytes());
      }
    }
    t.commit(n - from);
    const int64_t n_pub = index->publish(ns, t, tokens, std::min(n_nodes, k));
    for (int64_t j = 0; j < n_pub; ++j) {
      for (int g = 1; g < pool->n_groups(); ++g) {
        const int32_t b = t.group(g).ids()[static_cast<size_t>(j)];
        if (b != kNullBlock && !index->is_published(b)) {
          (void)index->attach_companion(t.ids()[static_cast<size_t>(j)], g, b);
        }
      }
    }
    return o;
  }

  void check() const {
    pool->check_invariants();
    index->check_invariants();
    tiers->check_invariants();
  }

  // (hash, group) of every published pool block.
  std::set<std::pair<std::pair<uint64_t, uint64_t>, int>> pool_keys() const {
    std::set<std::pair<std::pair<uint64_t, uint64_t>, int>> out;
    for (int32_t b = 0; b < pool->n_blocks(); ++b) {
      if (pool->state(BlockId{b}) == BlockState::kFree || !index->is_published(b)) continue;
      const CachedBlockInfo i = index->cached_block_info(b);
      out.insert({{i.hash.lo, i.hash.hi}, i.group});
    }
    return out;
  }
};

std::filesystem::path temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() /
           ("kvstack-tiers-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  return d;
}

// Prompts sharing prefixes: `n_roots` stems, each continued by branches.
std::vector<std::vector<int32_t>> prompt_universe(std::mt19937& rng, int n) {
  std::vector<std::vector<int32_t>> out;
  std::uniform_int_distribution<int32_t> tok(1, 50);
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    if (!out.empty() && rng() % 2 == 0) {
      const auto& base = out[rng() % out.size()];
      p.assign(base.begin(), base.begin() + static_cast<int64_t>(rng() % (base.size() + 1)));
    }
    const int add = 1 + static_cast<int>(rng() % (6 * kP));
    for (int j = 0; j < add; ++j) p.push_back(tok(rng));
    if (p.size() > 12 * kP) p.resize(12 * kP);  // fits the pool
    if (p.size() < 2) p.push_back(tok(rng));
    out.push_back(std::move(p));
  }
  return out;
}

// The chained keys (group 0) of a prompt's full blocks below its last token.
std::vector<Hash128> chain_keys(const PrefixIndex& index, NamespaceId ns,
                                std::span<const int32_t> tokens) {
  std::vector<Hash128> out;
  const int64_t n = (static_cast<int64_t>(tokens.size()) - 1) / kP;
  Hash128 parent{};
  for (int64_t i = 0; i < n; ++i) {
    parent = index.chain_hash(parent, ns, tokens.subspan(static_cast<size_t>(i * kP), kP));
    out.push_back(parent);
  }
  return out;
}

// Random publish / release / evict / promote / hit / cancel sequences.
// Reference model: every block ever published (group 0) must stay findable
// in pool, host or disk (the disk holds the whole universe, so nothing may
// be lost), a request must hit every block of its chain that the model
// says exists, and adopted bytes must equal the computed ones.
void random_ops(bool hybrid, bool write_through, bool with_host, uint32_t seed) {
  const auto dir = temp_dir("random" + std::to_string(seed));
  KvTierConfig cfg;
  const BlockRecordIdentity rid = block_record_identity(make_identity(make_layout(hybrid)), kP,
                                                        make_layout(hybrid).block_bytes());
  const int64_t host_slot =
      ((block_record_header_bytes(kP) + 63) / 64 * 64) + (rid.payload_bytes + 63) / 64 * 64;
  if (with_host) cfg.host_bytes = 6 * host_slot;  // small: overflows to disk
  cfg.write_through = write_through;
  cfg.disk_dir = dir.string();
  cfg.disk_bytes = int64_t{4096 + 4096} * 4000;  // the whole universe fits
  Rig rig(hybrid, /*n_blocks=*/48, cfg);
  std::mt19937 rng(seed);
  const auto universe = prompt_universe(rng, 40);
  std::set<std::pair<std::pair<uint64_t, uint64_t>, int>> ever;  // published (group 0)
  std::vector<Rig::Outcome> live;
  int64_t n_tier_hits = 0;
  for (int step = 0; step < 600; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op <= 3) {
      // Publish / hit / promote: a request, kept alive or released at once.
      const auto& p = universe[rng() % universe.size()];
      const std::vector<Hash128> keys = chain_keys(*rig.index, rig.ns, p);
      const auto pool_keys = rig.pool_keys();
      int64_t expect = 0;  // blocks the model says are somewhere
      for (const Hash128& h : keys) {
        const bool somewhere = pool_keys.count({{h.lo, h.hi}, 0}) || rig.tiers->in_host({h, 0}) ||
                               rig.tiers->in_disk({h, 0});
        if (!somewhere) break;
        ++expect;
      }
      const int64_t failed_before = rig.tiers->stats().n_promote_failed;
      Rig::Outcome o = rig.request(p);
      ASSERT_TRUE(o.bytes_ok) << "step " << step << ": adopted bytes differ";
      if (!hybrid && rig.tiers->stats().n_promote_failed == failed_before) {
        // Single group: the hit is exactly what the model predicts.
        ASSERT_EQ(o.n_adopted, expect * kP) << "step " << step;
      } else {
        ASSERT_LE(o.n_adopted, expect * kP) << "step " << step;
      }
      n_tier_hits += o.n_from_tiers > 0;
      // Blocks now published join the model: from here on they must
      // always be somewhere.
      const auto now_in_pool = rig.pool_keys();
      for (const Hash128& h : keys) {
        if (now_in_pool.count({{h.lo, h.hi}, 0})) ever.insert({{h.lo, h.hi}, 0});
      }
      if (rng() % 3 == 0 && live.size() < 3 && o.table.length() == static_cast<int64_t>(p.size())) {
        live.push_back(std::move(o));
      } else {
        o.table.release();
      }
    } else if (op == 4 && !live.empty()) {
      const size_t i = rng() % live.size();
      live[i].table.release();
      live.erase(live.begin() + static_cast<int64_t>(i));
    } else if (op == 5 || op == 6) {
      // Evict (demote) some cached blocks.
      rig.index->evict(1 + static_cast<int64_t>(rng() % 8));
    } else if (op == 7) {
      // Cancel mid-fetch: promote, then drop the match unadopted.
      const auto& p = universe[rng() % universe.size()];
      const int64_t free_before = rig.pool->n_free() + rig.pool->n_cached();
      {
        PrefixMatch m = rig.index->match(rig.ns, p, static_cast<int64_t>(p.size()) - 1, false);
        (void)rig.tiers->extend_match(rig.ns, p, static_cast<int64_t>(p.size()) - 1, m);
      }
      // Promoted blocks went back; the pool may only have lost cached
      // blocks to host/disk while allocating for them.
      ASSERT_LE(rig.pool->n_free() + rig.pool->n_cached(), rig.pool->n_blocks());
      ASSERT_GE(rig.pool->n_free() + rig.pool->n_cached(), free_before);
    } else if (op == 8) {
      rig.tiers->disk()->flush();
    } else {
      rig.tiers->persist();
    }
    rig.check();
    // No block lost: each one ever published is in the pool or a tier.
    const auto pk = rig.pool_keys();
    for (const auto& k : ever) {
      const TierKey tk{.hash = Hash128{k.first.first, k.first.second}, .group = 0};
      ASSERT_TRUE(pk.count(k) || rig.tiers->in_host(tk) || rig.tiers->in_disk(tk))
          << "step " << step << ": block " << tk.hash.hex() << " lost";
    }
    // No block counted twice: write-back keeps pool and host disjoint
    // (check_invariants); store counts equal their entries.
    const KvTiersStats st = rig.tiers->stats();
    for (const TierStoreStats& t : st.tiers) {
      ASSERT_LE(t.n_blocks, t.n_slots);
      ASSERT_EQ(t.n_corrupt + t.n_identity_mismatch + t.n_write_failed, 0);
    }
  }
  for (auto& o : live) o.table.release();
  rig.check();
  EXPECT_GT(n_tier_hits, 0) << "the sequence never hit a tier";
  EXPECT_GT(rig.tiers->stats().n_promoted, 0);
  // Everything returns: no reference is left behind.
  EXPECT_EQ(rig.pool->n_free() + rig.pool->n_cached(), rig.pool->n_blocks());
  rig.tiers.reset();
  rig.index->release_namespace(rig.ns);
  rig.index.reset();
  EXPECT_EQ(rig.pool->n_free(), rig.pool->n_blocks());
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, RandomOpsSingleGroupWriteBack) {
  random_ops(false, false, true, 1);
}
TEST(KvTiers, RandomOpsSingleGroupWriteThrough) {
  random_ops(false, true, true, 2);
}
TEST(KvTiers, RandomOpsSingleGroupDiskOnly) {
  random_ops(false, false, false, 3);
}
TEST(KvTiers, RandomOpsHybridWriteBack) {
  random_ops(true, false, true, 4);
}
TEST(KvTiers, RandomOpsHybridDiskOnly) {
  random_ops(true, false, false, 5);
}

std::vector<int32_t> long_prompt(int n, int seed) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<size_t>(i)] = 1 + (i * 7 + seed * 13) % 97;
  return p;
}

TEST(KvTiers, HostPromotionIsBitIdenticalAndCancelKeepsTheEntry) {
  Rig rig(false, 8, host_cfg(1 << 20));
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 1);
  rig.request(a).table.release();
  EXPECT_EQ(rig.index->evict(100), 4);
  EXPECT_EQ(rig.tiers->host()->stats().n_blocks, 4);
  {
    // Cancelled fetch: promoted, never adopted.
    PrefixMatch m = rig.index->match(rig.ns, a, 4 * kP, false);
    EXPECT_EQ(rig.tiers->extend_match(rig.ns, a, 4 * kP, m), 4 * kP);
    EXPECT_EQ(m.blocks.size(), 4u);
  }
  rig.check();
  EXPECT_EQ(rig.tiers->host()->stats().n_blocks, 4);
  EXPECT_EQ(rig.pool->n_free(), rig.pool->n_blocks());
  Rig::Outcome o = rig.request(a);
  EXPECT_TRUE(o.bytes_ok);
  EXPECT_EQ(o.n_adopted, 4 * kP);
  EXPECT_EQ(o.n_from_tiers, 4 * kP);
  // Published again: write-back erases the host copies.
  EXPECT_EQ(rig.tiers->host()->stats().n_blocks, 0);
  rig.check();
  const PrefixIndexStats is = rig.index->stats();
  EXPECT_EQ(is.total.n_hit_tokens, 2 * 4 * kP);  // both lookups counted the tier tokens
}

TEST(KvTiers, WarmRestartFromDisk) {
  const auto dir = temp_dir("warm");
  const KvTierConfig cfg = disk_cfg(dir.string(), 1 << 22);
  const std::vector<int32_t> a = long_prompt(5 * kP + 2, 2);
  {
    Rig rig(true, 16, cfg);
    rig.request(a).table.release();
    rig.tiers->persist();  // what KvManager's destructor does
    EXPECT_GT(rig.tiers->disk()->stats().n_blocks, 5);
  }
  Rig rig(true, 16, cfg);  // a fresh process: empty pool, index loaded from disk
  EXPECT_GT(rig.tiers->disk()->stats().n_blocks, 5);
  Rig::Outcome o = rig.request(a);
  EXPECT_TRUE(o.bytes_ok);
  EXPECT_EQ(o.n_adopted, 5 * kP);
  EXPECT_EQ(o.n_from_tiers, 5 * kP);
  rig.check();
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, CrashAfterAWriteBatchLosesNoWrittenRecord) {
  // A child process writes blocks to disk (evictions, then one batch at the
  // next lookup) and dies without flush() or its destructors (kill -9):
  // the journal brings every written record back.
  const auto dir = temp_dir("crash");
  const KvTierConfig cfg = disk_cfg(dir.string(), 1 << 22);
  const std::vector<int32_t> a = long_prompt(6 * kP + 1, 12);
  const std::vector<int32_t> b = long_prompt(3 * kP + 1, 13);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto* rig = new Rig(false, 16, cfg);  // never destroyed
    rig->request(a).table.release();
    if (rig->index->evict(100) != 6) ::_exit(2);
    rig->request(b).table.release();  // its lookup writes the batch of six
    if (rig->tiers->disk()->stats().n_stored != 6) ::_exit(3);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  Rig rig(false, 16, cfg);  // the restart
  EXPECT_EQ(rig.tiers->disk()->stats().n_blocks, 6);
  Rig::Outcome o = rig.request(a);
  EXPECT_EQ(o.n_from_tiers, 6 * kP);
  EXPECT_TRUE(o.bytes_ok);
  o.table.release();
  rig.check();
  std::filesystem::remove_all(dir);
}

// Writes the chain of `a` to disk in a first "process"; returns the dir.
std::filesystem::path disk_with(const std::string& name, const std::vector<int32_t>& a) {
  auto dir = temp_dir(name);
  Rig rig(false, 16, disk_cfg(dir.string(), 1 << 22));
  rig.request(a).table.release();
  rig.tiers->persist();
  return dir;
}

TEST(KvTiers, CorruptPayloadIsACheckedMissAndTheEntryIsDropped) {
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 3);
  const auto dir = disk_with("corrupt", a);
  Rig rig(false, 16, disk_cfg(dir.string(), 1 << 22));
  // Flip one payload byte in every slot but the first block's: find the
  // slot of block 1 through the store (slot order = write order).
  const int64_t slot_bytes = rig.tiers->disk()->stats().slot_bytes;
  const int fd = ::open(rig.tiers->disk()->data_path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const auto size = std::filesystem::file_size(rig.tiers->disk()->data_path());
  int n_flipped = 0;
  for (int64_t s = 0; (s + 1) * slot_bytes <= static_cast<int64_t>(size); ++s) {
    std::vector<uint8_t> hdr(static_cast<size_t>(block_record_header_bytes(kP)));
    ASSERT_EQ(::pread(fd, hdr.data(), hdr.size(), s * slot_bytes),
              static_cast<ssize_t>(hdr.size()));
    const std::vector<int32_t> t = record_tokens(hdr.data());
    if (t != std::vector<int32_t>(a.begin() + kP, a.begin() + 2 * kP)) continue;
    uint8_t b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, s * slot_bytes + 4096 + 100), 1);
    b ^= 0x5a;
    ASSERT_EQ(::pwrite(fd, &b, 1, s * slot_bytes + 4096 + 100), 1);
    ++n_flipped;
  }
  ::close(fd);
  ASSERT_EQ(n_flipped, 1);
  const int64_t n_before = rig.tiers->disk()->stats().n_blocks;
  Rig::Outcome o = rig.request(a);  // succeeds: block 0 from disk, the rest recomputed
  EXPECT_TRUE(o.bytes_ok);
  EXPECT_EQ(o.n_from_tiers, kP);
  EXPECT_EQ(o.table.length(), static_cast<int64_t>(a.size()));
  const TierStoreStats ds = rig.tiers->disk()->stats();
  EXPECT_EQ(ds.n_corrupt, 1);
  EXPECT_EQ(ds.n_blocks, n_before - 1);  // dropped
  rig.check();
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, TruncatedFileIsAMiss) {
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 4);
  const auto dir = disk_with("truncated", a);
  std::filesystem::resize_file(dir / "blocks.kvs", 4096);  // mid-record of slot 0
  Rig rig(false, 16, disk_cfg(dir.string(), 1 << 22));
  EXPECT_EQ(rig.tiers->disk()->stats().n_blocks, 4);  // the index still lists them
  Rig::Outcome o = rig.request(a);
  EXPECT_EQ(o.n_from_tiers, 0);
  EXPECT_EQ(o.table.length(), static_cast<int64_t>(a.size()));
  EXPECT_EQ(rig.tiers->disk()->stats().n_corrupt, 1);
  rig.check();
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, AnotherModelOrFormatIsAnIdentityMismatch) {
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 5);
  const auto dir = disk_with("identity", a);
  {
    // Other weights, same layout: the index is refused as a whole.
    Rig rig(false, 16, disk_cfg(dir.string(), 1 << 22), /*weights=*/2);
    EXPECT_EQ(rig.tiers->disk()->stats().n_identity_mismatch, 4);
    EXPECT_EQ(rig.tiers->disk()->stats().n_blocks, 0);
    Rig::Outcome o = rig.request(a);
    EXPECT_EQ(o.n_adopted, 0);
    EXPECT_EQ(o.table.length(), static_cast<int64_t>(a.size()));
    rig.tiers->persist();  // overwrites the index with its own blocks
  }
  {
    // Another KV layout (hybrid groups, other block bytes) on the same dir.
    Rig rig(true, 16, disk_cfg(dir.string(), 1 << 22));
    EXPECT_GT(rig.tiers->disk()->stats().n_identity_mismatch, 0);
    EXPECT_EQ(rig.tiers->disk()->stats().n_blocks, 0);
    EXPECT_EQ(rig.request(a).n_adopted, 0);
  }
  // A record whose header names another identity (index says ours): a
  // single foreign slot is refused at read time.
  BlockRecordIdentity id = block_record_identity(make_identity(make_layout(false)), kP, 4096);
  BlockRecordIdentity other = id;
  other.model_digest.lo ^= 1;
  std::vector<uint8_t> hdr(static_cast<size_t>(block_record_header_bytes(kP)));
  std::vector<uint8_t> payload(4096, 7);
  const std::vector<int32_t> toks(kP, 3);
  write_block_record_header(other, {.ns_digest = {}, .hash = {1, 2}, .parent_hash = {}, .group = 0},
                            toks, payload, hdr.data());
  EXPECT_EQ(check_block_record_header(id, hdr.data()), BlockRecordCheck::kIdentityMismatch);
  EXPECT_EQ(check_block_record_header(other, hdr.data()), BlockRecordCheck::kOk);
  hdr[40] ^= 1;  // any flipped header bit
  EXPECT_EQ(check_block_record_header(other, hdr.data()), BlockRecordCheck::kCorrupt);
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, DiskFullSkipsTheWriteBackAndCountsIt) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const auto dir = temp_dir("full");
  std::filesystem::create_directories(dir);
  // Every write of the data file fails with ENOSPC.
  std::filesystem::create_symlink("/dev/full", dir / "blocks.kvs");
  Rig rig(false, 6, disk_cfg(dir.string(), 1 << 22));
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 6);
  const std::vector<int32_t> b = long_prompt(4 * kP + 1, 7);
  rig.request(a).table.release();
  rig.request(b).table.release();  // evicts a's blocks: the disk write-back fails
  rig.tiers->disk()->flush();
  const TierStoreStats ds = rig.tiers->disk()->stats();
  EXPECT_GT(ds.n_write_failed, 0);
  EXPECT_EQ(ds.n_blocks, 0);
  Rig::Outcome o = rig.request(a);  // still served: recomputed
  EXPECT_EQ(o.n_from_tiers, 0);
  EXPECT_EQ(o.table.length(), static_cast<int64_t>(a.size()));
  rig.check();
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, FetchOrRecomputePicksTheFasterPath) {
  const auto dir = temp_dir("decide");
  Rig rig(false, 16, disk_cfg(dir.string(), 1 << 22));
  // Measured at start-up by the probe.
  EXPECT_GT(rig.tiers->cost_model().disk.bytes_per_s, 0);
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 8);
  rig.request(a).table.release();
  ASSERT_EQ(rig.index->evict(100), 4);
  rig.tiers->disk()->flush();
  const double bb = static_cast<double>(rig.pool->block_bytes());
  // A slow disk (1 KB/s) against a fast prefill: recomputing is faster.
  rig.tiers->set_cost_model({.host = {},
                             .disk = {.t0_s = 0.001, .bytes_per_s = 1e3},
                             .redis = {},
                             .prefill_tokens_per_s = 1e6},
                            /*frozen=*/true);
  Rig::Outcome o = rig.request(a);
  EXPECT_EQ(o.n_from_tiers, 0);
  EXPECT_EQ(o.table.length(), static_cast<int64_t>(a.size()));
  KvTiersStats st = rig.tiers->stats();
  EXPECT_EQ(st.n_decide_recompute, 1);
  EXPECT_EQ(st.n_decide_fetch, 0);
  EXPECT_NEAR(st.last_fetch_s, 4 * (0.001 + bb / 1e3), 1e-9);
  EXPECT_NEAR(st.last_recompute_s, 4.0 * kP / 1e6, 1e-12);
  o.table.release();
  ASSERT_EQ(rig.index->evict(100), 4);  // already on disk: nothing rewritten
  // A fast disk against a slow prefill: fetching is faster.
  rig.tiers->set_cost_model({.host = {},
                             .disk = {.t0_s = 1e-5, .bytes_per_s = 1e9},
                             .redis = {},
                             .prefill_tokens_per_s = 100},
                            /*frozen=*/true);
  o = rig.request(a);
  EXPECT_EQ(o.n_from_tiers, 4 * kP);
  EXPECT_TRUE(o.bytes_ok);
  st = rig.tiers->stats();
  EXPECT_EQ(st.n_decide_fetch, 1);
  EXPECT_EQ(st.n_decide_recompute, 1);
  rig.check();
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, OneProcessPerDiskDirectory) {
  const auto dir = temp_dir("lock");
  BlockRecordIdentity id = block_record_identity(make_identity(make_layout(false)), kP, 4096);
  auto a = DiskStore::open(id, dir.string(), 1 << 20);
  ASSERT_TRUE(a.ok());
  auto b = DiskStore::open(id, dir.string(), 1 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message.find("in use by another kvstack process"), std::string::npos);
  a->reset();
  EXPECT_TRUE(DiskStore::open(id, dir.string(), 1 << 20).ok());
  std::filesystem::remove_all(dir);
}

TEST(KvTiers, FlagErrorsNameTheFlag) {
  const KvLayout layout = make_layout(false);
  auto pool = BlockPool::create(layout, {.mem_bytes = 4 * layout.block_bytes()});
  ASSERT_TRUE(pool.ok());
  PrefixIndex index(**pool);
  const CacheIdentity id = make_identity(layout);
  auto tiny = KvTiers::create(index, id, host_cfg(100));
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.error().message.find("--kv-host-mem"), std::string::npos);
  auto no_size = KvTiers::create(index, id, disk_cfg("/tmp/x", 0));
  ASSERT_FALSE(no_size.ok());
  EXPECT_NE(no_size.error().message.find("--kv-disk-size"), std::string::npos);
  auto bad_dir = KvTiers::create(index, id, disk_cfg("/proc/none/x", 1 << 20));
  ASSERT_FALSE(bad_dir.ok());
  EXPECT_NE(bad_dir.error().message.find("/proc/none/x"), std::string::npos);
}

// A private redis-server on a free port (no persistence), stopped at the
// end; running() is false where redis-server is not installed.
class RedisServer {
 public:
  RedisServer() {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ::close(s);
      return;
    }
    port_ = ntohs(a.sin_port);
    ::close(s);
    const std::string port = std::to_string(port_);
    pid_ = ::fork();
    if (pid_ == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      ::execlp("redis-server", "redis-server", "--port", port.c_str(), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 250 && pid_ > 0; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;  // exited: not installed
        break;
      }
      const int c = ::socket(AF_INET, SOCK_STREAM, 0);
      a.sin_port = htons(static_cast<uint16_t>(port_));
      const bool up = ::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
      ::close(c);
      if (up) {
        running_ = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    running_ = false;
  }
  bool running() const { return running_; }
  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  bool running_ = false;
};

KvTierConfig redis_cfg(const std::string& url) {
  KvTierConfig c;
  c.redis_url = url;
  c.redis_timeout_ms = 1000;
  return c;
}

TEST(KvTiers, RedisRunsArePipelined) {
  RedisServer server;
  if (!server.running()) GTEST_SKIP() << "redis-server not installed (scripts/setup.sh)";
  constexpr int kBlocks = 24;
  Rig rig(false, 2 * kBlocks + 4, redis_cfg(server.url()));
  RedisStore* r = rig.tiers->redis();
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->connected());
  const std::vector<int32_t> a = long_prompt(kBlocks * kP + 1, 3);
  int64_t rt = r->stats().n_round_trips;
  rig.request(a).table.release();
  // The lookup's miss (one EXISTS batch of 8), then one publish: one EXISTS
  // batch and one SET batch for all 24 blocks.
  EXPECT_EQ(r->stats().n_stored, kBlocks);
  EXPECT_EQ(r->stats().n_round_trips - rt, 3);
  ASSERT_EQ(rig.index->evict(1000), kBlocks);
  rt = r->stats().n_round_trips;
  Rig::Outcome o = rig.request(a);
  EXPECT_EQ(o.n_from_tiers, kBlocks * kP);
  EXPECT_TRUE(o.bytes_ok);
  // Chain walk: EXISTS batches of 8 and 16; then one GET stream; the
  // republish finds every block present (one EXISTS batch, no SET).
  EXPECT_EQ(r->stats().n_round_trips - rt, 4);
  EXPECT_EQ(r->stats().n_hits, kBlocks);
  EXPECT_EQ(r->stats().n_stored, kBlocks);
  EXPECT_EQ(r->stats().n_errors, 0);
  o.table.release();
  rig.check();
  // Another namespace's lookup of the same tokens finds nothing.
  const NamespaceId other = rig.index->intern_namespace(Hash128{5, 5});
  rig.index->acquire_namespace(other);
  ASSERT_EQ(rig.index->evict(1000), kBlocks);
  PrefixMatch m = rig.index->match(other, a, kBlocks * kP, false);
  EXPECT_EQ(rig.tiers->extend_match(other, a, kBlocks * kP, m), 0);
  m = PrefixMatch{};
  rig.index->release_namespace(other);
}

TEST(KvTiers, RedisCorruptValueInARunCutsTheHitThere) {
  RedisServer server;
  if (!server.running()) GTEST_SKIP() << "redis-server not installed (scripts/setup.sh)";
  if (std::system("command -v redis-cli > /dev/null") != 0) GTEST_SKIP() << "no redis-cli";
  constexpr int kBlocks = 12;
  Rig rig(false, 2 * kBlocks + 4, redis_cfg(server.url()));
  RedisStore* r = rig.tiers->redis();
  const std::vector<int32_t> a = long_prompt(kBlocks * kP + 1, 4);
  rig.request(a).table.release();
  // The key of block 7 (its chained hash, as the index computes it).
  const Hash128 ns_digest = rig.index->namespace_digest(rig.ns);
  Hash128 h{};
  for (int i = 0; i <= 7; ++i) {
    h = rig.index->chain_hash(h, rig.ns, std::span<const int32_t>(a).subspan(i * kP, kP));
  }
  const std::string key = r->key_name({.hash = h, .group = 0}, ns_digest);
  const std::string cmd = "redis-cli -p " + std::to_string(server.port()) + " SETRANGE " + key +
                          " " + std::to_string(block_record_header_bytes(kP) + 9) +
                          " garbage > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  ASSERT_EQ(rig.index->evict(1000), kBlocks);
  Rig::Outcome o = rig.request(a);
  // The stream stops being useful at block 7: the retry takes blocks 0-6.
  EXPECT_EQ(o.n_from_tiers, 7 * kP);
  EXPECT_TRUE(o.bytes_ok);
  EXPECT_EQ(r->stats().n_corrupt, 1);
  o.table.release();
  rig.check();
  // The bad value was deleted; the republish stored the recomputed block.
  ASSERT_EQ(rig.index->evict(1000), kBlocks);
  o = rig.request(a);
  EXPECT_EQ(o.n_from_tiers, kBlocks * kP);
  EXPECT_TRUE(o.bytes_ok);
  EXPECT_EQ(r->stats().n_corrupt, 1);
  o.table.release();
}

TEST(KvTiers, RedisDownIsABoundedMiss) {
  RedisServer server;
  if (!server.running()) GTEST_SKIP() << "redis-server not installed (scripts/setup.sh)";
  constexpr int kBlocks = 8;
  KvTierConfig cfg = redis_cfg(server.url());
  cfg.redis_timeout_ms = 100;
  Rig rig(false, 2 * kBlocks + 4, cfg);
  const std::vector<int32_t> a = long_prompt(kBlocks * kP + 1, 5);
  rig.request(a).table.release();
  ASSERT_EQ(rig.index->evict(1000), kBlocks);
  server.stop();
  const auto t0 = std::chrono::steady_clock::now();
  Rig::Outcome o = rig.request(a);  // recomputed; the publish is skipped
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(o.n_from_tiers, 0);
  EXPECT_EQ(o.table.length(), static_cast<int64_t>(a.size()));
  EXPECT_LT(s, 0.5);
  EXPECT_GT(rig.tiers->redis()->stats().n_errors, 0);
  o.table.release();
  rig.check();
}

TEST(KvTiers, PartialTailBlockComesFromTheTier) {
  // A repeated 5-block prompt looked up with all but its last token (what
  // the server does): 4 full blocks and 3 tokens of the 5th.
  Rig rig(false, 16, host_cfg(1 << 20));
  const std::vector<int32_t> a = long_prompt(5 * kP, 6);
  rig.request(a).table.release();
  ASSERT_EQ(rig.index->evict(100), 5);  // all five to the host
  const int64_t max_tokens = 5 * kP - 1;
  PrefixMatch m = rig.index->match(rig.ns, a, max_tokens, /*find_partial=*/true);
  EXPECT_EQ(m.n_tokens(), 0);
  EXPECT_EQ(rig.tiers->extend_match(rig.ns, a, max_tokens, m, true, /*find_partial=*/true),
            max_tokens);
  ASSERT_EQ(m.blocks.size(), 4u);
  ASSERT_TRUE(m.partial.valid());
  EXPECT_EQ(m.n_partial_tokens, kP - 1);
  EXPECT_TRUE(block_matches(*rig.pool, m.partial.id().value, a, 0));  // bit-identical
  EXPECT_EQ(rig.tiers->stats().n_partial_hits, 1);
  // The tail comes into a private block the sequence copies from.
  BlockTable t(*rig.pool);
  t.adopt_prefix(std::move(m.blocks));
  ASSERT_TRUE(t.adopt_partial_copy(std::move(m.partial), kP - 1).ok());
  EXPECT_EQ(t.length(), max_tokens);
  m = PrefixMatch{};
  // Nothing was published again, so the host still holds all five.
  EXPECT_EQ(rig.tiers->host()->stats().n_blocks, 5);
  t.release();
  rig.check();
  // Without find_partial: the full blocks only.
  m = rig.index->match(rig.ns, a, max_tokens, false);
  EXPECT_EQ(rig.tiers->extend_match(rig.ns, a, max_tokens, m), 4 * kP);
  EXPECT_FALSE(m.partial.valid());
  m = PrefixMatch{};
  // A request whose 5th block differs in its last token (beyond the
  // lookup limit): another block by hash, but the host's child of block 4
  // shares the 3 tokens that count (the tail completed by other tokens,
  // e.g. a previous answer).
  std::vector<int32_t> b = a;
  b.back() += 1;
  ASSERT_EQ(rig.index->evict(100), 0);
  m = rig.index->match(rig.ns, b, max_tokens, true);
  EXPECT_EQ(rig.tiers->extend_match(rig.ns, b, max_tokens, m, true, true), max_tokens);
  ASSERT_TRUE(m.partial.valid());
  EXPECT_EQ(m.n_partial_tokens, kP - 1);
  EXPECT_TRUE(block_matches(*rig.pool, m.partial.id().value, a, 0));
  m = PrefixMatch{};
  // Differing at its 3rd token: 2 tokens shared; at its 1st: none.
  std::vector<int32_t> c = a;
  c[4 * kP + 2] += 1;
  m = rig.index->match(rig.ns, c, max_tokens, true);
  EXPECT_EQ(rig.tiers->extend_match(rig.ns, c, max_tokens, m, true, true), 4 * kP + 2);
  EXPECT_EQ(m.n_partial_tokens, 2);
  m = PrefixMatch{};
  c[4 * kP] += 1;
  m = rig.index->match(rig.ns, c, max_tokens, true);
  EXPECT_EQ(rig.tiers->extend_match(rig.ns, c, max_tokens, m, true, true), 4 * kP);
  EXPECT_FALSE(m.partial.valid());
  m = PrefixMatch{};
  EXPECT_EQ(rig.tiers->stats().n_partial_hits, 3);
  rig.check();
}

TEST(KvTiers, PartialTailBlockComesFromRedis) {
  RedisServer server;
  if (!server.running()) GTEST_SKIP() << "redis-server not installed (scripts/setup.sh)";
  Rig rig(false, 16, redis_cfg(server.url()));
  const std::vector<int32_t> a = long_prompt(3 * kP, 7);
  rig.request(a).table.release();
  ASSERT_EQ(rig.index->evict(100), 3);
  const int64_t max_tokens = 3 * kP - 1;
  PrefixMatch m = rig.index->match(rig.ns, a, max_tokens, true);
  EXPECT_EQ(rig.tiers->extend_match(rig.ns, a, max_tokens, m, true, true), max_tokens);
  ASSERT_TRUE(m.partial.valid());
  EXPECT_TRUE(block_matches(*rig.pool, m.partial.id().value, a, 0));
  EXPECT_EQ(rig.tiers->redis()->stats().n_hits, 3);
  m = PrefixMatch{};
  rig.check();
}

// The bytes an int8 host round trip gives for the expected block.
bool block_matches_int8(const BlockPool& pool, int32_t b, std::span<const int32_t> prefix,
                        int group) {
  const int64_t n = pool.block_bytes();
  std::vector<uint8_t> want(static_cast<size_t>(n));
  std::vector<uint8_t> enc(static_cast<size_t>(int8_block_bytes(n)));
  fill_expected(prefix, group, want.data(), n);
  encode_int8_block_scalar(want.data(), n, enc.data());
  decode_int8_block_scalar(enc.data(), n, want.data());
  return std::memcmp(want.data(), pool.block_data(BlockId{b}), want.size()) == 0;
}

TEST(KvTiers, Int8HostFormatRoundTripsAndIsItsOwnIdentity) {
  const auto dir = temp_dir("int8");
  KvTierConfig cfg = host_cfg(1 << 20);
  cfg.host_format = HostFormat::kInt8;
  cfg.disk_dir = dir.string();
  cfg.disk_bytes = 1 << 22;
  const std::vector<int32_t> a = long_prompt(4 * kP + 1, 9);
  {
    Rig rig(false, 8, cfg);
    const int64_t bb = rig.pool->block_bytes();
    rig.request(a).table.release();
    ASSERT_EQ(rig.index->evict(100), 4);
    KvTiersStats st = rig.tiers->stats();
    EXPECT_EQ(st.host_format, "int8");
    EXPECT_EQ(st.pool_block_bytes, bb);
    EXPECT_EQ(st.stored_block_bytes, int8_block_bytes(bb));
    EXPECT_EQ(st.n_encoded, 4);
    EXPECT_GT(st.cost.convert_s, 0);
    // Promotion decodes: the blocks hold exactly the int8 round trip of
    // what was computed (not the computed bytes: the format is lossy).
    const int64_t max_tokens = static_cast<int64_t>(a.size()) - 1;
    PrefixMatch m = rig.index->match(rig.ns, a, max_tokens, false);
    ASSERT_EQ(rig.tiers->extend_match(rig.ns, a, max_tokens, m), 4 * kP);
    for (size_t i = 0; i < m.blocks.size(); ++i) {
      EXPECT_TRUE(block_matches_int8(*rig.pool, m.blocks[i].id().value,
                                     std::span<const int32_t>(a).first((i + 1) * kP), 0));
      EXPECT_FALSE(block_matches(*rig.pool, m.blocks[i].id().value,
                                 std::span<const int32_t>(a).first((i + 1) * kP), 0));
    }
    st = rig.tiers->stats();
    EXPECT_EQ(st.n_decoded, 4);
    EXPECT_GT(st.decode_seconds, 0);
    m = PrefixMatch{};
    rig.tiers->persist();  // the host's int8 records to disk
    rig.check();
  }
  {
    // The same directory read with the pool format: another identity, a miss.
    KvTierConfig pool_fmt = disk_cfg(dir.string(), 1 << 22);
    Rig rig(false, 8, pool_fmt);
    Rig::Outcome o = rig.request(a);
    EXPECT_EQ(o.n_from_tiers, 0);
    EXPECT_GT(rig.tiers->disk()->stats().n_identity_mismatch, 0);
    o.table.release();
  }
  std::filesystem::remove_all(dir);
  // int8 of a non-f16 pool is refused, naming the flag.
  std::vector<KvLayerSpec> layers = {{.kind = KvLayerKind::kStandard,
                                      .n_kv_heads = 1,
                                      .head_dim_k = 32,
                                      .head_dim_v = 32,
                                      .dtype = KvDtype::kInt8}};
  auto l8 = KvLayout::create(std::move(layers), kP);
  ASSERT_TRUE(l8.ok());
  auto pool = BlockPool::create(*l8, {.mem_bytes = 4 * l8->block_bytes()});
  ASSERT_TRUE(pool.ok());
  PrefixIndex index(**pool);
  KvTierConfig bad = host_cfg(1 << 20);
  bad.host_format = HostFormat::kInt8;
  auto t = KvTiers::create(index, make_identity(*l8), bad);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("--kv-host-format"), std::string::npos);
}

}  // namespace
}  // namespace kvstack

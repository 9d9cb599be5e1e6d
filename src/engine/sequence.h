// Sequences and the KV manager: the request lifecycle on top of the block
// pool and the prefix index (kv-cache-spec.md section 5, reference-and-append).
//
//   KvManager kv(pool, identity, {.prefix_cache = true});
//   Sequence s = kv.new_sequence(kv.namespace_for(cache_salt));
//   s.adopt_cached_prefix(prompt);        // 1. longest compatible match, refs taken
//   forward.step({s.table(), rest...});   // 2. reserve (+ COW), write, commit
//   s.on_committed(rest);                 //    record tokens, publish full blocks
//   Sequence beam = s.fork();             // share every block; COW on append
//   ~Sequence / release()                 // 5. each reference released once
//
// A Sequence owns its BlockTable and the token ids of its committed
// positions (tokens().size() == table().length() between steps), its
// namespace, and the length of its published chain. Only committed full
// blocks are published (after the forward that wrote them returned), so a
// cancelled or failed step publishes nothing: the caller rolls back the
// table (or drops the sequence) and the uncommitted reservation returns to
// the pool.
//
// Namespaces: namespace_for(salt) hashes the cache identity with the salt
// (or the deployment default when the salt is empty); public prefixes
// (pin_public) are visible from every namespace. Disabled (prefix_cache =
// false): no index is attached, lookups match nothing, nothing is
// published, and blocks are freed on release.
//
// Thread-safety: single owner (the engine's scheduler thread).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/cache_identity.h"
#include "kv/kv_tiers.h"
#include "kv/prefix_index.h"

namespace kvstack {

struct KvManagerConfig {
  bool prefix_cache = true;
  std::string default_namespace = "default";  // namespace of requests without a cache salt
  bool partial_reuse = true;                  // copy-on-partial-reuse of a cached block
  int64_t event_capacity = 0;                 // pending KV events kept (0 = events off)
};

// Prefix-cache statistics of one namespace (KvManager::prefix_stats).
struct KvNamespaceStats {
  NamespaceId ns = kNoNamespace;
  // "default" (or the configured default), "public", or "salt:<cache salt>".
  // Names a tenant's salt: do not show it to other tenants (spec section 6).
  std::string name;
  NamespaceStats counts;
};

// Everything a user or an operator needs to judge the prefix cache (the
// /v1/kv/stats payload, `kvstack run --kv-stats`). Counters are lifetime
// totals of this manager; block figures are current.
struct KvPrefixStats {
  bool enabled = false;              // prefix cache on (all else is 0 when off)
  int64_t block_size = 0;            // tokens per block (P)
  int64_t n_queries = 0;             // prefix lookups (one per new request or sequence)
  int64_t n_query_tokens = 0;        // tokens offered to lookups (prompt minus its last token)
  int64_t n_hit_blocks = 0;          // full blocks matched
  int64_t n_hit_tokens = 0;          // tokens served from the cache (partial copies included)
  double hit_rate = 0;               // n_hit_tokens / n_query_tokens
  int64_t n_partial_hits = 0;        // lookups ending in a partial-block candidate
  int64_t n_published = 0;           // blocks published (lifetime)
  int64_t n_nodes = 0;               // published blocks now (in use + cached)
  int64_t n_cached_blocks = 0;       // unreferenced, resident, evictable
  int64_t n_pinned_blocks = 0;       // public prefix blocks (never evicted)
  int64_t n_evictions = 0;           // cached blocks reclaimed for allocations
  int64_t n_cow_copies = 0;          // shared partial tails copied before an append
  int64_t n_partial_copies = 0;      // cached blocks copied for a partial-block hit
  int64_t n_collisions = 0;          // lookup-hash hits rejected by token verification
  int64_t n_duplicates = 0;          // publishes refused: an equal block was published
  int64_t n_events_dropped = 0;      // queued events lost to the queue bound
  int64_t n_namespaces = 0;          // live namespaces now (used, or holding blocks)
  int64_t n_namespaces_expired = 0;  // namespaces expired so far (lifetime)
  std::vector<KvNamespaceStats> namespaces;  // by namespace id
  // The pool per KV group (kv_groups.h; one entry for a single-group model),
  // filled whether or not the prefix cache is on.
  std::vector<BlockPoolGroupStats> groups;
  // Retention compaction totals over every table of the pool (retention.h),
  // filled whether or not the prefix cache is on.
  RetentionStats retention;
};

// A human table (units spelled out, one line per namespace) and a JSON
// object of the same figures (keys are the field names without n_).
std::string format_prefix_stats(const KvPrefixStats& stats);
std::string prefix_stats_json(const KvPrefixStats& stats);
// The per-group table that format_prefix_stats ends with.
std::string format_group_stats(const std::vector<BlockPoolGroupStats>& groups);
// One event as a JSON line (no newline), the format of --kv-events:
//   {"event":"stored","hash":"<32 hex>","parent":"<32 hex>","n_tokens":16,"namespace":0}
std::string kv_event_json(const KvEvent& event);

class KvManager;

// One use of a namespace (PrefixIndex::acquire_namespace), held by every
// live Sequence: a namespace expires only when no sequence uses it and it
// holds no block. Move-only; releases exactly once.
class NamespaceUse {
 public:
  NamespaceUse() = default;
  NamespaceUse(PrefixIndex* index, NamespaceId ns);
  NamespaceUse(NamespaceUse&& other) noexcept;
  NamespaceUse& operator=(NamespaceUse&& other) noexcept;
  NamespaceUse(const NamespaceUse&) = delete;
  NamespaceUse& operator=(const NamespaceUse&) = delete;
  ~NamespaceUse() { reset(); }
  void reset();

 private:
  PrefixIndex* index_ = nullptr;
  NamespaceId ns_ = kNoNamespace;
};

// Appends a KvManager's block stored / removed events to a file as JSON
// lines (kv_event_json), from open() (blocks already published are written
// first, as stored events) until destruction, flushed after every line.
// REQUIRES: destroyed before the manager.
class KvEventFile {
 public:
  KvEventFile() = default;
  ~KvEventFile();
  KvEventFile(const KvEventFile&) = delete;
  KvEventFile& operator=(const KvEventFile&) = delete;
  // kInvalidArgument when the prefix cache is off, kIo naming the file.
  Status open(KvManager& kv, const std::string& path);
  int64_t n_written() const { return n_written_; }

 private:
  KvManager* kv_ = nullptr;
  std::FILE* file_ = nullptr;
  int64_t n_written_ = 0;
};

class Sequence {
 public:
  Sequence(Sequence&&) noexcept = default;
  Sequence& operator=(Sequence&&) noexcept = default;
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;
  ~Sequence() = default;  // the table releases every reference exactly once

  BlockTable& table() { return table_; }
  const BlockTable& table() const { return table_; }
  int64_t length() const { return table_.length(); }
  // Token ids of the committed positions [0, length()).
  const std::vector<int32_t>& tokens() const { return tokens_; }
  NamespaceId ns() const { return ns_; }
  // Length of this sequence's published chain, in blocks.
  int64_t n_published_blocks() const { return n_published_; }

  // Adopts the longest cached prefix of `prompt` of at most
  // prompt.size() - 1 tokens (the last prompt position is always recomputed
  // so its logits exist): full blocks by reference, then a partial block by
  // copy. Returns the tokens adopted; the caller forwards
  // prompt[returned ..]. REQUIRES length() == 0.
  // count_stats = false: not counted as a prefix-cache query (prefetch).
  int64_t adopt_cached_prefix(std::span<const int32_t> prompt, bool count_stats = true);

  // Records tokens the last forward committed on table() (in order) and
  // publishes the newly completed full blocks.
  // REQUIRES: length() == tokens().size() + tokens.size().
  void on_committed(std::span<const int32_t> tokens);

  // A new sequence sharing every committed block, the tokens and the
  // namespace; either copies a shared partial tail before appending.
  Sequence fork() const;
  // The no-sharing reference of fork(): private copies of every block.
  Result<Sequence> clone_private() const;

  // Drops the uncommitted reservation (a failed or cancelled step).
  void rollback() { table_.rollback(); }
  // Releases every reference; the sequence becomes empty.
  void release();

 private:
  friend class KvManager;
  Sequence(KvManager& kv, NamespaceId ns, BlockTable table);
  void publish();

  KvManager* kv_ = nullptr;
  NamespaceId ns_ = kNoNamespace;
  NamespaceUse ns_use_;  // keeps ns_ from expiring while this sequence lives
  BlockTable table_;
  std::vector<int32_t> tokens_;
  int64_t n_published_ = 0;     // blocks [0, n_published_) are index nodes on this chain
  int64_t n_checkpointed_ = 0;  // hybrid: nodes whose other-group blocks were offered as companions
  bool publish_stopped_ = false;  // an equal block was published by another sequence
};

class KvManager {
 public:
  // REQUIRES: pool outlives the manager; every Sequence dies before it.
  KvManager(BlockPool& pool, CacheIdentity identity, KvManagerConfig config);
  ~KvManager();
  KvManager(const KvManager&) = delete;
  KvManager& operator=(const KvManager&) = delete;

  BlockPool& pool() const { return pool_; }
  const KvManagerConfig& config() const { return config_; }
  const CacheIdentity& identity() const { return identity_; }
  // The prefix index, or null when the prefix cache is disabled.
  PrefixIndex* index() const { return index_.get(); }

  // The namespace of a request: its cache salt, or the deployment default
  // when the salt is empty. kNoNamespace when the cache is disabled. A
  // namespace lives while a Sequence uses it or it holds published blocks
  // (PrefixIndex::acquire_namespace): pass the id to new_sequence() before
  // the pool changes, and do not keep it beyond the sequence's life.
  NamespaceId namespace_for(std::string_view cache_salt);
  NamespaceId public_namespace();
  // The namespace name namespace_for() gives `cache_salt` (its root digest
  // is identity().with_namespace(name).digest()).
  std::string namespace_name(std::string_view cache_salt) const;

  Sequence new_sequence(NamespaceId ns);

  // Keeps `seq` (computed in public_namespace()) alive for the manager's
  // lifetime: its published blocks are shared with every namespace and never
  // evicted. Returns the number of pinned blocks.
  int64_t pin_public(Sequence seq);
  int64_t n_pinned_blocks() const;

  // Prefix-cache statistics (index counters, pool copy/eviction counters,
  // per-namespace counts). O(namespaces).
  KvPrefixStats prefix_stats() const;
  // Delivers every block stored / removed event to `sink` as it happens
  // (inside the pool operation: the sink must not call back into the
  // manager). replay_existing first sends one stored event per block
  // already published, parents first. kInvalidArgument when the prefix
  // cache is disabled. An empty sink turns delivery off; the manager's
  // destructor turns it off before tearing the cache down.
  Status set_event_sink(KvEventSink sink, bool replay_existing = true);

  // Storage tiers below the pool (kv_tiers.h): evicted blocks go to host
  // memory and/or disk and prefix lookups continue there. Errors name the
  // flag at fault; kInvalidArgument when the prefix cache is off. Call
  // before the first sequence. The manager persists the tiers to disk
  // (warm restart) when it is destroyed.
  Status enable_tiers(const KvTierConfig& config);
  KvTiers* tiers() const { return tiers_.get(); }
  // Prefetch (spec section 9): promotes the tier-held part of `prompt`'s
  // cached prefix in the namespace of `cache_salt` into the pool, as cached
  // blocks, so that the request's later lookup hits the pool. May evict
  // other cached blocks (LRU, to the tiers), never blocks in use; skipped
  // when free + cached blocks cannot hold the prompt. Not counted as a
  // prefix-cache query. Returns the blocks promoted.
  int64_t prefetch(std::string_view cache_salt, std::span<const int32_t> prompt);
  // Tier statistics (enabled = false when there are none).
  KvTiersStats tier_stats() const;

 private:
  friend class Sequence;
  BlockPool& pool_;
  CacheIdentity identity_;
  KvManagerConfig config_;
  std::unique_ptr<PrefixIndex> index_;
  std::unique_ptr<KvTiers> tiers_;     // destroyed before index_
  std::vector<std::string> ns_names_;  // [namespace id] display name
  std::vector<Sequence> pinned_;       // destroyed before index_ (declared after it)
};

}  // namespace kvstack

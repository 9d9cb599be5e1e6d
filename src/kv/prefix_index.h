// PrefixIndex: the prefix cache over one BlockPool (kv-cache-spec.md
// sections 5 and 6). A radix tree at block granularity: every node is one
// full, committed, published pool block of P tokens; a node's children are
// keyed by their P token ids plus optional extra keys (multimodal inputs,
// encoder outputs). The tree has one root per namespace (NamespaceId), made
// from the full cache identity (cache_identity.h), so a namespace never sees
// another's blocks; the one public namespace (pinned deployment-wide
// prefixes) is visible from every namespace.
//
// Keys. Each node carries a chained 128-bit block hash (XXH3-128 of the
// parent node's hash (0 at the top), the node's namespace digest, its P
// token ids and its extra keys): the block's name in events and (later) in
// the cluster directory and tier keys. It is computed once, at publish.
// Lookups use a separate child table: one open-addressing (linear probing,
// load <= 1/2, backward-shift deletion) array of 16-byte slots keyed by a
// cheap 64-bit hash of (parent node, namespace, tokens, extra keys), each
// slot holding a 32-bit tag, the parent, the namespace and the block. A
// probe that matches tag, parent and namespace is verified against the
// stored token ids (memcmp) and extra keys, so a collision can never return
// wrong K/V: it reads as a miss (counted in n_collisions). Equal blocks
// under one parent are published once (a second publish is a duplicate).
// The match path does no hashing beyond that one XXH3-64 per block and no
// allocation beyond the result's block vector.

// Namespaces and public prefixes. A block published from namespace N is a
// node of N, whose parent may be a node of N or of the public namespace
// (a private continuation of a public system prompt). A lookup from N at a
// node tries N's key for the next block first, then (only while the path so
// far is public) the public key. Public nodes only have public parents.
//
// Lifecycle (block states in block_pool.h):
//   publish: a full committed block held by a table becomes a node (kUsed).
//   release: when the last reference drops, the node's block becomes kCached
//            and joins the LRU list (stays resident for future hits).
//   match:   hits take a reference (a kCached block is revived to kUsed and
//            leaves the LRU list).
//   evict:   only when an allocation needs more blocks than are free
//            (BlockPool::take_free); leaf-first in LRU order; the node is
//            removed and the block freed. Referenced blocks are never
//            evicted.
// The LRU list holds cached nodes in the order they became unreferenced.
// Tables release tail-first and a child's holders also hold its parent, so
// children normally precede their parent. evict() takes the front: a leaf is
// evicted; a node that still has children (rare: only when loose references
// outlived the chain) leaves the list and is put back at the front when its
// last child is evicted. Every step is O(1) amortized per block; match and
// publish are O(blocks) with one XXH3 + one hash-map probe per block; the
// partial-block search scans at most kMaxPartialScan children of one node.
// Node metadata, token ids and LRU links are arrays indexed by block id.
//
// Hybrid models (KV groups, kv_groups.h; spec section 12). Nodes are
// blocks of the primary group (group 0). A node may carry, per other group
// g, a companion: that group's block for the same logical block (a
// checkpoint of the window layers at that block). A companion is
// "published" too: when a window table drops it, it becomes cached (on the
// LRU list like a node) instead of free. Evicting a companion only empties
// its node's slot; evicting a node frees its cached companions (and
// unpublishes any still held). A hit of length L = k P needs the nodes
// [0, k) and, in every other group, companions for every block a query at L
// can see: [0, k) for groups that keep everything, [floor(max(0, L - w +
// 1) / P), k) for window groups; match() returns the longest such k.
//
// Observability: stats() (global and per namespace) and an event stream of
// block stored / removed (hash, parent hash, token count, namespace) for
// routing and tiers: a bounded queue (set_event_capacity / drain_events)
// and/or a synchronous sink (set_event_sink); replay_stored() describes the
// current tree as stored events for a consumer that starts late.
//
// Thread-safety: not thread-safe; single owner, like BlockPool.
// Lifetime: attaches to the pool on construction and detaches on
// destruction (cached blocks return to the free list; blocks still in use
// stay with their holders, unpublished). REQUIRES: the pool outlives this.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/block_pool.h"
#include "kv/block_table.h"

namespace kvstack {

struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const Hash128&) const = default;
  std::string hex() const;  // 32 hex digits, hi then lo
};

// XXH3-128 of a byte range.
Hash128 hash128(const void* data, size_t n_bytes, uint64_t seed = 0);

using NamespaceId = int32_t;
inline constexpr NamespaceId kNoNamespace = -1;

// Extra keys of one block (empty = none): anything besides the token ids that
// changes the block's K/V (e.g. a multimodal input's digest).
using BlockExtraKeys = std::span<const uint64_t>;

// Result of a lookup: references to the matched full blocks (in order) and,
// optionally, one cached block whose first n_partial_tokens slots continue
// the match (copy-on-partial-reuse: adopt it with
// BlockTable::adopt_partial_copy). Dropping a match releases every
// reference exactly once, deepest first.
struct PrefixMatch {
  std::vector<BlockRef> blocks;
  // Hybrid models: per group g >= 1 (index g - 1), the companions of blocks
  // [group_first[g - 1], blocks.size()) in order.
  std::vector<std::vector<BlockRef>> group_blocks;
  std::vector<int64_t> group_first;
  BlockRef partial;
  int64_t n_partial_tokens = 0;
  int block_size = 0;
  PrefixMatch() = default;
  PrefixMatch(PrefixMatch&&) = default;
  PrefixMatch& operator=(PrefixMatch&&) = default;
  ~PrefixMatch() { reset(); }
  int64_t n_tokens() const {
    return static_cast<int64_t>(blocks.size()) * block_size + n_partial_tokens;
  }
  void reset();
};

// kAllCleared (clear_cached() left the index empty) names no block: every
// block stored before it is gone; hash, parent_hash, n_tokens and ns are unset.
struct KvEvent {
  enum class Kind : uint8_t { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  Hash128 hash;
  Hash128 parent_hash;  // zero for a top-level block
  int32_t n_tokens = 0;
  NamespaceId ns = kNoNamespace;
  // kStored: the block's n_tokens token ids, valid only during a sink call
  // (null in drain_events and for kRemoved).
  const int32_t* tokens = nullptr;
};

// "stored", "removed" or "cleared" (the JSON-lines event files).
inline const char* kv_event_name(KvEvent::Kind k) {
  return k == KvEvent::Kind::kStored    ? "stored"
         : k == KvEvent::Kind::kRemoved ? "removed"
                                        : "cleared";
}

// Receives each event synchronously, inside the pool operation that caused
// it (publish, evict): it must not call back into the pool or the index.
using KvEventSink = std::function<void(const KvEvent&)>;

// What the storage tiers (kv_tiers.h) need to name a published block (a
// node or a companion) outside the pool: its identity, not its location.
struct CachedBlockInfo {
  Hash128 hash;         // the node's chained hash (a companion: its node's)
  Hash128 parent_hash;  // zero at the top of a prefix
  Hash128 ns_digest;    // the namespace's root digest
  NamespaceId ns = kNoNamespace;
  int group = 0;                    // 0 for a node, g >= 1 for its group-g companion
  std::span<const int32_t> tokens;  // [P] the node's token ids
  bool has_extra = false;           // extra keys (tiers do not carry such blocks)
};

// Hooks of a tier manager, called synchronously inside the pool operation
// (they must not call back into the pool or the index):
//   on_evict(block)   a cached published block (node or companion) is about
//                     to be freed by eviction; still described by
//                     cached_block_info and its bytes still in the pool.
//   on_publish(block) a block just became a node or a companion.
//   on_publish_end()  the end of one publish() or attach_companion() that
//                     called on_publish (the blocks it named are still
//                     published and in the pool: a batch point).
struct PrefixIndexTierHooks {
  std::function<void(int32_t)> on_evict;
  std::function<void(int32_t)> on_publish;
  std::function<void()> on_publish_end;
};

struct PrefixIndexConfig {
  // Bits of the child-table lookup hash that are kept (64 = all). Tests set
  // fewer to force lookup-hash collisions through the verification path.
  int lookup_hash_bits = 64;
};

struct NamespaceStats {
  int64_t n_queries = 0;
  int64_t n_query_tokens = 0;  // tokens offered to lookups (after the last-token rule)
  int64_t n_hit_blocks = 0;    // full blocks matched
  int64_t n_hit_tokens = 0;    // tokens matched, partial-block copies included
  int64_t n_published = 0;     // blocks published from this namespace (lifetime)
  int64_t n_nodes = 0;         // blocks of this namespace in the index now
  double hit_rate() const {
    return n_query_tokens > 0 ? static_cast<double>(n_hit_tokens) / n_query_tokens : 0.0;
  }
};

struct PrefixIndexStats {
  NamespaceStats total;
  int64_t n_partial_hits = 0;    // lookups that ended with a partial-block copy candidate
  int64_t n_partial_tokens = 0;  // tokens of those partial candidates
  int64_t n_cached_blocks = 0;   // unreferenced, resident, evictable
  int64_t n_nodes = 0;           // published blocks (cached + in use)
  int64_t n_evictions = 0;
  int64_t n_collisions = 0;  // lookup-hash hits rejected by token / extra-key verification
  int64_t n_duplicates = 0;  // publishes refused: an equal block is already published
  int64_t n_events_dropped = 0;
  std::vector<std::pair<NamespaceId, NamespaceStats>> per_namespace;
};

class PrefixIndex {
 public:
  // Partial-block candidates examined per lookup (children of the last
  // matched node, most recently published first).
  static constexpr int kMaxPartialScan = 64;

  // Attaches to `pool` (at most one index per pool).
  explicit PrefixIndex(BlockPool& pool, PrefixIndexConfig config = {});
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  BlockPool& pool() const { return pool_; }
  int block_size() const { return block_size_; }

  // The namespace for a cache-identity digest (cache_identity.h), created on
  // first use. `is_public` marks the one deployment-wide public namespace
  // (REQUIRES: at most one digest is registered public).
  // Ids of expired namespaces are reused.
  NamespaceId intern_namespace(const Hash128& identity_digest, bool is_public = false);
  NamespaceId public_namespace() const { return public_ns_; }
  // Live namespaces (interned and not expired).
  int64_t n_namespaces() const { return static_cast<int64_t>(roots_.size() - ns_free_.size()); }
  // Namespaces expired so far (lifetime).
  int64_t n_namespaces_expired() const { return n_ns_expired_; }

  // Users of a namespace (live sequences; KvManager counts them). A
  // non-public namespace with no user and no published block expires: its
  // digest is forgotten, its counters are dropped and its id is reused, so
  // every distinct cache salt costs memory only while it is used or holds
  // blocks (issue 22: a client cannot grow the index by inventing salts).
  // REQUIRES: ns live; release only what was acquired.
  void acquire_namespace(NamespaceId ns);
  void release_namespace(NamespaceId ns);

  // Longest match of `tokens[0, max_tokens)` in namespace `ns` (plus public
  // blocks): full blocks, then the best partial-block candidate for the rest
  // when find_partial. `extra` gives per-block extra keys (block j uses
  // extra[j] when j < extra.size()). References are taken on every returned
  // block. Counts one query in the stats.
  // count_stats = false: a lookup that is not a query (tier prefetch).
  PrefixMatch match(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                    bool find_partial = true, std::span<const BlockExtraKeys> extra = {},
                    bool count_stats = true);

  // Publishes the full committed blocks [n_published, table.length() / P) of
  // `table`, whose committed token ids are tokens[0, table.length()), as
  // nodes of `ns`. Blocks [0, n_published) must already be the published
  // chain of this table (what a previous publish returned, or adopted match
  // blocks). Stops at the first block that cannot be published (an equal
  // block is already published by another table, or a hash collision).
  // Returns the new length of the published chain, in blocks.
  int64_t publish(NamespaceId ns, const BlockTable& table, std::span<const int32_t> tokens,
                  int64_t n_published, std::span<const BlockExtraKeys> extra = {});

  // Evicts up to n cached blocks (leaf-first, LRU) back to the pool's free
  // list; returns the number evicted (< n only when fewer are cached).
  int64_t evict(int64_t n);

  // Clears the prefix cache (vLLM's reset_prefix_cache, the routers'
  // flush_cache): every cached (unreferenced) block, node or companion, is
  // evicted, as evict() would (tier hooks included: with storage tiers the
  // blocks are written back like any eviction; the tiers keep their
  // contents). Blocks held by sequences (running requests, pinned public
  // prefixes, leases) stay published and untouched. Events: when nothing is
  // left published, one kAllCleared (vLLM's AllBlocksCleared) replaces the
  // per-block kRemoved events; otherwise one kRemoved per removed node, as an
  // eviction sends. The counts are blocks freed and nodes still published.
  struct ClearResult {
    int64_t n_freed = 0;
    int64_t n_kept = 0;
    bool all_cleared = false;  // kAllCleared was sent
  };
  ClearResult clear_cached();

  // A node or a companion (both stay cached when unreferenced).
  bool is_published(int32_t block) const {
    return nodes_[block].published || owner_[block] != kNullBlock;
  }
  bool is_node(int32_t block) const { return nodes_[block].published; }

  // Hybrid models: the companion of node `node` in group g (kNullBlock when
  // none), and attaching `block` (group g's full committed block for the
  // node's logical block, held by a table, not published) as that companion.
  // attach returns false (nothing changed) when the slot is already taken.
  // REQUIRES: 1 <= g < pool().n_groups(), node published.
  int32_t companion(int32_t node, int g) const {
    return companions_[static_cast<size_t>(node) * n_companions_ + (g - 1)];
  }
  bool attach_companion(int32_t node, int g, int32_t block);
  // Chained hash of a published block. REQUIRES is_published(block).
  Hash128 block_hash(int32_t block) const { return nodes_[block].hash; }
  NamespaceId block_namespace(int32_t block) const { return nodes_[block].ns; }
  // Stored token ids of a published block ([P]).
  std::span<const int32_t> block_tokens(int32_t block) const;

  PrefixIndexStats stats() const;

  // ---- storage tiers (kv_tiers.h) ----
  // The root digest of a live namespace.
  const Hash128& namespace_digest(NamespaceId ns) const { return roots_[ns].digest; }
  // The chained hash a block of these P tokens (no extra keys) gets under a
  // parent of hash parent_hash (zero: top level) in namespace ns: the hash
  // publish() gives it. REQUIRES tokens.size() >= P, ns live.
  Hash128 chain_hash(const Hash128& parent_hash, NamespaceId ns,
                     std::span<const int32_t> tokens) const {
    return child_key(parent_hash, ns, tokens.data(), {});
  }
  // The published nodes matching full blocks of tokens[0, max_tokens) in ns
  // (and public blocks, as match() finds them), taking no references and
  // counting nothing: what match() would return before the hybrid rule.
  std::vector<int32_t> chain(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens);
  // Identity of a published block. REQUIRES is_published(block).
  CachedBlockInfo cached_block_info(int32_t block) const;
  // Adds to the last query of ns blocks and tokens a tier supplied (n_tokens
  // may be negative when a partial-block candidate was given up for them).
  void count_tier_hit(NamespaceId ns, int64_t n_blocks, int64_t n_tokens);
  // Installs (or, with empty functions, removes) the tier hooks.
  void set_tier_hooks(PrefixIndexTierHooks hooks) { tier_hooks_ = std::move(hooks); }

  // Events since the last drain, oldest first (capacity bounded: the oldest
  // are dropped and counted when more than `max_events` are pending).
  void set_event_capacity(int64_t max_events) { max_events_ = max_events; }
  std::vector<KvEvent> drain_events();
  // Also (or instead: capacity 0) delivers every event to `sink` as it
  // happens; an empty sink turns delivery off.
  void set_event_sink(KvEventSink sink) { sink_ = std::move(sink); }
  // Calls `sink` with one kStored event per published block, every parent
  // before its children (the current tree, for a consumer that starts
  // after blocks were published). O(nodes).
  void replay_stored(const KvEventSink& sink) const;

  // Tree, hash map, LRU list and state consistency; KV_CHECK on violation.
  // O(nodes). Called by BlockPool::check_invariants.
  void check_invariants() const;

 private:
  friend class BlockPool;

  struct Node {
    Hash128 hash;                 // chained 128-bit block hash (events, directory)
    uint64_t key = 0;             // child-table lookup hash (lookup_key)
    int32_t parent = kNullBlock;  // parent block, or kNullBlock (top level)
    NamespaceId ns = kNoNamespace;
    int32_t first_child = kNullBlock;  // children list (most recent first)
    int32_t next_sibling = kNullBlock;
    int32_t prev_sibling = kNullBlock;
    int32_t n_children = 0;
    int32_t lru_prev = kNullBlock;
    int32_t lru_next = kNullBlock;
    bool published = false;
    bool in_lru = false;
    bool deferred = false;  // cached but left the LRU list while it had children
    bool has_extra = false;
  };
  // One child-table entry; block == kNullBlock marks an empty slot.
  struct Slot {
    uint32_t tag = 0;  // high 32 bits of the lookup key
    int32_t block = kNullBlock;
    int32_t parent = kNullBlock;
    NamespaceId ns = kNoNamespace;
  };
  struct Root {
    Hash128 digest;
    bool is_public = false;
    bool live = true;                  // false: expired, id on ns_free_
    int64_t n_users = 0;               // acquire_namespace - release_namespace
    int32_t first_child = kNullBlock;  // top-level nodes (most recent first)
    NamespaceStats stats;
  };
  struct HashOf {
    size_t operator()(const Hash128& h) const { return static_cast<size_t>(h.lo ^ (h.hi << 1)); }
  };

  // Pool callbacks.
  void on_unreferenced(int32_t block);  // ref 1 -> 0 of a published block
  void on_referenced(int32_t block);    // cached block revived

  Hash128 child_key(const Hash128& parent_hash, NamespaceId ns, const int32_t* tokens,
                    BlockExtraKeys extra) const;
  uint64_t lookup_key(int32_t parent, NamespaceId ns, const int32_t* tokens,
                      BlockExtraKeys extra) const;
  // The verified child of `parent` (kNullBlock: top level of ns) for these
  // tokens in namespace ns, or kNullBlock.
  int32_t find_child(int32_t parent, NamespaceId ns, const int32_t* tokens, BlockExtraKeys extra);
  bool extra_equal(int32_t block, BlockExtraKeys extra) const;
  void slot_insert(uint64_t key, int32_t block);
  void slot_erase(uint64_t key, int32_t block);
  int32_t& child_head(int32_t parent, NamespaceId ns);
  void link_child(int32_t parent, NamespaceId ns, int32_t block);
  void unlink_child(int32_t block);
  void lru_push_back(int32_t block);
  void lru_push_front(int32_t block);
  void lru_remove(int32_t block);
  void remove_node(int32_t block);
  bool ns_live(NamespaceId ns) const {
    return ns >= 0 && static_cast<size_t>(ns) < roots_.size() && roots_[ns].live;
  }
  // Expires ns when it is not public, has no user and no node.
  void maybe_expire(NamespaceId ns);
  void emit(KvEvent e);
  // Best partial candidate among the children of `parent` (and public
  // children when allow_public): longest common prefix with tokens[0, n).
  int32_t best_partial(int32_t parent, NamespaceId ns, bool allow_public, const int32_t* tokens,
                       int64_t n, int64_t* n_common) const;

  BlockPool& pool_;
  int block_size_ = 0;
  std::vector<Node> nodes_;            // [n_blocks] (a companion uses only its LRU fields)
  void drop_companions(int32_t node);  // on node removal
  int64_t n_companion_frees_ = 0;      // cached companions freed with their node (in evict)
  std::vector<int32_t> tokens_;        // [n_blocks, P] token ids of published blocks
  // Hybrid models: [n_blocks, n_groups - 1] companion of each node per group,
  // and [n_blocks] the node a companion block belongs to (kNullBlock: none).
  size_t n_companions_ = 0;
  std::vector<int32_t> companions_;
  std::vector<int32_t> owner_;
  std::unordered_map<int32_t, std::vector<uint64_t>> extra_;  // blocks with extra keys
  std::vector<Slot> slots_;  // child table, power-of-two size >= 2 * n_blocks
  uint64_t slot_mask_ = 0;
  uint64_t key_mask_ = ~uint64_t{0};  // PrefixIndexConfig::lookup_hash_bits
  int64_t n_extra_nodes_ = 0;         // published blocks with extra keys
  std::vector<Root> roots_;
  std::unordered_map<Hash128, NamespaceId, HashOf> ns_by_digest_;
  std::vector<NamespaceId> ns_free_;  // expired ids, reused first
  int64_t n_ns_expired_ = 0;
  NamespaceStats expired_stats_;  // lifetime counters of expired namespaces (totals keep them)
  NamespaceId public_ns_ = kNoNamespace;
  int32_t lru_head_ = kNullBlock;  // least recently released cached node
  int32_t lru_tail_ = kNullBlock;
  int64_t n_nodes_ = 0;
  int64_t n_partial_hits_ = 0;
  int64_t n_partial_tokens_ = 0;
  int64_t n_evictions_ = 0;
  int64_t n_collisions_ = 0;
  int64_t n_duplicates_ = 0;
  std::deque<KvEvent> events_;
  std::vector<KvEvent>* held_events_ = nullptr;  // clear_cached(): removals held back
  int64_t max_events_ = 0;                       // 0 = events off
  int64_t n_events_dropped_ = 0;
  KvEventSink sink_;
  PrefixIndexTierHooks tier_hooks_;
};

}  // namespace kvstack

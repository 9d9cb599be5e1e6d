// BlockPool: the hot-tier KV storage. One aligned anonymous mapping holds
// n_blocks blocks of layout.block_bytes() each; per-block metadata (state,
// reference count, prefix-cache fields) lives in arrays owned by the pool.
//
// Block states (spec section 5):
//   kFree    ref 0, on the free list, contents meaningless.
//   kUsed    ref > 0: held by block tables and/or BlockRef handles.
//   kCached  ref 0, holds published (completed, committed) K/V kept for future
//            prefix hits; evictable. Only blocks published in the attached
//            PrefixIndex (prefix_index.h) enter this state: when the last
//            reference to a published block is released it becomes kCached
//            instead of kFree, and a reservation that needs more blocks than
//            are free evicts cached blocks through the index (leaf-first LRU).
// Invariant: n_free + n_used + n_cached == n_total.
//
// KV groups (kv_groups.h). The pool serves every group of the model's layout
// from the one mapping: all group layouts share block_bytes(), a used or
// cached block belongs to exactly one group (block_group()), and a freed
// block can go to any group. One free list, one eviction order, one
// invariant above for the whole model; stats() also reports per group.
//
// Reference counting. Every reference is owned by exactly one RAII holder: a
// BlockTable (one reference per table entry) or a BlockRef (one reference).
// Both are move-only and release exactly once; a moved-from holder owns
// nothing. A block returns to the free list when its count drops to 0.
// check_invariants() recomputes every count from the live holders.
//
// Memory policy. The mapping is reserved lazily (pages are not touched at
// creation unless `populate` is set), so resident memory grows with the
// blocks actually written. resident_bytes (stats) is measured with mincore().
// Freed blocks are not cleared: valid lengths gate every read (spec 6).
//
// Chain rule (with a PrefixIndex attached): a holder of a published block
// also holds the block's parent (tables hold whole prefixes; PrefixMatch
// holds the matched chain). A loose BlockRef to a published block alone
// (share_block) breaks it and is reported by check_invariants.
//
// Reuse rule: a block may be handed out again as soon as its last reference
// is released, so holders must release only after every kernel that reads
// the block has returned (the CPU engine's forward is synchronous; an async
// backend must defer releases to step completion).
//
// Thread-safety: not thread-safe. One owner (the engine's scheduler thread)
// allocates, commits and releases. Writing K/V into distinct reserved slots
// (kv_write.h) may run on worker threads while the pool is not mutated.
#pragma once

#include <compare>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_set>
#include <vector>

#include "core/result.h"
#include "core/thread_pool.h"
#include "kv/kv_groups.h"
#include "kv/kv_view.h"
#include "kv/layout.h"
#include "kv/retention.h"

namespace kvstack {

// Strong id of a physical block in one pool. The value is what block tables
// hand to kernels (int32 index into the pool).
struct BlockId {
  int32_t value = -1;
  bool valid() const { return value >= 0; }
  auto operator<=>(const BlockId&) const = default;
};
inline constexpr int32_t kNullBlock = -1;

enum class BlockState : uint8_t { kFree = 0, kUsed = 1, kCached = 2 };

struct BlockPoolConfig {
  // Exactly one of the two sizes must be set (> 0).
  int64_t mem_bytes = 0;  // --kv-cache-mem: n_blocks = floor(mem_bytes / block_bytes)
  // --kv-cache-tokens: blocks for one sequence of n_tokens tokens in every
  // KV group (KvGroups::peak_blocks_for_sequence with prefill_chunk; a
  // single-group model: ceil(n_tokens / block_size)).
  int64_t n_tokens = 0;
  int64_t prefill_chunk = 0;  // tokens per step bounding window groups (0 = n_tokens)
  bool populate = false;      // pre-fault every page at creation (MAP_POPULATE)
  // Every layer its own KV group (KvGroups::create): per-layer retention
  // (snapkv, pyramidkv) keeps a slot map per layer.
  bool one_layer_per_group = false;
};

// One KV group's share of the pool (BlockPoolStats::groups).
struct BlockPoolGroupStats {
  int64_t n_layers = 0;
  int64_t window = 0;             // 0 = full attention
  int64_t n_blocks_used = 0;      // blocks of this group held by tables / refs
  int64_t n_blocks_cached = 0;    // this group's cached (published, unreferenced) blocks
  int64_t n_tokens_resident = 0;  // committed tokens whose blocks tables still hold
  int64_t payload_bytes = 0;      // per-layer formula over those tokens
  int64_t allocated_bytes = 0;    // (used + cached) * block_bytes
};

struct BlockPoolStats {
  int64_t n_blocks_total = 0;
  int64_t n_blocks_free = 0;
  int64_t n_blocks_used = 0;
  int64_t n_blocks_cached = 0;
  int64_t n_tables = 0;            // live block tables (sequences)
  int64_t n_tokens_committed = 0;  // sum of committed lengths over live tables
  int64_t n_tokens_reserved = 0;   // slots reserved beyond committed lengths
  int64_t block_size = 0;          // tokens per block (P)
  int64_t block_bytes = 0;
  // Spec section 3 figures, exact:
  int64_t payload_bytes = 0;    // layout.payload_bytes_per_token() * n_tokens_committed
  int64_t allocated_bytes = 0;  // (n_blocks_used + n_blocks_cached) * block_bytes
  int64_t pool_bytes = 0;       // n_blocks_total * block_bytes (the mapping's useful size)
  int64_t resident_bytes = 0;   // bytes of the mapping resident in RAM (mincore)
  // Lifetime counters.
  int64_t n_allocations = 0;                // blocks handed out
  int64_t n_releases = 0;                   // blocks returned to the free list
  int64_t n_out_of_blocks = 0;              // reservations refused with kOutOfBlocks
  int64_t n_evictions = 0;                  // cached blocks reclaimed for an allocation
  int64_t n_cow_copies = 0;                 // shared partial tails copied before an append
  int64_t n_partial_copies = 0;             // cached blocks copied for a partial-block prefix hit
  int64_t n_clone_copies = 0;               // blocks copied by BlockTable::clone_private
  RetentionStats retention;                 // compaction totals (retention.h), all tables
  std::vector<BlockPoolGroupStats> groups;  // [n_groups], group order of kv_groups.h
};

class BlockPool;
class BlockTable;
class GroupTable;
class PrefixIndex;
Status reserve_all(std::span<BlockTable* const> tables, std::span<const int64_t> n_new);

// One reference to one block, held outside a block table (e.g. by a prefix
// match in flight, or a transfer). Move-only; releases exactly once.
class BlockRef {
 public:
  BlockRef() = default;
  BlockRef(BlockRef&& other) noexcept;
  BlockRef& operator=(BlockRef&& other) noexcept;
  BlockRef(const BlockRef&) = delete;
  BlockRef& operator=(const BlockRef&) = delete;
  ~BlockRef() { reset(); }

  BlockId id() const { return id_; }
  bool valid() const { return pool_ != nullptr; }
  // Releases the reference now (no-op when empty).
  void reset();

 private:
  friend class BlockPool;
  friend class GroupTable;
  BlockRef(BlockPool* pool, BlockId id) : pool_(pool), id_(id) {}
  BlockPool* pool_ = nullptr;
  BlockId id_{};
};

class BlockPool {
 public:
  // Fails with kInvalidArgument when the config sets neither or both sizes,
  // or the budget holds zero blocks (the message names the flag and the
  // block size); kIo when the mapping cannot be created.
  static Result<std::unique_ptr<BlockPool>> create(const KvLayout& layout,
                                                   const BlockPoolConfig& config);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // The model's layout (all layers, as given to create()). Block geometry
  // lives in the groups: block_bytes() and layer_view() come from them.
  const KvLayout& layout() const { return layout_; }
  const KvGroups& groups() const { return groups_; }
  int n_groups() const { return groups_.n_groups(); }
  const KvGroup& group(int g) const { return groups_.group(g); }
  int block_size() const { return layout_.block_size(); }
  // Bytes of one block (the largest group block; == layout().block_bytes()
  // for a single-group model).
  int64_t block_bytes() const { return groups_.block_bytes(); }
  int64_t n_blocks() const { return static_cast<int64_t>(state_.size()); }
  int64_t n_free() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t n_cached() const { return n_cached_; }
  // Blocks a reservation may use now: free plus cached (every cached block is
  // evictable: cached blocks only ever have cached descendants or children
  // that are themselves evictable first; see PrefixIndex).
  int64_t n_available() const { return n_free() + n_cached_; }
  // The prefix index attached to this pool, or null (see PrefixIndex).
  PrefixIndex* index() const { return index_; }
  // Threads table operations may use from the owner's thread (SnapKV's
  // scoring at the end of prefill); null (the default) runs them inline.
  // REQUIRES: outlives its use; not called from inside a job of `threads`.
  void set_threads(ThreadPool* threads) { threads_ = threads; }
  ThreadPool* threads() const { return threads_; }

  // Start of block `id`'s bytes (all layers). REQUIRES: id in range.
  uint8_t* block_data(BlockId id) const;
  // Layer l's (model layer index) view over the whole pool; the entries of
  // the table of l's group (BlockTable::ids_for_layer) index it.
  PagedKvLayerView layer_view(int l) const {
    const KvLayerSlot s = groups_.slot(l);
    return group_layer_view(s.group, s.index);
  }
  // Layer i of group g's layout.
  PagedKvLayerView group_layer_view(int g, int i) const {
    return groups_.group(g).layout.layer_view(i, base_);
  }

  BlockState state(BlockId id) const { return state_[id.value]; }
  // Group of a used or cached block (-1 for a free one).
  int block_group(BlockId id) const { return group_of_[id.value]; }
  int32_t ref_count(BlockId id) const { return ref_count_[id.value]; }

  // Allocates one block of group `group` with ref 1 held by the returned
  // handle, evicting one cached block when none is free; kOutOfBlocks (and
  // no side effect) when none is available. REQUIRES 0 <= group < n_groups.
  Result<BlockRef> allocate(int group = 0);

  // A new reference to a block that is in use (ref > 0) or cached (ref 0,
  // revived to kUsed and taken off the eviction list). REQUIRES: not kFree.
  BlockRef ref_block(BlockId id);

  // O(n_blocks + tables) for the per-group figures, plus one mincore() over
  // the mapping for resident_bytes (about pool_bytes / 4 KiB bytes of
  // scratch and time).
  BlockPoolStats stats() const;

  // Recomputes states, free list, reference counts (from every live table
  // and BlockRef) and token totals; aborts via KV_CHECK naming the first
  // violation. O(n_blocks + table entries). Runs after every mutation when
  // KV_DCHECK_IS_ON.
  void check_invariants() const;

 private:
  friend class BlockRef;
  friend class BlockTable;
  friend class GroupTable;
  friend class PrefixIndex;
  friend Status reserve_all(std::span<BlockTable* const> tables, std::span<const int64_t> n_new);

  BlockPool(const KvLayout& layout, KvGroups groups, uint8_t* base, int64_t map_bytes,
            int64_t n_blocks);

  // Internal reference operations used by BlockRef / BlockTable / PrefixIndex.
  // take_free: pops n free blocks (ref 1 each, owned by group `group`) into
  // `out`, first evicting cached blocks when fewer than n are free;
  // REQUIRES n <= n_available().
  void take_free(int64_t n, std::vector<int32_t>& out, int group);
  // add_ref: REQUIRES kUsed. ref_any: kUsed or kCached (revives a cached block).
  void add_ref(int32_t id);
  void ref_any(int32_t id);
  void drop_ref(int32_t id);
  // Evicted by the index: kCached -> kFree.
  void reclaim(int32_t id);
  // Copies every byte of block src into block dst (all layers; slots past a
  // holder's valid length are never read, so a whole-block copy is exact).
  void copy_block(int32_t src, int32_t dst);
  void debug_check() const {
#if KV_DCHECK_IS_ON
    check_invariants();
#endif
  }

  KvLayout layout_;
  KvGroups groups_;
  uint8_t* base_ = nullptr;  // [n_blocks, block_bytes], 64-byte (page) aligned
  int64_t map_bytes_ = 0;    // mapping size (pool bytes rounded up to pages)

  // Per-block metadata, indexed by BlockId::value.
  std::vector<BlockState> state_;
  std::vector<int32_t> ref_count_;
  std::vector<int32_t> loose_refs_;  // references held by BlockRef handles
  std::vector<int16_t> group_of_;    // group of a used/cached block, -1 when free
  // Prefix-cache metadata (hash, parent, tokens, LRU links) lives in the
  // attached PrefixIndex's per-block arrays.
  PrefixIndex* index_ = nullptr;
  ThreadPool* threads_ = nullptr;

  std::vector<int32_t> free_list_;  // LIFO; low ids handed out first
  int64_t n_cached_ = 0;            // blocks in state kCached (prefix index)

  std::unordered_set<const GroupTable*> tables_;  // live group tables (for checks/stats)
  // Per group: sums of committed lengths / reserved slots over its tables.
  std::vector<int64_t> n_tokens_committed_;
  std::vector<int64_t> n_tokens_reserved_;
  int64_t n_allocations_ = 0;
  int64_t n_releases_ = 0;
  int64_t n_out_of_blocks_ = 0;
  int64_t n_evictions_ = 0;
  int64_t n_cow_copies_ = 0;
  int64_t n_partial_copies_ = 0;
  int64_t n_clone_copies_ = 0;
  RetentionStats retention_;  // summed over every table's compactions
};

}  // namespace kvstack

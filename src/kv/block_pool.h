// BlockPool: the hot-tier KV storage. One aligned anonymous mapping holds
// n_blocks blocks of layout.block_bytes() each; per-block metadata (state,
// reference count, prefix-cache fields) lives in arrays owned by the pool.
//
// Block states (spec section 5):
//   kFree    ref 0, on the free list, contents meaningless.
//   kUsed    ref > 0: held by block tables and/or BlockRef handles.
//   kCached  ref 0, holds published (completed, committed) K/V kept for future
//            prefix hits; evictable. Set only by the prefix index (next issue).
// Invariant: n_free + n_used + n_cached == n_total.
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
#include "kv/kv_view.h"
#include "kv/layout.h"

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
  int64_t n_tokens = 0;   // --kv-cache-tokens: n_blocks = ceil(n_tokens / block_size)
  bool populate = false;  // pre-fault every page at creation (MAP_POPULATE)
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
  int64_t n_allocations = 0;    // blocks handed out
  int64_t n_releases = 0;       // blocks returned to the free list
  int64_t n_out_of_blocks = 0;  // reservations refused with kOutOfBlocks
};

class BlockPool;
class BlockTable;
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
  friend class BlockTable;
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

  const KvLayout& layout() const { return layout_; }
  int block_size() const { return layout_.block_size(); }
  int64_t block_bytes() const { return layout_.block_bytes(); }
  int64_t n_blocks() const { return static_cast<int64_t>(state_.size()); }
  int64_t n_free() const { return static_cast<int64_t>(free_list_.size()); }
  // Blocks a reservation may use now (free; later also evictable cached).
  int64_t n_available() const { return n_free(); }

  // Start of block `id`'s bytes (all layers). REQUIRES: id in range.
  uint8_t* block_data(BlockId id) const;
  // Layer l's view over the whole pool; block table entries index it.
  PagedKvLayerView layer_view(int l) const { return layout_.layer_view(l, base_); }

  BlockState state(BlockId id) const { return state_[id.value]; }
  int32_t ref_count(BlockId id) const { return ref_count_[id.value]; }

  // Allocates one block with ref 1 held by the returned handle; kOutOfBlocks
  // (and no side effect) when none is available.
  Result<BlockRef> allocate();

  // O(1) except resident_bytes, which costs one mincore() over the mapping
  // (about pool_bytes / 4 KiB bytes of scratch and time).
  BlockPoolStats stats() const;

  // Recomputes states, free list, reference counts (from every live table
  // and BlockRef) and token totals; aborts via KV_CHECK naming the first
  // violation. O(n_blocks + table entries). Runs after every mutation when
  // KV_DCHECK_IS_ON.
  void check_invariants() const;

 private:
  friend class BlockRef;
  friend class BlockTable;
  friend Status reserve_all(std::span<BlockTable* const> tables, std::span<const int64_t> n_new);

  BlockPool(const KvLayout& layout, uint8_t* base, int64_t map_bytes, int64_t n_blocks);

  // Internal reference operations used by BlockRef / BlockTable.
  // take_free: pops n free blocks (ref 1 each) into `out`; REQUIRES n <= n_free().
  void take_free(int64_t n, std::vector<int32_t>& out);
  void add_ref(int32_t id);
  void drop_ref(int32_t id);
  void debug_check() const {
#if KV_DCHECK_IS_ON
    check_invariants();
#endif
  }

  KvLayout layout_;
  uint8_t* base_ = nullptr;  // [n_blocks, block_bytes], 64-byte (page) aligned
  int64_t map_bytes_ = 0;    // mapping size (pool bytes rounded up to pages)

  // Per-block metadata, indexed by BlockId::value.
  std::vector<BlockState> state_;
  std::vector<int32_t> ref_count_;
  std::vector<int32_t> loose_refs_;  // references held by BlockRef handles
  // Prefix-cache fields, owned here, filled by the prefix index (next issue):
  std::vector<uint64_t> hash_;      // block key: hash(parent key, tokens, extra keys)
  std::vector<int32_t> parent_;     // block holding the previous P tokens, or kNullBlock
  std::vector<uint64_t> last_use_;  // logical clock of the last hit/release (LRU)

  std::vector<int32_t> free_list_;  // LIFO; low ids handed out first
  int64_t n_cached_ = 0;            // blocks in state kCached (prefix index)

  std::unordered_set<const BlockTable*> tables_;  // live tables (for checks/stats)
  int64_t n_tokens_committed_ = 0;
  int64_t n_tokens_reserved_ = 0;
  int64_t n_allocations_ = 0;
  int64_t n_releases_ = 0;
  int64_t n_out_of_blocks_ = 0;
};

}  // namespace kvstack

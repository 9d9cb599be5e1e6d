#include "kv/block_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

#include "kv/group_table.h"
#include "kv/prefix_index.h"

namespace kvstack {

// ---------------------------------------------------------------- BlockRef

BlockRef::BlockRef(BlockRef&& other) noexcept : pool_(other.pool_), id_(other.id_) {
  other.pool_ = nullptr;
  other.id_ = BlockId{};
}

BlockRef& BlockRef::operator=(BlockRef&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = other.pool_;
    id_ = other.id_;
    other.pool_ = nullptr;
    other.id_ = BlockId{};
  }
  return *this;
}

void BlockRef::reset() {
  if (pool_ == nullptr) return;
  BlockPool* pool = pool_;
  const int32_t id = id_.value;
  pool_ = nullptr;
  id_ = BlockId{};
  KV_CHECK(pool->loose_refs_[id] > 0, "BlockRef released without a loose reference");
  --pool->loose_refs_[id];
  pool->drop_ref(id);
  pool->debug_check();
}

// --------------------------------------------------------------- BlockPool

namespace {
int64_t page_size() {
  static const int64_t p = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
  return p;
}
}  // namespace

Result<std::unique_ptr<BlockPool>> BlockPool::create(const KvLayout& layout,
                                                     const BlockPoolConfig& config) {
  auto groups = KvGroups::create(layout, config.one_layer_per_group);
  if (!groups) return groups.error();
  const int64_t bb = groups->block_bytes();
  const int64_t p = layout.block_size();
  if ((config.mem_bytes > 0) == (config.n_tokens > 0)) {
    return make_error(Errc::kInvalidArgument,
                      "KV pool: set exactly one of --kv-cache-mem and --kv-cache-tokens (got " +
                          std::to_string(config.mem_bytes) + " bytes, " +
                          std::to_string(config.n_tokens) + " tokens)");
  }
  if (config.mem_bytes < 0 || config.n_tokens < 0) {
    return make_error(Errc::kInvalidArgument, "KV pool: negative cache size");
  }
  int64_t n_blocks = 0;
  if (config.mem_bytes > 0) {
    n_blocks = config.mem_bytes / bb;
    if (n_blocks == 0) {
      return make_error(Errc::kInvalidArgument,
                        "KV pool: --kv-cache-mem " + std::to_string(config.mem_bytes) +
                            " bytes is smaller than one block (" + std::to_string(bb) +
                            " bytes = " + std::to_string(p) + " tokens)");
    }
  } else {
    const int64_t chunk = config.prefill_chunk > 0 ? config.prefill_chunk : config.n_tokens;
    n_blocks = groups->peak_blocks_for_sequence(config.n_tokens, chunk);
  }
  if (n_blocks > std::numeric_limits<int32_t>::max()) {
    return make_error(Errc::kInvalidArgument,
                      "KV pool: " + std::to_string(n_blocks) + " blocks exceed the 2^31-1 limit");
  }
  if (n_blocks > std::numeric_limits<int64_t>::max() / bb - page_size()) {
    return make_error(Errc::kInvalidArgument, "KV pool: size overflows");
  }
  const int64_t pool_bytes = n_blocks * bb;
  const int64_t map_bytes = (pool_bytes + page_size() - 1) / page_size() * page_size();
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  if (config.populate) flags |= MAP_POPULATE;
  void* mem = mmap(nullptr, static_cast<size_t>(map_bytes), PROT_READ | PROT_WRITE, flags, -1, 0);
  if (mem == MAP_FAILED) {
    return make_error(Errc::kIo, "KV pool: cannot map " + std::to_string(map_bytes) +
                                     " bytes: " + std::strerror(errno));
  }
  madvise(mem, static_cast<size_t>(map_bytes), MADV_HUGEPAGE);  // fewer TLB misses; advisory
  return std::unique_ptr<BlockPool>(
      new BlockPool(layout, std::move(*groups), static_cast<uint8_t*>(mem), map_bytes, n_blocks));
}

BlockPool::BlockPool(const KvLayout& layout, KvGroups groups, uint8_t* base, int64_t map_bytes,
                     int64_t n_blocks)
    : layout_(layout),
      groups_(std::move(groups)),
      base_(base),
      map_bytes_(map_bytes),
      state_(n_blocks, BlockState::kFree),
      ref_count_(n_blocks, 0),
      loose_refs_(n_blocks, 0),
      group_of_(n_blocks, -1),
      n_tokens_committed_(groups_.n_groups(), 0),
      n_tokens_reserved_(groups_.n_groups(), 0) {
  free_list_.reserve(n_blocks);
  for (int64_t i = n_blocks - 1; i >= 0; --i) free_list_.push_back(static_cast<int32_t>(i));
}

BlockPool::~BlockPool() {
  // Outstanding holders would dangle; this is a lifetime bug in the caller.
  KV_CHECK(tables_.empty(), "BlockPool destroyed while block tables are alive");
  KV_CHECK(index_ == nullptr, "BlockPool destroyed while a PrefixIndex is attached");
  for (int32_t r : loose_refs_) KV_CHECK(r == 0, "BlockPool destroyed while BlockRefs are alive");
  munmap(base_, static_cast<size_t>(map_bytes_));
}

uint8_t* BlockPool::block_data(BlockId id) const {
  KV_CHECK(id.value >= 0 && id.value < n_blocks(), "block id out of range");
  return base_ + static_cast<int64_t>(id.value) * block_bytes();
}

Result<BlockRef> BlockPool::allocate(int group) {
  KV_CHECK(group >= 0 && group < n_groups(), "allocate: no such KV group");
  if (n_available() == 0) {
    ++n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: need 1 block, 0 available of " +
                                              std::to_string(n_blocks()));
  }
  std::vector<int32_t> got;
  take_free(1, got, group);
  ++loose_refs_[got[0]];
  debug_check();
  return BlockRef(this, BlockId{got[0]});
}

BlockRef BlockPool::ref_block(BlockId id) {
  ref_any(id.value);
  ++loose_refs_[id.value];
  debug_check();
  return BlockRef(this, id);
}

void BlockPool::take_free(int64_t n, std::vector<int32_t>& out, int group) {
  KV_CHECK(n >= 0 && n <= n_available(), "take_free: not enough blocks (plan violated)");
  if (n > n_free()) {
    KV_CHECK(index_ != nullptr, "take_free: cached blocks without an index");
    const int64_t want = n - n_free();
    const int64_t got = index_->evict(want);
    KV_CHECK(got >= want, "take_free: eviction reclaimed fewer blocks than planned");
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = free_list_.back();
    free_list_.pop_back();
    KV_DCHECK(state_[id] == BlockState::kFree && ref_count_[id] == 0, "free list corrupt");
    state_[id] = BlockState::kUsed;
    ref_count_[id] = 1;
    group_of_[id] = static_cast<int16_t>(group);
    out.push_back(id);
  }
  n_allocations_ += n;
}

void BlockPool::ref_any(int32_t id) {
  KV_CHECK(id >= 0 && id < n_blocks(), "block id out of range");
  if (state_[id] == BlockState::kCached) {
    KV_CHECK(ref_count_[id] == 0, "cached block with references");
    state_[id] = BlockState::kUsed;
    ref_count_[id] = 1;
    --n_cached_;
    index_->on_referenced(id);
    return;
  }
  add_ref(id);
}

void BlockPool::reclaim(int32_t id) {
  KV_CHECK(state_[id] == BlockState::kCached && ref_count_[id] == 0,
           "reclaim: block is not cached");
  state_[id] = BlockState::kFree;
  group_of_[id] = -1;
  --n_cached_;
  ++n_evictions_;
  ++n_releases_;
  free_list_.push_back(id);
}

void BlockPool::copy_block(int32_t src, int32_t dst) {
  KV_CHECK(src != dst, "copy_block: source and destination are the same block");
  std::memcpy(block_data(BlockId{dst}), block_data(BlockId{src}),
              static_cast<size_t>(block_bytes()));
}

void BlockPool::add_ref(int32_t id) {
  KV_CHECK(id >= 0 && id < n_blocks(), "block id out of range");
  KV_CHECK(state_[id] == BlockState::kUsed && ref_count_[id] > 0,
           "add_ref on a block that is not in use");
  KV_CHECK(ref_count_[id] < std::numeric_limits<int32_t>::max(), "ref count overflow");
  ++ref_count_[id];
}

void BlockPool::drop_ref(int32_t id) {
  KV_CHECK(id >= 0 && id < n_blocks(), "block id out of range");
  KV_CHECK(state_[id] == BlockState::kUsed && ref_count_[id] > 0,
           "reference released twice (ref count already 0)");
  if (--ref_count_[id] == 0) {
    if (index_ != nullptr && index_->is_published(id)) {
      // Published K/V stay resident for future hits until evicted.
      state_[id] = BlockState::kCached;
      ++n_cached_;
      index_->on_unreferenced(id);
      return;
    }
    state_[id] = BlockState::kFree;
    group_of_[id] = -1;
    free_list_.push_back(id);
    ++n_releases_;
  }
}

BlockPoolStats BlockPool::stats() const {
  BlockPoolStats s;
  s.n_blocks_total = n_blocks();
  s.n_blocks_free = n_free();
  s.n_blocks_cached = n_cached_;
  s.n_blocks_used = s.n_blocks_total - s.n_blocks_free - s.n_blocks_cached;
  s.n_tokens_committed = n_tokens_committed_[0];
  s.n_tokens_reserved = n_tokens_reserved_[0];
  s.block_size = block_size();
  s.block_bytes = block_bytes();
  // Per group: blocks by state, resident tokens and the payload formula
  // (a dropping window group keeps min(T, w) tokens a sequence can still
  // attend to; every other group all T).
  s.groups.resize(static_cast<size_t>(n_groups()));
  for (int g = 0; g < n_groups(); ++g) {
    s.groups[g].n_layers = static_cast<int64_t>(group(g).layers.size());
    s.groups[g].window = group(g).window;
  }
  for (int64_t i = 0; i < n_blocks(); ++i) {
    if (state_[i] == BlockState::kUsed) ++s.groups[group_of_[i]].n_blocks_used;
    if (state_[i] == BlockState::kCached) ++s.groups[group_of_[i]].n_blocks_cached;
  }
  for (const GroupTable* t : tables_) {
    BlockPoolGroupStats& gs = s.groups[t->group_];
    const KvGroup& gr = group(t->group_);
    if (t->group_ == 0) ++s.n_tables;
    gs.n_tokens_resident += std::max<int64_t>(0, t->length_ - t->n_dropped_ * t->block_size_);
    const int64_t kept = gr.drops_blocks ? std::min<int64_t>(t->length_, gr.window) : t->length_;
    gs.payload_bytes += gr.layout.payload_bytes(kept);
  }
  s.payload_bytes = 0;
  for (BlockPoolGroupStats& gs : s.groups) {
    gs.allocated_bytes = (gs.n_blocks_used + gs.n_blocks_cached) * block_bytes();
    s.payload_bytes += gs.payload_bytes;
  }
  s.allocated_bytes = (s.n_blocks_used + s.n_blocks_cached) * block_bytes();
  s.pool_bytes = n_blocks() * block_bytes();
  {
    const int64_t n_pages = map_bytes_ / page_size();
    std::vector<unsigned char> vec(static_cast<size_t>(n_pages));
    if (n_pages > 0 && mincore(base_, static_cast<size_t>(map_bytes_), vec.data()) == 0) {
      int64_t resident = 0;
      for (unsigned char c : vec) resident += (c & 1u);
      s.resident_bytes = resident * page_size();
    } else {
      s.resident_bytes = -1;  // unknown
    }
  }
  s.n_allocations = n_allocations_;
  s.n_releases = n_releases_;
  s.n_out_of_blocks = n_out_of_blocks_;
  s.n_evictions = n_evictions_;
  s.n_cow_copies = n_cow_copies_;
  s.n_partial_copies = n_partial_copies_;
  s.n_clone_copies = n_clone_copies_;
  s.retention = retention_;
  return s;
}

void BlockPool::check_invariants() const {
  const int64_t n = n_blocks();
  std::vector<int32_t> holders(loose_refs_.begin(), loose_refs_.end());
  std::vector<int64_t> committed(static_cast<size_t>(n_groups()), 0);
  std::vector<int64_t> reserved(static_cast<size_t>(n_groups()), 0);
  for (const GroupTable* t : tables_) {
    KV_CHECK(t->pool_ == this, "registered table belongs to another pool");
    KV_CHECK(t->group_ >= 0 && t->group_ < n_groups(), "table of an unknown group");
    KV_CHECK(t->length_ >= 0 && t->length_ <= t->capacity(), "table length exceeds capacity");
    KV_CHECK(t->n_dropped_ >= 0 && t->n_dropped_ <= t->n_blocks(), "dropped count out of range");
    KV_CHECK(t->n_dropped_ == 0 || group(t->group_).drops_blocks,
             "a group that keeps every block has dropped entries");
    committed[t->group_] += t->length_;
    reserved[t->group_] += t->capacity() - t->length_;
    // Positions per slot: stored only after a compaction, one per committed
    // slot, ascending, below the logical length.
    KV_CHECK(t->n_evicted_ >= 0, "evicted count negative");
    KV_CHECK(t->n_evicted_ == 0 ? t->positions_.empty()
                                : static_cast<int64_t>(t->positions_.size()) == t->length_,
             "positions per slot out of sync with the committed length");
    for (size_t i = 0; i < t->positions_.size(); ++i) {
      KV_CHECK(t->positions_[i] < t->logical_length() &&
                   (i == 0 || t->positions_[i] > t->positions_[i - 1]),
               "positions per slot are not ascending below the logical length");
    }
    for (int64_t j = 0; j < t->n_blocks(); ++j) {
      const int32_t id = t->ids_[j];
      if (j < t->n_dropped_) {
        KV_CHECK(id == kNullBlock, "a dropped table entry is not null");
        continue;
      }
      KV_CHECK(id >= 0 && id < n, "table holds an out-of-range block id");
      KV_CHECK(group_of_[id] == t->group_, "a table holds a block of another group");
      ++holders[id];
    }
  }
  // Writable blocks are private and unpublished, so writes never touch shared
  // data. A committed partial tail may be shared (forks): GroupTable::reserve
  // copies it before anything is appended.
  for (const GroupTable* t : tables_) {
    for (int64_t j = t->n_dropped_; j < t->n_blocks(); ++j) {
      KV_CHECK(state_[t->ids_[j]] == BlockState::kUsed, "a table points at a free or cached block");
    }
    // Blocks past the committed tail are pure reservations; a partial tail
    // itself may be shared (copied before the next write) but never published.
    const int64_t tail = t->length_ / t->block_size_;
    if (t->length_ % t->block_size_ != 0) {
      KV_CHECK(tail >= t->n_dropped_, "a partial tail block was dropped");
      KV_CHECK(index_ == nullptr || !index_->is_published(t->ids_[tail]),
               "a partial tail block is published");
    }
    for (int64_t j = (t->length_ + t->block_size_ - 1) / t->block_size_; j < t->n_blocks(); ++j) {
      KV_CHECK(j >= t->n_dropped_, "a reserved block was dropped");
      KV_CHECK(holders[t->ids_[j]] == 1, "a writable (reserved, uncommitted) block is shared");
      KV_CHECK(index_ == nullptr || !index_->is_published(t->ids_[j]),
               "a writable (reserved, uncommitted) block is published");
    }
  }
  for (int g = 0; g < n_groups(); ++g) {
    KV_CHECK(committed[g] == n_tokens_committed_[g],
             "committed token total out of sync with tables");
    KV_CHECK(reserved[g] == n_tokens_reserved_[g], "reserved token total out of sync with tables");
  }
  std::vector<uint8_t> on_free_list(n, 0);
  for (int32_t id : free_list_) {
    KV_CHECK(id >= 0 && id < n, "free list holds an out-of-range block id");
    KV_CHECK(on_free_list[id] == 0, "block on the free list twice");
    on_free_list[id] = 1;
  }
  int64_t n_free = 0, n_used = 0, n_cached = 0;
  for (int64_t i = 0; i < n; ++i) {
    KV_CHECK(ref_count_[i] == holders[i], "ref count differs from the number of holders");
    switch (state_[i]) {
      case BlockState::kFree:
        ++n_free;
        KV_CHECK(group_of_[i] == -1, "free block owned by a group");
        KV_CHECK(ref_count_[i] == 0, "free block with a nonzero ref count");
        KV_CHECK(on_free_list[i] == 1, "free block missing from the free list");
        break;
      case BlockState::kUsed:
        ++n_used;
        KV_CHECK(group_of_[i] >= 0 && group_of_[i] < n_groups(), "used block without a group");
        KV_CHECK(ref_count_[i] > 0, "used block with ref count 0");
        KV_CHECK(on_free_list[i] == 0, "used block on the free list");
        break;
      case BlockState::kCached:
        ++n_cached;
        KV_CHECK(group_of_[i] >= 0 && group_of_[i] < n_groups(), "cached block without a group");
        KV_CHECK(ref_count_[i] == 0, "cached block must have no active reference");
        KV_CHECK(on_free_list[i] == 0, "cached block on the free list");
        break;
    }
  }
  KV_CHECK(n_free == static_cast<int64_t>(free_list_.size()), "free count != free list size");
  KV_CHECK(n_cached == n_cached_, "cached block count out of sync");
  KV_CHECK(n_free + n_used + n_cached == n, "free + used + cached != total");
  if (index_ != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      if (state_[i] == BlockState::kCached) {
        KV_CHECK(index_->is_published(static_cast<int32_t>(i)), "a cached block is not published");
      }
      if (state_[i] == BlockState::kFree) {
        KV_CHECK(!index_->is_published(static_cast<int32_t>(i)), "a free block is published");
      }
    }
    index_->check_invariants();
  }
}

}  // namespace kvstack

#include "kv/block_table.h"

#include <string>
#include <utility>

#include "kv/kv_write.h"
#include "kv/prefix_index.h"

namespace kvstack {

BlockTable::BlockTable(BlockPool& pool) : pool_(&pool), block_size_(pool.block_size()) {
  pool_->tables_.insert(this);
}

BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_),
      block_size_(other.block_size_),
      ids_(std::move(other.ids_)),
      length_(other.length_) {
  other.ids_.clear();
  other.length_ = 0;
  // Registration is per object: the moved-from table stays registered (and
  // empty) until it is destroyed.
  pool_->tables_.insert(this);
}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this == &other) return *this;
  release();
  if (pool_ != other.pool_) {
    pool_->tables_.erase(this);
    pool_ = other.pool_;
    block_size_ = other.block_size_;
    pool_->tables_.insert(this);
  }
  ids_ = std::move(other.ids_);
  length_ = other.length_;
  other.ids_.clear();
  other.length_ = 0;
  pool_->debug_check();
  return *this;
}

BlockTable::~BlockTable() {
  release();
  pool_->tables_.erase(this);
}

bool BlockTable::tail_shared() const {
  if (length_ % block_size_ == 0) return false;
  const int32_t tail = ids_[length_ / block_size_];
  return pool_->ref_count(BlockId{tail}) > 1 ||
         (pool_->index_ != nullptr && pool_->index_->is_published(tail));
}

int64_t BlockTable::blocks_needed(int64_t n_new) const {
  KV_CHECK(n_new >= 0, "blocks_needed: negative token count");
  const int64_t need = (length_ + n_new + block_size_ - 1) / block_size_;
  const int64_t cow = n_new > 0 && tail_shared() ? 1 : 0;
  return (need > n_blocks() ? need - n_blocks() : 0) + cow;
}

Status BlockTable::reserve(int64_t n_new) {
  const int64_t n = blocks_needed(n_new);
  if (n == 0) return Status{};
  if (n > pool_->n_available()) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks,
                      "KV pool exhausted: " + std::to_string(n_new) + " tokens need " +
                          std::to_string(n) + " more blocks of " + std::to_string(block_size_) +
                          " tokens, " + std::to_string(pool_->n_available()) + " available");
  }
  const int64_t old_capacity = capacity();
  if (n_new > 0 && tail_shared()) {
    // Copy-on-write: the committed slots of the shared tail move to a
    // private block before anything is appended to it.
    const int64_t j = length_ / block_size_;
    std::vector<int32_t> fresh;
    pool_->take_free(1, fresh);
    pool_->copy_block(ids_[j], fresh[0]);
    pool_->drop_ref(ids_[j]);
    ids_[j] = fresh[0];
    ++pool_->n_cow_copies_;
  }
  const int64_t need = (length_ + n_new + block_size_ - 1) / block_size_;
  if (need > n_blocks()) pool_->take_free(need - n_blocks(), ids_);
  pool_->n_tokens_reserved_ += capacity() - old_capacity;
  pool_->debug_check();
  return Status{};
}

void BlockTable::write(int l, int64_t pos, const float* k_rows, const float* v_rows,
                       int64_t n_tokens) {
  KV_CHECK(n_tokens >= 0, "write: negative token count");
  KV_CHECK(pos >= length_, "write: position is committed (committed K/V are immutable)");
  KV_CHECK(pos + n_tokens <= capacity(), "write: positions beyond the reserved capacity");
  KV_CHECK(l >= 0 && l < pool_->layout().n_layers(), "write: layer index out of range");
  KV_DCHECK(n_tokens == 0 || pool_->ref_count(BlockId{ids_[pos / block_size_]}) == 1,
            "write: target block is shared");
  KV_DCHECK(n_tokens == 0 || pool_->index_ == nullptr ||
                !pool_->index_->is_published(ids_[pos / block_size_]),
            "write: target block is published");
  write_kv(pool_->layer_view(l), ids_, pos, k_rows, v_rows, n_tokens);
}

void BlockTable::commit(int64_t n_new) {
  KV_CHECK(n_new >= 0, "commit: negative token count");
  KV_CHECK(length_ + n_new <= capacity(), "commit: more tokens than reserved");
  length_ += n_new;
  pool_->n_tokens_committed_ += n_new;
  pool_->n_tokens_reserved_ -= n_new;
  pool_->debug_check();
}

int64_t BlockTable::rollback() {
  const int64_t keep = (length_ + block_size_ - 1) / block_size_;
  const int64_t n_release = n_blocks() - keep;
  if (n_release == 0) return 0;
  const int64_t old_capacity = capacity();
  // Release newest first so the LIFO free list hands the same blocks back.
  for (int64_t j = n_blocks() - 1; j >= keep; --j) pool_->drop_ref(ids_[j]);
  ids_.resize(keep);
  pool_->n_tokens_reserved_ -= old_capacity - capacity();
  pool_->debug_check();
  return n_release;
}

void BlockTable::release() {
  if (ids_.empty() && length_ == 0) return;
  const int64_t old_capacity = capacity();
  for (int64_t j = n_blocks() - 1; j >= 0; --j) pool_->drop_ref(ids_[j]);
  pool_->n_tokens_committed_ -= length_;
  pool_->n_tokens_reserved_ -= old_capacity - length_;
  ids_.clear();
  length_ = 0;
  pool_->debug_check();
}

BlockRef BlockTable::share_block(int64_t i) const {
  KV_CHECK(i >= 0 && (i + 1) * block_size_ <= length_,
           "share_block: only full committed blocks may be shared");
  const int32_t id = ids_[i];
  pool_->add_ref(id);
  ++pool_->loose_refs_[id];
  pool_->debug_check();
  return BlockRef(pool_, BlockId{id});
}

void BlockTable::adopt_prefix(std::vector<BlockRef> refs) {
  KV_CHECK(length_ == capacity() && length_ % block_size_ == 0,
           "adopt_prefix: table has a partial tail or a reservation");
  for (const BlockRef& r : refs) {
    KV_CHECK(r.pool_ == pool_, "adopt_prefix: reference is empty or from another pool");
  }
  for (BlockRef& r : refs) {
    // The reference moves from the handle into the table entry.
    const int32_t id = r.id_.value;
    --pool_->loose_refs_[id];
    r.pool_ = nullptr;
    r.id_ = BlockId{};
    ids_.push_back(id);
  }
  const int64_t added = static_cast<int64_t>(refs.size()) * block_size_;
  length_ += added;
  pool_->n_tokens_committed_ += added;
  pool_->debug_check();
}

Status BlockTable::adopt_partial_copy(BlockRef src, int64_t n_tokens) {
  KV_CHECK(length_ == capacity() && length_ % block_size_ == 0,
           "adopt_partial_copy: table has a partial tail or a reservation");
  KV_CHECK(n_tokens > 0 && n_tokens <= block_size_, "adopt_partial_copy: bad token count");
  KV_CHECK(src.pool_ == pool_, "adopt_partial_copy: reference is empty or from another pool");
  if (pool_->n_available() == 0) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: no block for a partial prefix copy");
  }
  std::vector<int32_t> fresh;
  pool_->take_free(1, fresh);  // src is referenced, so it cannot be the evicted block
  pool_->copy_block(src.id_.value, fresh[0]);
  ++pool_->n_partial_copies_;
  src.reset();
  ids_.push_back(fresh[0]);
  length_ += n_tokens;
  pool_->n_tokens_committed_ += n_tokens;
  pool_->n_tokens_reserved_ += block_size_ - n_tokens;
  // The copied slots are committed; the rest of the block is this table's
  // reservation (it is private), so the accounting matches a reserve+commit.
  pool_->debug_check();
  return Status{};
}

BlockTable BlockTable::fork() const {
  BlockTable t(*pool_);
  const int64_t keep = (length_ + block_size_ - 1) / block_size_;
  t.ids_.assign(ids_.begin(), ids_.begin() + keep);
  for (int32_t id : t.ids_) pool_->add_ref(id);
  t.length_ = length_;
  pool_->n_tokens_committed_ += length_;
  pool_->n_tokens_reserved_ += keep * block_size_ - length_;
  pool_->debug_check();
  return t;
}

Result<BlockTable> BlockTable::clone_private() const {
  const int64_t keep = (length_ + block_size_ - 1) / block_size_;
  if (keep > pool_->n_available()) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: cloning a sequence needs " +
                                              std::to_string(keep) + " blocks, " +
                                              std::to_string(pool_->n_available()) + " available");
  }
  BlockTable t(*pool_);
  pool_->take_free(keep, t.ids_);  // this table's blocks are referenced: never evicted here
  for (int64_t j = 0; j < keep; ++j) pool_->copy_block(ids_[j], t.ids_[j]);
  pool_->n_clone_copies_ += keep;
  t.length_ = length_;
  pool_->n_tokens_committed_ += length_;
  pool_->n_tokens_reserved_ += keep * block_size_ - length_;
  pool_->debug_check();
  return t;
}

int64_t plan_reserve(std::span<BlockTable* const> tables, std::span<const int64_t> n_new) {
  KV_CHECK(tables.size() == n_new.size(), "plan_reserve: tables and n_new differ in size");
  int64_t total = 0;
  for (size_t i = 0; i < tables.size(); ++i) total += tables[i]->blocks_needed(n_new[i]);
  return total;
}

Status reserve_all(std::span<BlockTable* const> tables, std::span<const int64_t> n_new) {
  KV_CHECK(tables.size() == n_new.size(), "reserve_all: tables and n_new differ in size");
  if (tables.empty()) return Status{};
  BlockPool& pool = tables[0]->pool();
  for (size_t i = 0; i < tables.size(); ++i) {
    KV_CHECK(&tables[i]->pool() == &pool, "reserve_all: tables from different pools");
    for (size_t j = 0; j < i; ++j) KV_CHECK(tables[j] != tables[i], "reserve_all: duplicate table");
  }
  const int64_t need = plan_reserve(tables, n_new);
  if (need > pool.n_available()) {
    ++pool.n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: batch of " +
                                              std::to_string(tables.size()) + " sequences needs " +
                                              std::to_string(need) + " blocks, " +
                                              std::to_string(pool.n_available()) + " available");
  }
  for (size_t i = 0; i < tables.size(); ++i) {
    Status s = tables[i]->reserve(n_new[i]);
    KV_CHECK(s.ok(), "reserve_all: reservation failed after a successful plan");
  }
  return Status{};
}

}  // namespace kvstack

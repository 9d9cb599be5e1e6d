#include "kv/group_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "core/half.h"
#include "kv/kivi_codec.h"

#include "kv/kv_write.h"
#include "kv/prefix_index.h"

namespace kvstack {

GroupTable::GroupTable(BlockPool& pool, int group)
    : pool_(&pool),
      layout_(&pool.group(group).layout),
      group_(group),
      window_(pool.group(group).drops_blocks ? pool.group(group).window : 0),
      block_size_(pool.block_size()),
      kivi_(layout_->has_kivi()) {
  pool_->tables_.insert(this);
  if (kivi_) {
    res_k_.resize(layout_->n_layers());
    res_v_.resize(layout_->n_layers());
  }
}

GroupTable::GroupTable(GroupTable&& other) noexcept
    : pool_(other.pool_),
      layout_(other.layout_),
      group_(other.group_),
      window_(other.window_),
      block_size_(other.block_size_),
      ids_(std::move(other.ids_)),
      n_dropped_(other.n_dropped_),
      length_(other.length_),
      n_evicted_(other.n_evicted_),
      positions_(std::move(other.positions_)),
      kivi_(other.kivi_),
      converted_(other.converted_),
      res_k_(std::move(other.res_k_)),
      res_v_(std::move(other.res_v_)) {
  other.ids_.clear();
  other.n_dropped_ = 0;
  other.length_ = 0;
  other.n_evicted_ = 0;
  other.positions_.clear();
  other.converted_ = 0;
  other.res_k_.assign(res_k_.size(), {});
  other.res_v_.assign(res_v_.size(), {});
  // Registration is per object: the moved-from table stays registered (and
  // empty) until it is destroyed.
  pool_->tables_.insert(this);
}

GroupTable& GroupTable::operator=(GroupTable&& other) noexcept {
  if (this == &other) return *this;
  release();
  if (pool_ != other.pool_) {
    pool_->tables_.erase(this);
    pool_ = other.pool_;
    block_size_ = other.block_size_;
    pool_->tables_.insert(this);
  }
  layout_ = other.layout_;
  group_ = other.group_;
  window_ = other.window_;
  ids_ = std::move(other.ids_);
  n_dropped_ = other.n_dropped_;
  other.n_dropped_ = 0;
  length_ = other.length_;
  n_evicted_ = other.n_evicted_;
  positions_ = std::move(other.positions_);
  other.n_evicted_ = 0;
  other.positions_.clear();
  kivi_ = other.kivi_;
  converted_ = other.converted_;
  res_k_ = std::move(other.res_k_);
  res_v_ = std::move(other.res_v_);
  other.ids_.clear();
  other.length_ = 0;
  other.converted_ = 0;
  other.res_k_.assign(res_k_.size(), {});
  other.res_v_.assign(res_v_.size(), {});
  pool_->debug_check();
  return *this;
}

int64_t GroupTable::row_elems(int l) const {
  const KvLayerSpec& s = layout_->layer(l);
  return s.kind == KvLayerKind::kMlaLatent ? static_cast<int64_t>(s.latent_dim + s.rope_dim)
                                           : static_cast<int64_t>(s.n_kv_heads) * s.head_dim_k;
}

int64_t GroupTable::kivi_target(int64_t len) const {
  const int64_t g = layout_->kivi_group();
  const int64_t r = layout_->kivi_residual();
  const int64_t ready = len >= r ? (len - r) / g * g : 0;
  return std::max(converted_, ready);
}

int64_t GroupTable::n_held_elsewhere() const {
  int64_t n = 0;
  for (int32_t id : ids_) n += id != kNullBlock && pool_->ref_count(BlockId{id}) > 1 ? 1 : 0;
  return n;
}

bool GroupTable::any_shared() const {
  for (int64_t j = 0; j < n_blocks(); ++j) {
    if (block_shared(j)) return true;
  }
  return false;
}

bool GroupTable::block_shared(int64_t j) const {
  const int32_t id = ids_[j];
  if (id == kNullBlock) return false;
  return pool_->ref_count(BlockId{id}) > 1 ||
         (pool_->index_ != nullptr && pool_->index_->is_published(id));
}

void GroupTable::write_range(int64_t n_new, int64_t* first, int64_t* end) const {
  // Committed slots are never rewritten, except a KIVI group converting.
  const int64_t lo = kivi_ ? converted_ : length_;
  const int64_t hi = kivi_ ? kivi_target(length_ + n_new) : length_ + n_new;
  *first = lo / block_size_;
  *end = std::min<int64_t>(n_blocks(), hi > lo ? (hi + block_size_ - 1) / block_size_ : *first);
}

int64_t GroupTable::n_shared_in(int64_t first, int64_t end) const {
  int64_t n = 0;
  for (int64_t j = first; j < end; ++j) {
    // Slots of block j below `length_` are committed: only then can it be shared.
    if (j * block_size_ < length_ && block_shared(j)) ++n;
  }
  return n;
}

KvResidualView GroupTable::residual_view(int l) const {
  if (!kivi_) return {};
  const int64_t w = row_elems(l);
  const auto& k = res_k_[static_cast<size_t>(l)];
  const auto& v = res_v_[static_cast<size_t>(l)];
  return KvResidualView{.k = k.data(),
                        .v = v.empty() ? nullptr : v.data(),
                        .start = converted_,
                        .n_tokens = static_cast<int64_t>(k.size()) / w};
}

int64_t GroupTable::residual_bytes() const {
  int64_t n = 0;
  for (size_t l = 0; l < res_k_.size(); ++l) {
    n += static_cast<int64_t>(res_k_[l].size() + res_v_[l].size()) * 2;
  }
  return n;
}

void GroupTable::convert_ready() {
  const int64_t target = kivi_target(length_);
  const int64_t n = target - converted_;
  if (n <= 0) return;
  const KvLayout& layout = *layout_;
  std::vector<float> k, v;
  for (int l = 0; l < layout.n_layers(); ++l) {
    const int64_t w = row_elems(l);
    auto& rk = res_k_[static_cast<size_t>(l)];
    auto& rv = res_v_[static_cast<size_t>(l)];
    KV_CHECK(static_cast<int64_t>(rk.size()) >= n * w, "KIVI residual shorter than its groups");
    k.resize(static_cast<size_t>(n * w));
    for (int64_t i = 0; i < n * w; ++i) k[i] = f16_to_f32(rk[i]);
    const bool has_v = !rv.empty();
    if (has_v) {
      v.resize(static_cast<size_t>(n * w));
      for (int64_t i = 0; i < n * w; ++i) v[i] = f16_to_f32(rv[i]);
    }
    write_kv(pool_->group_layer_view(group_, l), ids_, converted_, k.data(),
             has_v ? v.data() : nullptr, n);
    rk.erase(rk.begin(), rk.begin() + n * w);
    if (has_v) rv.erase(rv.begin(), rv.begin() + n * w);
  }
  converted_ = target;
}

void GroupTable::copy_residual_from(const GroupTable& other) {
  kivi_ = other.kivi_;
  converted_ = other.converted_;
  if (!kivi_) return;
  // Only the committed part: rows written for an unfinished step stay behind.
  const int64_t n = other.length_ - other.converted_;
  for (size_t l = 0; l < res_k_.size(); ++l) {
    const int64_t w = row_elems(static_cast<int>(l));
    const auto& k = other.res_k_[l];
    const auto& v = other.res_v_[l];
    res_k_[l].assign(k.begin(), k.begin() + std::min<int64_t>(n * w, k.size()));
    res_v_[l].assign(v.begin(), v.begin() + std::min<int64_t>(n * w, v.size()));
  }
}

GroupTable::~GroupTable() {
  release();
  pool_->tables_.erase(this);
}

bool GroupTable::tail_shared() const {
  if (length_ % block_size_ == 0) return false;
  const int32_t tail = ids_[length_ / block_size_];
  return pool_->ref_count(BlockId{tail}) > 1 ||
         (pool_->index_ != nullptr && pool_->index_->is_published(tail));
}

int64_t GroupTable::drop_invisible() {
  if (window_ <= 0) return 0;
  // Keys before first_visible(length_) are masked for every query at
  // position >= length_; KIVI blocks below converted_ are final.
  int64_t end = std::max<int64_t>(0, length_ - window_ + 1);
  if (kivi_) end = std::min(end, converted_);
  const int64_t n_drop = std::min<int64_t>(end / block_size_, n_blocks());
  if (n_drop <= n_dropped_) return 0;
  const int64_t n = n_drop - n_dropped_;
  // Oldest first: a dropped checkpoint (published) joins the LRU list before newer ones.
  for (int64_t j = n_dropped_; j < n_drop; ++j) {
    const int32_t id = ids_[j];
    ids_[j] = kNullBlock;
    pool_->drop_ref(id);
  }
  n_dropped_ = n_drop;
  pool_->debug_check();
  return n;
}

int64_t GroupTable::blocks_needed(int64_t n_new) const {
  KV_CHECK(n_new >= 0, "blocks_needed: negative token count");
  const int64_t need = (length_ + n_new + block_size_ - 1) / block_size_;
  int64_t first = 0, end = 0;
  write_range(n_new, &first, &end);
  const int64_t cow = n_new > 0 ? n_shared_in(first, end) : 0;
  return (need > n_blocks() ? need - n_blocks() : 0) + cow;
}

Status GroupTable::reserve(int64_t n_new) {
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
  int64_t first = 0, end = 0;
  write_range(n_new, &first, &end);
  for (int64_t j = first; n_new > 0 && j < end; ++j) {
    if (j * block_size_ >= length_ || !block_shared(j)) continue;
    // Copy-on-write: the committed slots of a shared block this step will
    // write (the partial tail; for KIVI, every block a conversion reaches)
    // move to a private block first.
    std::vector<int32_t> fresh;
    pool_->take_free(1, fresh, group_);
    pool_->copy_block(ids_[j], fresh[0]);
    pool_->drop_ref(ids_[j]);
    ids_[j] = fresh[0];
    ++pool_->n_cow_copies_;
  }
  const int64_t need = (length_ + n_new + block_size_ - 1) / block_size_;
  if (need > n_blocks()) pool_->take_free(need - n_blocks(), ids_, group_);
  pool_->n_tokens_reserved_[group_] += capacity() - old_capacity;
  pool_->debug_check();
  return Status{};
}

void GroupTable::write(int l, int64_t pos, const float* k_rows, const float* v_rows,
                       int64_t n_tokens) {
  KV_CHECK(n_tokens >= 0, "write: negative token count");
  KV_CHECK(pos >= length_, "write: position is committed (committed K/V are immutable)");
  KV_CHECK(pos + n_tokens <= capacity(), "write: positions beyond the reserved capacity");
  KV_CHECK(l >= 0 && l < layout_->n_layers(), "write: layer index out of range");
  KV_DCHECK(n_tokens == 0 || kivi_ || pool_->ref_count(BlockId{ids_[pos / block_size_]}) == 1,
            "write: target block is shared");
  KV_DCHECK(n_tokens == 0 || kivi_ || pool_->index_ == nullptr ||
                !pool_->index_->is_published(ids_[pos / block_size_]),
            "write: target block is published");
  if (!kivi_) {
    write_kv(pool_->group_layer_view(group_, l), ids_, pos, k_rows, v_rows, n_tokens);
    return;
  }
  const int64_t w = row_elems(l);
  auto& rk = res_k_[static_cast<size_t>(l)];
  auto& rv = res_v_[static_cast<size_t>(l)];
  KV_CHECK(pos == length_ && static_cast<int64_t>(rk.size()) == (length_ - converted_) * w,
           "write: KIVI layers append at length() once per step");
  const PagedKvLayerView view = pool_->group_layer_view(group_, l);
  const Status valid = validate_kv_rows(view, pos, k_rows, view.v ? v_rows : nullptr, n_tokens);
  KV_CHECK(valid.ok(), valid.ok() ? "" : valid.error().message.c_str());
  for (int which = 0; which < 2; ++which) {
    const float* x = which == 0 ? k_rows : v_rows;
    if (which == 1 && view.v == nullptr) break;
    for (int64_t i = 0; i < n_tokens * w; ++i) {
      KV_CHECK(std::fabs(x[i]) <= 65504.0f,
               "write: K/V value beyond the f16 range of the KIVI residual");
    }
    auto& r = which == 0 ? rk : rv;
    const size_t base = r.size();
    r.resize(base + static_cast<size_t>(n_tokens * w));
    for (int64_t i = 0; i < n_tokens * w; ++i) r[base + i] = f32_to_f16(x[i]);
  }
}

void GroupTable::commit(int64_t n_new) {
  KV_CHECK(n_new >= 0, "commit: negative token count");
  KV_CHECK(length_ + n_new <= capacity(), "commit: more tokens than reserved");
  if (n_evicted_ > 0) {
    for (int64_t i = 0; i < n_new; ++i) {
      positions_.push_back(static_cast<int32_t>(logical_length() + i));
    }
  }
  length_ += n_new;
  pool_->n_tokens_committed_[group_] += n_new;
  pool_->n_tokens_reserved_[group_] -= n_new;
  if (kivi_) convert_ready();
  pool_->debug_check();
}

void GroupTable::commit_final(int64_t n_new) {
  if (kivi_) {
    KV_CHECK(converted_ == length_, "commit_final: the KIVI residual is not empty");
    KV_CHECK((length_ + n_new) % layout_->kivi_group() == 0,
             "commit_final: not a whole number of KIVI key groups");
    converted_ = length_ + n_new;  // commit()'s conversion then has nothing to do
  }
  commit(n_new);
}

int64_t GroupTable::rollback() {
  if (kivi_) {
    // Rows written for the abandoned step leave the residual.
    for (size_t l = 0; l < res_k_.size(); ++l) {
      const size_t n = static_cast<size_t>((length_ - converted_) * row_elems(static_cast<int>(l)));
      if (res_k_[l].size() > n) res_k_[l].resize(n);
      if (res_v_[l].size() > n) res_v_[l].resize(n);
    }
  }
  const int64_t keep = (length_ + block_size_ - 1) / block_size_;
  const int64_t n_release = n_blocks() - keep;
  if (n_release == 0) return 0;
  const int64_t old_capacity = capacity();
  // Release newest first so the LIFO free list hands the same blocks back.
  for (int64_t j = n_blocks() - 1; j >= keep; --j) pool_->drop_ref(ids_[j]);
  ids_.resize(keep);
  pool_->n_tokens_reserved_[group_] -= old_capacity - capacity();
  pool_->debug_check();
  return n_release;
}

void GroupTable::release() {
  converted_ = 0;
  for (auto& r : res_k_) r.clear();
  for (auto& r : res_v_) r.clear();
  if (ids_.empty() && length_ == 0) return;
  const int64_t old_capacity = capacity();
  for (int64_t j = n_blocks() - 1; j >= n_dropped_; --j) pool_->drop_ref(ids_[j]);
  pool_->n_tokens_committed_[group_] -= length_;
  pool_->n_tokens_reserved_[group_] -= old_capacity - length_;
  ids_.clear();
  n_dropped_ = 0;
  length_ = 0;
  n_evicted_ = 0;
  positions_.clear();
  pool_->debug_check();
}

BlockRef GroupTable::share_block(int64_t i) const {
  KV_CHECK(i >= n_dropped_ && (i + 1) * block_size_ <= shareable_length(),
           "share_block: only full committed (KIVI: converted), non-dropped blocks may be shared");
  KV_CHECK(n_evicted_ == 0, "share_block: a compacted table's blocks are private");
  const int32_t id = ids_[i];
  pool_->add_ref(id);
  ++pool_->loose_refs_[id];
  pool_->debug_check();
  return BlockRef(pool_, BlockId{id});
}

void GroupTable::adopt_prefix(std::vector<BlockRef> refs) {
  adopt_prefix_after(0, std::move(refs));
}

void GroupTable::adopt_prefix_after(int64_t n_null, std::vector<BlockRef> refs) {
  KV_CHECK(n_null >= 0 && (n_null == 0 || (window_ > 0 && n_dropped_ == n_blocks())),
           "adopt_prefix_after: null entries only lead a dropping window group's table");
  KV_CHECK(length_ == capacity() && length_ % block_size_ == 0 && converted() == length_,
           "adopt_prefix: table has a partial tail, a reservation or a KIVI residual");
  for (const BlockRef& r : refs) {
    KV_CHECK(r.pool_ == pool_, "adopt_prefix: reference is empty or from another pool");
  }
  ids_.insert(ids_.end(), static_cast<size_t>(n_null), kNullBlock);
  n_dropped_ += n_null;
  for (BlockRef& r : refs) {
    // The reference moves from the handle into the table entry.
    const int32_t id = r.id_.value;
    --pool_->loose_refs_[id];
    r.pool_ = nullptr;
    r.id_ = BlockId{};
    ids_.push_back(id);
  }
  const int64_t added = (n_null + static_cast<int64_t>(refs.size())) * block_size_;
  length_ += added;
  if (kivi_) converted_ = length_;  // cached blocks are published only when converted
  pool_->n_tokens_committed_[group_] += added;
  pool_->debug_check();
}

Status GroupTable::adopt_partial_copy(BlockRef src, int64_t n_tokens) {
  KV_CHECK(length_ == capacity() && length_ % block_size_ == 0 && converted() == length_,
           "adopt_partial_copy: table has a partial tail, a reservation or a KIVI residual");
  KV_CHECK(n_tokens > 0 && n_tokens <= block_size_, "adopt_partial_copy: bad token count");
  KV_CHECK(src.pool_ == pool_, "adopt_partial_copy: reference is empty or from another pool");
  if (pool_->n_available() == 0) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: no block for a partial prefix copy");
  }
  std::vector<int32_t> fresh;
  pool_->take_free(1, fresh, group_);  // src is referenced, so it cannot be the evicted block
  pool_->copy_block(src.id_.value, fresh[0]);
  ++pool_->n_partial_copies_;
  ids_.push_back(fresh[0]);
  length_ += n_tokens;
  pool_->n_tokens_committed_[group_] += n_tokens;
  pool_->n_tokens_reserved_[group_] += block_size_ - n_tokens;
  if (kivi_) {
    // A KIVI key group is whole or not at all: the adopted tokens of a group
    // cut by n_tokens go back to the residual as their decoded values.
    const int64_t g = layout_->kivi_group();
    const int64_t start = length_ / g * g;
    converted_ = start;
    const int64_t n = length_ - start;
    if (n > 0) {
      std::vector<float> k, v;
      for (int l = 0; l < layout_->n_layers(); ++l) {
        const PagedKvLayerView view = pool_->group_layer_view(group_, l);
        const int64_t w = row_elems(l);
        k.resize(static_cast<size_t>(n * w));
        v.resize(static_cast<size_t>(n * w));
        read_kv(view, ids_, start, n, k.data(), v.data());
        auto& rk = res_k_[static_cast<size_t>(l)];
        auto& rv = res_v_[static_cast<size_t>(l)];
        rk.resize(static_cast<size_t>(n * w));
        for (int64_t i = 0; i < n * w; ++i) rk[i] = f32_to_f16(k[i]);
        rv.clear();
        if (view.v != nullptr) {
          rv.resize(static_cast<size_t>(n * w));
          for (int64_t i = 0; i < n * w; ++i) rv[i] = f32_to_f16(v[i]);
        }
      }
    }
  }
  // The copied slots are committed; the rest of the block is this table's
  // reservation (it is private), so the accounting matches a reserve+commit.
  // src is released only now, once the copy is one of this table's entries:
  // releasing it runs the pool check, which must see every block's holder.
  src.reset();
  pool_->debug_check();
  return Status{};
}

GroupTable GroupTable::fork() const {
  GroupTable t(*pool_, group_);
  const int64_t keep = (length_ + block_size_ - 1) / block_size_;
  t.ids_.assign(ids_.begin(), ids_.begin() + keep);
  t.n_dropped_ = n_dropped_;
  for (int64_t j = n_dropped_; j < keep; ++j) pool_->add_ref(t.ids_[j]);
  t.length_ = length_;
  t.n_evicted_ = n_evicted_;
  t.positions_ = positions_;
  t.copy_residual_from(*this);
  pool_->n_tokens_committed_[group_] += length_;
  pool_->n_tokens_reserved_[group_] += keep * block_size_ - length_;
  pool_->debug_check();
  return t;
}

Result<GroupTable> GroupTable::clone_private() const {
  const int64_t keep = (length_ + block_size_ - 1) / block_size_;
  const int64_t n_copy = keep - n_dropped_;
  if (n_copy > pool_->n_available()) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: cloning a sequence needs " +
                                              std::to_string(n_copy) + " blocks, " +
                                              std::to_string(pool_->n_available()) + " available");
  }
  GroupTable t(*pool_, group_);
  t.ids_.assign(static_cast<size_t>(n_dropped_), kNullBlock);
  t.n_dropped_ = n_dropped_;
  // This table's blocks are referenced: never evicted here.
  pool_->take_free(n_copy, t.ids_, group_);
  for (int64_t j = n_dropped_; j < keep; ++j) pool_->copy_block(ids_[j], t.ids_[j]);
  pool_->n_clone_copies_ += n_copy;
  t.length_ = length_;
  t.n_evicted_ = n_evicted_;
  t.positions_ = positions_;
  t.copy_residual_from(*this);
  pool_->n_tokens_committed_[group_] += length_;
  pool_->n_tokens_reserved_[group_] += keep * block_size_ - length_;
  pool_->debug_check();
  return t;
}

int64_t GroupTable::slot_of(int64_t pos) const {
  if (pos < 0 || pos >= logical_length()) return -1;
  if (positions_.empty()) return pos;
  const auto it = std::lower_bound(positions_.begin(), positions_.end(), pos);
  if (it == positions_.end() || *it != pos) return -1;
  return it - positions_.begin();
}

Status GroupTable::compact(std::span<const int64_t> keep, RetentionStats* stats) {
  const auto n_keep = static_cast<int64_t>(keep.size());
  KV_CHECK(n_blocks() == (length_ + block_size_ - 1) / block_size_,
           "compact: the table holds a reservation (compact between steps)");
  for (int64_t d = 0; d < n_keep; ++d) {
    KV_CHECK(keep[d] >= 0 && keep[d] < length_ && (d == 0 || keep[d] > keep[d - 1]),
             "compact: kept slots must be ascending, unique and committed");
  }
  if (window_ > 0 || pool_->group(group_).window > 0 || kivi_) {
    return make_error(Errc::kUnsupported,
                      "compact: sliding-window and KIVI groups cannot be compacted");
  }
  for (int i = 0; i < layout_->n_layers(); ++i) {
    const KvLayerPlacement& pl = layout_->placement(i);
    if (pl.k_meta_block_bytes > 0 || pl.v_meta_block_bytes > 0) {
      return make_error(Errc::kUnsupported,
                        "compact: a format with per-block metadata (fp8) cannot move tokens");
    }
  }
  if (n_keep == length_) return Status{};
  // Slots [0, first_moved) stay where they are; every later kept token moves
  // down (keep[d] > d from there on, as keep is strictly increasing).
  int64_t first_moved = 0;
  while (first_moved < n_keep && keep[first_moved] == first_moved) ++first_moved;
  const int64_t new_blocks = (n_keep + block_size_ - 1) / block_size_;
  const int64_t first_written = first_moved / block_size_;
  // Copy-on-write takes one block per destination another table holds; a
  // published block only this table holds returns to the pool (cached) as
  // its copy is made. The copies run newest first, so each such original
  // is a leaf of the prefix tree (its published descendants are this
  // table's later originals, already cached) and evictable at once: one
  // block in flight, not one each. Unless a published block past the
  // survivors is still held (released only in step 3, after the moves): it
  // keeps every earlier original unevictable until then, so each needs its
  // own block.
  int64_t n_cow = 0;
  int64_t n_published_only = 0;
  for (int64_t j = first_written; j < new_blocks; ++j) {
    if (!block_shared(j)) continue;
    if (pool_->ref_count(BlockId{ids_[j]}) > 1) {
      ++n_cow;
    } else {
      ++n_published_only;
    }
  }
  bool tail_published = false;
  for (int64_t j = new_blocks; j < n_blocks() && !tail_published; ++j) {
    tail_published = pool_->index_ != nullptr && pool_->index_->is_published(ids_[j]);
  }
  const int64_t n_in_flight =
      n_cow + (tail_published ? n_published_only : std::min<int64_t>(n_published_only, 1));
  if (n_in_flight > pool_->n_available()) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: compaction needs " +
                                              std::to_string(n_in_flight) +
                                              " copy-on-write blocks, " +
                                              std::to_string(pool_->n_available()) + " available");
  }
  RetentionStats delta;
  // 1. Private destination blocks. Block j's old contents feed only
  // destinations in blocks <= j, so the copy serves every later read of it.
  for (int64_t j = new_blocks - 1; j >= first_written; --j) {
    if (!block_shared(j)) continue;
    std::vector<int32_t> fresh;
    pool_->take_free(1, fresh, group_);
    pool_->copy_block(ids_[j], fresh[0]);
    pool_->drop_ref(ids_[j]);
    ids_[j] = fresh[0];
    delta.n_bytes_moved += pool_->block_bytes();
  }
  // 2. Move rows in ascending order: destination d <= source keep[d], and
  // every slot overwritten so far (< d) is below every source still unread.
  for (int i = 0; i < layout_->n_layers(); ++i) {
    const PagedKvLayerView v = pool_->group_layer_view(group_, i);
    const int n_heads = v.n_kv_heads;
    const int64_t k_head = v.head_stride;
    for (int64_t d = first_moved; d < n_keep; ++d) {
      const int64_t src = keep[d];
      const int64_t sb = int64_t{ids_[src / block_size_]} * v.block_stride;
      const int64_t db = int64_t{ids_[d / block_size_]} * v.block_stride;
      const int64_t ss = src % block_size_, ds = d % block_size_;
      for (int h = 0; h < n_heads; ++h) {
        std::memcpy(v.k + db + h * k_head + ds * v.slot_stride,
                    v.k + sb + h * k_head + ss * v.slot_stride, static_cast<size_t>(v.slot_stride));
        delta.n_bytes_moved += v.slot_stride;
        if (v.v != nullptr) {
          const int64_t vh = v.value_head_stride(), vs = v.value_slot_stride();
          std::memcpy(v.v + db + h * vh + ds * vs, v.v + sb + h * vh + ss * vs,
                      static_cast<size_t>(vs));
          delta.n_bytes_moved += vs;
        }
        if (v.k_meta != nullptr && v.k_meta_slot_stride > 0) {
          const int64_t mh = v.k_meta_head_stride, ms = v.k_meta_slot_stride;
          std::memcpy(v.k_meta + db + h * mh + ds * ms, v.k_meta + sb + h * mh + ss * ms,
                      static_cast<size_t>(ms));
          delta.n_bytes_moved += ms;
        }
        if (v.v_meta != nullptr && v.v_meta_slot_stride > 0) {
          const int64_t mh = v.v_meta_head_stride, ms = v.v_meta_slot_stride;
          std::memcpy(v.v_meta + db + h * mh + ds * ms, v.v_meta + sb + h * mh + ss * ms,
                      static_cast<size_t>(ms));
          delta.n_bytes_moved += ms;
        }
      }
    }
  }
  // 3. Positions, then release the blocks past the survivors (newest first).
  std::vector<int32_t> pos(static_cast<size_t>(n_keep));
  for (int64_t d = 0; d < n_keep; ++d) pos[d] = static_cast<int32_t>(position(keep[d]));
  const int64_t old_length = length_, old_capacity = capacity();
  for (int64_t j = n_blocks() - 1; j >= new_blocks; --j) pool_->drop_ref(ids_[j]);
  delta.n_blocks_freed = n_blocks() - new_blocks;
  ids_.resize(static_cast<size_t>(new_blocks));
  positions_ = std::move(pos);
  length_ = n_keep;
  n_evicted_ += old_length - n_keep;
  delta.n_compactions = 1;
  delta.n_tokens_dropped = old_length - n_keep;
  pool_->n_tokens_committed_[group_] -= old_length - n_keep;
  pool_->n_tokens_reserved_[group_] += (capacity() - length_) - (old_capacity - old_length);
  pool_->retention_.n_compactions += delta.n_compactions;
  pool_->retention_.n_tokens_dropped += delta.n_tokens_dropped;
  pool_->retention_.n_blocks_freed += delta.n_blocks_freed;
  pool_->retention_.n_bytes_moved += delta.n_bytes_moved;
  if (stats != nullptr) {
    stats->n_compactions += delta.n_compactions;
    stats->n_tokens_dropped += delta.n_tokens_dropped;
    stats->n_blocks_freed += delta.n_blocks_freed;
    stats->n_bytes_moved += delta.n_bytes_moved;
  }
  pool_->debug_check();
  return Status{};
}

}  // namespace kvstack

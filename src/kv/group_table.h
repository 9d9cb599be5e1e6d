// GroupTable: one sequence's table in ONE KV group (kv_groups.h) of the
// pool: the layers of that group, logical position t in block ids()[t / P],
// slot t % P (spec section 4). It owns one pool reference per non-null entry
// (move-only RAII: destruction releases every entry exactly once).
// BlockTable (block_table.h) is the per-sequence coordinator holding one
// GroupTable per group; callers normally use it. Layer indices given to a
// GroupTable are indices inside its group (0 .. group layers - 1).
//
// Window groups that drop blocks (KvGroup::drops_blocks). The table keeps
// LOGICAL indexing: entry j always covers positions [j P, (j + 1) P). Before
// a step at length L, drop_invisible() releases every block lying entirely
// before max(0, L - w + 1), the first key the coming chunk's queries can see
// (the kernels mask keys < pos - w + 1), and sets its entry to kNullBlock.
// Null entries only ever form a prefix of ids() (n_dropped() of them); the
// attention kernels never read them (paged_attention's planner starts every
// tile at the first visible key). Positions, RoPE and masks stay logical.
// Dropped blocks are released like any other reference: a published one
// (a prefix-index checkpoint) becomes cached, not free.
//
// Two lengths:
//   length()    committed tokens: their K/V were written for every layer and
//               the forward that produced them finished. Only this is visible
//               to readers and (later) to the prefix index.
//   capacity()  slots covered by the table (n_blocks * P) >= length().
// A step appends n_new tokens in phases:
//   1. plan:     blocks_needed(n_new) / plan_reserve(...)  (no side effect)
//   2. reserve:  reserve(n_new) or reserve_all(...)         (all or nothing)
//   3. write:    write(layer, pos, k, v, n) for pos in [length, length + n_new)
//   4. commit:   commit(n_new) once every layer is written
// or rollback() to drop the uncommitted reservation (a failed or cancelled
// forward: the blocks go back, length is unchanged, nothing is published).
// "Sampled" tokens are not in the table; a token enters it only by commit.
//
// Sharing: full committed blocks may be shared with other tables/holders
// (share_block / adopt_prefix / fork); such blocks are immutable because
// writes only target positions >= length(). A committed partial tail may be
// shared too (fork): the next reserve() that appends into it first copies
// it into a private block (copy-on-write, spec section 5), so a shared or
// published block is never written in place. A prefix hit that ends inside
// a cached block is adopted by copy (adopt_partial_copy).
//
// KIVI layouts (KvLayout::has_kivi(), kivi_codec.h). A key group is G
// tokens of one channel, so a token cannot be quantized on arrival. Each
// table keeps a residual: per layer, the K/V of positions
// [converted(), length() + written) as f16 rows in a side buffer owned by the
// table (not by the pool). write() appends there; commit() then converts every
// group g whose tokens are all older than the newest R (R = kivi_residual()),
// i.e. while converted + G + R <= length, encoding it into the blocks and
// dropping it from the residual. Readers (attention) take positions
// < converted() from the blocks and the rest from residual_view(), so within
// one step every reader sees the same, never half-converted state, and the
// reference "quantize the same groups at the same moments" is exact.
// The blocks are reserved for all length() tokens as for other formats (the
// slots of residual tokens wait for their codes), so converting in commit()
// never allocates and cannot fail; the residual costs at most
// (R + G - 1 + step tokens) x 2 H_kv d x 2 bytes per layer per sequence.
// Only converted blocks are final: shareable_length() = converted() bounds
// what share_block() / the prefix index may publish; reserve() copies
// (copy-on-write) every shared block the coming conversions will write;
// fork() and clone_private() copy the residual; adopt_prefix() takes fully
// converted blocks; adopt_partial_copy() re-expands a partly adopted group
// into the residual (its decoded values) so groups stay whole.
//
// Positions per slot (spec section 12; retention.h). Normally slot s holds
// logical position s and nothing is stored for it. compact() (retention
// compaction) packs the kept tokens densely into slots 0 .. n - 1 and
// releases the blocks past them; from then on positions() holds every
// committed slot's original logical position (ascending: compaction keeps
// order, so causal order in slots equals causal order in positions), new
// tokens take position logical_length() (not the resident count), and
// length() counts resident slots while logical_length() = length() +
// n_evicted() counts every token the sequence ever committed. Only
// full-attention groups compact (a window group's mask needs logical
// distances the kernels compute from slots), and a compacted table is never
// shared by index (share_block refuses it).
//
// Thread-safety: same as BlockPool (single owner). write() on distinct
// positions may run concurrently while no table/pool is mutated.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/result.h"
#include "kv/block_pool.h"
#include "kv/kv_groups.h"
#include "kv/retention.h"

namespace kvstack {

class GroupTable {
 public:
  // An empty table of group `group` of `pool` (registered with it for stats
  // and checks). REQUIRES: pool outlives the table; 0 <= group < n_groups.
  GroupTable(BlockPool& pool, int group);
  GroupTable(GroupTable&& other) noexcept;
  GroupTable& operator=(GroupTable&& other) noexcept;
  GroupTable(const GroupTable&) = delete;
  GroupTable& operator=(const GroupTable&) = delete;
  ~GroupTable();

  BlockPool& pool() const { return *pool_; }
  int group() const { return group_; }
  const KvLayout& layout() const { return *layout_; }
  // Leading entries released by drop_invisible() (kNullBlock), and the
  // blocks the table holds now (n_blocks() - n_dropped()).
  int64_t n_dropped() const { return n_dropped_; }
  int64_t n_resident_blocks() const { return n_blocks() - n_dropped_; }
  // Window groups that drop blocks: releases every block lying entirely
  // before the first position a step starting at length() can see (and, for
  // KIVI, already converted). Returns the blocks released. A no-op for other
  // groups. Never needed again: a later step starts at >= length().
  int64_t drop_invisible();
  // Committed resident slots (== logical_length() unless compacted).
  int64_t length() const { return length_; }
  // Logical tokens committed: the position the next token takes.
  int64_t logical_length() const { return length_ + n_evicted_; }
  // Tokens compaction removed (0 unless compacted).
  int64_t n_evicted() const { return n_evicted_; }
  bool compacted() const { return n_evicted_ > 0; }
  // Logical position of committed slot s, and the slots' positions
  // ([length()] ascending; EMPTY when not compacted: then position(s) == s).
  int64_t position(int64_t s) const { return positions_.empty() ? s : positions_[s]; }
  std::span<const int32_t> positions() const { return positions_; }
  // Slot holding logical position `pos`, or -1 when it was dropped (or is
  // not committed). O(log length()).
  int64_t slot_of(int64_t pos) const;
  // Retention compaction: keeps the committed slots `keep` (ascending,
  // unique, each < length()), moving them in order to slots 0 ..
  // keep.size() - 1 with their logical positions, then releases the blocks
  // past ceil(keep.size() / P) (released newest first; a published one becomes
  // cached). A destination block that is shared or published is copied to a
  // private block first (copy-on-write), so nobody else's K/V change. Net
  // blocks taken from the pool: one per destination block another table
  // holds (a published block only this table holds becomes cached as its
  // copy is taken, newest first: one block in flight; one each while a
  // published block past the survivors is still held, as it keeps the
  // released originals unevictable until the end). All or nothing: kOutOfBlocks
  // (nothing changed) when the pool has fewer than those plus one in flight;
  // kUnsupported for a window group, KIVI or per-block-metadata (fp8)
  // layers. Adds what it did to *stats (may be null) and the pool's totals.
  // REQUIRES: nothing reserved past the committed length (between steps).
  Status compact(std::span<const int64_t> keep, RetentionStats* stats);
  // Resident blocks another table also holds (reference count > 1): what
  // compact()'s copy-on-write takes from the pool at most. any_shared():
  // some resident block is held elsewhere or published.
  int64_t n_held_elsewhere() const;
  bool any_shared() const;
  // KIVI: positions < converted() are quantized in the blocks; the rest are in
  // the residual. Equals length() for other layouts.
  int64_t converted() const { return kivi_ ? converted_ : length_; }
  // Committed positions whose blocks are final (may be shared/published):
  // full blocks below this length. converted() for KIVI, else length().
  int64_t shareable_length() const { return converted(); }
  // Residual of layer l (KIVI layouts; an empty view otherwise). Covers the
  // committed residual plus rows written for the step in progress. Valid
  // until the next write/commit/rollback/release.
  KvResidualView residual_view(int l) const;
  // Bytes of f16 rows the residual holds (all layers, K and V).
  int64_t residual_bytes() const;
  int64_t capacity() const { return n_blocks() * block_size_; }
  int64_t n_blocks() const { return static_cast<int64_t>(ids_.size()); }
  // Block ids for the attention kernel: [n_blocks] int32 indices into the
  // pool (kNullBlock for the first n_dropped() entries), valid until the next
  // reserve/rollback/release/adopt/drop.
  std::span<const int32_t> ids() const { return ids_; }
  const int32_t* data() const { return ids_.data(); }

  // Blocks a reservation of n_new more tokens on top of length() would take
  // from the pool (0 when already reserved), including one copy-on-write
  // block when the partial tail is shared. No side effect. REQUIRES n_new >= 0.
  int64_t blocks_needed(int64_t n_new) const;

  // True when the committed tail block is partly filled and has another holder
  // (the next append copies it first).
  bool tail_shared() const;

  // Ensures capacity() >= length() + n_new, copying a shared partial tail
  // into a private block first (copy-on-write). All or nothing: on
  // kOutOfBlocks (message gives needed and available blocks) nothing changed.
  // May evict cached blocks. REQUIRES n_new >= 0.
  Status reserve(int64_t n_new);

  // Writes layer l's K/V for tokens [pos, pos + n_tokens), converting from
  // float32 to the layer's dtype (KIVI layouts: to f16 in the residual;
  // REQUIRES pos == length() and each layer written once per step; values
  // beyond the f16 range abort with a message naming them).
  // k_rows, v_rows: [n_tokens, n_kv_heads, head_dim] float32 (MLA: k_rows is
  // [n_tokens, latent_dim + rope_dim], v_rows must be null).
  // REQUIRES: length() <= pos and pos + n_tokens <= capacity() (only reserved,
  // uncommitted slots are writable; committed K/V are immutable).
  void write(int l, int64_t pos, const float* k_rows, const float* v_rows, int64_t n_tokens);

  // Marks n_new more tokens as written for every layer (KIVI: and converts
  // the groups that left the residual window). Never allocates.
  // REQUIRES: n_new >= 0 and length() + n_new <= capacity().
  void commit(int64_t n_new);
  // Commits n_new tokens whose final bytes were placed in the blocks
  // directly (a KV transfer: whole blocks in their stored format). KIVI:
  // they count as converted and never pass through the residual.
  // REQUIRES as commit(); KIVI: an empty residual (converted() == length())
  // and length() + n_new a multiple of the key group size.
  void commit_final(int64_t n_new);

  // Releases blocks beyond those the committed length needs
  // (ceil(length / P) remain). Returns the number of blocks released.
  int64_t rollback();

  // Releases every reference; the table becomes empty with length 0 and stays
  // usable. Also run by the destructor.
  void release();

  // Another reference to entry i, which must be a full committed,
  // non-dropped block (REQUIRES n_dropped() <= i, (i + 1) * P <= shareable_length()).
  BlockRef share_block(int64_t i) const;

  // Appends full, already-written blocks (e.g. a prefix-cache match) as
  // committed tokens: length += refs.size() * P. The references move into
  // the table. REQUIRES: length() == capacity() and length() % P == 0 (no
  // partial tail, nothing reserved), every ref valid and from this pool.
  void adopt_prefix(std::vector<BlockRef> refs);
  // The same after n_null null entries (a window group adopting a prefix
  // hit: blocks before the window are not needed): length += (n_null +
  // refs.size()) * P. REQUIRES as adopt_prefix, and a dropping group when
  // n_null > 0.
  void adopt_prefix_after(int64_t n_null, std::vector<BlockRef> refs);

  // Adopts the first n_tokens slots of block `src` (a cached block whose
  // first n_tokens tokens continue this table) by copying the block into a
  // new private block: length += n_tokens. `src` is released on return.
  // kOutOfBlocks (nothing changed) when no block is available.
  // REQUIRES: length() == capacity(), length() % P == 0, 0 < n_tokens <= P,
  // src valid and from this pool.
  Status adopt_partial_copy(BlockRef src, int64_t n_tokens);

  // A new table sharing every committed block (ceil(length / P) of them,
  // one more reference each) with the same length; nothing reserved is
  // shared. The fork and this table copy a shared partial tail on their next
  // append.
  GroupTable fork() const;

  // A new table with private copies of every committed block (no sharing):
  // the reference for what forks save. kOutOfBlocks (nothing changed) when
  // the pool cannot hold the copies.
  Result<GroupTable> clone_private() const;

 private:
  friend class BlockPool;
  void unregister();
  // KIVI: the converted length once length() reaches `len`.
  int64_t kivi_target(int64_t len) const;
  // First and one-past-last block index that the next reserve(n_new) and
  // commit may write (shared ones among them need copy-on-write).
  void write_range(int64_t n_new, int64_t* first, int64_t* end) const;
  int64_t n_shared_in(int64_t first, int64_t end) const;
  bool block_shared(int64_t j) const;
  void convert_ready();
  void copy_residual_from(const GroupTable& other);
  int64_t row_elems(int l) const;  // f16 elements per residual token row of layer l

  BlockPool* pool_ = nullptr;
  const KvLayout* layout_ = nullptr;  // the group's layout (owned by the pool)
  int group_ = 0;
  int window_ = 0;  // > 0 only when the group drops blocks
  int block_size_ = 0;
  std::vector<int32_t> ids_;  // [n_blocks]; each non-null entry holds one reference
  int64_t n_dropped_ = 0;     // ids_[0, n_dropped_) are kNullBlock
  int64_t length_ = 0;
  int64_t n_evicted_ = 0;           // tokens removed by compact()
  std::vector<int32_t> positions_;  // [length_] when n_evicted_ > 0, else empty
  // KIVI residual (empty unless the layout has_kivi()).
  bool kivi_ = false;
  int64_t converted_ = 0;
  std::vector<std::vector<uint16_t>> res_k_, res_v_;  // per layer [n, row_elems_]
};

}  // namespace kvstack

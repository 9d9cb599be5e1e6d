// BlockTable: one sequence's KV, the coordinator of its per-group tables
// (kv-cache-spec.md section 12). It holds one GroupTable (group_table.h)
// per KV group of the pool (kv_groups.h) and drives them together: reserve,
// write, commit, rollback, fork (copy-on-write), clone and release act on
// every group, all or nothing. A single-group model (every llama/qwen2
// model) has exactly one inner table and behaves as the one-table engine
// did; ids()/data()/n_blocks() are the primary group's (group 0) table.
//
// Lengths (the same in every group between and during steps):
//   length()    committed LOGICAL tokens: their K/V were written for every
//               layer and the forward that produced them finished; the next
//               token takes position length().
//   capacity()  logical tokens the tables cover (tokens compaction removed
//               plus n_blocks * P) >= length().
// Retention (retention.h): with set_retention() the table compacts its
// full-attention groups before each step (in drop_invisible(), which
// reserve() and reserve_all() run first), so a group's resident slots
// (resident_length) can be fewer than length(); positions per slot are kept
// (group_table.h). Without retention nothing of this runs.
// A step appends n_new tokens in phases:
//   1. plan:     blocks_needed(n_new) / plan_reserve(...)  (no side effect)
//   2. reserve:  reserve(n_new) or reserve_all(...)         (all or nothing;
//                first drops every window-group block the coming chunk
//                cannot see: drop_invisible())
//   3. write:    write(layer, pos, k, v, n) for pos in [length, length + n_new)
//   4. commit:   commit(n_new) once every layer is written
// or rollback() to drop the uncommitted reservation. Kernels read layer l
// through ids_for_layer(l) and the pool's layer_view(l).
//
// Sharing and KIVI: see group_table.h (each group table keeps its layers'
// residual; shareable_length() is the minimum over groups).
//
// Thread-safety: same as BlockPool (single owner). write() on distinct
// positions may run concurrently while no table/pool is mutated.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/result.h"
#include "kv/block_pool.h"
#include "kv/group_table.h"

namespace kvstack {

class BlockTable {
 public:
  // An empty table (one empty GroupTable per group of `pool`).
  // REQUIRES: pool outlives the table.
  explicit BlockTable(BlockPool& pool);
  BlockTable(BlockTable&& other) noexcept;
  BlockTable& operator=(BlockTable&& other) noexcept;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  ~BlockTable() = default;  // each group table releases its references

  BlockPool& pool() const { return *pool_; }
  int n_groups() const { return static_cast<int>(groups_.size()); }
  GroupTable& group(int g) { return groups_[static_cast<size_t>(g)]; }
  const GroupTable& group(int g) const { return groups_[static_cast<size_t>(g)]; }

  int64_t length() const { return groups_[0].logical_length(); }
  // Resident slots of model layer l's group: the kernels' key count (the
  // attention kernels index slots; compaction keeps slot order == position
  // order, and only full-attention groups compact).
  int64_t resident_length(int l) const {
    return groups_[static_cast<size_t>(pool_->groups().slot(l).group)].length();
  }
  // True once any group compacted (retention): blocks are then private.
  bool compacted() const;
  // KIVI: the smallest converted length over groups; length() otherwise.
  int64_t converted() const;
  // Committed positions whose blocks are final in every group.
  int64_t shareable_length() const { return converted(); }
  // Residual of model layer l (KIVI layouts; an empty view otherwise).
  KvResidualView residual_view(int l) const;
  int64_t residual_bytes() const;
  int64_t capacity() const { return groups_[0].capacity() + groups_[0].n_evicted(); }

  // Retention policy (retention.h) applied before every later step; kNone
  // (the default) turns it off. kUnsupported / kInvalidArgument (nothing
  // changed) when the pool's layout cannot compact (retention_supported) or
  // the config is out of range.
  Status set_retention(const RetentionConfig& config);
  const RetentionConfig& retention() const { return retention_; }
  // This table's compaction counters (since creation or the last release()).
  const RetentionStats& retention_stats() const { return retention_stats_; }
  // Applies the retention policy now: compacts each full-attention group
  // whose droppable resident tokens reach the slack (retention.h). Returns
  // the blocks released. A compaction whose copy-on-write finds no block is
  // skipped (counted in n_deferred) and retried at the next step.
  int64_t apply_retention();

  // SnapKV (retention.h). While wants_queries(), the forward pass hands each
  // layer's query rows of every multi-token step ([n_tokens, n_q_heads,
  // head_dim] at logical positions [pos, pos + n_tokens), after RoPE and
  // --kv-rotate: the basis K is stored in); the table keeps, per model
  // layer, the rows of the last `window` positions. The next one-token step
  // (reserve / reserve_all with n_new == 1: decoding begins, the prompt has
  // ended) first runs apply_snapkv(), which scores the observation window
  // against the stored keys, selects (snapkv_mark_unit per layer and KV
  // head, union over the KV group) and compacts; then the rows are dropped.
  // Returns the blocks released (0 without rows, or with nothing to drop).
  struct QueryShape {
    int n_q_heads = 0;
    int head_dim = 0;
    float scale = 0.0f;  // multiplies q.k before the softmax
  };
  bool wants_queries() const { return retention_.observed_rows() > 0; }
  void observe_queries(int l, int64_t pos, const float* q, int64_t n_tokens,
                       const QueryShape& shape);
  int64_t apply_snapkv();

  // H2O (retention.h): accumulated attention mass per resident slot of each
  // KV group. The forward pass hands key_mass(l, n) to the decode kernel
  // (AttnSeq::key_mass) for layer l's n keys: [n] floats of l's group, new
  // slots 0, valid until the next table call. At the end of a prefill
  // apply_snapkv() adds the prompt's last `obs` queries' attention; before
  // each one-token step apply_retention() keeps h2o_keep_slots() and
  // compacts, carrying each survivor's mass along. Empty when not h2o.
  bool wants_mass() const { return retention_.is_h2o() && mass_output_; }
  // Bench only (`kvstack bench --mass-ab`): false stops the mass output
  // (wants_mass() false, so the forward pass passes no AttnSeq::key_mass)
  // while H2O keeps compacting on the mass accumulated so far: the same
  // step without the kernel's mass work. Forks and clones copy it.
  void set_mass_output(bool on) { mass_output_ = on; }

  // topk (retention.h): per model layer and logical block, each KV head's
  // per-channel minimum and maximum of the stored keys ([n_kv][2][d] f16
  // per block: the minimum rounded down, the maximum up, f16_bound_down/up),
  // as decoded from the pool: write() refreshes the
  // blocks it touches, key_summary() rebuilds blocks this table did not
  // write (a prefix hit, a copy-on-write copy). key_summary(l, n) covers
  // full blocks [0, n) of layer l. Empty unless topk.
  bool topk_reads() const { return retention_.is_topk(); }
  std::span<const uint16_t> key_summary(int l, int64_t n_blocks);
  // Counts one decode query's blocks read / present in one layer.
  void count_topk_reads(int64_t n_read, int64_t n_total);
  // The full blocks layer l's last top-k read chose (empty: read all).
  std::vector<int64_t>& topk_choice(int l);
  float* key_mass(int l, int64_t n_keys);
  std::span<const float> group_mass(int g) const;

  // The primary group's table (all layers for a single-group model).
  int64_t n_blocks() const { return groups_[0].n_blocks(); }
  std::span<const int32_t> ids() const { return groups_[0].ids(); }
  const int32_t* data() const { return groups_[0].data(); }
  // Block ids of model layer l's group: [n_blocks] int32 indices into the
  // pool (kNullBlock where a window group dropped a block), what the
  // attention kernels take with pool().layer_view(l). Valid until the next
  // reserve/rollback/release/adopt.
  std::span<const int32_t> ids_for_layer(int l) const {
    return groups_[static_cast<size_t>(pool_->groups().slot(l).group)].ids();
  }
  // Blocks the tables hold now, all groups.
  int64_t n_resident_blocks() const;
  // Admission (retention_reserve.cpp): the most blocks this table may still
  // take from the pool while it grows to n_target logical tokens, its first
  // n_prompt tokens written in multi-token steps (prefill chunks of at most
  // `chunk` tokens) and every later one alone. Under a compacting policy
  // (streamingllm, snapkv, pyramidkv, h2o) each full-attention group counts
  // what the policy keeps (retention.h, and retention_group_peak below), at
  // least the whole prompt for a policy that selects at the first one-token
  // step, and subtracts only blocks no other table holds (compaction copies
  // shared ones), plus one block in flight while a compaction may still copy
  // a shared or published block (until the first compaction), and until a
  // group's first compaction, with a prefix index, one block per kept
  // block for that compaction's copies of published blocks. Other
  // groups and policies: the exact peak (KvGroups::peak_blocks) minus the
  // resident blocks. all_shared: count every resident block as held
  // elsewhere (a table about to be forked).
  int64_t retention_reserve_blocks(int64_t n_prompt, int64_t n_target, int64_t chunk,
                                   bool all_shared = false) const;
  // retention_reserve_blocks of a new, empty table of `pool` under
  // `config`, without making one (safe on any thread: reads only the pool's
  // fixed geometry). Admission checks with it that a request can ever fit.
  static int64_t fresh_reserve_blocks(const BlockPool& pool, const RetentionConfig& config,
                                      int64_t n_prompt, int64_t n_target, int64_t chunk);
  // The most blocks group g holds from now on, by the same rules.
  int64_t retention_group_peak(int g, int64_t n_prompt, int64_t n_target, int64_t chunk) const;
  // True when retention compacts group g (a full-attention group of
  // standard layers under a compacting policy).
  bool retention_compacts(int g) const;

  // Blocks a reservation of n_new more tokens would take from the pool, all
  // groups, including copy-on-write copies; blocks drop_invisible() would
  // release first are not subtracted. No side effect. REQUIRES n_new >= 0.
  int64_t blocks_needed(int64_t n_new) const;
  // True when any group's committed tail is partly filled and shared.
  bool tail_shared() const;

  // Window groups: releases the blocks no query from length() on can see
  // (GroupTable::drop_invisible), then apply_retention(). Returns the blocks
  // released.
  int64_t drop_invisible();
  // What reserve(n_new) / reserve_all do first: drop_invisible(), and
  // apply_snapkv() when n_new == 1 (then h2o's apply_retention()). Returns
  // the blocks released.
  int64_t prepare_step(int64_t n_new);

  // drop_invisible(), then capacity() >= length() + n_new in every group
  // (copy-on-write of shared tails first). All or nothing beyond the drop:
  // on kOutOfBlocks (message gives needed and available blocks) no group
  // reserved anything. REQUIRES n_new >= 0.
  Status reserve(int64_t n_new);

  // Writes model layer l's K/V for logical positions [pos, pos + n_tokens)
  // (see GroupTable::write; a compacted group writes them at its slots
  // pos - n_evicted()).
  void write(int l, int64_t pos, const float* k_rows, const float* v_rows, int64_t n_tokens);
  // Commits n_new written tokens in every group.
  void commit(int64_t n_new);
  // The same for tokens whose final bytes were placed in the blocks
  // directly (GroupTable::commit_final).
  void commit_final(int64_t n_new);
  // Drops every group's uncommitted reservation; returns blocks released.
  int64_t rollback();
  // Releases every reference in every group; the table stays usable.
  void release();

  // Single-group tables only (the prefix index's chain is group 0; hybrid
  // prefix hits go through adopt_hybrid_prefix): see GroupTable.
  BlockRef share_block(int64_t i) const;
  void adopt_prefix(std::vector<BlockRef> refs);
  Status adopt_partial_copy(BlockRef src, int64_t n_tokens);

  // A table sharing every committed block of every group.
  BlockTable fork() const;
  // Private copies of every committed block of every group; kOutOfBlocks
  // (nothing changed) when the pool cannot hold them all.
  Result<BlockTable> clone_private() const;

 private:
  void make_groups();

  BlockPool* pool_ = nullptr;
  RetentionConfig retention_;
  RetentionStats retention_stats_;
  // SnapKV observation rows per model layer: positions [start, start + n).
  struct ObservedQueries {
    int64_t start = 0;
    std::vector<float> rows;  // [n, n_q_heads * head_dim]
  };
  std::vector<ObservedQueries> obs_;  // [n_layers] while rows are held, else empty
  QueryShape obs_shape_;
  // H2O: [n_groups][>= committed resident slots] accumulated mass (empty
  // vectors when not h2o); entries past a group's length() are stale
  // (rolled back) and cut by prepare_step().
  std::vector<std::vector<float>> mass_;
  bool mass_output_ = true;  // set_mass_output
  void trim_mass();
  // topk: [n_layers] key summaries (see key_summary()).
  struct KeySummary {
    std::vector<uint16_t> mm;   // [n_blocks][n_kv][2][d] f16 bits (min down, max up)
    std::vector<int32_t> id;    // [n_blocks] block id summarized (-1: none)
    std::vector<int32_t> n;     // [n_blocks] slots summarized
    std::vector<int64_t> last;  // the last top-k choice
  };
  std::vector<KeySummary> summ_;
  void summarize(int l, int64_t b, int64_t n_valid);
  std::vector<GroupTable> groups_;  // [n_groups]; never reallocated (tables register by address)
};

// Batch plan/commit for one engine step over distinct tables of one pool:
// plan_reserve sums blocks_needed (no side effect); reserve_all first drops
// every table's invisible window blocks, then reserves for every table or,
// on kOutOfBlocks, for none.
// REQUIRES: tables.size() == n_new.size(), tables distinct, same pool.
int64_t plan_reserve(std::span<BlockTable* const> tables, std::span<const int64_t> n_new);
Status reserve_all(std::span<BlockTable* const> tables, std::span<const int64_t> n_new);

}  // namespace kvstack

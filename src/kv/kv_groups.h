// KV groups (kv-cache-spec.md section 12): a model's layers grouped by what
// they cache and how long they keep it, so that one pool of fungible blocks
// serves full-attention and sliding-window layers at their own cost.
//
// Grouping (vLLM's hybrid-allocator scheme). Layers fall into retention
// classes by window (standard and MLA layers of one class share a layout). Every group holds the
// same number of layers g = gcd of the class sizes (Gemma 3: 3 full + 15 window layers -> g = 3:
// one full group and five window groups), each group has its own KvLayout
// over its layers, and every group layout is padded to the largest group's
// block bytes, so a block can serve any group: one free list, one eviction
// order and one `free + used + cached = total` for the whole model. A block
// belongs to one group at a time (BlockPool tracks which).
//
// Group 0 (the primary group) is a full-attention group whenever the model
// has one: its table holds every block from position 0, it carries the
// prefix index's chain of nodes, and it never drops blocks. Other window
// groups drop whole blocks that no coming query can see (GroupTable), so a
// sequence keeps at most ceil((w - 1 + chunk) / P) + 1 blocks in them.
// A model whose layers all share one class is ONE group over all layers:
// its layout is exactly the model layout (same bytes, same views), so it
// behaves as the single-table engine did.
//
// Thread-safety: immutable after create(); share freely.
#pragma once

#include <cstdint>
#include <vector>

#include "core/result.h"
#include "kv/layout.h"

namespace kvstack {

struct KvGroup {
  int window = 0;             // 0 = full attention (keeps every block)
  bool drops_blocks = false;  // window > 0 and not the primary group
  std::vector<int> layers;    // model layer indices, ascending
  KvLayout layout;            // over `layers` (in that order), padded to the pool's block bytes
};

// Where model layer l lives: group and index inside the group's layout.
struct KvLayerSlot {
  int group = 0;
  int index = 0;
};

class KvGroups {
 public:
  // Groups the layers of `model_layout` (their kind and window). Errors come
  // from the per-group layouts (KvLayout::create). one_layer_per_group: every
  // layer its own group (retention policies that keep different tokens per
  // layer, retention.h: each group has its own slot map).
  static Result<KvGroups> create(const KvLayout& model_layout, bool one_layer_per_group = false);

  int n_groups() const { return static_cast<int>(groups_.size()); }
  const KvGroup& group(int g) const { return groups_[static_cast<size_t>(g)]; }
  KvLayerSlot slot(int l) const { return slots_[static_cast<size_t>(l)]; }
  int n_layers() const { return static_cast<int>(slots_.size()); }
  // Bytes of one pool block (the largest group block; every group layout is
  // padded to it).
  int64_t block_bytes() const { return block_bytes_; }
  int block_size() const { return block_size_; }

  // Blocks group g holds for one sequence of n_tokens committed tokens
  // about to run a step of `chunk` more (0: between steps): ceil(T / P) for
  // a full group; for a dropping window group the blocks overlapping
  // [max(0, T - w + 1), T + chunk) (what the coming queries can see), i.e.
  // at most ceil((w - 1 + chunk) / P) + 1. The figure the scheduler's
  // admission and the planner use; GroupTable keeps exactly this many.
  int64_t blocks_for(int g, int64_t n_tokens, int64_t chunk) const;
  // Sum over groups.
  int64_t blocks_for_sequence(int64_t n_tokens, int64_t chunk) const;
  // The most blocks group g ever holds for one sequence that grows to
  // n_tokens tokens in steps of at most `chunk` tokens: ceil(T / P) for a
  // group that keeps everything, min(ceil(T / P), ceil((w - 1 + chunk) / P)
  // + 1) for a dropping window group. What admission reserves ("does it
  // fit"), never a model-wide ceil(T / P).
  int64_t peak_blocks(int g, int64_t n_tokens, int64_t chunk) const;
  int64_t peak_blocks_for_sequence(int64_t n_tokens, int64_t chunk) const;
  // The longest sequence whose peak_blocks_for_sequence fits n_blocks.
  int64_t max_tokens_in(int64_t n_blocks, int64_t chunk) const;

 private:
  std::vector<KvGroup> groups_;
  std::vector<KvLayerSlot> slots_;
  int64_t block_bytes_ = 0;
  int block_size_ = 0;
};

}  // namespace kvstack

// Physical layout of one KV block: which bytes of a block hold which layer's
// K and V. The pool, block tables and (future) prefix index only ever see
// whole blocks of `block_bytes()`; everything about per-layer shapes, dtypes
// and formats lives here and in the views it produces.
//
// ---------------------------------------------------------------------------
// Design notes (docs/kv-layout.md material)
// ---------------------------------------------------------------------------
// Block identity. One block holds ALL layers of P consecutive logical
// positions of one sequence. A block is therefore the unit that the prefix
// cache hashes and shares (its key covers P tokens across the whole model),
// that tiers move and that disaggregated transfer ships. Layer l of block b
// starts at `pool_base + b * block_bytes + placement(l).k_offset`.
//
// Inside a block, per standard layer, KV head by KV head:
//   [n_kv_heads] x ( K tile: [P][head_dim] elements, V tile: [P][head_dim] elements )
// then padding to 64 bytes, as much as separate K and V regions padded to 64
// bytes each would take. So one KV head of one block is a contiguous
// [P, head_dim] K tile (what a paged attention kernel streams) directly
// followed by its V tile: decode reads both, and one run of 2 * P rows per
// head and block instead of two runs of P rows in different places took
// paged decode attention at 16K-32K tokens with scattered blocks from
// 0.75-0.81 to 0.91-0.95 of contiguous speed (docs/benchmarks.md, "Kernel
// tuning"). The layer and its metadata
// regions start 64-byte aligned (the pool aligns every block to 64 bytes and
// block_bytes is a multiple of 64); a head's tiles are aligned when P rows
// are a multiple of 64 bytes. PagedKvLayerView (kv_view.h) exposes exactly
// this addressing: head_stride (= v_head_stride) steps over both tiles.
//
// Quantized formats (int8/fp8/int4/KIVI). A quantized dtype is a new KvDtype
// plus, per layer, a metadata region placed after the K/V tiles inside the
// same block: [n_kv_heads][n_groups] scales/zeros for K and for V, with the
// group shape fixed by the format (per-token groups for V, per-channel groups
// along the block's P tokens for K). Implemented for fp8/int8/int4 (region
// order K/V code tiles, K meta, V meta, each region padded to 64 bytes; row
// geometry in kv_codec.h); K and V may use different dtypes (dtype_v). KvLayerPlacement gains
// k_meta_offset / v_meta_offset and the view gains the matching pointers/strides; the block is
// still one opaque run of block_bytes, so the pool, tables and prefix index are unchanged, and a
// shared block carries its own scales.
// KIVI (kivi2/kivi4, kivi_codec.h): a KIVI K's metadata is per block ([P/G][head_dim] f16
// scale/min pairs per head: one group of G tokens per channel), a KIVI V's per token. The
// not-yet-quantized newest tokens (the residual, R = KvLayoutOptions::kivi_residual) do not
// live in the pool: each BlockTable keeps them as f16 rows in a side buffer and converts whole
// key groups at commit (block_table.h). The blocks still reserve every token's quantized slot,
// so conversion never allocates; pool, tables and prefix index are unchanged, and only
// converted blocks are shareable.
//
// Sliding windows. `KvLayerSpec::window` (w > 0) makes the kernels mask
// positions < pos - w + 1. To save memory the pool groups layers by window
// (kv_groups.h): each group gets its own KvLayout over its layers (all
// padded to one block size, padded_to()) in the one pool, and a sequence
// holds one table per group (block_table.h / group_table.h). A window
// group's table keeps LOGICAL indexing (entry j covers [j*P, (j+1)*P)) and
// drops the blocks no coming query can see (kNullBlock entries), so RoPE and
// masks stay logical; the prefix index matches on the cumulative logical
// length and keeps window-group checkpoints (prefix_index.h, spec 12).
//
// MLA. A KvLayerKind::kMlaLatent layer caches one latent row per token:
// [P][latent_dim + rope_dim] elements (c_t then the decoupled RoPE key), no
// heads and no V. It is just another region inside the block: its view has
// n_kv_heads = 1, head_dim = latent_dim + rope_dim, head_stride = 0 and
// v == nullptr, and its payload is (d_c + d_R) * b per token (no factor 2).
// Mixed models (some MLA layers, some standard) need no special casing.
//
// Thread-safety: KvLayout is immutable after create(); share it freely.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "kv/kv_view.h"

namespace kvstack {

// What one layer caches per token.
enum class KvLayerKind : uint8_t {
  kStandard = 0,   // K and V per KV head (MHA/GQA/MQA)
  kMlaLatent = 1,  // one latent row c_t (latent_dim) + decoupled RoPE key (rope_dim)
};

// Parses "f32", "f16", "bf16", "fp8", "int8", "int4", "kivi2", "kivi4" (as
// used by --kv-dtype).
Result<KvDtype> parse_kv_dtype(std::string_view name);

struct KvLayerSpec {
  KvLayerKind kind = KvLayerKind::kStandard;
  // kStandard: H_kv >= 1 and head dims >= 1. Only head_dim_k == head_dim_v is
  // supported for now (PagedKvLayerView has one head_dim); create() returns
  // kUnsupported otherwise.
  int n_kv_heads = 0;
  int head_dim_k = 0;
  int head_dim_v = 0;
  // kMlaLatent: d_c >= 1, d_R >= 0 (n_kv_heads / head_dim_* must be 0).
  int latent_dim = 0;
  int rope_dim = 0;
  KvDtype dtype = KvDtype::kF16;  // K's dtype (and the MLA latent's), and V's by default
  int window = 0;                 // sliding-window width in tokens; 0 = full attention
  // V's dtype when it differs from K's (kStandard only); unset = dtype.
  std::optional<KvDtype> dtype_v = std::nullopt;

  KvDtype value_dtype() const { return dtype_v.value_or(dtype); }
};

// Byte offsets of one layer's regions inside a block (relative to the block
// start) and its in-block strides. k_offset and the metadata offsets are
// multiples of 64; v_offset = k_offset + P * slot_stride (V tiles follow
// their head's K tile).
struct KvLayerPlacement {
  int64_t k_offset = 0;     // start of the K region (MLA: latent region)
  int64_t v_offset = -1;    // start of head 0's V tile; -1 for MLA (no V)
  int64_t head_stride = 0;  // bytes between KV heads, K and V tiles (0 for MLA)
  int64_t slot_stride = 0;  // bytes between consecutive slots (tokens)
  int64_t k_bytes = 0;      // K bytes of all heads, before padding
  int64_t v_bytes = 0;      // V bytes of all heads, before padding (0 for MLA)
  int64_t end_offset = 0;   // first byte after this layer's padded regions
  // V strides: v_head_stride == head_stride; v_slot_stride differs from
  // slot_stride when V has another dtype.
  int64_t v_head_stride = 0;
  int64_t v_slot_stride = 0;
  // Quantization metadata regions (kv_codec.h), after the K/V tiles:
  // [n_kv_heads][meta_head_stride] bytes each; offset -1 when absent.
  int64_t k_meta_offset = -1;
  int64_t v_meta_offset = -1;
  int64_t k_meta_head_stride = 0;  // P * meta_row_bytes + meta_block_bytes
  int64_t v_meta_head_stride = 0;
  int64_t k_meta_slot_stride = 0;  // meta_row_bytes (0 for per-block metadata)
  int64_t v_meta_slot_stride = 0;
  int64_t k_meta_block_bytes = 0;  // per (block, head) metadata bytes
  int64_t v_meta_block_bytes = 0;
};

// Layout-wide options.
struct KvLayoutOptions {
  // KIVI layouts: R, the newest tokens of each sequence kept in f16 in the
  // sequence's residual (block_table.h) before their key group is quantized;
  // a multiple of the key group size G (kivi_codec.h). Ignored otherwise.
  int kivi_residual = 128;
};

class KvLayout {
 public:
  static constexpr int kMaxBlockSize = 256;
  static constexpr int64_t kAlign = 64;  // block and region alignment, bytes

  // Validates and lays out `layers` (in model order) with `block_size` tokens
  // per block (a power of two in [1, 256]). Errors name the offending layer
  // and field (kInvalidArgument) or an unsupported combination (kUnsupported).
  static Result<KvLayout> create(std::vector<KvLayerSpec> layers, int block_size,
                                 KvLayoutOptions options = {});

  // Convenience: n_layers identical standard layers (d_k = d_v = head_dim),
  // V in dtype_v when given.
  static Result<KvLayout> uniform(int n_layers, int n_kv_heads, int head_dim, KvDtype dtype,
                                  int block_size, std::optional<KvDtype> dtype_v = std::nullopt,
                                  KvLayoutOptions options = {});

  int n_layers() const { return static_cast<int>(layers_.size()); }
  int block_size() const { return block_size_; }
  // KIVI: key group size G (0 when no layer has a KIVI K or V) and residual R.
  // When G > 0 every layer's new K/V go through the table's f16 residual and
  // reach the blocks only when their group is converted (block_table.h).
  bool has_kivi() const { return kivi_group_ > 0; }
  int kivi_group() const { return kivi_group_; }
  int kivi_residual() const { return kivi_residual_; }
  const KvLayerSpec& layer(int l) const { return layers_[l]; }
  const KvLayerPlacement& placement(int l) const { return placements_[l]; }

  // Bytes of one block: sum over layers of the padded regions; multiple of 64.
  int64_t block_bytes() const { return block_bytes_; }
  // Payload bytes cached per token, summed over layers, without paging or
  // padding: standard 2 * H_kv * d * b (H_kv * (d_k + d_v) * b), MLA
  // (d_c + d_R) * b; quantized formats count codes plus per-token metadata
  // (w/8 + s/g per element, spec section 3). Formats with per-block
  // metadata (fp8) add it per block: payload_bytes(T) is exact for them.
  // For formats without per-block metadata B_KV for T tokens is T * this.
  int64_t payload_bytes_per_token() const { return payload_per_token_; }
  int64_t layer_payload_bytes_per_token(int l) const;
  // Metadata bytes per block that is not per token (fp8 scales), all layers.
  int64_t block_meta_bytes() const { return block_meta_bytes_; }
  // Exact payload of one sequence of n_tokens tokens (starting at a block
  // boundary): n * payload_bytes_per_token() + ceil(n / P) * block_meta_bytes().
  int64_t payload_bytes(int64_t n_tokens) const;

  // View of layer l over a pool whose block 0 starts at `pool_base`.
  // REQUIRES: 0 <= l < n_layers(); pool_base 64-byte aligned.
  PagedKvLayerView layer_view(int l, uint8_t* pool_base) const;

  // True when both layouts address memory identically (same layers, block
  // size and offsets): a block written under one can be read under the other.
  bool same_format(const KvLayout& other) const;

  // This layout with each block padded to `block_bytes` (the extra bytes
  // follow the last layer and are never read): the per-group layouts of one
  // pool share the largest group's block size (kv_groups.h). kInvalidArgument
  // unless block_bytes >= block_bytes() and a multiple of 64.
  Result<KvLayout> padded_to(int64_t block_bytes) const;

 private:
  KvLayout() = default;
  std::vector<KvLayerSpec> layers_;
  std::vector<KvLayerPlacement> placements_;
  int block_size_ = 0;
  int64_t block_bytes_ = 0;
  int64_t payload_per_token_ = 0;
  int64_t block_meta_bytes_ = 0;
  int kivi_group_ = 0;
  int kivi_residual_ = 0;
};

}  // namespace kvstack

// Paged attention over KIVI K and/or V (kv_view_is_kivi(view); kivi_codec.h),
// with each sequence's f16 residual (block_table.h). Same contract as
// paged_attention() in paged_attention.h, plus: positions below a sequence's
// residual start come from the blocks (final quantized form), positions from
// the start on come from its residual rows.
//
// On AVX2, rows run on the shared tile kernels (attention_kernels.h) in
// blocks of 16 query rows: decode_tile_avx2 for a decode row (the blocks'
// keys in split-K pieces of 512 positions, each KIVI key group's codes
// dotted with q * scale, + q . min), prefill_tile_avx2 for more rows (K tiles
// decoded with the group's scale and min); the f16 residual is one more
// piece; the pieces are merged in key order.
//
// The scalar path walks the keys tile by tile: a KIVI key group (G tokens sharing per-channel
// scale/min) or up to 32 residual rows of one KV head are decoded into a [tile, head_dim] float
// tile in L1 (K and V), used there by every query row and q head of the KV head group (online
// softmax), then dropped; no full-precision copy of a block list or of the cache is materialised.
// Work is split over (sequence, KV head, block of 16 query rows).
//
// The scalar path decodes with the kivi_codec.h reference decoders. The
// AVX2 kernels decode K tiles (prefill) and V the same way, fma(scale, code,
// min), while decode applies a K group's scale and min to q instead: the
// paths differ by float rounding and accumulation order. A non-KIVI side
// (e.g. K kivi2, V int8) is read as that format always is, except that int4
// keys keep the float query here (their rows run on the prefill kernel).
#pragma once

#include <span>

#include "attention/paged_attention.h"
#include "core/cpu_features.h"
#include "kv/kv_view.h"

namespace kvstack {

// residuals: empty (every position is in the blocks) or one per sequence, in
// batch order; sequence i's residual must end at n_past + n_new and start at a
// multiple of the view's kivi_group. Errors (kInvalidArgument) name the field
// and sequence; nothing is written on error.
Status paged_attention_kivi(const PagedKvLayerView& kv, const AttnParams& p,
                            std::span<const AttnSeq> seqs,
                            std::span<const KvResidualView> residuals, ThreadPool* pool);

// Same, forcing the kernel ISA (clamped to what the CPU has).
Status paged_attention_kivi_isa(Isa isa, const PagedKvLayerView& kv, const AttnParams& p,
                                std::span<const AttnSeq> seqs,
                                std::span<const KvResidualView> residuals, ThreadPool* pool);

// Double-precision two-pass reference reading every key/value through the
// reference decoders (blocks) or the residual (f16).
Status paged_attention_kivi_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                      std::span<const AttnSeq> seqs,
                                      std::span<const KvResidualView> residuals);

// The checks paged_attention_kivi() runs.
Status validate_kivi_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                                    std::span<const AttnSeq> seqs,
                                    std::span<const KvResidualView> residuals);

}  // namespace kvstack

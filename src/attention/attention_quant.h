// Paged attention over quantized (fp8, int8, int4) or mixed-dtype K/V
// (kv_view_is_quantized(view)). Same contract as paged_attention() in
// paged_attention.h, which forwards such views here.
//
// The same planner, split-K and kernels serve every format
// (attention_kernels.h). The kernels consume the stored codes directly; no
// full-precision copy of a block list or of the cache is ever materialised.
// Decode computes q . K on the raw codes and applies the per-token (int8),
// per-block (fp8) or per-group (int4) scale once per key after the dot; for V
// the scale is folded into the softmax weight. Prefill decodes each chunk of
// 32 keys of one KV head (scales applied, bit for bit as kv_decode_row) into
// L1 tiles used by every query vector of the tile. The scalar kernel decodes
// rows with the kv_codec.h reference decoders.
#pragma once

#include <span>

#include "attention/paged_attention.h"
#include "core/cpu_features.h"

namespace kvstack {

// REQUIRES nothing beyond paged_attention(); errors name the field at fault.
Status paged_attention_quant(const PagedKvLayerView& kv, const AttnParams& p,
                             std::span<const AttnSeq> seqs, ThreadPool* pool);

// Same, forcing the kernel ISA (clamped to what the CPU has); for tests and
// benchmarks.
Status paged_attention_quant_isa(Isa isa, const PagedKvLayerView& kv, const AttnParams& p,
                                 std::span<const AttnSeq> seqs, ThreadPool* pool);

// Double-precision two-pass reference reading K/V through kv_decode_row().
Status paged_attention_quant_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                       std::span<const AttnSeq> seqs);

// The checks paged_attention_quant() runs.
Status validate_quant_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                                     std::span<const AttnSeq> seqs);

}  // namespace kvstack

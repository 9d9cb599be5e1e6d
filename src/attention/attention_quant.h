// Paged attention over quantized (fp8, int8, int4) or mixed-dtype K/V
// (kv_view_is_quantized(view)). Same contract as paged_attention() in
// paged_attention.h, which forwards such views here.
//
// The kernels consume the stored codes directly: each chunk of 32 key
// positions of one KV head is decoded (scales applied) into a 32 x head_dim
// tile in L1 (K transposed, V row-major) and used there by every query vector
// of the tile; no full-precision copy of a block list or of the cache is ever
// materialised. Decode splits long sequences along the keys (split-K) and
// merges the partial softmax states, like the float path.
//
// Scalar kernels decode rows with the kv_codec.h reference decoders; the
// AVX2+FMA+F16C kernels decode in registers (fp8 via the E4M3 -> f16 bit
// shift, int8/int4 via integer widening and FMA) and produce the same K/V
// values bit for bit, so the two paths differ only in accumulation order.
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

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
//
// Decode rows (a sequence with n_new == 1) over int4 keys (and over int8
// keys on the AVX-512 VNNI decode kernel, attention_kernels_avx512.cpp)
// attend with a rounded query: the query, already multiplied by the attention scale, is
// rounded to int8 codes per group of 32 elements (round_query_int8), as
// llama.cpp rounds activations to q8_0 for its q4_0 dot products. The AVX2
// kernel then dots the int4 key codes with the int8 query codes in integer
// arithmetic (vpmaddubsw), four times as many products per instruction as
// float FMAs. Scores are q^ . k with q^ = code * group scale; the kernels,
// the scalar one included, and the reference all use the same q^. Prefill
// rows keep the float query, and so do int4 keys beside a KIVI V
// (attention_kivi.h, which runs their rows on the prefill kernel).
#pragma once

#include <cstdint>
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

struct QuantReferenceOptions {
  // Decode rows over int8 keys use q^ too, as the AVX-512 VNNI decode kernel
  // does (int4 keys always do).
  bool round_int8_query = false;
};

// Double-precision two-pass reference reading K/V through kv_decode_row();
// decode rows over int4 keys (and, with opt.round_int8_query, int8 keys) use
// q^ (round_query_int8), as the kernels do.
Status paged_attention_quant_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                       std::span<const AttnSeq> seqs,
                                       const QuantReferenceOptions& opt = {});

// Elements per query rounding group.
inline constexpr int kQueryGroup = 32;

// q^ of a decode row over int4 keys: for each group of kQueryGroup elements
// of qs [d] (the query times the attention scale; REQUIRES d % 32 == 0),
// group_scale[g] = amax / 127 and codes[i] = nearbyint(qs[i] * (127 / amax))
// in [-127, 127], so q^[i] = codes[i] * group_scale[g]. An all-zero group
// gets scale 0 and zero codes; a group holding an infinity or a NaN gets a
// NaN scale and zero codes (so the scores are NaN, as a float dot would
// make them).
void round_query_int8(const float* qs, int d, int8_t* codes, float* group_scale);

// The checks paged_attention_quant() runs.
Status validate_quant_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                                     std::span<const AttnSeq> seqs);

}  // namespace kvstack

// Layout conversion of transferred KV blocks (kv-cache-spec.md section 10:
// "layouts that differ between the sides need an explicit conversion
// step"). A decode worker whose pool differs from the prefill worker's in
// block size and/or KV dtype reads the producer's blocks into a staging
// buffer, checks their records under the producer's identity, and rewrites
// the tokens into its own blocks, layer by layer, through the scalar
// reference decoder (read_kv) and its own encoder (write_kv).
//
// Which pairs convert (per layer, for K and for V separately):
//   - same float dtype (f32, f16, bf16), any block size: rows are decoded
//     and re-encoded unchanged (exact);
//   - f16 or bf16 -> f32: exact widening;
//   - f32 -> f16 / bf16: this worker's own encoder (round to nearest even)
//     applied to the producer's values, exactly what its own prefill stores
//     from the same f32 activations.
// Refused (a clear kUnsupported): f16 <-> bf16 (neither holds the other's
// values: bf16 has 8 significant bits, f16 5 exponent bits; the result
// would match neither side's own prefill), any quantized format (fp8,
// int8, int4, KIVI: their scales are per block or per group of tokens, so a
// different block size or dtype means re-quantizing decoded values, and the
// same quantized format needs the same block size, which is no
// conversion), a different model geometry (layers, heads, dims, kind,
// window) and models with several KV groups (hybrid window models).
//
// Thread-safety: plain functions over caller-owned memory.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/result.h"
#include "kv/layout.h"
#include "kv/prefix_index.h"

namespace kvstack::transfer {

// The producer's layout from its kv_format string (kv_format_key): this
// worker's layer geometry with the block size and the per-layer K/V dtypes
// named there. kUnsupported when the string does not describe such a
// layout exactly (another geometry, or anything kv_format_key of the
// rebuilt layout does not reproduce byte for byte).
Result<KvLayout> producer_layout(const KvLayout& local, const std::string& kv_format);

// OK when every layer of `src` converts to `dst` (the pairs above); else
// kUnsupported naming the layer and the two dtypes.
Status check_convertible(const KvLayout& src, const KvLayout& dst);

// Rewrites tokens [pos, pos + n_tokens) of every layer from blocks laid out
// as `src` (block table src_table, over src_base) into blocks laid out as
// `dst` (dst_table over dst_base): token t goes from src block
// src_table[t / P_src] slot t % P_src to dst block dst_table[t / P_dst]
// slot t % P_dst. REQUIRES check_convertible(src, dst) ok; both bases
// 64-byte aligned; both tables cover the range with valid ids.
void convert_kv_blocks(const KvLayout& src, uint8_t* src_base, std::span<const int32_t> src_table,
                       const KvLayout& dst, uint8_t* dst_base, std::span<const int32_t> dst_table,
                       int64_t pos, int64_t n_tokens);

// The chained hash the prefix index gives a block of tokens.size() tokens
// (no extra keys) under parent hash `parent` in a namespace of root digest
// `ns_digest` (PrefixIndex::chain_hash for an index of that block size):
// what a producer with another block size put in its records.
Hash128 block_chain_hash(const Hash128& parent, const Hash128& ns_digest,
                         std::span<const int32_t> tokens);

}  // namespace kvstack::transfer

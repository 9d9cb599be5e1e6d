// Writing freshly computed K/V rows into paged storage.
#pragma once

#include <cstdint>
#include <span>

#include "core/cpu_features.h"
#include "core/result.h"
#include "kv/kv_view.h"

namespace kvstack {

// Stores tokens [pos, pos + n_tokens) of one layer: token t goes to block
// block_table[t / P], slot t % P, converted from float32 to view.dtype
// (f16: IEEE round-to-nearest-even, bf16: round-to-nearest-even, both
// bit-identical to core/half.h); V to view.value_dtype().
//
// Quantized formats (kv_codec.h) encode each (token, head) row with the
// scalar reference encoders. fp8 keeps one power-of-two scale per (block,
// head): the first write to slot 0 of a block sets it, and a later row that
// needs a larger scale re-encodes the block's earlier slots of that head
// (an exact exponent shift except for values pushed into E4M3 subnormals).
// So a partial block may change while the sequence appends to it; a full
// block, the only kind that is ever shared, never changes again.
// Quantized formats never store NaN/Inf or values beyond their metadata
// range: write_kv aborts with a message naming the position, head and
// element; try_write_kv returns kInvalidArgument and writes nothing.
// k_rows, v_rows: [n_tokens, n_kv_heads, head_dim] float32, row-major.
// v_rows is ignored (may be null) when view.v is null (MLA latent layer).
// REQUIRES: pos >= 0, (pos + n_tokens) <= block_table.size() * P, table
// entries valid ids of the view's pool (checked with KV_CHECK; the view
// itself is trusted, it comes from BlockPool::layer_view).
void write_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
              const float* k_rows, const float* v_rows, int64_t n_tokens);
Status try_write_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
                    const float* k_rows, const float* v_rows, int64_t n_tokens);

// The validation try_write_kv does (nothing to check for float formats).
Status validate_kv_rows(const PagedKvLayerView& view, int64_t pos, const float* k_rows,
                        const float* v_rows, int64_t n_tokens);

// KIVI (kivi_codec.h): a KIVI K is quantized per channel over groups of G =
// view.kivi_group tokens, so it is written in whole groups only: REQUIRES
// pos % G == 0 and n_tokens % G == 0 (BlockTable converts its residual one
// group at a time). A KIVI V is per token like int4.

// Decodes tokens [pos, pos + n_tokens) of one layer back to float32 with the
// scalar reference decoders (tests, and re-expanding a partly adopted KIVI
// group into a residual). k_rows, v_rows: [n_tokens, n_kv_heads, head_dim];
// v_rows unused when view.v is null.
void read_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
             int64_t n_tokens, float* k_rows, float* v_rows);

// Same, forcing an ISA level (tests and benchmarks compare paths); `isa` is
// clamped to what the CPU supports.
void write_kv_isa(Isa isa, const PagedKvLayerView& view, std::span<const int32_t> block_table,
                  int64_t pos, const float* k_rows, const float* v_rows, int64_t n_tokens);

// Row converters used above, exposed for tests: dst[i] = convert(src[i]).
// dst is [n] elements of `dtype` (unaligned is fine).
void convert_f32_row(Isa isa, KvDtype dtype, const float* src, void* dst, int64_t n);

}  // namespace kvstack

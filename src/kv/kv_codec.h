// Quantized KV formats (fp8, int8, int4): row geometry, scalar reference
// encoders/decoders and input validation. The attention kernels
// (attention/attention_quant_*.cpp) decode the same bytes in registers; these
// functions are the reference every SIMD path is tested against.
//
// Row layouts, per (token, KV head) of head_dim d (kv_view.h gives where a
// row and its metadata live in a block):
//   fp8   codes: d bytes, E4M3 (1 sign, 4 exponent bits with bias 7, 3
//         mantissa bits; subnormals; max finite 448; 0x7f/0xff are NaN and
//         never written). Metadata per (block, head): f32 scale, a power of
//         two (0 while every value so far was zero). x = scale * e4m3(code).
//   int8  codes: d bytes, two's complement in [-127, 127]. Metadata per
//         (token, head): f16 scale s >= amax / 127. x = s * code.
//   int4  codes: d / 2 bytes in groups of 32 elements; byte j of group g
//         holds element 32g + j in its low nibble and 32g + 16 + j in its high
//         nibble. Metadata per (token, head): d / 32 pairs (f16 scale, f16
//         min). x = fma(scale, code, min), code in [0, 15].
#pragma once

#include <cstdint>

#include "core/cpu_features.h"
#include "core/result.h"
#include "kv/kv_view.h"

namespace kvstack {

// Bytes one format stores for one KV head.
struct KvRowGeometry {
  int64_t row_bytes = 0;         // codes (or elements) per token
  int64_t meta_row_bytes = 0;    // metadata per token
  int64_t meta_block_bytes = 0;  // metadata per block (independent of P)
};

// Errors (kUnsupported) when the format cannot store rows of head_dim
// elements (int4 needs head_dim % 32 == 0).
Result<KvRowGeometry> kv_row_geometry(KvDtype dtype, int head_dim);

// Exact bytes one KV head of `n_tokens` tokens occupies in a sequence that
// starts at a block boundary: n * (row + meta_row) + ceil(n / P) * meta_block.
int64_t kv_head_bytes(const KvRowGeometry& g, int64_t n_tokens, int block_size);

// Checks that `n` values can be stored in `dtype`: every value finite, and
// within what the format can represent (int8/int4: their f16 metadata;
// f16/bf16: no value that would round to Inf; fp8 and f32: any finite
// value). The message names the first offending element ("element 5 is
// nan"); the caller adds where it was (layer, position, head).
Status kv_validate_values(KvDtype dtype, const float* x, int64_t n);

// Checks the K/V rows of tokens [pos, pos + n_tokens) that are about to be
// written into `view` with kv_validate_values (every dtype, float formats
// included: a NaN/Inf or overflowing row is never stored). Writes nothing.
// k_rows, v_rows: [n_tokens, n_kv_heads, head_dim] float32; v_rows is not
// read when view.v is null. Errors (kInvalidArgument) name the tensor,
// position, head and element: "K of position 17, head 2: element 5 is nan;
// ...". REQUIRES a standard (non-MLA) layer view.
Status kv_validate_rows(const PagedKvLayerView& view, int64_t pos, const float* k_rows,
                        const float* v_rows, int64_t n_tokens);

// ---- fp8 E4M3 ----
// Round to nearest even; |x| beyond 448 saturates to +-448. REQUIRES finite x.
uint8_t fp8_e4m3_from_f32(float x);
float fp8_e4m3_to_f32(uint8_t code);
// Smallest power of two s with amax / s <= 448 (0 for amax == 0).
// REQUIRES amax finite and >= 0.
float fp8_scale_for(float amax);
// codes[i] = e4m3(x[i] / scale) (0 when scale == 0).
void fp8_encode_row(const float* x, int d, float scale, uint8_t* codes);

// ---- int8 / int4 ----
// REQUIRES kv_validate_values() passed for the row.
void int8_encode_row(const float* x, int d, uint8_t* codes, uint8_t* meta);
void int4_encode_row(const float* x, int d, uint8_t* codes, uint8_t* meta);

// Asymmetric quantization of n <= kAsymQuantMaxN values (stride apart) to
// codes q[i] in [0, 2^bits - 1] with f16 scale and min, decoded as
// fma(s, q, m): of the min-max fit (min rounded down, scale up: no code
// clamps) and the least-squares (s, m) refits of the codes of ranges
// stretched or shrunk by up to one step, the one with the smallest squared
// error (llama.cpp's k-quants search similarly). Never worse than min-max;
// one value may be off by more than half a step (clipped outliers). Used
// by int4 (groups of 32 channels) and KIVI (kivi_codec.h). REQUIRES finite
// x within the f16 range, 1 <= bits <= 8.
inline constexpr int kAsymQuantMaxN = 64;
void asym_quant_fit(int bits, const float* x, int64_t stride, int n, uint16_t* scale, uint16_t* min,
                    uint8_t* q);
// The same with the ISA chosen by the caller (tests): kAvx2 and above run the
// per-element loops with AVX2 when the CPU has it, and kAvx512 runs the search's
// candidates side by side in AVX-512 lanes when the CPU has AVX-512F/VL
// (kv_codec_avx512.h); every path is bit-identical to kScalar.
void asym_quant_fit_isa(Isa isa, int bits, const float* x, int64_t stride, int n, uint16_t* scale,
                        uint16_t* min, uint8_t* q);

// Scalar reference decoder for every dtype: out[i] = value of element i of
// the row at `row` whose metadata is at `meta` (fp8: the block's f32 scale;
// float formats: unused).
void kv_decode_row(KvDtype dtype, const uint8_t* row, const uint8_t* meta, int d, float* out);

// Encodes one row of a per-token format (float formats, int8, int4) from
// float32 (scalar reference). REQUIRES validated input; not for fp8, whose
// scale is per block (kv_write.cpp handles it).
void kv_encode_row(KvDtype dtype, const float* x, int d, uint8_t* row, uint8_t* meta);

}  // namespace kvstack

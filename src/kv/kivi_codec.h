// KIVI quantized KV formats (kivi2, kivi4): geometry, scalar reference
// encoders/decoders and input validation. The attention kernels
// (attention/attention_kivi*.cpp) decode the same bytes; these functions are
// the reference every SIMD path is tested against.
//
// Asymmetric quantization, q = clamp(round((x - m) / s), 0, 2^w - 1),
// x_hat = fma(s, q, m), with s and m stored as f16 and chosen per group by
// asym_quant_fit() (kv_codec.h): the smallest squared error among the
// min-max fit and least-squares refits, so a clipped outlier may be off by
// more than s / 2 while the group's total error is never above min-max's.
//   keys    one group = G consecutive tokens of one channel of one KV head
//           (KIVI: key outliers are channel-wise). Metadata per (block, head):
//           [P / G][head_dim] pairs (f16 scale, f16 min).
//   values  one group = 32 consecutive channels of one token of one head.
//           Metadata per (token, head): [head_dim / 32] pairs (scale, min).
// Codes of one (token, head) row: head_dim * w / 8 bytes in chunks of 32
// elements; a chunk is 4w bytes and byte j of a chunk holds element
// j + k * 4w at bits [k w, (k + 1) w) for k in [0, 8 / w). (For w = 4 this is
// the int4 nibble order of kv_codec.h.)
//
// Group size G = min(32, P). 32 tokens is the KIVI paper's key group and
// amortises the 4 metadata bytes of a channel group to 0.125 byte per
// element (as the value groups do); G must divide the block so that a group
// never spans two blocks, which a block size of 16 (the default) forces down
// to 16. Bytes per element (spec w/8 + s/g): keys w/8 + 4/G, values
// w/8 + 4/32: kivi2 0.375 / 0.375 at P >= 32, 0.5 / 0.375 at P = 16.
#pragma once

#include <cstdint>

#include "core/result.h"
#include "kv/kv_codec.h"
#include "kv/kv_view.h"

namespace kvstack {

inline constexpr int kKiviValueGroup = 32;  // channels per value group
inline constexpr int kKiviMaxKeyGroup = 32;

// G for a block size P (a power of two): min(32, P).
inline int kivi_group_size(int block_size) {
  return block_size < kKiviMaxKeyGroup ? block_size : kKiviMaxKeyGroup;
}

// Geometry of a KIVI K or V of one KV head (kUnsupported unless
// head_dim % 32 == 0; kInvalidArgument for a non-KIVI dtype).
Result<KvRowGeometry> kivi_key_geometry(KvDtype dtype, int head_dim, int block_size);
Result<KvRowGeometry> kivi_value_geometry(KvDtype dtype, int head_dim);

// Every value finite and within the f16 range of the metadata (|x| <= 65504).
// The message names the first offending element.
Status kivi_validate_values(const float* x, int64_t n);

// Unpacks one row of d codes (d % 32 == 0) into out[d] in [0, 2^bits).
void kivi_unpack_codes(int bits, const uint8_t* codes, int d, uint8_t* out);
// Packs d codes (each < 2^bits) into d * bits / 8 bytes.
void kivi_pack_codes(int bits, const uint8_t* q, int d, uint8_t* codes);

// Keys: quantizes n_tokens (1..G) tokens of one head, token t's d values at
// x + t * x_stride, per channel over the tokens. Token t's codes go to
// codes + t * code_stride; meta receives d (f16 scale, f16 min) pairs.
// REQUIRES validated input, d % 32 == 0.
void kivi_encode_key_group(int bits, const float* x, int64_t x_stride, int n_tokens, int d,
                           uint8_t* codes, int64_t code_stride, uint8_t* meta);
// Decodes one token row of a key group whose metadata is `meta` (d pairs).
void kivi_decode_key_row(int bits, const uint8_t* codes, const uint8_t* meta, int d, float* out);

// Values: one (token, head) row of d values; meta receives d / 32 pairs.
void kivi_encode_value_row(int bits, const float* x, int d, uint8_t* codes, uint8_t* meta);
void kivi_decode_value_row(int bits, const uint8_t* codes, const uint8_t* meta, int d, float* out);

}  // namespace kvstack

// Plain, non-owning views of paged KV storage handed to attention kernels.
// The block pool produces them; kernels assume they were validated.
#pragma once

#include <cstdint>

namespace kvstack {

// Element format of cached K or V. Float formats (f32, f16, bf16) store one
// element per `kv_dtype_bytes` bytes and no metadata. Quantized formats
// (kv_codec.h has their encoders/decoders and exact geometry) store codes in
// the data region plus scales in a per-block metadata region; each declares
// its bytes per element including metadata, w/8 + s/g (spec section 3):
//   kFp8   E4M3 codes; one f32 power-of-two scale per (block, KV head)
//          (1 + 4 / (P * d) bytes per element)
//   kInt8  symmetric int8; one f16 scale per (token, KV head) (1 + 2/d)
//   kInt4  asymmetric 4-bit, groups of 32 along head_dim, f16 scale + f16
//          min per group (0.5 + 4/32 = 0.625); REQUIRES head_dim % 32 == 0
//   kKivi2, kKivi4 (kivi_codec.h; not per-row formats): asymmetric
//          2/4-bit; as K, per channel over groups of G tokens, as V per token
//          in groups of 32 along head_dim; f16 scale + f16 min per group.
enum class KvDtype : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kFp8 = 3,
  kInt8 = 4,
  kInt4 = 5,
  kKivi2 = 6,  // KIVI (kivi_codec.h): 2- or 4-bit codes, keys per channel over
  kKivi4 = 7,  // groups of tokens, values per token; not a per-row format
};

// The KIVI formats under their historical names.
inline constexpr KvDtype kKvDtypeKivi2 = KvDtype::kKivi2;
inline constexpr KvDtype kKvDtypeKivi4 = KvDtype::kKivi4;

inline bool kv_dtype_is_kivi(KvDtype t) {
  return t == kKvDtypeKivi2 || t == kKvDtypeKivi4;
}
// Code width in bits of a KIVI format (0 for others).
inline int kv_dtype_kivi_bits(KvDtype t) {
  return t == kKvDtypeKivi2 ? 2 : (t == kKvDtypeKivi4 ? 4 : 0);
}

inline bool kv_dtype_is_quantized(KvDtype t) {
  return t == KvDtype::kFp8 || t == KvDtype::kInt8 || t == KvDtype::kInt4 || kv_dtype_is_kivi(t);
}
// Bytes per element of a float format (the code width for fp8/int8: 1; int4
// has no whole-byte width and returns 0). Metadata is not included.
inline int kv_dtype_bytes(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return 4;
    case KvDtype::kF16:
    case KvDtype::kBF16:
      return 2;
    case KvDtype::kFp8:
    case KvDtype::kInt8:
      return 1;
    case KvDtype::kInt4:
    case KvDtype::kKivi2:
    case KvDtype::kKivi4:
      return 0;
  }
  return 0;
}
const char* kv_dtype_name(KvDtype t);

// One layer's K and V inside the block pool. Element (block b, kv head h,
// slot s, dim i) of K is at
//   k + b * block_stride + h * head_stride + s * slot_stride + i * elem_bytes
// (all strides in bytes), and likewise for V. Slot s of block table entry j
// holds logical position j * block_size + s.
//
// When K and V use different dtypes (v_distinct), V's dtype and strides are
// v_dtype, v_head_stride and v_slot_stride instead; otherwise those fields
// are unused (views built by hand need not set them).
//
// Quantized formats: the row of (b, h, s) holds the codes (kv_codec.h gives
// the row layout) and its metadata is at
//   k_meta + b * block_stride + h * k_meta_head_stride + s * k_meta_slot_stride
// (k_meta_slot_stride is 0 for per-block metadata, fp8), likewise for V.
// Float formats have null meta pointers.
struct PagedKvLayerView {
  uint8_t* k = nullptr;  // [n_blocks] x (strided) [n_kv_heads, block_size, head_dim]
  uint8_t* v = nullptr;  // same shape as k
  int64_t block_stride = 0;
  int64_t head_stride = 0;
  int64_t slot_stride = 0;
  KvDtype dtype = KvDtype::kF32;  // K's dtype, and V's unless v_distinct
  int block_size = 16;
  int n_kv_heads = 0;
  int head_dim = 0;
  bool v_distinct = false;
  KvDtype v_dtype = KvDtype::kF32;
  int64_t v_head_stride = 0;
  int64_t v_slot_stride = 0;
  // Quantization metadata (null for float formats).
  uint8_t* k_meta = nullptr;
  uint8_t* v_meta = nullptr;
  int64_t k_meta_head_stride = 0;
  int64_t k_meta_slot_stride = 0;
  int64_t v_meta_head_stride = 0;
  int64_t v_meta_slot_stride = 0;
  // KIVI (kivi_codec.h): G, the tokens per key group (divides block_size);
  // 0 when neither K nor V is a KIVI format. A KIVI K's metadata for the
  // group of slot s is at k_meta + b * block_stride + h * k_meta_head_stride
  // + (s / G) * head_dim * 4: head_dim (f16 scale, f16 min) pairs.
  int kivi_group = 0;

  KvDtype value_dtype() const { return v_distinct ? v_dtype : dtype; }
  int64_t value_head_stride() const { return v_distinct ? v_head_stride : head_stride; }
  int64_t value_slot_stride() const { return v_distinct ? v_slot_stride : slot_stride; }
};

// One sequence's f16 residual of one layer (KIVI layouts, block_table.h):
// positions [start, start + n_tokens) live here, not yet in the blocks;
// positions < start are in the blocks in their final quantized form.
struct KvResidualView {
  const uint16_t* k = nullptr;  // [n_tokens, n_kv_heads, head_dim] f16
  const uint16_t* v = nullptr;  // same shape (null for MLA)
  int64_t start = 0;
  int64_t n_tokens = 0;
};

// True when K or V is a KIVI format (attention/attention_kivi.h).
inline bool kv_view_is_kivi(const PagedKvLayerView& v) {
  return kv_dtype_is_kivi(v.dtype) || kv_dtype_is_kivi(v.value_dtype());
}

// True when the view needs the quantized/mixed attention path
// (attention/attention_quant.h): a quantized K or V, or K and V stored in
// different dtypes.
inline bool kv_view_is_quantized(const PagedKvLayerView& v) {
  return kv_dtype_is_quantized(v.dtype) || kv_dtype_is_quantized(v.value_dtype()) ||
         v.value_dtype() != v.dtype;
}

}  // namespace kvstack

// Internal tile kernels behind paged_attention_quant(); not a public API.
// A tile is (sequence, KV head, run of query rows, key range), as in
// attention_kernels.h; here K and V each carry their own format and metadata.
#pragma once

#include <cstdint>

#include "kv/kv_view.h"

namespace kvstack::attn_quant {

// One stream (K or V) of one KV head.
struct HeadStream {
  const uint8_t* data = nullptr;  // view.k + kv_head * head_stride (or V's)
  const uint8_t* meta = nullptr;  // view.k_meta + kv_head * k_meta_head_stride; null for floats
  int64_t slot_stride = 0;        // bytes between rows of one block
  int64_t meta_slot_stride = 0;   // bytes between rows' metadata (0: per-block metadata)
  KvDtype dtype = KvDtype::kF32;
};

struct QuantTileArgs {
  HeadStream k;
  HeadStream v;
  const int32_t* block_table = nullptr;
  int64_t block_stride = 0;
  int block_size = 0;
  int head_dim = 0;
  const float* q = nullptr;  // vector (r, g) at q + r * row_stride + g * head_dim
  float* out = nullptr;      // same layout as q; used when part_acc is null
  int64_t row_stride = 0;
  int n_rows = 0;
  int group = 0;
  int32_t pos0 = 0;
  int window = 0;
  int32_t key_begin = 0;
  int32_t key_end = 0;
  float scale = 0.0f;
  float* part_m = nullptr;  // split-K partial state [n_rows * group] (or all null)
  float* part_l = nullptr;
  float* part_acc = nullptr;  // [n_rows * group, head_dim]
};

// Row and metadata addresses of logical position t.
inline const uint8_t* stream_row(const QuantTileArgs& a, const HeadStream& s, int32_t t) {
  return s.data + a.block_table[t / a.block_size] * a.block_stride +
         (t % a.block_size) * s.slot_stride;
}
inline const uint8_t* stream_meta(const QuantTileArgs& a, const HeadStream& s, int32_t t) {
  if (s.meta == nullptr) return nullptr;
  return s.meta + a.block_table[t / a.block_size] * a.block_stride +
         (t % a.block_size) * s.meta_slot_stride;
}

void quant_tile_scalar(const QuantTileArgs& a);
// REQUIRES head_dim % 8 == 0 and AVX2+FMA+F16C.
void quant_tile_avx2(const QuantTileArgs& a);         // any n_rows (prefill: L1 tiles)
void quant_decode_tile_avx2(const QuantTileArgs& a);  // n_rows == 1, decoded in registers

}  // namespace kvstack::attn_quant

// Internal tile functions behind mla_attention()'s SIMD path (AVX2 and
// AVX-512, mla_attention_simd.cpp); not part of the public API.
//
// The driver (mla_attention.cpp) walks a query row's keys in tiles of at
// most kMlaTile consecutive positions. Each tile's latent rows are decoded
// once (stored dtype -> f32, int8's per-row scale applied: the fused
// dequant, tile by tile, never a copy of the cache) into an L1 buffer
// [n][dpad] that every one of the H query heads then reads: one latent
// shared by all heads, nothing replicated per head.
#pragma once

#include <cstdint>

#include "attention/paged_attention.h"
#include "core/cpu_features.h"
#include "kv/kv_view.h"

namespace kvstack::mla_detail {

inline constexpr int kMlaTile = 16;  // keys per tile

// Floats per padded row: d rounded up to a multiple of 16 (one AVX-512
// vector, two AVX2 vectors), so the tile functions never need tails.
inline int mla_pad(int d) {
  return (d + 15) / 16 * 16;
}

struct MlaTileFns {
  // buf[j][0 .. dpad) = decoded row j (rows[j]: the stored row of d elements;
  // metas[j]: its int8 f16 scale, unused for float dtypes), zero past d.
  void (*decode)(KvDtype dt, const uint8_t* const* rows, const uint8_t* const* metas, int n, int d,
                 int dpad, float* buf);
  // s[h * kMlaTile + j] = scale * (q[h] . buf[j]) for h < H, j < n;
  // q: [H][dpad] (zero past d).
  void (*scores)(const float* q, const float* buf, int H, int n, int dpad, float scale, float* s);
  // Online softmax over the tile, per head h: s[h * kMlaTile + j] (j < n)
  // becomes e^(s - m_new) (0 for j >= n), m[h] the new running max, l[h] the
  // running sum rescaled and increased, f[h] = e^(m_old - m_new) (0 while
  // m_old is -inf).
  void (*softmax)(float* s, int H, int n, float* m, float* l, float* f);
  // acc[h][0 .. dcpad) = f[h] * acc[h] + sum_j w[h * kMlaTile + j] buf[j][0 .. dcpad);
  // acc: [H][dcpad], dcpad = mla_pad(d_c) <= dpad.
  void (*accum)(const float* w, const float* buf, int H, int n, int dpad, int dcpad, const float* f,
                float* acc);
  // The expanded form's up-projection (mla_attention_expanded.cpp), a plain
  // f32 GEMM: out[t][o] = sum_k c[t][k] wt[k][o] for t < m, o in [o0, o1);
  // c: [m][k] (row stride k), wt: [k][ldw], out: [m][ldw]. o0 and o1 are
  // multiples of kMlaGemmCols (o1 <= ldw). Column blocks outside, the m rows
  // inside, so a block of wt stays in cache while every row passes.
  void (*gemm)(const float* c, int m, int k, const float* wt, int ldw, int o0, int o1, float* out);
  // out[i] = f16(x[i]) for i < n, round to nearest even (as f32_to_f16).
  void (*to_f16)(const float* x, int n, uint16_t* out);
};

inline constexpr int kMlaGemmCols = 64;  // columns per gemm block (4 AVX-512 vectors)

// The tile functions of exactly `isa` (kAvx2 or kAvx512); null for kScalar
// and when the CPU lacks the ISA.
const MlaTileFns* mla_tile_fns(Isa isa);

// Row j (logical token) of a sequence in a latent layer: its stored bytes,
// and its int8 scale (null for a float latent).
inline const uint8_t* row_at(const PagedKvLayerView& v, const AttnSeq& s, int32_t j) {
  const int32_t blk = s.block_table[j / v.block_size];
  return v.k + static_cast<int64_t>(blk) * v.block_stride +
         static_cast<int64_t>(j % v.block_size) * v.slot_stride;
}
inline const uint8_t* meta_at(const PagedKvLayerView& v, const AttnSeq& s, int32_t j) {
  if (v.k_meta == nullptr) return nullptr;
  const int32_t blk = s.block_table[j / v.block_size];
  return v.k_meta + static_cast<int64_t>(blk) * v.block_stride +
         static_cast<int64_t>(j % v.block_size) * v.k_meta_slot_stride;
}

}  // namespace kvstack::mla_detail

// Portable tile kernel for every K/V format: each K/V row is decoded once
// with the kv_codec.h reference decoder into a head_dim buffer and used by
// every query vector of the tile; one online softmax per query vector, float
// accumulation.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_quant.h"
#include "core/half.h"
#include "kv/kv_codec.h"

namespace kvstack::attn_detail {

ScratchBuffer& thread_scratch() {
  thread_local ScratchBuffer scratch;
  return scratch;
}

void chunk_slots(const TileArgs& a, int32_t t0, int n, int64_t* base, int32_t* slot) {
  int32_t blk = t0 / a.block_size;
  int32_t off = t0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    base[j] = a.block_table[blk] * a.block_stride;
    slot[j] = off;
    if (++off == a.block_size) {
      off = 0;
      ++blk;
    }
  }
}

void tile_scalar(const TileArgs& a) {
  const int d = a.head_dim;
  const int n_vec = a.n_rows * a.group;
  // qs [n_vec, d] (pre-scaled), acc [n_vec, d], m, l [n_vec], k, v [d].
  float* qs = thread_scratch().get(static_cast<size_t>(n_vec) * (2 * d + 2) + 2 * d);
  float* acc = qs + static_cast<size_t>(n_vec) * d;
  float* m = acc + static_cast<size_t>(n_vec) * d;
  float* l = m + n_vec;
  float* krow = l + n_vec;
  float* vrow = krow + d;
  std::vector<int8_t> codes(a.round_query ? d : 0);
  std::vector<float> gscale(a.round_query ? d / kQueryGroup : 0);
  for (int i = 0; i < n_vec; ++i) {
    const float* src = a.q + (i / a.group) * a.row_stride + (i % a.group) * d;
    for (int c = 0; c < d; ++c) qs[i * d + c] = src[c] * a.scale;
    if (a.round_query) {  // q^ = code * group scale
      round_query_int8(qs + static_cast<size_t>(i) * d, d, codes.data(), gscale.data());
      for (int c = 0; c < d; ++c) qs[i * d + c] = codes[c] * gscale[c / kQueryGroup];
    }
    std::memset(acc + static_cast<size_t>(i) * d, 0, sizeof(float) * d);
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  const int32_t pos_last = a.pos0 + a.n_rows - 1;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, pos_last + 1);
  for (int32_t t = t_begin; t < t_end; ++t) {
    kv_decode_row(a.k.dtype, stream_row(a, a.k, t), stream_meta(a, a.k, t), d, krow);
    kv_decode_row(a.v.dtype, stream_row(a, a.v, t), stream_meta(a, a.v, t), d, vrow);
    for (int i = 0; i < n_vec; ++i) {
      const int32_t pos = a.pos0 + i / a.group;
      if (t > pos || t < first_visible(pos, a.window)) continue;
      const float* qi = qs + static_cast<size_t>(i) * d;
      float s = 0.0f;
      for (int c = 0; c < d; ++c) s += qi[c] * krow[c];
      float* ai = acc + static_cast<size_t>(i) * d;
      float p = 1.0f;
      if (s > m[i]) {
        const float corr = std::exp(m[i] - s);
        for (int c = 0; c < d; ++c) ai[c] *= corr;
        l[i] *= corr;
        m[i] = s;
      } else {
        p = std::exp(s - m[i]);
      }
      l[i] += p;
      for (int c = 0; c < d; ++c) ai[c] += p * vrow[c];
      if (a.mass_p != nullptr) {  // H2O key mass: one max record per key
        a.mass_p[t * a.mass_stride + i] = f32_to_f16(p);
        a.mass_m[t * a.mass_m_stride + i] = m[i];
      }
    }
  }
  finish_tile(a, n_vec, acc, m, l);
}

void finish_tile(const TileArgs& a, int n_vec, const float* acc, const float* m, const float* l) {
  const int d = a.head_dim;
  for (int i = 0; i < n_vec; ++i) {
    const float* ai = acc + static_cast<size_t>(i) * d;
    if (a.part_acc != nullptr) {
      a.part_m[i] = m[i];
      a.part_l[i] = l[i];
      std::memcpy(a.part_acc + static_cast<size_t>(i) * d, ai, sizeof(float) * d);
    } else {
      float* dst = a.n_rows == 1 ? a.out + static_cast<size_t>(i) * d
                                 : a.out + (i / a.group) * a.row_stride + (i % a.group) * d;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int c = 0; c < d; ++c) dst[c] = ai[c] * inv;
    }
  }
}

}  // namespace kvstack::attn_detail

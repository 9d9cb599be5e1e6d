// Portable tile kernel: one pass over the tile's keys with an online softmax
// per query vector. Each K/V row is converted once and used by every query
// vector of the tile (all q heads of the KV group, all rows).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/attention_kernels.h"
#include "core/half.h"

namespace kvstack::attn_detail {
namespace {

void load_row(const uint8_t* src, KvDtype dtype, int n, float* dst) {
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(dst, src, sizeof(float) * n);
      return;
    case KvDtype::kF16:
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    case KvDtype::kBF16:
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    default:  // quantized formats take attention_quant_*.cpp
      return;
  }
}

}  // namespace

ScratchBuffer& thread_scratch() {
  thread_local ScratchBuffer scratch;
  return scratch;
}

void attention_tile_scalar(const TileArgs& a) {
  const int d = a.keys.head_dim;
  const int n_vec = a.n_rows * a.group;
  // Scratch: qs [n_vec, d] (pre-scaled), acc [n_vec, d], m, l [n_vec], k, v [d].
  float* base = thread_scratch().get(static_cast<size_t>(n_vec) * (2 * d + 2) + 2 * d);
  float* qs = base;
  float* acc = qs + static_cast<size_t>(n_vec) * d;
  float* m = acc + static_cast<size_t>(n_vec) * d;
  float* l = m + n_vec;
  float* krow = l + n_vec;
  float* vrow = krow + d;

  for (int i = 0; i < n_vec; ++i) {
    const float* src = a.q + (i / a.group) * a.row_stride + (i % a.group) * d;
    for (int c = 0; c < d; ++c) qs[i * d + c] = src[c] * a.scale;
    std::memset(acc + static_cast<size_t>(i) * d, 0, sizeof(float) * d);
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }

  const int32_t pos_last = a.pos0 + a.n_rows - 1;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, pos_last + 1);
  for (int32_t t = t_begin; t < t_end; ++t) {
    load_row(row_ptr(a.keys, a.keys.k_head, t), a.keys.dtype, d, krow);
    load_row(row_ptr(a.keys, a.keys.v_head, t), a.keys.dtype, d, vrow);
    for (int i = 0; i < n_vec; ++i) {
      const int32_t pos = a.pos0 + i / a.group;
      if (t > pos || t < first_visible(pos, a.window)) continue;
      const float* qi = qs + static_cast<size_t>(i) * d;
      float s = 0.0f;
      for (int c = 0; c < d; ++c) s += qi[c] * krow[c];
      float* ai = acc + static_cast<size_t>(i) * d;
      float p = 1.0f;
      if (s > m[i]) {
        const float corr = std::exp(m[i] - s);  // 0 when m[i] is -inf
        for (int c = 0; c < d; ++c) ai[c] *= corr;
        l[i] *= corr;
        m[i] = s;
      } else {
        p = std::exp(s - m[i]);
      }
      l[i] += p;
      for (int c = 0; c < d; ++c) ai[c] += p * vrow[c];
    }
  }

  for (int i = 0; i < n_vec; ++i) {
    const float* ai = acc + static_cast<size_t>(i) * d;
    if (a.part_acc != nullptr) {
      a.part_m[i] = m[i];
      a.part_l[i] = l[i];
      std::memcpy(a.part_acc + static_cast<size_t>(i) * d, ai, sizeof(float) * d);
    } else {
      float* dst = a.out + (i / a.group) * a.row_stride + (i % a.group) * d;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int c = 0; c < d; ++c) dst[c] = ai[c] * inv;
    }
  }
}

}  // namespace kvstack::attn_detail

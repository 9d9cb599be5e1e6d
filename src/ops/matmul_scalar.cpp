// Scalar reference kernels: one dot product per (activation row, weight row),
// integer sums per block exactly as ggml's reference vec_dot functions.
#include <algorithm>
#include <cstring>

#include "core/half.h"
#include "ops/matmul_kernels.h"

namespace kvstack::ops_detail {
namespace {

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Weight-row dots against one prepared activation row `r`.
float dot_f32(const float* w, const PreparedAct& a, int64_t r) {
  const float* x = a.f32 + r * a.n_in;
  double sum = 0.0;
  for (int64_t i = 0; i < a.n_in; ++i) sum += static_cast<double>(w[i]) * x[i];
  return static_cast<float>(sum);
}

float dot_f16(const uint16_t* w, const PreparedAct& a, int64_t r) {
  const float* x = a.f32 + r * a.n_in;
  double sum = 0.0;
  for (int64_t i = 0; i < a.n_in; ++i) sum += static_cast<double>(f16_to_f32(w[i])) * x[i];
  return static_cast<float>(sum);
}

// Legacy 32-blocks: the weight's integer values q[32] (after offsets), its
// scale d and min m (m = 0 for symmetric types).
template <class Block>
void unpack_legacy(const Block& b, int* q, float* d, float* m);

template <>
void unpack_legacy(const BlockQ4_0& b, int* q, float* d, float* m) {
  for (int j = 0; j < 16; ++j) {
    q[j] = (b.qs[j] & 0x0f) - 8;
    q[j + 16] = (b.qs[j] >> 4) - 8;
  }
  *d = f16_to_f32(b.d);
  *m = 0.f;
}
template <>
void unpack_legacy(const BlockQ4_1& b, int* q, float* d, float* m) {
  for (int j = 0; j < 16; ++j) {
    q[j] = b.qs[j] & 0x0f;
    q[j + 16] = b.qs[j] >> 4;
  }
  *d = f16_to_f32(b.d);
  *m = f16_to_f32(b.m);
}
template <>
void unpack_legacy(const BlockQ5_0& b, int* q, float* d, float* m) {
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    q[j] = ((b.qs[j] & 0x0f) | (((qh >> j) & 1u) << 4)) - 16;
    q[j + 16] = ((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
  }
  *d = f16_to_f32(b.d);
  *m = 0.f;
}
template <>
void unpack_legacy(const BlockQ5_1& b, int* q, float* d, float* m) {
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    q[j] = (b.qs[j] & 0x0f) | (((qh >> j) & 1u) << 4);
    q[j + 16] = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
  }
  *d = f16_to_f32(b.d);
  *m = f16_to_f32(b.m);
}
template <>
void unpack_legacy(const BlockQ8_0& b, int* q, float* d, float* m) {
  std::copy_n(b.qs, 32, q);  // int8 quants, sign-extended to int
  *d = f16_to_f32(b.d);
  *m = 0.f;
}

template <class Block>
float dot_legacy(const Block* w, const PreparedAct& a, int64_t r) {
  const int64_t nb = a.n_in / kQK;
  const int8_t* y = a.qs + r * a.n_in;
  const float* yd = a.d + r * nb;
  const float* ys = a.s ? a.s + r * nb : nullptr;
  float sum = 0.f;
  int q[kQK];
  for (int64_t b = 0; b < nb; ++b) {
    float d, m;
    unpack_legacy(w[b], q, &d, &m);
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) sumi += q[j] * y[b * kQK + j];
    sum += d * yd[b] * static_cast<float>(sumi);
    if (ys) sum += m * ys[b];
  }
  return sum;
}

// k-quant 6-bit scale/min pair j (0..7) of a Q4_K/Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: value = d * sc_j * q - dmin * m_j over 8 sub-blocks of 32.
template <bool kFive>
float dot_q45_k(const uint8_t* wrow, const PreparedAct& a, int64_t r) {
  const int64_t nb = a.n_in / kQK_K;
  const BlockQ8_K* y = a.q8k + r * nb;
  float sum = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qs;
    const uint8_t* qh = nullptr;
    const uint8_t* scales;
    float d, dmin;
    if constexpr (kFive) {
      const auto& blk = reinterpret_cast<const BlockQ5_K*>(wrow)[b];
      qs = blk.qs;
      qh = blk.qh;
      scales = blk.scales;
      d = f16_to_f32(blk.d);
      dmin = f16_to_f32(blk.dmin);
    } else {
      const auto& blk = reinterpret_cast<const BlockQ4_K*>(wrow)[b];
      qs = blk.qs;
      scales = blk.scales;
      d = f16_to_f32(blk.d);
      dmin = f16_to_f32(blk.dmin);
    }
    const int8_t* q8 = y[b].qs;
    int sumi = 0, summ = 0;
    for (int chunk = 0; chunk < 4; ++chunk) {  // 64 elements: low nibbles, then high
      for (int half = 0; half < 2; ++half) {
        const int j = chunk * 2 + half;
        int sc, mn;
        scale_min_k4(j, scales, &sc, &mn);
        int s32 = 0;
        for (int l = 0; l < 32; ++l) {
          int q = half == 0 ? (qs[chunk * 32 + l] & 0x0f) : (qs[chunk * 32 + l] >> 4);
          if constexpr (kFive) q += ((qh[l] >> j) & 1) << 4;
          s32 += q * q8[j * 32 + l];
        }
        sumi += sc * s32;
        summ += mn * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
      }
    }
    sum += d * y[b].d * static_cast<float>(sumi) - dmin * y[b].d * static_cast<float>(summ);
  }
  return sum;
}

// Q6_K: value = d * scales[k] * (q - 32) over 16 sub-blocks of 16.
float dot_q6_k(const uint8_t* wrow, const PreparedAct& a, int64_t r) {
  const int64_t nb = a.n_in / kQK_K;
  const BlockQ8_K* y = a.q8k + r * nb;
  const auto* w = reinterpret_cast<const BlockQ6_K*>(wrow);
  float sum = 0.f;
  int q[kQK_K];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ql = w[b].ql;
    const uint8_t* qh = w[b].qh;
    for (int n = 0; n < kQK_K; n += 128) {
      for (int l = 0; l < 32; ++l) {
        q[n + l] = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        q[n + l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        q[n + l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        q[n + l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      }
      ql += 64;
      qh += 32;
    }
    int sumi = 0;
    for (int g = 0; g < kQK_K / 16; ++g) {
      int s16 = 0;
      for (int l = 0; l < 16; ++l) s16 += q[g * 16 + l] * y[b].qs[g * 16 + l];
      sumi += w[b].scales[g] * s16;
    }
    sum += f16_to_f32(w[b].d) * y[b].d * static_cast<float>(sumi);
  }
  return sum;
}

template <float (*kDot)(const uint8_t*, const PreparedAct&, int64_t)>
void kernel(const WeightView& w, const PreparedAct& a, int64_t c0, int64_t c1, float* y,
            int64_t ldy) {
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* wrow = w.data + c * row_bytes;
    for (int64_t r = 0; r < a.m; ++r) y[r * ldy + c] = kDot(wrow, a, r);
  }
}

float row_f32(const uint8_t* w, const PreparedAct& a, int64_t r) {
  return dot_f32(reinterpret_cast<const float*>(w), a, r);
}
float row_f16(const uint8_t* w, const PreparedAct& a, int64_t r) {
  return dot_f16(reinterpret_cast<const uint16_t*>(w), a, r);
}
template <class Block>
float row_legacy(const uint8_t* w, const PreparedAct& a, int64_t r) {
  return dot_legacy(reinterpret_cast<const Block*>(w), a, r);
}

}  // namespace

MatmulKernel scalar_kernel(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return kernel<row_f32>;
    case GgmlType::kF16:
      return kernel<row_f16>;
    case GgmlType::kQ4_0:
      return kernel<row_legacy<BlockQ4_0>>;
    case GgmlType::kQ4_1:
      return kernel<row_legacy<BlockQ4_1>>;
    case GgmlType::kQ5_0:
      return kernel<row_legacy<BlockQ5_0>>;
    case GgmlType::kQ5_1:
      return kernel<row_legacy<BlockQ5_1>>;
    case GgmlType::kQ8_0:
      return kernel<row_legacy<BlockQ8_0>>;
    case GgmlType::kQ4_K:
      return kernel<dot_q45_k<false>>;
    case GgmlType::kQ5_K:
      return kernel<dot_q45_k<true>>;
    case GgmlType::kQ6_K:
      return kernel<dot_q6_k>;
    default:
      return nullptr;
  }
}

ActKind act_kind(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return ActKind::kF32;
    case GgmlType::kF16:
      return ActKind::kF16;
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1:
      return ActKind::kQ8_1;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return ActKind::kQ8_K;
    default:
      return ActKind::kQ8_0;
  }
}

}  // namespace kvstack::ops_detail

// AVX2+FMA+F16C quantized tile kernel. Every function using these
// instructions carries the target attribute; entered only after a run-time
// CPU check (attention_quant.cpp).
//
// Per chunk of kChunk key positions of one KV head: the K rows are decoded in
// registers (8 elements at a time, scales and minimums applied) and stored
// transposed into an L1 tile kt [head_dim, kChunk]; V rows into vc [kChunk,
// head_dim]. S = Qs Kt, the online softmax and O = alpha O + P V then run on
// those tiles, exactly as the float prefill kernel does. The decoded values
// equal kv_decode_row()'s bit for bit (same FMA/multiply per element).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/attention_kernels.h"
#include "attention/attention_quant_kernels.h"

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvstack::attn_quant {
namespace {

using attn_detail::first_visible;

constexpr int kChunk = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

KV_AVX2 inline float f16_scalar(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Elements [c, c + 8) of a row, decoded to f32. REQUIRES c % 8 == 0.
template <KvDtype F>
KV_AVX2 inline __m256 deq8(const uint8_t* row, const uint8_t* meta, int c) {
  if constexpr (F == KvDtype::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + c);
  } else if constexpr (F == KvDtype::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
  } else if constexpr (F == KvDtype::kBF16) {
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (F == KvDtype::kInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return _mm256_mul_ps(q, _mm256_set1_ps(f16_scalar(meta)));
  } else if constexpr (F == KvDtype::kFp8) {
    // E4M3 -> f16 bits: sign to bit 15, exponent+mantissa shifted left by 7.
    // The f16 value is the E4M3 value times 2^-8 (normals and subnormals).
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(-32768)),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    float scale;
    std::memcpy(&scale, meta, 4);
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f)),
                         _mm256_set1_ps(scale));
  } else {  // kInt4
    const int g = c >> 5;
    const int o = c & 31;
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * g + (o & 15)));
    __m256i v = _mm256_cvtepu8_epi32(b);
    v = o >= 16 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0xf));
    return _mm256_fmadd_ps(_mm256_set1_ps(f16_scalar(meta + 4 * g)), _mm256_cvtepi32_ps(v),
                           _mm256_set1_ps(f16_scalar(meta + 4 * g + 2)));
  }
}

KV_AVX2 inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]);
  const __m256 t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]);
  const __m256 t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]);
  const __m256 t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]);
  const __m256 t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44);
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44);
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44);
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44);
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// kt[c * kChunk + j] = K_j[c] for the kChunk rows (padding rows included).
template <KvDtype F>
KV_AVX2 void k_tile(const uint8_t* const* rows, const uint8_t* const* metas, int d, float* kt) {
  for (int j0 = 0; j0 < kChunk; j0 += 8) {
    for (int c = 0; c < d; c += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int x = 0; x < 8; ++x) r[x] = deq8<F>(rows[j0 + x], metas[j0 + x], c);
      transpose8(r);
#pragma GCC unroll 8
      for (int x = 0; x < 8; ++x) _mm256_storeu_ps(kt + (c + x) * kChunk + j0, r[x]);
    }
  }
}

// vc[j * d + c] = V_j[c] for j < n.
template <KvDtype F>
KV_AVX2 void v_tile(const uint8_t* const* rows, const uint8_t* const* metas, int n, int d,
                    float* vc) {
  for (int j = 0; j < n; ++j) {
    for (int c = 0; c < d; c += 8) _mm256_storeu_ps(vc + j * d + c, deq8<F>(rows[j], metas[j], c));
  }
}

using KTileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int, float*);
using VTileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int, int, float*);

KTileFn k_tile_fn(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return k_tile<KvDtype::kF32>;
    case KvDtype::kF16:
      return k_tile<KvDtype::kF16>;
    case KvDtype::kBF16:
      return k_tile<KvDtype::kBF16>;
    case KvDtype::kFp8:
      return k_tile<KvDtype::kFp8>;
    case KvDtype::kInt8:
      return k_tile<KvDtype::kInt8>;
    case KvDtype::kInt4:
      return k_tile<KvDtype::kInt4>;
  }
  return nullptr;
}

VTileFn v_tile_fn(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return v_tile<KvDtype::kF32>;
    case KvDtype::kF16:
      return v_tile<KvDtype::kF16>;
    case KvDtype::kBF16:
      return v_tile<KvDtype::kBF16>;
    case KvDtype::kFp8:
      return v_tile<KvDtype::kFp8>;
    case KvDtype::kInt8:
      return v_tile<KvDtype::kInt8>;
    case KvDtype::kInt4:
      return v_tile<KvDtype::kInt4>;
  }
  return nullptr;
}

// e^x for x <= 88 (0 below -87), as attention_kernels_avx2.cpp's exp256.
KV_AVX2 inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

KV_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KV_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Online-softmax update over n scores at s (padded to kChunk in place);
// leaves p = exp(s - m_new) in s and returns the previous state's rescale.
KV_AVX2 inline float softmax_update(float* s, int n, float* m, float* l) {
  for (int j = n; j < kChunk; ++j) s[j] = kNegInf;
  __m256 mx = _mm256_loadu_ps(s);
  for (int j = 8; j < kChunk; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m_new = std::max(*m, hmax(mx));
  if (m_new == kNegInf) {
    std::memset(s, 0, sizeof(float) * kChunk);
    return 1.0f;
  }
  const float alpha = std::exp(*m - m_new);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < kChunk; j += 8) {
    const __m256 pj = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, pj);
    sum = _mm256_add_ps(sum, pj);
  }
  *l = *l * alpha + hsum(sum);
  *m = m_new;
  return alpha;
}

// Row and metadata addresses of positions [t0, t0 + n) of one stream.
inline void chunk_rows(const QuantTileArgs& a, const HeadStream& s, int32_t t0, int n,
                       const uint8_t** rows, const uint8_t** metas) {
  int32_t blk = t0 / a.block_size;
  int32_t off = t0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t base = a.block_table[blk] * a.block_stride;
    rows[j] = s.data + base + off * s.slot_stride;
    metas[j] = s.meta == nullptr ? nullptr : s.meta + base + off * s.meta_slot_stride;
    if (++off == a.block_size) {
      off = 0;
      ++blk;
    }
  }
}

// ---------------------------------------------------------------- decode --
// One query row: the group's q heads share every K/V row, decoded in
// registers 8 elements at a time (no L1 tile). J keys at a time share each q
// load; the SG * J dot products are reduced by one hadd tree.

// Lane i of the result is the horizontal sum of v[i].
KV_AVX2 inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <KvDtype F, int SG, int J>
KV_AVX2 void qk_chunk(const float* qs, int d, const uint8_t* const* kp, const uint8_t* const* km,
                      int n_pad, float* s) {
  static_assert(SG * J <= 8);
  for (int j0 = 0; j0 < n_pad; j0 += J) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      __m256 qv[SG];
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) qv[h] = _mm256_loadu_ps(qs + h * d + c);
#pragma GCC unroll 8
      for (int jj = 0; jj < J; ++jj) {
        const __m256 kv = deq8<F>(kp[j0 + jj], km[j0 + jj], c);
#pragma GCC unroll 8
        for (int h = 0; h < SG; ++h) acc[h * J + jj] = _mm256_fmadd_ps(qv[h], kv, acc[h * J + jj]);
      }
    }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, hsum8(acc));
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
#pragma GCC unroll 8
      for (int jj = 0; jj < J; ++jj) s[h * kChunk + j0 + jj] = tmp[h * J + jj];
    }
  }
}

// acc[h] = alpha[h] * acc[h] + sum_j p[h * kChunk + j] V_j for SG heads.
template <KvDtype F, int SG>
KV_AVX2 void pv_chunk(const float* p, const uint8_t* const* vp, const uint8_t* const* vm, int n,
                      const float* alpha, float* acc, int d) {
  for (int c = 0; c < d; c += 16) {
    const bool two = c + 16 <= d;
    __m256 a0[SG], a1[SG];
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
      const __m256 al = _mm256_broadcast_ss(alpha + h);
      a0[h] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c), al);
      a1[h] = two ? _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c + 8), al) : _mm256_setzero_ps();
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = deq8<F>(vp[j], vm[j], c);
      const __m256 v1 = two ? deq8<F>(vp[j], vm[j], c + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) {
        const __m256 pb = _mm256_broadcast_ss(p + h * kChunk + j);
        a0[h] = _mm256_fmadd_ps(pb, v0, a0[h]);
        a1[h] = _mm256_fmadd_ps(pb, v1, a1[h]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
      _mm256_storeu_ps(acc + h * d + c, a0[h]);
      if (two) _mm256_storeu_ps(acc + h * d + c + 8, a1[h]);
    }
  }
}

constexpr int keys_per_step(int sg) {
  return sg == 1 ? 8 : sg == 2 ? 4 : 2;
}

template <KvDtype F>
KV_AVX2 void qk_any(int sg, const float* qs, int d, const uint8_t** kp, const uint8_t** km, int n,
                    float* s) {
  const int j = keys_per_step(sg);
  const int n_pad = (n + j - 1) / j * j;
  for (int x = n; x < n_pad; ++x) {  // finite filler, scores dropped
    kp[x] = kp[0];
    km[x] = km[0];
  }
  switch (sg) {
    case 1:
      return qk_chunk<F, 1, 8>(qs, d, kp, km, n_pad, s);
    case 2:
      return qk_chunk<F, 2, 4>(qs, d, kp, km, n_pad, s);
    case 3:
      return qk_chunk<F, 3, 2>(qs, d, kp, km, n_pad, s);
    default:
      return qk_chunk<F, 4, 2>(qs, d, kp, km, n_pad, s);
  }
}

template <KvDtype F>
KV_AVX2 void pv_any(int sg, const float* p, const uint8_t* const* vp, const uint8_t* const* vm,
                    int n, const float* alpha, float* acc, int d) {
  switch (sg) {
    case 1:
      return pv_chunk<F, 1>(p, vp, vm, n, alpha, acc, d);
    case 2:
      return pv_chunk<F, 2>(p, vp, vm, n, alpha, acc, d);
    case 3:
      return pv_chunk<F, 3>(p, vp, vm, n, alpha, acc, d);
    default:
      return pv_chunk<F, 4>(p, vp, vm, n, alpha, acc, d);
  }
}

using QkFn = void (*)(int, const float*, int, const uint8_t**, const uint8_t**, int, float*);
using PvFn = void (*)(int, const float*, const uint8_t* const*, const uint8_t* const*, int,
                      const float*, float*, int);

template <KvDtype F>
constexpr QkFn kQk = qk_any<F>;
template <KvDtype F>
constexpr PvFn kPv = pv_any<F>;

QkFn qk_fn(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return kQk<KvDtype::kF32>;
    case KvDtype::kF16:
      return kQk<KvDtype::kF16>;
    case KvDtype::kBF16:
      return kQk<KvDtype::kBF16>;
    case KvDtype::kFp8:
      return kQk<KvDtype::kFp8>;
    case KvDtype::kInt8:
      return kQk<KvDtype::kInt8>;
    case KvDtype::kInt4:
      return kQk<KvDtype::kInt4>;
  }
  return nullptr;
}

PvFn pv_fn(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return kPv<KvDtype::kF32>;
    case KvDtype::kF16:
      return kPv<KvDtype::kF16>;
    case KvDtype::kBF16:
      return kPv<KvDtype::kBF16>;
    case KvDtype::kFp8:
      return kPv<KvDtype::kFp8>;
    case KvDtype::kInt8:
      return kPv<KvDtype::kInt8>;
    case KvDtype::kInt4:
      return kPv<KvDtype::kInt4>;
  }
  return nullptr;
}

}  // namespace

KV_AVX2 void quant_tile_avx2(const QuantTileArgs& a) {
  const int d = a.head_dim;
  const int g = a.group;
  const int n_vec = a.n_rows * g;
  const int n_vp = (n_vec + 3) / 4 * 4;
  const KTileFn k_fn = k_tile_fn(a.k.dtype);
  const VTileFn v_fn = v_tile_fn(a.v.dtype);
  thread_local attn_detail::ScratchBuffer scratch;
  // qs, o [n_vp, d]; s [n_vp, kChunk]; kt [d, kChunk]; vc [kChunk, d]; m, l, alpha [n_vp].
  const size_t n_floats =
      static_cast<size_t>(n_vp) * (2 * d + kChunk + 3) + 2 * static_cast<size_t>(kChunk) * d;
  float* qs = scratch.get(n_floats);
  float* o = qs + static_cast<size_t>(n_vp) * d;
  float* s = o + static_cast<size_t>(n_vp) * d;
  float* kt = s + static_cast<size_t>(n_vp) * kChunk;
  float* vc = kt + static_cast<size_t>(kChunk) * d;
  float* m = vc + static_cast<size_t>(kChunk) * d;
  float* l = m + n_vp;
  float* alpha = l + n_vp;

  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int i = 0; i < n_vp; ++i) {
    const float* src = a.q + (i / g) * a.row_stride + (i % g) * d;
    for (int c = 0; c < d; c += 8) {
      const __m256 qv =
          i < n_vec ? _mm256_mul_ps(_mm256_loadu_ps(src + c), scale) : _mm256_setzero_ps();
      _mm256_storeu_ps(qs + i * d + c, qv);
      _mm256_storeu_ps(o + i * d + c, _mm256_setzero_ps());
    }
    m[i] = kNegInf;
    l[i] = 0.0f;
    alpha[i] = 1.0f;
  }

  const int32_t pos_last = a.pos0 + a.n_rows - 1;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, pos_last + 1);
  const uint8_t* kp[kChunk];
  const uint8_t* km[kChunk];
  const uint8_t* vp[kChunk];
  const uint8_t* vm[kChunk];
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    chunk_rows(a, a.k, c0, n, kp, km);
    chunk_rows(a, a.v, c0, n, vp, vm);
    for (int j = n; j < kChunk; ++j) {  // finite filler, masked below
      kp[j] = kp[0];
      km[j] = km[0];
    }
    // Decode is bound by memory: fetch the next chunk's first rows early.
    if (c0 + kChunk < t_end) {
      const int32_t nb = (c0 + kChunk) / a.block_size;
      const int64_t base = a.block_table[nb] * a.block_stride;
      _mm_prefetch(reinterpret_cast<const char*>(a.k.data + base), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.v.data + base), _MM_HINT_T0);
    }
    k_fn(kp, km, d, kt);
    v_fn(vp, vm, n, d, vc);

    // S = Qs Kt, 4 vectors x 16 keys per register block.
    const int n_kb = n > 16 ? 2 : 1;
    for (int i0 = 0; i0 < n_vp; i0 += 4) {
      for (int kb = 0; kb < n_kb; ++kb) {
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float* kcol = kt + kb * 16;
        for (int c = 0; c < d; ++c) {
          const __m256 k0 = _mm256_loadu_ps(kcol + c * kChunk);
          const __m256 k1 = _mm256_loadu_ps(kcol + c * kChunk + 8);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            const __m256 qb = _mm256_broadcast_ss(qs + (i0 + r) * d + c);
            acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          _mm256_storeu_ps(s + (i0 + r) * kChunk + kb * 16, acc[r][0]);
          _mm256_storeu_ps(s + (i0 + r) * kChunk + kb * 16 + 8, acc[r][1]);
        }
      }
    }

    for (int i = 0; i < n_vec; ++i) {
      float* si = s + static_cast<size_t>(i) * kChunk;
      const int32_t pos = a.pos0 + i / g;
      const int32_t lo = first_visible(pos, a.window);
      if (c0 < lo || c0 + n - 1 > pos) {
        for (int j = 0; j < n; ++j) {
          if (c0 + j > pos || c0 + j < lo) si[j] = kNegInf;
        }
      }
      alpha[i] = softmax_update(si, n, m + i, l + i);
    }
    for (int i = n_vec; i < n_vp; ++i) std::memset(s + i * kChunk, 0, sizeof(float) * kChunk);

    // O = alpha O + P V, 4 vectors x 8 dims per register block.
    for (int i0 = 0; i0 < n_vp; i0 += 4) {
      const float* p0 = s + static_cast<size_t>(i0) * kChunk;
      for (int c = 0; c < d; c += 8) {
        __m256 acc[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          acc[r] = _mm256_mul_ps(_mm256_loadu_ps(o + (i0 + r) * d + c),
                                 _mm256_broadcast_ss(alpha + i0 + r));
        }
        for (int j = 0; j < n; ++j) {
          const __m256 v0 = _mm256_loadu_ps(vc + j * d + c);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + r * kChunk + j), v0, acc[r]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + (i0 + r) * d + c, acc[r]);
      }
    }
  }

  for (int i = 0; i < n_vec; ++i) {
    const float* ai = o + static_cast<size_t>(i) * d;
    if (a.part_acc != nullptr) {
      a.part_m[i] = m[i];
      a.part_l[i] = l[i];
      std::memcpy(a.part_acc + static_cast<size_t>(i) * d, ai, sizeof(float) * d);
    } else {
      float* dst = a.out + (i / g) * a.row_stride + (i % g) * d;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int c = 0; c < d; ++c) dst[c] = ai[c] * inv;
    }
  }
}

KV_AVX2 void quant_decode_tile_avx2(const QuantTileArgs& a) {
  const int d = a.head_dim;
  const int g = a.group;
  const QkFn qk = qk_fn(a.k.dtype);
  const PvFn pv = pv_fn(a.v.dtype);
  thread_local attn_detail::ScratchBuffer scratch;
  // qs, acc [g, d]; s [g, kChunk]; m, l, alpha [g].
  float* qs = scratch.get(static_cast<size_t>(g) * (2 * d + kChunk + 3));
  float* acc = qs + static_cast<size_t>(g) * d;
  float* s = acc + static_cast<size_t>(g) * d;
  float* m = s + static_cast<size_t>(g) * kChunk;
  float* l = m + g;
  float* alpha = l + g;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int h = 0; h < g; ++h) {
    for (int c = 0; c < d; c += 8) {
      _mm256_storeu_ps(qs + h * d + c, _mm256_mul_ps(_mm256_loadu_ps(a.q + h * d + c), scale));
      _mm256_storeu_ps(acc + h * d + c, _mm256_setzero_ps());
    }
    m[h] = kNegInf;
    l[h] = 0.0f;
  }
  const int n_sub = (g + 3) / 4;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, a.pos0 + 1);
  const uint8_t* kp[kChunk];
  const uint8_t* km[kChunk];
  const uint8_t* vp[kChunk];
  const uint8_t* vm[kChunk];
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    chunk_rows(a, a.k, c0, n, kp, km);
    chunk_rows(a, a.v, c0, n, vp, vm);
    if (c0 + kChunk < t_end) {  // next chunk's rows: the prefetcher loses blocks
      const int n_next = std::min<int32_t>(kChunk, t_end - c0 - kChunk);
      for (int j = 0; j < n_next; ++j) {
        const int32_t t = c0 + kChunk + j;
        _mm_prefetch(reinterpret_cast<const char*>(stream_row(a, a.k, t)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(stream_row(a, a.v, t)), _MM_HINT_T0);
      }
    }
    for (int sub = 0, h0 = 0; sub < n_sub; ++sub) {
      const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
      qk(sg, qs + h0 * d, d, kp, km, n, s + h0 * kChunk);
      h0 += sg;
    }
    for (int h = 0; h < g; ++h) alpha[h] = softmax_update(s + h * kChunk, n, m + h, l + h);
    for (int sub = 0, h0 = 0; sub < n_sub; ++sub) {
      const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
      pv(sg, s + h0 * kChunk, vp, vm, n, alpha + h0, acc + h0 * d, d);
      h0 += sg;
    }
  }
  for (int i = 0; i < g; ++i) {
    const float* ai = acc + static_cast<size_t>(i) * d;
    if (a.part_acc != nullptr) {
      a.part_m[i] = m[i];
      a.part_l[i] = l[i];
      std::memcpy(a.part_acc + static_cast<size_t>(i) * d, ai, sizeof(float) * d);
    } else {
      float* dst = a.out + i * d;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int c = 0; c < d; ++c) dst[c] = ai[c] * inv;
    }
  }
}

}  // namespace kvstack::attn_quant

// AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL) tile functions of the MLA latent
// attention (mla_attention_kernels.h). Every function that uses these
// instructions carries its target attribute; the file is compiled for
// generic x86-64 and mla_tile_fns() hands a table out only after checking
// the CPU (cpu_features()).
//
// Per tile of n <= 16 keys and H heads (d = d_c + d_R, rows padded to dpad):
//   decode: n rows -> f32 buffer (f16 via vcvtph2ps, bf16 by a shift, int8
//           codes widened and times the row's f16 scale: fused dequant);
//   scores: H x n dot products; 2 heads x 4 keys share their loads;
//   softmax: the online update per head (running max m, sum l, the factor
//           f = e^(m_old - m_new) the accumulator is rescaled by), in AVX2;
//   accum:  acc_h = f_h acc_h + sum_j w_hj c_j over d_c; 4 heads x 4 (AVX2:
//           2) vectors of accumulators stay in registers over the tile, so
//           each loaded latent vector feeds 4 heads.
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -W(maybe-)uninitialized reports inside the
// system header (GCC bug 105593, as in ops/matmul_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "attention/mla_attention_kernels.h"
#include "core/half.h"
#include "ops/simd_avx2.h"

#define MLA_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MLA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace kvstack::mla_detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scalar element decode for row tails (d not a multiple of the vector width).
inline float decode_one(KvDtype dt, const uint8_t* row, int i, float int8_scale) {
  switch (dt) {
    case KvDtype::kF32: {
      float v;
      std::memcpy(&v, row + 4 * static_cast<int64_t>(i), 4);
      return v;
    }
    case KvDtype::kF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * static_cast<int64_t>(i), 2);
      return f16_to_f32(h);
    }
    case KvDtype::kBF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * static_cast<int64_t>(i), 2);
      return bf16_to_f32(h);
    }
    case KvDtype::kInt8:
      return int8_scale * static_cast<float>(static_cast<int8_t>(row[i]));
    default:
      return 0.0f;
  }
}

inline float int8_row_scale(KvDtype dt, const uint8_t* meta) {
  if (dt != KvDtype::kInt8) return 0.0f;
  uint16_t h;
  std::memcpy(&h, meta, 2);
  return f16_to_f32(h);
}

// ---- softmax (shared by both ISAs: AVX-512 CPUs have AVX2) ----

MLA_AVX2 inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
MLA_AVX2 inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// s[h][0..n) scores -> weights e^(s - m_new) (0 past n); m, l updated;
// f[h] = e^(m_old - m_new) (0 while nothing was accumulated).
MLA_AVX2 void softmax_tile(float* s, int H, int n, float* m, float* l, float* f) {
  const __m256i idx_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i idx_hi = _mm256_add_epi32(idx_lo, _mm256_set1_epi32(8));
  const __m256i nv = _mm256_set1_epi32(n);
  const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, idx_lo));
  const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, idx_hi));
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  for (int h = 0; h < H; ++h) {
    float* row = s + static_cast<int64_t>(h) * kMlaTile;
    const __m256 a = _mm256_blendv_ps(ninf, _mm256_loadu_ps(row), keep_lo);
    const __m256 b = _mm256_blendv_ps(ninf, _mm256_loadu_ps(row + 8), keep_hi);
    const float mx = hmax8(_mm256_max_ps(a, b));
    const float m_new = mx > m[h] ? mx : m[h];
    f[h] = m[h] == kNegInf ? 0.0f : std::exp(m[h] - m_new);
    const __m256 mv = _mm256_set1_ps(m_new);
    const __m256 ea = _mm256_and_ps(simd::exp8(_mm256_sub_ps(a, mv)), keep_lo);
    const __m256 eb = _mm256_and_ps(simd::exp8(_mm256_sub_ps(b, mv)), keep_hi);
    _mm256_storeu_ps(row, ea);
    _mm256_storeu_ps(row + 8, eb);
    l[h] = l[h] * f[h] + hsum8(_mm256_add_ps(ea, eb));
    m[h] = m_new;
  }
}

// ---- AVX2 ----

MLA_AVX2 void decode_avx2(KvDtype dt, const uint8_t* const* rows, const uint8_t* const* metas,
                          int n, int d, int dpad, float* buf) {
  const int dv = d / 8 * 8;
  for (int j = 0; j < n; ++j) {
    const uint8_t* r = rows[j];
    float* o = buf + static_cast<int64_t>(j) * dpad;
    const float sc = int8_row_scale(dt, metas[j]);
    int i = 0;
    switch (dt) {
      case KvDtype::kF32:
        for (; i < dv; i += 8)
          _mm256_storeu_ps(o + i, _mm256_loadu_ps(reinterpret_cast<const float*>(r) + i));
        break;
      case KvDtype::kF16:
        for (; i < dv; i += 8) {
          _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                      r + 2 * static_cast<int64_t>(i)))));
        }
        break;
      case KvDtype::kBF16:
        for (; i < dv; i += 8) {
          const __m256i w = _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * static_cast<int64_t>(i))));
          _mm256_storeu_ps(o + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        break;
      case KvDtype::kInt8: {
        const __m256 sv = _mm256_set1_ps(sc);
        for (; i < dv; i += 8) {
          const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + i));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c))));
        }
        break;
      }
      default:
        break;
    }
    for (; i < d; ++i) o[i] = decode_one(dt, r, i, sc);
    for (; i < dpad; ++i) o[i] = 0.0f;
  }
}

template <int HB, int KB>
MLA_AVX2 inline void scores_block_avx2(const float* q, const float* buf, int dpad, float scale,
                                       float* s) {
  __m256 acc[HB][KB];
  for (int a = 0; a < HB; ++a) {
    for (int b = 0; b < KB; ++b) acc[a][b] = _mm256_setzero_ps();
  }
  for (int i = 0; i < dpad; i += 8) {
    __m256 kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = _mm256_loadu_ps(buf + static_cast<int64_t>(b) * dpad + i);
    for (int a = 0; a < HB; ++a) {
      const __m256 qv = _mm256_loadu_ps(q + static_cast<int64_t>(a) * dpad + i);
      for (int b = 0; b < KB; ++b) acc[a][b] = _mm256_fmadd_ps(qv, kv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < HB; ++a) {
    for (int b = 0; b < KB; ++b) s[a * kMlaTile + b] = scale * hsum8(acc[a][b]);
  }
}

MLA_AVX2 void scores_avx2(const float* q, const float* buf, int H, int n, int dpad, float scale,
                          float* s) {
  int h = 0;
  for (; h + 2 <= H; h += 2) {
    const float* qh = q + static_cast<int64_t>(h) * dpad;
    float* sh = s + static_cast<int64_t>(h) * kMlaTile;
    int j = 0;
    for (; j + 4 <= n; j += 4)
      scores_block_avx2<2, 4>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
    for (; j < n; ++j)
      scores_block_avx2<2, 1>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
  }
  for (; h < H; ++h) {
    const float* qh = q + static_cast<int64_t>(h) * dpad;
    float* sh = s + static_cast<int64_t>(h) * kMlaTile;
    int j = 0;
    for (; j + 4 <= n; j += 4)
      scores_block_avx2<1, 4>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
    for (; j < n; ++j)
      scores_block_avx2<1, 1>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
  }
}

// HB heads x IC vectors of 8 columns starting at column i.
template <int HB, int IC>
MLA_AVX2 inline void accum_block_avx2(const float* w, const float* buf, int n, int dpad, int dcpad,
                                      const float* f, float* acc, int i) {
  __m256 a[HB][IC];
  for (int x = 0; x < HB; ++x) {
    const __m256 fv = _mm256_set1_ps(f[x]);
    for (int c = 0; c < IC; ++c) {
      a[x][c] =
          _mm256_mul_ps(fv, _mm256_loadu_ps(acc + static_cast<int64_t>(x) * dcpad + i + 8 * c));
    }
  }
  for (int j = 0; j < n; ++j) {
    __m256 cv[IC];
    for (int c = 0; c < IC; ++c)
      cv[c] = _mm256_loadu_ps(buf + static_cast<int64_t>(j) * dpad + i + 8 * c);
    for (int x = 0; x < HB; ++x) {
      const __m256 wv = _mm256_broadcast_ss(w + x * kMlaTile + j);
      for (int c = 0; c < IC; ++c) a[x][c] = _mm256_fmadd_ps(wv, cv[c], a[x][c]);
    }
  }
  for (int x = 0; x < HB; ++x) {
    for (int c = 0; c < IC; ++c)
      _mm256_storeu_ps(acc + static_cast<int64_t>(x) * dcpad + i + 8 * c, a[x][c]);
  }
}

MLA_AVX2 void accum_avx2(const float* w, const float* buf, int H, int n, int dpad, int dcpad,
                         const float* f, float* acc) {
  // dcpad is a multiple of 16: whole pairs of 8-column vectors.
  int h = 0;
  for (; h + 4 <= H; h += 4) {
    for (int i = 0; i < dcpad; i += 16) {
      accum_block_avx2<4, 2>(w + h * kMlaTile, buf, n, dpad, dcpad, f + h,
                             acc + static_cast<int64_t>(h) * dcpad, i);
    }
  }
  for (; h < H; ++h) {
    for (int i = 0; i < dcpad; i += 16) {
      accum_block_avx2<1, 2>(w + h * kMlaTile, buf, n, dpad, dcpad, f + h,
                             acc + static_cast<int64_t>(h) * dcpad, i);
    }
  }
}

// TB rows x 2 vectors of 8 columns over the whole k, 16 columns at a time.
template <int TB>
MLA_AVX2 inline void gemm_block_avx2(const float* c, int k, const float* wt, int ldw, float* out,
                                     int o) {
  __m256 a[TB][2];
  for (int t = 0; t < TB; ++t) a[t][0] = a[t][1] = _mm256_setzero_ps();
  for (int i = 0; i < k; ++i) {
    const float* w = wt + static_cast<int64_t>(i) * ldw + o;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int t = 0; t < TB; ++t) {
      const __m256 cv = _mm256_broadcast_ss(c + static_cast<int64_t>(t) * k + i);
      a[t][0] = _mm256_fmadd_ps(cv, w0, a[t][0]);
      a[t][1] = _mm256_fmadd_ps(cv, w1, a[t][1]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    _mm256_storeu_ps(out + static_cast<int64_t>(t) * ldw + o, a[t][0]);
    _mm256_storeu_ps(out + static_cast<int64_t>(t) * ldw + o + 8, a[t][1]);
  }
}

MLA_AVX2 void gemm_avx2(const float* c, int m, int k, const float* wt, int ldw, int o0, int o1,
                        float* out) {
  for (int ob = o0; ob < o1; ob += kMlaGemmCols) {
    for (int o = ob; o < ob + kMlaGemmCols; o += 16) {
      int t = 0;
      for (; t + 6 <= m; t += 6) {
        gemm_block_avx2<6>(c + static_cast<int64_t>(t) * k, k, wt, ldw,
                           out + static_cast<int64_t>(t) * ldw, o);
      }
      for (; t < m; ++t) {
        gemm_block_avx2<1>(c + static_cast<int64_t>(t) * k, k, wt, ldw,
                           out + static_cast<int64_t>(t) * ldw, o);
      }
    }
  }
}

MLA_AVX2 void to_f16_avx2(const float* x, int n, uint16_t* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = f32_to_f16(x[i]);
}

// ---- AVX-512 ----

MLA_AVX512 void decode_avx512(KvDtype dt, const uint8_t* const* rows, const uint8_t* const* metas,
                              int n, int d, int dpad, float* buf) {
  const int dv = d / 16 * 16;
  for (int j = 0; j < n; ++j) {
    const uint8_t* r = rows[j];
    float* o = buf + static_cast<int64_t>(j) * dpad;
    const float sc = int8_row_scale(dt, metas[j]);
    int i = 0;
    switch (dt) {
      case KvDtype::kF32:
        for (; i < dv; i += 16)
          _mm512_storeu_ps(o + i, _mm512_loadu_ps(reinterpret_cast<const float*>(r) + i));
        break;
      case KvDtype::kF16:
        for (; i < dv; i += 16) {
          _mm512_storeu_ps(o + i,
                           _mm512_cvtph_ps(_mm256_loadu_si256(
                               reinterpret_cast<const __m256i*>(r + 2 * static_cast<int64_t>(i)))));
        }
        break;
      case KvDtype::kBF16:
        for (; i < dv; i += 16) {
          const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(r + 2 * static_cast<int64_t>(i))));
          _mm512_storeu_ps(o + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
        break;
      case KvDtype::kInt8: {
        const __m512 sv = _mm512_set1_ps(sc);
        for (; i < dv; i += 16) {
          const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c))));
        }
        break;
      }
      default:
        break;
    }
    for (; i < d; ++i) o[i] = decode_one(dt, r, i, sc);
    for (; i < dpad; ++i) o[i] = 0.0f;
  }
}

template <int HB, int KB>
MLA_AVX512 inline void scores_block_avx512(const float* q, const float* buf, int dpad, float scale,
                                           float* s) {
  __m512 acc[HB][KB];
  for (int a = 0; a < HB; ++a) {
    for (int b = 0; b < KB; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  for (int i = 0; i < dpad; i += 16) {
    __m512 kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = _mm512_loadu_ps(buf + static_cast<int64_t>(b) * dpad + i);
    for (int a = 0; a < HB; ++a) {
      const __m512 qv = _mm512_loadu_ps(q + static_cast<int64_t>(a) * dpad + i);
      for (int b = 0; b < KB; ++b) acc[a][b] = _mm512_fmadd_ps(qv, kv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < HB; ++a) {
    for (int b = 0; b < KB; ++b) s[a * kMlaTile + b] = scale * _mm512_reduce_add_ps(acc[a][b]);
  }
}

MLA_AVX512 void scores_avx512(const float* q, const float* buf, int H, int n, int dpad, float scale,
                              float* s) {
  int h = 0;
  for (; h + 2 <= H; h += 2) {
    const float* qh = q + static_cast<int64_t>(h) * dpad;
    float* sh = s + static_cast<int64_t>(h) * kMlaTile;
    int j = 0;
    for (; j + 4 <= n; j += 4)
      scores_block_avx512<2, 4>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
    for (; j < n; ++j)
      scores_block_avx512<2, 1>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
  }
  for (; h < H; ++h) {
    const float* qh = q + static_cast<int64_t>(h) * dpad;
    float* sh = s + static_cast<int64_t>(h) * kMlaTile;
    int j = 0;
    for (; j + 4 <= n; j += 4)
      scores_block_avx512<1, 4>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
    for (; j < n; ++j)
      scores_block_avx512<1, 1>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
  }
}

template <int HB, int IC>
MLA_AVX512 inline void accum_block_avx512(const float* w, const float* buf, int n, int dpad,
                                          int dcpad, const float* f, float* acc, int i) {
  __m512 a[HB][IC];
  for (int x = 0; x < HB; ++x) {
    const __m512 fv = _mm512_set1_ps(f[x]);
    for (int c = 0; c < IC; ++c) {
      a[x][c] =
          _mm512_mul_ps(fv, _mm512_loadu_ps(acc + static_cast<int64_t>(x) * dcpad + i + 16 * c));
    }
  }
  for (int j = 0; j < n; ++j) {
    __m512 cv[IC];
    for (int c = 0; c < IC; ++c)
      cv[c] = _mm512_loadu_ps(buf + static_cast<int64_t>(j) * dpad + i + 16 * c);
    for (int x = 0; x < HB; ++x) {
      const __m512 wv = _mm512_set1_ps(w[x * kMlaTile + j]);
      for (int c = 0; c < IC; ++c) a[x][c] = _mm512_fmadd_ps(wv, cv[c], a[x][c]);
    }
  }
  for (int x = 0; x < HB; ++x) {
    for (int c = 0; c < IC; ++c)
      _mm512_storeu_ps(acc + static_cast<int64_t>(x) * dcpad + i + 16 * c, a[x][c]);
  }
}

template <int HB>
MLA_AVX512 inline void accum_heads_avx512(const float* w, const float* buf, int n, int dpad,
                                          int dcpad, const float* f, float* acc) {
  int i = 0;
  for (; i + 64 <= dcpad; i += 64) accum_block_avx512<HB, 4>(w, buf, n, dpad, dcpad, f, acc, i);
  for (; i < dcpad; i += 16) accum_block_avx512<HB, 1>(w, buf, n, dpad, dcpad, f, acc, i);
}

MLA_AVX512 void accum_avx512(const float* w, const float* buf, int H, int n, int dpad, int dcpad,
                             const float* f, float* acc) {
  int h = 0;
  for (; h + 4 <= H; h += 4) {
    accum_heads_avx512<4>(w + h * kMlaTile, buf, n, dpad, dcpad, f + h,
                          acc + static_cast<int64_t>(h) * dcpad);
  }
  for (; h < H; ++h) {
    accum_heads_avx512<1>(w + h * kMlaTile, buf, n, dpad, dcpad, f + h,
                          acc + static_cast<int64_t>(h) * dcpad);
  }
}

// TB rows x 4 vectors of 16 columns (one kMlaGemmCols block) over the whole k.
template <int TB>
MLA_AVX512 inline void gemm_block_avx512(const float* c, int k, const float* wt, int ldw,
                                         float* out, int o) {
  __m512 a[TB][4];
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < 4; ++v) a[t][v] = _mm512_setzero_ps();
  }
  for (int i = 0; i < k; ++i) {
    const float* w = wt + static_cast<int64_t>(i) * ldw + o;
    __m512 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int t = 0; t < TB; ++t) {
      const __m512 cv = _mm512_set1_ps(c[static_cast<int64_t>(t) * k + i]);
      for (int v = 0; v < 4; ++v) a[t][v] = _mm512_fmadd_ps(cv, wv[v], a[t][v]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < 4; ++v)
      _mm512_storeu_ps(out + static_cast<int64_t>(t) * ldw + o + 16 * v, a[t][v]);
  }
}

MLA_AVX512 void gemm_avx512(const float* c, int m, int k, const float* wt, int ldw, int o0, int o1,
                            float* out) {
  for (int o = o0; o < o1; o += kMlaGemmCols) {
    int t = 0;
    for (; t + 6 <= m; t += 6) {
      gemm_block_avx512<6>(c + static_cast<int64_t>(t) * k, k, wt, ldw,
                           out + static_cast<int64_t>(t) * ldw, o);
    }
    for (; t < m; ++t) {
      gemm_block_avx512<1>(c + static_cast<int64_t>(t) * k, k, wt, ldw,
                           out + static_cast<int64_t>(t) * ldw, o);
    }
  }
}

MLA_AVX512 void to_f16_avx512(const float* x, int n, uint16_t* out) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = f32_to_f16(x[i]);
}

const MlaTileFns kAvx2Fns{decode_avx2, scores_avx2, softmax_tile,
                          accum_avx2,  gemm_avx2,   to_f16_avx2};
const MlaTileFns kAvx512Fns{decode_avx512, scores_avx512, softmax_tile,
                            accum_avx512,  gemm_avx512,   to_f16_avx512};

}  // namespace

const MlaTileFns* mla_tile_fns(Isa isa) {
  const CpuFeatures& c = cpu_features();
  const bool avx2 = c.avx2 && c.fma && c.f16c;
  if (isa == Isa::kAvx512)
    return avx2 && c.avx512f && c.avx512bw && c.avx512vl ? &kAvx512Fns : nullptr;
  if (isa == Isa::kAvx2) return avx2 ? &kAvx2Fns : nullptr;
  return nullptr;
}

}  // namespace kvstack::mla_detail

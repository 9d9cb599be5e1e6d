// Helpers shared by the AVX2+FMA+F16C tile kernels: decode
// (attention_kernels_avx2.cpp) and prefill (attention_prefill_avx2.cpp).
// Every function carries the target attribute; the including files are
// compiled for generic x86-64 and enter these only after a run-time check
// (run_attention). Internal to those two files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/attention_kernels.h"
#include "ops/simd_avx2.h"

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvstack::attn_detail::avx2 {

constexpr int kChunk = 32;  // keys per chunk (multiple of 16)
static_assert(kChunk == kMassChunkAvx2, "key-mass records are per decode chunk");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

KV_AVX2 inline float f16_scalar(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// E4M3 codes -> f16 bits of value * 2^-8: sign to bit 15, exponent+mantissa
// shifted left by 7 (normals and subnormals alike).
KV_AVX2 inline __m256 fp8_raw8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(-32768)),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm256_cvtph_ps(h);
}

// Elements [c, c + 8) of a row in raw form (see the file comment): the value
// for float formats, else the value before the scale (and int4 minimum).
// REQUIRES c % 8 == 0.
template <KvDtype F>
KV_AVX2 inline __m256 raw8(const uint8_t* row, int c) {
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
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (F == KvDtype::kFp8) {
    return fp8_raw8(row + c);
  } else if constexpr (F == KvDtype::kKivi2) {
    // Byte j of 32-element chunk k (8 bytes) holds element 32k + j + 8i at
    // bits [2i, 2i + 2).
    const int o = c & 31;
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * (c >> 5)));
    const __m256i v = _mm256_srli_epi32(_mm256_cvtepu8_epi32(b), 2 * (o >> 3));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(3)));
  } else {  // kInt4 and kKivi4: byte j of group g holds element 32g + j (low)
            // and 32g + 16 + j (high)
    const int o = c & 31;
    const __m128i b =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * (c >> 5) + (o & 15)));
    __m256i v = _mm256_cvtepu8_epi32(b);
    v = o >= 16 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0xf));
    return _mm256_cvtepi32_ps(v);
  }
}

// Elements [c, c + 32) of an int4 or KIVI row (one whole group) as
// raw8<F>(row, c + 8 x) for x = 0..3, each code byte widened once.
// REQUIRES c % 32 == 0.
template <KvDtype F>
KV_AVX2 inline void raw32(const uint8_t* row, int c, __m256* v) {
  static_assert(F == KvDtype::kInt4 || F == KvDtype::kKivi4 || F == KvDtype::kKivi2);
  if constexpr (F == KvDtype::kKivi2) {
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 4)));
    const __m256i m = _mm256_set1_epi32(3);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, m));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 2), m));
    v[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4), m));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 6));
  } else {
    const uint8_t* g = row + c / 2;
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g)));
    const __m256i b1 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 8)));
    const __m256i m = _mm256_set1_epi32(0xf);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, m));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, m));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  }
}

// Multiplier turning a raw int8/fp8 row into values (1 for the others;
// int4 has per-group scales instead).
template <KvDtype F>
KV_AVX2 inline float row_scale(const uint8_t* meta) {
  if constexpr (F == KvDtype::kInt8) {
    return f16_scalar(meta);
  } else if constexpr (F == KvDtype::kFp8) {
    float s;
    std::memcpy(&s, meta, 4);
    return s * 256.0f;
  } else {
    return 1.0f;
  }
}

template <KvDtype F>
constexpr bool kRowScaled = F == KvDtype::kInt8 || F == KvDtype::kFp8;

// Per-token rows in groups of 32 elements, each with an f16 (scale, min)
// pair in the row's metadata: int4, and a KIVI V.
template <KvDtype F>
constexpr bool kGroupScaled = F == KvDtype::kInt4 || F == KvDtype::kKivi4 || F == KvDtype::kKivi2;

// KIVI K metadata: the (scale, min) f16 pairs of channels [c, c + 8) of a
// key group's record, widened.
KV_AVX2 inline void kivi_pairs8(const uint8_t* meta, int c, __m256* sc, __m256* mn) {
  const __m256 lo =
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 4 * c)));
  const __m256 hi =
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 4 * c + 16)));
  // lo = s0 m0 s1 m1 | s2 m2 s3 m3, hi = s4 m4 s5 m5 | s6 m6 s7 m7
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  *sc = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo, hi, 0x88), order);
  *mn = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo, hi, 0xDD), order);
}

// Elements [c, c + 8) of a KIVI K row (codes at row, its group's record at
// meta), decoded as kivi_decode_key_row() does: fma(scale, code, min).
template <KvDtype F>
KV_AVX2 inline __m256 kivi_key_deq8(const uint8_t* row, const uint8_t* meta, int c) {
  __m256 sc, mn;
  kivi_pairs8(meta, c, &sc, &mn);
  return _mm256_fmadd_ps(sc, raw8<F>(row, c), mn);
}

// Elements [c, c + 8) decoded exactly as kv_decode_row() does (prefill tiles).
template <KvDtype F>
KV_AVX2 inline __m256 deq8(const uint8_t* row, const uint8_t* meta, int c) {
  if constexpr (F == KvDtype::kInt8) {
    return _mm256_mul_ps(raw8<F>(row, c), _mm256_set1_ps(f16_scalar(meta)));
  } else if constexpr (F == KvDtype::kFp8) {
    float scale;
    std::memcpy(&scale, meta, 4);
    return _mm256_mul_ps(_mm256_mul_ps(fp8_raw8(row + c), _mm256_set1_ps(256.0f)),
                         _mm256_set1_ps(scale));
  } else if constexpr (kGroupScaled<F>) {  // int4, or a KIVI V
    const int g = c >> 5;
    return _mm256_fmadd_ps(_mm256_set1_ps(f16_scalar(meta + 4 * g)), raw8<F>(row, c),
                           _mm256_set1_ps(f16_scalar(meta + 4 * g + 2)));
  } else {
    return raw8<F>(row, c);
  }
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

// Online-softmax update of one query vector over a chunk of n scores at s
// (s padded to kChunk in place). Leaves p = exp(s - m_new) in s, returns the
// rescale factor of the previous state. An all-masked chunk leaves the state
// unchanged (alpha 1, p 0).
KV_AVX2 inline float softmax_update(float* s, int n, float* m, float* l) {
  for (int j = n; j < kChunk; ++j) s[j] = kNegInf;
  __m256 mx = _mm256_loadu_ps(s);
  for (int j = 8; j < kChunk; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m_new = std::max(*m, hmax(mx));
  if (m_new == kNegInf) {
    std::memset(s, 0, sizeof(float) * kChunk);
    return 1.0f;
  }
  // 0 when *m is -inf; exactly 1 (as std::exp(0) would give) when the max
  // did not move, the common case after the first chunks.
  const float alpha = m_new == *m ? 1.0f : std::exp(*m - m_new);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < kChunk; j += 8) {
    const __m256 pj = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, pj);
    sum = _mm256_add_ps(sum, pj);
  }
  *l = *l * alpha + hsum(sum);
  *m = m_new;
  return alpha;
}

// fn.template operator()<F>() for the format t (a templated lambda), or a
// value-initialised result for a format without AVX2 kernels.
template <typename Fn>
auto by_format(KvDtype t, Fn fn) -> decltype(fn.template operator()<KvDtype::kF32>()) {
  switch (t) {
    case KvDtype::kF32:
      return fn.template operator()<KvDtype::kF32>();
    case KvDtype::kF16:
      return fn.template operator()<KvDtype::kF16>();
    case KvDtype::kBF16:
      return fn.template operator()<KvDtype::kBF16>();
    case KvDtype::kFp8:
      return fn.template operator()<KvDtype::kFp8>();
    case KvDtype::kInt8:
      return fn.template operator()<KvDtype::kInt8>();
    case KvDtype::kInt4:
      return fn.template operator()<KvDtype::kInt4>();
    default:
      return {};
  }
}

}  // namespace kvstack::attn_detail::avx2

// AVX2+FMA+F16C primitives of the KIVI attention kernel. Decoded values equal
// the kivi_codec.h reference bit for bit: codes widen exactly to float and
// x = fma(scale, code, min) with the same f16 -> f32 scale and min.
#include <immintrin.h>

#include <cstring>

#include "attention/attention_kivi_kernels.h"
#include "core/half.h"
#include "ops/simd_avx2.h"

namespace kvstack::kivi_detail {
namespace {

#define KIVI_AVX2 __attribute__((target("avx2,fma,f16c")))

// 8 consecutive bytes widened to 8 int32 lanes.
KIVI_AVX2 inline __m256i load8_u8(const uint8_t* p) {
  int64_t x;
  std::memcpy(&x, p, 8);
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(x));
}

// Unpacks one row of d codes (kivi_codec.h chunk order) into float codes.
KIVI_AVX2 inline void unpack_row(int bits, const uint8_t* codes, int d, float* q) {
  const int chunk_bytes = 4 * bits;
  const int per_byte = 8 / bits;
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  for (int c = 0; c < d / 32; ++c) {
    for (int j = 0; j < chunk_bytes; j += 8) {
      const __m256i x = load8_u8(codes + c * chunk_bytes + j);
      for (int k = 0; k < per_byte; ++k) {
        const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_set1_epi32(k * bits)), mask);
        _mm256_storeu_ps(q + 32 * c + j + k * chunk_bytes, _mm256_cvtepi32_ps(v));
      }
    }
  }
}

KIVI_AVX2 void key_rows_avx2(int bits, const uint8_t* codes, int64_t code_stride,
                             const uint8_t* meta, int n, int d, float* out) {
  // Per channel scale/min of the group, deinterleaved once per tile.
  alignas(32) float s[512];
  alignas(32) float m[512];
  for (int c0 = 0; c0 < d; c0 += 512) {
    const int nc = d - c0 < 512 ? d - c0 : 512;
    for (int c = 0; c < nc; c += 8) {
      // 8 (scale, min) pairs = 16 f16 values.
      const __m256i pairs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 4 * (c0 + c)));
      const __m256i lohi = _mm256_shuffle_epi8(
          pairs, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                  8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
      const __m256i perm = _mm256_permute4x64_epi64(lohi, 0xD8);  // [s0..7 | m0..7]
      _mm256_storeu_ps(s + c, _mm256_cvtph_ps(_mm256_castsi256_si128(perm)));
      _mm256_storeu_ps(m + c, _mm256_cvtph_ps(_mm256_extracti128_si256(perm, 1)));
    }
    for (int t = 0; t < n; ++t) {
      float* o = out + t * d + c0;
      unpack_row(bits, codes + t * code_stride + c0 * bits / 8, nc, o);
      for (int c = 0; c < nc; c += 8) {
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(_mm256_load_ps(s + c), _mm256_loadu_ps(o + c),
                                                _mm256_load_ps(m + c)));
      }
    }
  }
}

KIVI_AVX2 void value_rows_avx2(int bits, const uint8_t* codes, int64_t code_stride,
                               const uint8_t* meta, int64_t meta_stride, int n, int d, float* out) {
  for (int t = 0; t < n; ++t) {
    float* o = out + t * d;
    unpack_row(bits, codes + t * code_stride, d, o);
    const uint8_t* mt = meta + t * meta_stride;
    for (int g = 0; g < d / 32; ++g) {
      uint16_t sh, mh;
      std::memcpy(&sh, mt + 4 * g, 2);
      std::memcpy(&mh, mt + 4 * g + 2, 2);
      const __m256 s = _mm256_set1_ps(f16_to_f32(sh));
      const __m256 m = _mm256_set1_ps(f16_to_f32(mh));
      for (int j = 0; j < 32; j += 8) {
        _mm256_storeu_ps(o + 32 * g + j, _mm256_fmadd_ps(s, _mm256_loadu_ps(o + 32 * g + j), m));
      }
    }
  }
}

KIVI_AVX2 void f16_rows_avx2(const uint16_t* src, int64_t stride, int n, int d, float* out) {
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < d; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + t * stride + i));
      _mm256_storeu_ps(out + t * d + i, _mm256_cvtph_ps(h));
    }
  }
}

KIVI_AVX2 float dot_avx2(const float* a, const float* b, int d) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < d; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

KIVI_AVX2 void exp_shift_avx2(float* x, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    _mm256_storeu_ps(x + t, simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv)));
  }
  if (t < n) {  // the tail through the same 8-wide code
    alignas(32) float b[8];
    for (int i = 0; i < 8; ++i) b[i] = t + i < n ? x[t + i] : m;
    _mm256_store_ps(b, simd::exp8(_mm256_sub_ps(_mm256_load_ps(b), mv)));
    for (int i = 0; t + i < n; ++i) x[t + i] = b[i];
  }
}

// 32 columns at a time in registers (4 sums, each one FMA per row), then 8.
KIVI_AVX2 void scale_pv_avx2(float* acc, float c, const float* w, const float* x, int n, int d) {
  const __m256 vc = _mm256_set1_ps(c);
  int i = 0;
  for (; i + 32 <= d; i += 32) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + i), vc);
    __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 8), vc);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 16), vc);
    __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 24), vc);
    for (int t = 0; t < n; ++t) {
      const __m256 wt = _mm256_broadcast_ss(w + t);
      const float* xt = x + static_cast<int64_t>(t) * d + i;
      a0 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(xt), a0);
      a1 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(xt + 8), a1);
      a2 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(xt + 16), a2);
      a3 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(xt + 24), a3);
    }
    _mm256_storeu_ps(acc + i, a0);
    _mm256_storeu_ps(acc + i + 8, a1);
    _mm256_storeu_ps(acc + i + 16, a2);
    _mm256_storeu_ps(acc + i + 24, a3);
  }
  for (; i < d; i += 8) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + i), vc);
    for (int t = 0; t < n; ++t) {
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + t),
                           _mm256_loadu_ps(x + static_cast<int64_t>(t) * d + i), a0);
    }
    _mm256_storeu_ps(acc + i, a0);
  }
}

}  // namespace

const KiviOps& avx2_ops() {
  static const KiviOps ops{key_rows_avx2, value_rows_avx2, f16_rows_avx2,
                           dot_avx2,      exp_shift_avx2,  scale_pv_avx2};
  return ops;
}

}  // namespace kvstack::kivi_detail

// AVX2+FMA vector math shared by the element-wise kernels (ops) and the
// attention kernels. Header-only: every function carries its own target
// attribute, so including files are compiled for generic x86-64 and call
// these only after a run-time ISA check.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>

namespace kvstack::simd {

// e^x for 8 floats, within a few ulp over the whole float range: +inf above
// 88.72, exactly 0 below -87.33 (and for -inf). Range reduction
// x = k ln2 + r, |r| <= ln2/2 (ln2 split in two parts), then the degree-7
// Taylor polynomial (truncation error r^8/8! < 6e-9); 2^k is applied as
// 2^kc * 2^(k - kc) with kc = k clamped to [-126, 127], so k = 128 (x just
// below the overflow threshold) still gives a finite result. For k in
// [-126, 127] the second factor is exactly 1.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.4286068203094172e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 kc = _mm256_min_ps(_mm256_max_ps(k, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
  const __m256 kr =
      _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(k, kc), _mm256_set1_ps(-1.f)), _mm256_set1_ps(1.f));
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(kc), bias), 23));
  const __m256 s2 =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(kr), bias), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.72f), _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_LT_OQ));
  return y;
}

}  // namespace kvstack::simd

#endif  // __x86_64__

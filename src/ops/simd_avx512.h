// AVX-512 F vector math shared by the AVX-512 attention and element-wise
// kernels. Header-only: every function carries its own target attribute, so
// including files call these only after a run-time ISA check (callers with a
// wider target inline them).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>

namespace kvstack::simd {

// exp(x) for an online softmax's x = s - m <= 0, 16 lanes: exp(x) = 2^k e^r,
// k = round(x log2 e), r = x - k ln 2 in two steps, a degree-6 polynomial
// (relative error below 2e-7) and 2^k by vscalefps; exactly 0 below -87.33
// (and for -inf), NaN stays NaN. Inputs above 0 are not handled.
__attribute__((target("avx512f,fma"))) inline __m512 exp16_nonpos(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ), p, k);
}

// simd::exp8 (ops/simd_avx2.h) on 16 lanes, over the whole float range: the
// same operations in the same order (round to nearest, the two-step
// reduction, the degree-7 Horner polynomial, the split 2^k scaling, the
// overflow and underflow selects), so each lane's bits are exp8's.
__attribute__((target("avx512f,fma"))) inline __m512 exp16(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512 kc = _mm512_min_ps(_mm512_max_ps(k, _mm512_set1_ps(-126.f)), _mm512_set1_ps(127.f));
  const __m512 kr =
      _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(k, kc), _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(kc), bias), 23));
  const __m512 s2 =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(kr), bias), 23));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72f), _CMP_GT_OQ), y,
                           _mm512_set1_ps(INFINITY));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33f), _CMP_LT_OQ), y,
                           _mm512_setzero_ps());
  return y;
}

}  // namespace kvstack::simd

#endif  // __x86_64__

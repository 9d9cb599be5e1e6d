// AVX-512 lanes of asym_quant_fit's search (see kv_codec_avx512.h).
//
// Why each lane equals the scalar reference (kv_codec.cpp, asym_quant_fit_isa
// with asym_codes / fit_codes_scalar):
// - float steps: vsubps, vmulps, vdivps and vfmadd (one rounding, like
//   std::fma) are correctly rounded IEEE operations like their scalar
//   counterparts; vroundps with round-to-nearest-even is std::nearbyint
//   under the default rounding mode; max(v, 0) then min(., qmax) is
//   std::clamp(v, 0, qmax) for non-NaN v (a -0 code becomes +0, which gives
//   the same sums, products and codes).
// - double steps: vcvtps2pd is exact, and every sum is accumulated in the
//   reference's order over i, one add per element, from +0.
// - this file is compiled with -ffp-contract=off (CMakeLists.txt): the
//   compiler must not fuse a multiply into the following add. l*l and l*x
//   are exact in double (an integer <= 255 times a float), but e*e is not
//   when e spans more than 26 bits (a clipped outlier far from its decoded
//   value), and a fused err + e*e would then differ from the reference's two
//   roundings (kv_codec_test's lane test fails on it).
// - the fit (asym_solve): products, differences and quotients of doubles are
//   correctly rounded (n * sll with n converted exactly, as in C++);
//   vcvtpd2ps rounds to nearest even like static_cast<float>; vcvtps2ph with
//   round-to-nearest-even is f32_to_f16 (core/half.h: RNE, 65520 and above to
//   inf, subnormals RNE) and vcvtph2ps is f16_to_f32 (exact); the compares
//   are the reference's, NaN included (!(x > y) is the unordered NGT).
// A lane whose scale is not > 0 gets code 0 (its quotient, inf or NaN, is
// masked away), as the reference's `s > 0 ? ... : 0`.
#include "kv/kv_codec_avx512.h"

#include <immintrin.h>

#include "core/half.h"

namespace kvstack {

#define KV_CODEC_AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

namespace {

constexpr int kVecs = kAsymFitLanes / 8;
static_assert(kVecs * 8 == kAsymFitLanes && kAsymFitLanes >= kAsymFitCandidates);

// clamp(nearbyint(v), 0, qmax) per lane.
KV_CODEC_AVX512 inline __m256 round_clamp(__m256 v, __m256 qmax) {
  v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), qmax);
}

// The 8 floats of v as doubles (exact). The all-ones mask form, because
// GCC 12 warns (maybe-uninitialized) on _mm512_cvtps_pd's undefined source
// (and on _mm512_cvtpd_ps's, hence the masked forms below too).
KV_CODEC_AVX512 inline __m512d to_pd(__m256 v) {
  return _mm512_maskz_cvtps_pd(0xff, v);
}

}  // namespace

KV_CODEC_AVX512 void asym_fit_sums_avx512(const float* x, int n, float mn, const float* iscale,
                                          float qmax, double* sl, double* sll, double* slx) {
  const __m256 qv = _mm256_set1_ps(qmax);
  __m256 is[kVecs];
  __m512d acc_l[kVecs], acc_ll[kVecs], acc_lx[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    is[v] = _mm256_loadu_ps(iscale + 8 * v);
    acc_l[v] = acc_ll[v] = acc_lx[v] = _mm512_setzero_pd();
  }
  for (int i = 0; i < n; ++i) {
    const __m256 d = _mm256_set1_ps(x[i] - mn);  // the reference's x[i] - mn, once per element
    const __m512d xd = _mm512_set1_pd(static_cast<double>(x[i]));
    for (int v = 0; v < kVecs; ++v) {
      const __m512d l = to_pd(round_clamp(_mm256_mul_ps(is[v], d), qv));
      acc_l[v] = _mm512_add_pd(acc_l[v], l);
      acc_ll[v] = _mm512_add_pd(acc_ll[v], _mm512_mul_pd(l, l));
      acc_lx[v] = _mm512_add_pd(acc_lx[v], _mm512_mul_pd(l, xd));
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    _mm512_storeu_pd(sl + 8 * v, acc_l[v]);
    _mm512_storeu_pd(sll + 8 * v, acc_ll[v]);
    _mm512_storeu_pd(slx + 8 * v, acc_lx[v]);
  }
}

KV_CODEC_AVX512 uint32_t asym_fit_solve_avx512(int n, double sx, const double* sl,
                                               const double* sll, const double* slx, uint16_t* s16,
                                               uint16_t* m16, float* s, float* m) {
  const __m512d nd = _mm512_set1_pd(static_cast<double>(n)), sxd = _mm512_set1_pd(sx);
  const __m512d zero = _mm512_setzero_pd(), f16max = _mm512_set1_pd(static_cast<double>(kF16Max));
  uint32_t ok = 0;
  for (int v = 0; v < kVecs; ++v) {
    const __m512d l = _mm512_loadu_pd(sl + 8 * v), ll = _mm512_loadu_pd(sll + 8 * v);
    const __m512d lx = _mm512_loadu_pd(slx + 8 * v);
    const __m512d det = _mm512_sub_pd(_mm512_mul_pd(nd, ll), _mm512_mul_pd(l, l));
    const __m512d s_fit =
        _mm512_div_pd(_mm512_sub_pd(_mm512_mul_pd(nd, lx), _mm512_mul_pd(l, sxd)), det);
    const __m512d m_fit =
        _mm512_div_pd(_mm512_sub_pd(_mm512_mul_pd(ll, sxd), _mm512_mul_pd(l, lx)), det);
    __mmask8 good = _mm512_cmp_pd_mask(det, zero, _CMP_GT_OQ);              // det > 0
    good &= _mm512_cmp_pd_mask(s_fit, zero, _CMP_GT_OQ);                    // s > 0
    good &= _mm512_cmp_pd_mask(s_fit, f16max, _CMP_NGT_UQ);                 // !(s > max)
    good &= _mm512_cmp_pd_mask(_mm512_abs_pd(m_fit), f16max, _CMP_NGT_UQ);  // !(|m| > max)
    const __m128i sh =
        _mm256_cvtps_ph(_mm512_maskz_cvtpd_ps(0xff, s_fit), _MM_FROUND_TO_NEAREST_INT);
    const __m128i mh =
        _mm256_cvtps_ph(_mm512_maskz_cvtpd_ps(0xff, m_fit), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s16 + 8 * v), sh);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m16 + 8 * v), mh);
    _mm256_storeu_ps(s + 8 * v,
                     _mm256_mask_blend_ps(good, _mm256_set1_ps(1.0f), _mm256_cvtph_ps(sh)));
    _mm256_storeu_ps(m + 8 * v, _mm256_maskz_mov_ps(good, _mm256_cvtph_ps(mh)));
    ok |= static_cast<uint32_t>(good) << (8 * v);
  }
  return ok & ((1u << kAsymFitCandidates) - 1);
}

KV_CODEC_AVX512 void asym_fit_errors_avx512(const float* x, int n, const float* s, const float* m,
                                            float qmax, double* err) {
  const __m256 qv = _mm256_set1_ps(qmax);
  __m256 sv[kVecs], mv[kVecs];
  __mmask8 pos[kVecs];  // lanes with s > 0
  __m512d acc[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    sv[v] = _mm256_loadu_ps(s + 8 * v);
    mv[v] = _mm256_loadu_ps(m + 8 * v);
    pos[v] = _mm256_cmp_ps_mask(sv[v], _mm256_setzero_ps(), _CMP_GT_OQ);
    acc[v] = _mm512_setzero_pd();
  }
  for (int i = 0; i < n; ++i) {
    const __m256 xv = _mm256_set1_ps(x[i]);
    const __m512d xd = _mm512_set1_pd(static_cast<double>(x[i]));
    for (int v = 0; v < kVecs; ++v) {
      const __m256 q = _mm256_maskz_mov_ps(
          pos[v], round_clamp(_mm256_div_ps(_mm256_sub_ps(xv, mv[v]), sv[v]), qv));
      const __m512d e = _mm512_sub_pd(to_pd(_mm256_fmadd_ps(sv[v], q, mv[v])), xd);
      acc[v] = _mm512_add_pd(acc[v], _mm512_mul_pd(e, e));
    }
  }
  for (int v = 0; v < kVecs; ++v) _mm512_storeu_pd(err + 8 * v, acc[v]);
}

}  // namespace kvstack

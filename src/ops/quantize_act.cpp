#include "ops/quantize_act.h"

#include <cmath>
#include <cstring>

#include "core/cpu_features.h"
#include "core/half.h"

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -Wmaybe-uninitialized reports inside the
// system header (GCC bug 105593); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

namespace kvstack {
namespace {

inline int8_t saturate_i8(int v) {
  return static_cast<int8_t>(v < -128 ? -128 : (v > 127 ? 127 : v));
}

// One 32-block: q, f16-rounded d as float, f16-rounded d * sum(q) as float.
inline void quantize_block32_scalar(const float* x, int8_t* q, uint16_t* d16, uint16_t* s16) {
  float amax = 0.f;
  for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int j = 0; j < kQK; ++j) {
    // nearbyint rounds half to even under the default rounding mode, like
    // _mm256_round_ps(_MM_ROUND_NEAREST).
    q[j] = saturate_i8(static_cast<int>(std::nearbyint(x[j] * id)));
    sum += q[j];
  }
  *d16 = f32_to_f16(d);
  *s16 = f32_to_f16(d * static_cast<float>(sum));
}

void quantize_act_q8_scalar(const float* x, int8_t* qs, float* d, float* s, int32_t* qsum,
                            int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    uint16_t d16, s16;
    quantize_block32_scalar(x + b * kQK, qs + b * kQK, &d16, &s16);
    d[b] = f16_to_f32(d16);
    if (s) s[b] = f16_to_f32(s16);
    if (qsum) {
      int32_t sum = 0;
      for (int j = 0; j < kQK; ++j) sum += qs[b * kQK + j];
      qsum[b] = sum;
    }
  }
}

#if defined(__x86_64__)
// Returns the block's d (unrounded) and writes q; *sum = sum(q).
__attribute__((target("avx2,fma,f16c"))) inline float quantize_block32_avx2(const float* x,
                                                                            int8_t* q, int* sum) {
  __m256 v0 = _mm256_loadu_ps(x);
  __m256 v1 = _mm256_loadu_ps(x + 8);
  __m256 v2 = _mm256_loadu_ps(x + 16);
  __m256 v3 = _mm256_loadu_ps(x + 24);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
  mx = _mm256_max_ps(mx, _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f;
  const __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
  const int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), kRound));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), kRound));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), kRound));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), kRound));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  *sum = _mm_cvtsi128_si32(s4);
  // Pack to int8 (saturating); packs work per 128-bit lane, so fix the order.
  i0 = _mm256_packs_epi32(i0, i1);
  i2 = _mm256_packs_epi32(i2, i3);
  i0 = _mm256_packs_epi16(i0, i2);
  i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i0);
  return d;
}

// f16_to_f32(f32_to_f16(v)) by F16C: the same round to nearest even,
// subnormals and overflow to infinity; NaNs (whose payload bits the two
// conversions treat differently) take the software conversion.
__attribute__((target("avx2,fma,f16c"))) inline float round_f16(float v) {
  if (std::isnan(v)) return f16_to_f32(f32_to_f16(v));
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("avx2,fma,f16c"))) void quantize_act_q8_avx2(const float* x, int8_t* qs,
                                                                   float* d, float* s,
                                                                   int32_t* qsum, int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    int sum = 0;
    const float db = quantize_block32_avx2(x + b * kQK, qs + b * kQK, &sum);
    d[b] = round_f16(db);
    if (s) s[b] = round_f16(db * static_cast<float>(sum));
    if (qsum) qsum[b] = sum;
  }
}

// ---- AVX-512: 16 blocks at a time ----
//
// The same values as quantize_act_q8_avx2, block by block, computed 16
// blocks side by side: each block's two vectors give a 16-lane partial max
// (and later sum), and a reduction tree over the 16 blocks' partials
// (unpack 32, unpack 64, two 128-bit shuffles) leaves block i's max (sum) in
// lane i. So one vector division gives 16 blocks' d and 127 / amax, and the
// f16 roundings run 16 at a time, where the AVX2 code spends two scalar
// divisions, two horizontal reductions and four scalar f16 round trips per
// block. max and the integer sums do not depend on their order, the
// division is IEEE's, the products, rounding (half to even), saturation to
// int8 and f16 conversions are the same instructions' lane by lane: the same
// bits as the AVX2 (and scalar) code. A group holding a NaN goes to the AVX2
// code (max's NaN rule depends on the operand order); blocks past the last
// whole group too.
#define KV_QA512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

struct MaxPs {
  KV_QA512 static __m512 apply(__m512 u, __m512 v) { return _mm512_max_ps(u, v); }
};
struct AddEpi32 {  // int32 lanes carried in float vectors
  KV_QA512 static __m512 apply(__m512 u, __m512 v) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(u), _mm512_castps_si512(v)));
  }
};

// r[i]: 16 vectors; returns the vector whose lane i reduces r[i]'s lanes.
template <class Op>
KV_QA512 inline __m512 reduce16_ps(const __m512* r) {
  constexpr auto op = Op::apply;
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j) {
    a[j] =
        op(_mm512_unpacklo_ps(r[2 * j], r[2 * j + 1]), _mm512_unpackhi_ps(r[2 * j], r[2 * j + 1]));
  }
  // a[j] lane (L, e): r[2j + (e & 1)]'s elements {e >> 1, (e >> 1) + 2} of 128-bit lane L.
  for (int k = 0; k < 4; ++k) {
    const __m512d lo =
        _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * k]), _mm512_castps_pd(a[2 * k + 1]));
    const __m512d hi =
        _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * k]), _mm512_castps_pd(a[2 * k + 1]));
    b[k] = op(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // b[k] lane (L, e): r[4k + e]'s 128-bit lane L.
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 c0 =
      op(_mm512_shuffle_f32x4(b[0], b[1], kEven), _mm512_shuffle_f32x4(b[0], b[1], kOdd));
  const __m512 c1 =
      op(_mm512_shuffle_f32x4(b[2], b[3], kEven), _mm512_shuffle_f32x4(b[2], b[3], kOdd));
  return op(_mm512_shuffle_f32x4(c0, c1, kEven), _mm512_shuffle_f32x4(c0, c1, kOdd));
}

// 16 blocks from x: false (nothing written) if one holds a NaN.
KV_QA512 bool quantize_16_blocks_avx512(const float* x, int8_t* qs, float* d, float* s,
                                        int32_t* qsum) {
  __m512 m[16];
  __mmask16 nan = 0;
  for (int i = 0; i < 16; ++i) {
    const __m512 a = _mm512_loadu_ps(x + 32 * i), b = _mm512_loadu_ps(x + 32 * i + 16);
    nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    m[i] = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
  }
  if (nan != 0) return false;
  const __m512 amax = reduce16_ps<MaxPs>(m);
  const __m512 k127 = _mm512_set1_ps(127.f);
  const __m512 dv = _mm512_div_ps(amax, k127);
  const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  alignas(64) float id[16];
  _mm512_store_ps(id, _mm512_maskz_div_ps(nonzero, k127, amax));
  const int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  // Block i's two vectors of q, as int32; then 2 blocks' 64 bytes at once:
  // the lane-wise saturating packs leave 128-bit lane L holding dwords
  // (block i lo, block i hi, block i + 1 lo, block i + 1 hi) of elements
  // 4L..4L + 3, which the permute puts in element order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512 sums[16];
  for (int i = 0; i < 16; i += 2) {
    __m512i q[4];
    for (int h = 0; h < 4; ++h) {
      const __m512 v = _mm512_loadu_ps(x + 32 * i + 16 * h);
      q[h] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id[i + h / 2])), kRound);
    }
    sums[i] = _mm512_castsi512_ps(_mm512_add_epi32(q[0], q[1]));
    sums[i + 1] = _mm512_castsi512_ps(_mm512_add_epi32(q[2], q[3]));
    const __m512i p =
        _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
    _mm512_storeu_si512(qs + 32 * i, _mm512_permutexvar_epi32(order, p));
  }
  const __m512i sum = _mm512_castps_si512(reduce16_ps<AddEpi32>(sums));
  const int kF16 = _MM_FROUND_TO_NEAREST_INT;
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtps_ph(dv, kF16)));
  if (s != nullptr) {
    const __m512 ds = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sum));
    _mm512_storeu_ps(s, _mm512_cvtph_ps(_mm512_cvtps_ph(ds, kF16)));
  }
  if (qsum != nullptr) _mm512_storeu_si512(qsum, sum);
  return true;
}

KV_QA512 void quantize_act_q8_avx512(const float* x, int8_t* qs, float* d, float* s, int32_t* qsum,
                                     int64_t n) {
  const int64_t nb = n / kQK;
  int64_t b = 0;
  for (; b + 16 <= nb; b += 16) {
    if (quantize_16_blocks_avx512(x + b * kQK, qs + b * kQK, d + b, s ? s + b : nullptr,
                                  qsum ? qsum + b : nullptr)) {
      continue;
    }
    quantize_act_q8_avx2(x + b * kQK, qs + b * kQK, d + b, s ? s + b : nullptr,
                         qsum ? qsum + b : nullptr, 16 * kQK);
  }
  quantize_act_q8_avx2(x + b * kQK, qs + b * kQK, d + b, s ? s + b : nullptr,
                       qsum ? qsum + b : nullptr, (nb - b) * kQK);
}
#undef KV_QA512
#endif

bool quantize_avx512_usable() {
#if defined(__x86_64__)
  const CpuFeatures& f = cpu_features();
  return best_isa() >= Isa::kAvx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
#else
  return false;
#endif
}

}  // namespace

void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    uint16_t s16;
    quantize_block32_scalar(x + b * kQK, y[b].qs, &y[b].d, &s16);
  }
}

void quantize_row_q8_1(const float* x, BlockQ8_1* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    quantize_block32_scalar(x + b * kQK, y[b].qs, &y[b].d, &y[b].s);
  }
}

namespace {

// One q8_K super-block (256 values), the reference.
void quantize_block_q8_K_scalar(const float* x, BlockQ8_K& out) {
  float max = 0.f, amax = 0.f;
  for (int j = 0; j < kQK_K; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  if (amax == 0.f) {
    out.d = 0.f;
    std::memset(out.qs, 0, sizeof(out.qs));
    std::memset(out.bsums, 0, sizeof(out.bsums));
    return;
  }
  const float iscale = -127.f / max;
  for (int j = 0; j < kQK_K; ++j) {
    const int v = static_cast<int>(std::nearbyint(iscale * x[j]));
    out.qs[j] = static_cast<int8_t>(v > 127 ? 127 : v);
  }
  for (int g = 0; g < kQK_K / 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += out.qs[g * 16 + j];
    out.bsums[g] = static_cast<int16_t>(sum);
  }
  out.d = 1.f / iscale;
}

#if defined(__x86_64__)
// quantize_block_q8_K_scalar in 8 lanes, bit for bit: the same max (the
// first element of largest |x|; NaNs are skipped by both), the same rounded
// product iscale * x, half-to-even rounding and clamp, the same sums.
__attribute__((target("avx2,fma,f16c"))) void quantize_block_q8_K_avx2(const float* x,
                                                                       BlockQ8_K& out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int j = 0; j < kQK_K; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    mx = _mm256_max_ps(_mm256_and_ps(v, abs_mask), mx);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  // Zero, non-finite and NaN-holding blocks, and blocks so small that
  // -127 / max overflows, are the scalar code's (there NaN or infinite
  // products meet a float -> int conversion whose result only the scalar
  // code defines).
  if (amax == 0.f || !std::isfinite(amax) || _mm256_movemask_ps(nan) != 0 ||
      !std::isfinite(-127.f / amax)) {
    return quantize_block_q8_K_scalar(x, out);
  }
  const __m256 vmax = _mm256_set1_ps(amax);
  float max = 0.f;
  for (int j = 0; j < kQK_K; j += 8) {
    const int eq = _mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), vmax, _CMP_EQ_OQ));
    if (eq != 0) {
      max = x[j + __builtin_ctz(static_cast<unsigned>(eq))];
      break;
    }
  }
  const float iscale = -127.f / max;
  const __m256 vs = _mm256_set1_ps(iscale);
  const __m256i k127 = _mm256_set1_epi32(127);
  const int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int g = 0; g < kQK_K / 32; ++g) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_mul_ps(vs, _mm256_loadu_ps(x + 32 * g + 8 * k));
      q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_round_ps(v, kRound)), k127);
    }
    // bsums of the two 16-groups: (q0 + q1) and (q2 + q3), summed across lanes.
    const __m256i s = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    // s: [a01 a23 b01 b23 | a45 a67 b45 b67] (a: group 2g, b: group 2g + 1).
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_hadd_epi32(s4, s4);
    out.bsums[2 * g] = static_cast<int16_t>(_mm_cvtsi128_si32(s2));
    out.bsums[2 * g + 1] = static_cast<int16_t>(_mm_extract_epi32(s2, 1));
    // Values lie in [-128, 127]: the saturating packs are exact. Packs work
    // per 128-bit lane, so fix the order.
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qs + 32 * g), p);
  }
  out.d = 1.f / iscale;
}
#endif

}  // namespace

void quantize_row_q8_K(const float* x, BlockQ8_K* y, int64_t n) {
#if defined(__x86_64__)
  if (best_isa() >= Isa::kAvx2) {
    for (int64_t b = 0; b < n / kQK_K; ++b) quantize_block_q8_K_avx2(x + b * kQK_K, y[b]);
    return;
  }
#endif
  for (int64_t b = 0; b < n / kQK_K; ++b) quantize_block_q8_K_scalar(x + b * kQK_K, y[b]);
}

void quantize_act_q8(const float* x, int8_t* qs, float* d, float* s, int64_t n, int32_t* qsum) {
#if defined(__x86_64__)
  if (quantize_avx512_usable()) return quantize_act_q8_avx512(x, qs, d, s, qsum, n);
  if (best_isa() >= Isa::kAvx2) return quantize_act_q8_avx2(x, qs, d, s, qsum, n);
#endif
  quantize_act_q8_scalar(x, qs, d, s, qsum, n);
}

}  // namespace kvstack

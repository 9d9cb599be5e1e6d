// Internal to kvstack_ops: k-quant (Q4_K, Q5_K, Q6_K) super-block unpacking
// shared by the AVX2 and AVX-512 k-quant kernels. Every function carries its
// own target attribute; call only after a run-time AVX2 check.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "core/ggml_types.h"
#include "core/half.h"

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvstack::ops_detail {

KV_AVX2 inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// k-quant 6-bit scale/min pair j (0..7), as in the scalar reference.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One weight super-block unpacked for dotting with any number of activation
// rows: q[i] holds 32 unsigned quants (elements 32 i .. 32 i + 31) and sc[i]
// the int16 multipliers of their maddubs pairs (one scale per 32 elements
// for Q4_K/Q5_K, per 16 for Q6_K).
struct UnpackedK {
  __m256i q[8];
  __m256i sc[8];
  int mn[8];      // Q4_K/Q5_K: per-32 mins
  int scale[16];  // per-16 scale: Q6_K's scales; Q4_K/Q5_K: sc of the 32-block
  float d, dmin;
};

template <bool kFive>
KV_AVX2 inline void unpack_q45_k(const uint8_t* blk_bytes, UnpackedK* u) {
  const uint8_t* qs;
  const uint8_t* scales;
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFive) {
    const auto* blk = reinterpret_cast<const BlockQ5_K*>(blk_bytes);
    qs = blk->qs;
    scales = blk->scales;
    qh = load256(blk->qh);
    u->d = f16_to_f32(blk->d);
    u->dmin = f16_to_f32(blk->dmin);
  } else {
    const auto* blk = reinterpret_cast<const BlockQ4_K*>(blk_bytes);
    qs = blk->qs;
    scales = blk->scales;
    u->d = f16_to_f32(blk->d);
    u->dmin = f16_to_f32(blk->dmin);
  }
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i one = _mm256_set1_epi8(1);
  for (int chunk = 0; chunk < 4; ++chunk) {
    const __m256i v = load256(qs + 32 * chunk);
    __m256i lo = _mm256_and_si256(v, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (kFive) {
      const int j = 2 * chunk;
      lo = _mm256_or_si256(lo,
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
      hi = _mm256_or_si256(
          hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j + 1), one), 4));
    }
    u->q[2 * chunk] = lo;
    u->q[2 * chunk + 1] = hi;
  }
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(j, scales, &sc, &mn);
    u->sc[j] = _mm256_set1_epi16(static_cast<int16_t>(sc));
    u->mn[j] = mn;
    u->scale[2 * j] = u->scale[2 * j + 1] = sc;
  }
}

// Q6_K: q + 32 in 0..63 (unsigned for maddubs); the offset is taken back as
// 32 * sum_g scale_g * bsum_g, exact in integers.
KV_AVX2 inline void unpack_q6_k(const uint8_t* blk_bytes, UnpackedK* u) {
  const auto* blk = reinterpret_cast<const BlockQ6_K*>(blk_bytes);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; ++half) {
    const __m256i ql0 = load256(blk->ql + 64 * half);
    const __m256i ql1 = load256(blk->ql + 64 * half + 32);
    const __m256i qh = load256(blk->qh + 32 * half);
    __m256i* q = u->q + 4 * half;
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                           _mm256_and_si256(qh, bits45));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
  }
  for (int g = 0; g < 16; ++g) {
    u->scale[g] = static_cast<int>(blk->scales[g]);  // NOLINT(bugprone-signed-char-misuse): signed
  }
  for (int i = 0; i < 8; ++i) {
    // Elements 32 i .. 32 i + 15 are group 2 i (pairs 0..7), the rest 2 i + 1.
    u->sc[i] = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(u->scale[2 * i])),
                                 _mm_set1_epi16(static_cast<int16_t>(u->scale[2 * i + 1])));
  }
  u->d = f16_to_f32(blk->d);
  u->dmin = 0.f;
}

}  // namespace kvstack::ops_detail

#endif  // __x86_64__

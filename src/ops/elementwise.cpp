#include "ops/elementwise.h"

#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvstack {

void rms_norm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
              float* out) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float mean = static_cast<float>(sum / static_cast<double>(n));
    const float s = 1.0f / std::sqrt(mean + eps);
    if (weight) {
      for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * s) * weight[i];
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * s;
    }
  }
}

void rope(float* x, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          const RopeParams& p) {
  KV_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim,
           "rope: n_rot must be even and in (0, head_dim]");
  const int half = p.n_rot / 2;
  const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
  thread_local std::vector<float> cs;  // [half] (cos, sin) pairs for the current token
  if (cs.size() < static_cast<size_t>(p.n_rot)) cs.resize(p.n_rot);
  for (int64_t t = 0; t < n_tokens; ++t) {
    // theta_i = pos * theta_scale^i, as a running float product (as ggml does).
    float theta = static_cast<float>(pos[t]);
    for (int i = 0; i < half; ++i) {
      const float a = theta * p.freq_scale;
      cs[2 * i] = std::cos(a);
      cs[2 * i + 1] = std::sin(a);
      theta *= theta_scale;
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        float* a = p.style == RopeStyle::kNormal ? v + 2 * i : v + i;
        float* b = p.style == RopeStyle::kNormal ? v + 2 * i + 1 : v + i + half;
        const float x0 = *a, x1 = *b;
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
      }
    }
  }
}

namespace {

void swiglu_scalar(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

#if defined(__x86_64__)
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

// exp(x) for 8 floats, within ~2 ulp of std::exp: x = k ln2 + r with
// k = round(x / ln2) and |r| <= ln2 / 2 (ln2 split in a high part exact in
// float and a low part), exp(r) by its degree-7 Taylor polynomial (truncation
// < 6e-9 relative), times 2^k built in the exponent bits. Inputs above
// 88.72 give +inf, below -87.33 give 0 (where the result would be subnormal).
KV_AVX2 inline __m256 exp8(__m256 x) {
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
  // 2^k as 2^kc * 2^(k - kc), kc = k clamped to [-126, 127], so k = 128 (x
  // just under the overflow threshold) still gives a finite result.
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

KV_AVX2 inline __m256 swiglu8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

// The tail goes through the same 8-wide code (padded), so every element's
// bits depend only on its own inputs, not on n or its position.
KV_AVX2 void swiglu_avx2(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, swiglu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    alignas(32) float g[8] = {}, u[8] = {}, o[8];
    for (int64_t j = i; j < n; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    _mm256_store_ps(o, swiglu8(_mm256_load_ps(g), _mm256_load_ps(u)));
    for (int64_t j = i; j < n; ++j) out[j] = o[j - i];
  }
}
#endif

}  // namespace

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
#if defined(__x86_64__)
  if (best_isa() >= Isa::kAvx2) return swiglu_avx2(gate, up, out, n);
#endif
  swiglu_scalar(gate, up, out, n);
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void mul(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

void scale(float* x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace kvstack

#include "ops/elementwise.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/cpu_features.h"
#include "core/half.h"
#include "ops/simd_avx2.h"

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -Wmaybe-uninitialized reports inside the
// system header (GCC bug 105593); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "ops/simd_avx512.h"
// SIMD functions opt in per function (the build baseline is generic x86-64).
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace kvstack {

namespace {

// Sum of squares in sequential order, in double: the reference (and ggml's
// order). Each square is exact in double (24-bit mantissas).
double sum_squares_scalar(const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

void rms_norm_row_scalar(const float* x, const float* weight, int64_t n, float eps, float* out) {
  const float mean = static_cast<float>(sum_squares_scalar(x, n) / static_cast<double>(n));
  const float s = 1.0f / std::sqrt(mean + eps);
  if (weight) {
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * s) * weight[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * s;
  }
}

#if defined(__x86_64__)

// The same sum in double, 16 lanes at a time: lane j of 16 accumulates the
// elements i = j (mod 16) of the 16-aligned prefix (in order), the 4-element
// step after it goes to lanes 0-3, the lanes are summed pairwise in a fixed
// order and the last n % 4 elements are added sequentially. The order depends
// only on n, so a row's bits do not depend on its address or its batch.
KV_AVX2 double sum_squares_avx2(const float* x, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v0));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(v1));
    const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1));
    a0 = _mm256_fmadd_pd(d0, d0, a0);
    a1 = _mm256_fmadd_pd(d1, d1, a1);
    a2 = _mm256_fmadd_pd(d2, d2, a2);
    a3 = _mm256_fmadd_pd(d3, d3, a3);
  }
  for (; i + 4 <= n; i += 4) {
    const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    a0 = _mm256_fmadd_pd(d, d, a0);
  }
  const __m256d a = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  double sum = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  for (; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

// Same formula as the scalar row; the scaling is two rounded multiplies
// (no FMA), so for equal sums the output bits equal the scalar path's.
KV_AVX2 void rms_norm_row_avx2(const float* x, const float* weight, int64_t n, float eps,
                               float* out) {
  const float mean = static_cast<float>(sum_squares_avx2(x, n) / static_cast<double>(n));
  const float s = 1.0f / std::sqrt(mean + eps);
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  if (weight) {
    for (; i + 8 <= n; i += 8) {
      const __m256 xs = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(xs, _mm256_loadu_ps(weight + i)));
    }
    for (; i < n; ++i) out[i] = (x[i] * s) * weight[i];
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    for (; i < n; ++i) out[i] = x[i] * s;
  }
}
#endif

}  // namespace

void rms_norm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
              float* out) {
#if defined(__x86_64__)
  if (best_isa() >= Isa::kAvx2) {
    for (int64_t r = 0; r < n_rows; ++r) rms_norm_row_avx2(x + r * n, weight, n, eps, out + r * n);
    return;
  }
#endif
  for (int64_t r = 0; r < n_rows; ++r) rms_norm_row_scalar(x + r * n, weight, n, eps, out + r * n);
}

namespace {

// The (cos, sin) table of one rope call, per thread, with the positions and
// parameters it was built for. The forward pass ropes Q and K of every layer
// with the same positions, so a step builds the table once instead of
// 2 * n_layers times. It holds n_tokens * n_rot floats, less than the Q rows
// being rotated.
struct RopeTable {
  int n_rot = 0;
  float freq_base = 0.f, freq_scale = 0.f;
  std::vector<int32_t> pos;  // [n_tokens]
  std::vector<float> cs;     // [n_tokens, n_rot / 2, 2]: (cos, sin) of each pair's angle

  bool matches(const int32_t* p, int64_t n_tokens, const RopeParams& params) const {
    return n_rot == params.n_rot && freq_base == params.freq_base &&
           freq_scale == params.freq_scale && std::ssize(pos) == n_tokens &&
           std::equal(pos.begin(), pos.end(), p);
  }

  void build(const int32_t* p, int64_t n_tokens, const RopeParams& params) {
    n_rot = params.n_rot;
    freq_base = params.freq_base;
    freq_scale = params.freq_scale;
    pos.assign(p, p + n_tokens);
    const int half = n_rot / 2;
    const float theta_scale = std::pow(freq_base, -2.0f / static_cast<float>(n_rot));
    cs.resize(static_cast<size_t>(n_tokens) * n_rot);
    for (int64_t t = 0; t < n_tokens; ++t) {
      float* c = cs.data() + t * n_rot;
      // theta_i = pos * theta_scale^i, as a running float product (as ggml does).
      float theta = static_cast<float>(p[t]);
      for (int i = 0; i < half; ++i) {
        const float a = theta * freq_scale;
        c[2 * i] = std::cos(a);
        c[2 * i + 1] = std::sin(a);
        theta *= theta_scale;
      }
    }
  }
};

}  // namespace

void rope(float* x, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          const RopeParams& p) {
  KV_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim,
           "rope: n_rot must be even and in (0, head_dim]");
  const int half = p.n_rot / 2;
  thread_local RopeTable table;
  if (!table.matches(pos, n_tokens, p)) table.build(pos, n_tokens, p);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* cs = table.cs.data() + t * p.n_rot;
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
KV_AVX2 inline __m256 swiglu8(__m256 g, __m256 u) {
  const __m256 e = simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
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

namespace {

#if defined(__x86_64__)
// 8 lanes each keep their first largest value and its index (strict >), two
// vectors per step so the compare/blend chains overlap; then the largest
// lane value, and among the lanes holding it the smallest index, which is
// the first occurrence overall. The tail is scanned after (larger indices,
// so again strict >).
KV_AVX2 int64_t argmax_avx2(const float* x, int64_t n) {
  if (n < 16 || n > INT32_MAX) return std::max_element(x, x + n) - x;
  __m256 best0 = _mm256_loadu_ps(x), best1 = _mm256_loadu_ps(x + 8);
  __m256i idx0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i idx1 = _mm256_add_epi32(idx0, _mm256_set1_epi32(8));
  __m256i cur0 = _mm256_add_epi32(idx0, _mm256_set1_epi32(16)),
          cur1 = _mm256_add_epi32(idx1, _mm256_set1_epi32(16));
  const __m256i step = _mm256_set1_epi32(16);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    const __m256 g0 = _mm256_cmp_ps(v0, best0, _CMP_GT_OQ),
                 g1 = _mm256_cmp_ps(v1, best1, _CMP_GT_OQ);
    best0 = _mm256_blendv_ps(best0, v0, g0);
    best1 = _mm256_blendv_ps(best1, v1, g1);
    idx0 = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(idx0), _mm256_castsi256_ps(cur0), g0));
    idx1 = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(idx1), _mm256_castsi256_ps(cur1), g1));
    cur0 = _mm256_add_epi32(cur0, step);
    cur1 = _mm256_add_epi32(cur1, step);
  }
  alignas(32) float bv[16];
  alignas(32) int32_t bi[16];
  _mm256_store_ps(bv, best0);
  _mm256_store_ps(bv + 8, best1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), idx0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi + 8), idx1);
  int64_t best = bi[0];
  float m = bv[0];
  for (int l = 1; l < 16; ++l) {
    if (bv[l] > m || (bv[l] == m && bi[l] < best)) {
      m = bv[l];
      best = bi[l];
    }
  }
  for (; i < n; ++i) {
    if (x[i] > m) {
      m = x[i];
      best = i;
    }
  }
  return best;
}
#endif

}  // namespace

int64_t argmax(const float* x, int64_t n) {
  KV_CHECK(n >= 1, "argmax: empty row");
#if defined(__x86_64__)
  if (best_isa() >= Isa::kAvx2) return argmax_avx2(x, n);
#endif
  return std::max_element(x, x + n) - x;
}

#if defined(__x86_64__)
namespace {

#define KV_AVX512 __attribute__((target("avx512f,avx2,fma")))

KV_AVX512 inline __m512 swiglu16(__m512 g, __m512 u) {
  const __m512 e = simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

// swiglu_avx2 on 16 lanes (the same bits per element); the tail is one
// masked 16-lane step.
KV_AVX512 void swiglu_avx512(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, swiglu16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  }
  if (i < n) {
    const auto m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(
        out + i, m, swiglu16(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

}  // namespace
#endif

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
#if defined(__x86_64__)
  if (best_isa() >= Isa::kAvx512 && cpu_features().avx512f) {
    return swiglu_avx512(gate, up, out, n);
  }
  if (best_isa() >= Isa::kAvx2) return swiglu_avx2(gate, up, out, n);
#endif
  swiglu_scalar(gate, up, out, n);
}

float gelu_tanh(float x) {
  constexpr float kCoefA = 0.044715f;
  constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + kCoefA * x * x)));
}

namespace {

// f16 bits of gelu_tanh(h) for every f16 bit pattern h (128 KiB, built once).
const std::vector<uint16_t>& gelu_f16_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(1u << 16);
    for (uint32_t i = 0; i < (1u << 16); ++i) {
      t[i] = f32_to_f16(gelu_tanh(f16_to_f32(static_cast<uint16_t>(i))));
    }
    return t;
  }();
  return table;
}

void geglu_scalar(const uint16_t* table, const float* gate, const float* up, float* out,
                  int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    if (g <= -10.0f) {
      out[i] = 0.0f;
    } else if (g >= 10.0f) {
      out[i] = g * up[i];
    } else {
      out[i] = f16_to_f32(table[f32_to_f16(g)]) * up[i];
    }
  }
}

#if defined(__x86_64__)
// 8 lanes of geglu_scalar, bit for bit: F16C's float -> f16 conversion rounds
// to nearest even like f32_to_f16 (subnormals included), the table is read by
// a masked gather (lanes outside (-10, 10) read nothing), and the product is
// one rounded multiply. A block with a NaN gate goes through the scalar code
// (its comparisons and NaN payloads are the scalar function's).
KV_AVX2 void geglu_avx2(const uint16_t* table, const float* gate, const float* up, float* out,
                        int64_t n) {
  const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
  const int* table32 = reinterpret_cast<const int*>(table);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 u = _mm256_loadu_ps(up + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(g, g, _CMP_UNORD_Q)) != 0) {
      geglu_scalar(table, gate + i, up + i, out + i, 8);
      continue;
    }
    const __m256 mid =
        _mm256_and_ps(_mm256_cmp_ps(g, lo, _CMP_GT_OQ), _mm256_cmp_ps(g, hi, _CMP_LT_OQ));
    const __m256 big = _mm256_cmp_ps(g, hi, _CMP_GE_OQ);
    const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT));
    // Two bytes past an index are read too; every index used (|value| < 10)
    // lies well inside the 65536-entry table.
    const __m256i t = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), table32, h,
                                                  _mm256_castps_si256(mid), 2);
    const __m128i t16 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256()),
        0x08));
    const __m256 gelu = _mm256_blendv_ps(_mm256_cvtph_ps(t16), g, big);
    // Gates <= -10 give +0 whatever up holds (as the scalar code stores 0).
    _mm256_storeu_ps(out + i, _mm256_and_ps(_mm256_mul_ps(gelu, u), _mm256_or_ps(mid, big)));
  }
  geglu_scalar(table, gate + i, up + i, out + i, n - i);
}
#endif

}  // namespace

void geglu(const float* gate, const float* up, float* out, int64_t n) {
  const uint16_t* table = gelu_f16_table().data();
#if defined(__x86_64__)
  if (best_isa() >= Isa::kAvx2) return geglu_avx2(table, gate, up, out, n);
#endif
  geglu_scalar(table, gate, up, out, n);
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

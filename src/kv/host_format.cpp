#include "kv/host_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu_features.h"
#include "core/half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KV_HOSTFMT_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace kvstack {

Result<HostFormat> parse_host_format(const std::string& s) {
  if (s == "pool") return HostFormat::kPool;
  if (s == "int8") return HostFormat::kInt8;
  return make_error(Errc::kInvalidArgument,
                    "--kv-host-format: '" + s + "' is not a host format (pool or int8)");
}

const char* host_format_name(HostFormat f) {
  return f == HostFormat::kInt8 ? "int8" : "pool";
}

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The group's scale (as stored, f16) and the multiplier codes are made with.
void group_scale(float amax, uint16_t* s16, float* inv) {
  // The smallest f16 >= amax / 127: no code needs clamping, and a group of
  // subnormal values keeps a nonzero scale.
  const float want = amax / 127.0f;
  *s16 = f32_to_f16(want);
  if (f16_to_f32(*s16) < want) ++*s16;
  const float s = f16_to_f32(*s16);
  *inv = s > 0 ? 1.0f / s : 0.0f;
}

}  // namespace

void encode_int8_block_scalar(const uint8_t* f16, int64_t pool_bytes, uint8_t* out) {
  const int64_t n = pool_bytes / 2;
  const int64_t groups = n / kInt8GroupValues;
  auto* codes = reinterpret_cast<int8_t*>(out + 2 * groups);
  for (int64_t g = 0; g < groups; ++g) {
    float x[kInt8GroupValues];
    float amax = 0;
    for (int64_t i = 0; i < kInt8GroupValues; ++i) {
      uint16_t h;
      std::memcpy(&h, f16 + 2 * (g * kInt8GroupValues + i), 2);
      x[i] = f16_to_f32(h);
      if (!(std::fabs(x[i]) < kInf)) x[i] = 0;  // inf and NaN are stored as 0
      amax = std::max(amax, std::fabs(x[i]));
    }
    uint16_t s16;
    float inv;
    group_scale(amax, &s16, &inv);
    std::memcpy(out + 2 * g, &s16, 2);
    for (int64_t i = 0; i < kInt8GroupValues; ++i) {
      const float q = std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f);
      codes[g * kInt8GroupValues + i] = static_cast<int8_t>(q);
    }
  }
}

void decode_int8_block_scalar(const uint8_t* in, int64_t pool_bytes, uint8_t* f16) {
  const int64_t n = pool_bytes / 2;
  const int64_t groups = n / kInt8GroupValues;
  const auto* codes = reinterpret_cast<const int8_t*>(in + 2 * groups);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t s16;
    std::memcpy(&s16, in + 2 * g, 2);
    const float s = f16_to_f32(s16);
    for (int64_t i = 0; i < kInt8GroupValues; ++i) {
      // Clamped to the f16 range: s * 127 may pass 65504 by up to s / 2.
      const float v =
          std::clamp(s * static_cast<float>(codes[g * kInt8GroupValues + i]), -kF16Max, kF16Max);
      const uint16_t h = f32_to_f16(v);
      std::memcpy(f16 + 2 * (g * kInt8GroupValues + i), &h, 2);
    }
  }
}

#if defined(__x86_64__)
namespace {

KV_HOSTFMT_AVX2 void encode_avx2(const uint8_t* f16, int64_t pool_bytes, uint8_t* out) {
  const int64_t n = pool_bytes / 2;
  const int64_t groups = n / kInt8GroupValues;
  auto* codes = out + 2 * groups;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(kInf);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = f16 + 2 * g * kInt8GroupValues;
    __m256 x[4];
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      x[k] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k)));
      const __m256 a = _mm256_andnot_ps(sign, x[k]);
      const __m256 finite = _mm256_cmp_ps(a, inf, _CMP_LT_OQ);  // false for inf and NaN
      x[k] = _mm256_and_ps(x[k], finite);
      amax = _mm256_max_ps(amax, _mm256_and_ps(a, finite));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    uint16_t s16;
    float inv;
    group_scale(_mm_cvtss_f32(m), &s16, &inv);
    std::memcpy(out + 2 * g, &s16, 2);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      // Rounds to nearest even (MXCSR default), as std::nearbyint does.
      const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x[k], vinv), lo), hi);
      q[k] = _mm256_cvtps_epi32(v);
    }
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + g * kInt8GroupValues), b);
  }
}

KV_HOSTFMT_AVX2 void decode_avx2(const uint8_t* in, int64_t pool_bytes, uint8_t* f16) {
  const int64_t n = pool_bytes / 2;
  const int64_t groups = n / kInt8GroupValues;
  const uint8_t* codes = in + 2 * groups;
  const __m256 fmin = _mm256_set1_ps(-kF16Max), fmax = _mm256_set1_ps(kF16Max);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t s16;
    std::memcpy(&s16, in + 2 * g, 2);
    const __m256 s = _mm256_set1_ps(f16_to_f32(s16));
    const uint8_t* c = codes + g * kInt8GroupValues;
    uint8_t* dst = f16 + 2 * g * kInt8GroupValues;
    for (int k = 0; k < 4; ++k) {
      const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k));
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)), s);
      v = _mm256_min_ps(_mm256_max_ps(v, fmin), fmax);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * k),
                       _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
}

bool use_avx2() {
  const CpuFeatures& f = cpu_features();
  return f.avx2 && f.fma && f.f16c && best_isa() >= Isa::kAvx2;
}

}  // namespace
#endif

void encode_int8_block(const uint8_t* f16, int64_t pool_bytes, uint8_t* out) {
#if defined(__x86_64__)
  if (use_avx2()) return encode_avx2(f16, pool_bytes, out);
#endif
  encode_int8_block_scalar(f16, pool_bytes, out);
}

void decode_int8_block(const uint8_t* in, int64_t pool_bytes, uint8_t* f16) {
#if defined(__x86_64__)
  if (use_avx2()) return decode_avx2(in, pool_bytes, f16);
#endif
  decode_int8_block_scalar(in, pool_bytes, f16);
}

}  // namespace kvstack

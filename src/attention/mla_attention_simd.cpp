// AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL) tile functions of the MLA latent
// attention (mla_attention_kernels.h). The functions are written once, as
// templates over an ISA traits struct (mla_attention_simd_impl.h), and
// instantiated below for Avx2Ops and Avx512Ops: the impl is included once per
// ISA inside its own namespace with MLA_TARGET set to that ISA's target
// attribute, so each instantiation is compiled for its own instruction set
// (the file itself is compiled for generic x86-64, like the project's other
// ISA-specific files) and mla_tile_fns() hands a table out only after
// checking the CPU (cpu_features()). Each ISA keeps its own horizontal-sum
// order and register blocking; the results are those of the two hand-written
// copies this replaced, bit for bit.
//
// Per tile of n <= 16 keys and H heads (d = d_c + d_R, rows padded to dpad):
//   decode: n rows -> f32 buffer (f16 via vcvtph2ps, bf16 by a shift, int8
//           codes widened and times the row's f16 scale: fused dequant);
//   scores: H x n dot products; 2 heads x 4 keys share their loads;
//   softmax: the online update per head (running max m, sum l, the factor
//           f = e^(m_old - m_new) the accumulator is rescaled by), in AVX2;
//   accum:  acc_h = f_h acc_h + sum_j w_hj c_j over d_c; 4 heads x 4 (AVX2:
//           2) vectors of accumulators stay in registers over the tile, so
//           each loaded latent vector feeds 4 heads;
//   gemm:   the expanded prefill's f32 up-projection, 6 rows x 64 columns
//           of accumulators per block (AVX2: 6 x 16);
//   to_f16: f32 -> f16 (vcvtps2ph, round to nearest even).
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -W(maybe-)uninitialized reports inside the
// system header (GCC bug 105593, as in ops/matmul_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "attention/mla_attention_kernels.h"
#include "core/half.h"
#include "ops/simd_avx2.h"

#define MLA_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MLA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace kvstack::mla_detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scalar element decode for row tails (d not a multiple of the vector width).
inline float decode_one(KvDtype dt, const uint8_t* row, int i, float int8_scale) {
  switch (dt) {
    case KvDtype::kF32: {
      float v;
      std::memcpy(&v, row + 4 * static_cast<int64_t>(i), 4);
      return v;
    }
    case KvDtype::kF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * static_cast<int64_t>(i), 2);
      return f16_to_f32(h);
    }
    case KvDtype::kBF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * static_cast<int64_t>(i), 2);
      return bf16_to_f32(h);
    }
    case KvDtype::kInt8:
      return int8_scale * static_cast<float>(static_cast<int8_t>(row[i]));
    default:
      return 0.0f;
  }
}

inline float int8_row_scale(KvDtype dt, const uint8_t* meta) {
  if (dt != KvDtype::kInt8) return 0.0f;
  uint16_t h;
  std::memcpy(&h, meta, 2);
  return f16_to_f32(h);
}

// ---- softmax (shared by both ISAs: AVX-512 CPUs have AVX2) ----

MLA_AVX2 inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
MLA_AVX2 inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// s[h][0..n) scores -> weights e^(s - m_new) (0 past n); m, l updated;
// f[h] = e^(m_old - m_new) (0 while nothing was accumulated).
MLA_AVX2 void softmax_tile(float* s, int H, int n, float* m, float* l, float* f) {
  const __m256i idx_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i idx_hi = _mm256_add_epi32(idx_lo, _mm256_set1_epi32(8));
  const __m256i nv = _mm256_set1_epi32(n);
  const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, idx_lo));
  const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, idx_hi));
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  for (int h = 0; h < H; ++h) {
    float* row = s + static_cast<int64_t>(h) * kMlaTile;
    const __m256 a = _mm256_blendv_ps(ninf, _mm256_loadu_ps(row), keep_lo);
    const __m256 b = _mm256_blendv_ps(ninf, _mm256_loadu_ps(row + 8), keep_hi);
    const float mx = hmax8(_mm256_max_ps(a, b));
    const float m_new = mx > m[h] ? mx : m[h];
    f[h] = m[h] == kNegInf ? 0.0f : std::exp(m[h] - m_new);
    const __m256 mv = _mm256_set1_ps(m_new);
    const __m256 ea = _mm256_and_ps(simd::exp8(_mm256_sub_ps(a, mv)), keep_lo);
    const __m256 eb = _mm256_and_ps(simd::exp8(_mm256_sub_ps(b, mv)), keep_hi);
    _mm256_storeu_ps(row, ea);
    _mm256_storeu_ps(row + 8, eb);
    l[h] = l[h] * f[h] + hsum8(_mm256_add_ps(ea, eb));
    m[h] = m_new;
  }
}

// ---- ISA traits (mla_attention_simd_impl.h lists what the templates use) ----

struct Avx2Ops {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kAccVecs = 2;   // accum: 4 heads x 2 vectors of accumulators
  static constexpr int kGemmVecs = 2;  // gemm: 6 rows x 2 vectors
  MLA_AVX2 static V zero() { return _mm256_setzero_ps(); }
  MLA_AVX2 static V load(const float* p) { return _mm256_loadu_ps(p); }
  MLA_AVX2 static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  MLA_AVX2 static V set1(float x) { return _mm256_set1_ps(x); }
  MLA_AVX2 static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  MLA_AVX2 static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  MLA_AVX2 static float reduce_add(V v) { return hsum8(v); }
  MLA_AVX2 static V load_f16(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  MLA_AVX2 static V load_bf16(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  MLA_AVX2 static V load_i8(const uint8_t* p) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
  }
  MLA_AVX2 static void store_f16(uint16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

struct Avx512Ops {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kAccVecs = 4;   // accum: 4 heads x 4 vectors (then 1 for the tail)
  static constexpr int kGemmVecs = 4;  // gemm: 6 rows x 4 vectors
  MLA_AVX512 static V zero() { return _mm512_setzero_ps(); }
  MLA_AVX512 static V load(const float* p) { return _mm512_loadu_ps(p); }
  MLA_AVX512 static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  MLA_AVX512 static V set1(float x) { return _mm512_set1_ps(x); }
  MLA_AVX512 static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  MLA_AVX512 static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  MLA_AVX512 static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  MLA_AVX512 static V load_f16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  MLA_AVX512 static V load_bf16(const uint8_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  MLA_AVX512 static V load_i8(const uint8_t* p) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  }
  MLA_AVX512 static void store_f16(uint16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

// ---- the instantiations, one namespace per ISA ----

namespace isa_avx2 {
#define MLA_TARGET MLA_AVX2
#include "attention/mla_attention_simd_impl.h"
#undef MLA_TARGET
const MlaTileFns kFns{decode<Avx2Ops>, scores<Avx2Ops>, softmax_tile,
                      accum<Avx2Ops>,  gemm<Avx2Ops>,   to_f16<Avx2Ops>};
}  // namespace isa_avx2

namespace isa_avx512 {
#define MLA_TARGET MLA_AVX512
#include "attention/mla_attention_simd_impl.h"
#undef MLA_TARGET
const MlaTileFns kFns{decode<Avx512Ops>, scores<Avx512Ops>, softmax_tile,
                      accum<Avx512Ops>,  gemm<Avx512Ops>,   to_f16<Avx512Ops>};
}  // namespace isa_avx512

}  // namespace

const MlaTileFns* mla_tile_fns(Isa isa) {
  const CpuFeatures& c = cpu_features();
  const bool avx2 = c.avx2 && c.fma && c.f16c;
  if (isa == Isa::kAvx512) {
    return avx2 && c.avx512f && c.avx512bw && c.avx512vl ? &isa_avx512::kFns : nullptr;
  }
  if (isa == Isa::kAvx2) return avx2 ? &isa_avx2::kFns : nullptr;
  return nullptr;
}

}  // namespace kvstack::mla_detail

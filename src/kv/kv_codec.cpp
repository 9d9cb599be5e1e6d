#include "kv/kv_codec.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include <immintrin.h>

#include "core/check.h"
#include "core/cpu_features.h"
#include "core/half.h"
#include "kv/kv_codec_avx512.h"

namespace kvstack {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kBf16Max = std::bit_cast<float>(0x7f7f0000u);  // the largest finite bf16

// f16 bits of the smallest f16 >= x (x >= 0, finite, <= kF16Max).
uint16_t f16_round_up(float x) {
  uint16_t h = f32_to_f16(x);
  if (f16_to_f32(h) < x) ++h;  // positive: the next bit pattern is the next value
  return h;
}

// f16 bits of the largest f16 <= x (|x| <= kF16Max).
uint16_t f16_round_down(float x) {
  uint16_t h = f32_to_f16(x);
  if (f16_to_f32(h) <= x) return h;
  if ((h & 0x8000u) == 0) return h == 0 ? uint16_t{0x8001u} : static_cast<uint16_t>(h - 1);
  return static_cast<uint16_t>(h + 1);  // negative: larger magnitude
}

void store_u16(uint8_t* p, uint16_t v) {
  std::memcpy(p, &v, 2);
}
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

std::array<float, 256> make_fp8_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 0xf;
    const int m = c & 7;
    float v;
    if (e == 0xf && m == 7) {
      v = std::nanf("");
    } else if (e == 0) {
      v = std::ldexp(static_cast<float>(m), -9);
    } else {
      v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
    }
    t[c] = (c & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> t = make_fp8_table();
  return t;
}

}  // namespace

Result<KvRowGeometry> kv_row_geometry(KvDtype dtype, int head_dim) {
  const int64_t d = head_dim;
  switch (dtype) {
    case KvDtype::kF32:
    case KvDtype::kF16:
    case KvDtype::kBF16:
      return KvRowGeometry{.row_bytes = d * kv_dtype_bytes(dtype)};
    case KvDtype::kFp8:
      return KvRowGeometry{.row_bytes = d, .meta_block_bytes = 4};
    case KvDtype::kInt8:
      return KvRowGeometry{.row_bytes = d, .meta_row_bytes = 2};
    case KvDtype::kInt4:
      if (head_dim % 32 != 0) {
        return make_error(Errc::kUnsupported, "KV dtype int4 needs head_dim % 32 == 0 (head_dim " +
                                                  std::to_string(head_dim) + ")");
      }
      return KvRowGeometry{.row_bytes = d / 2, .meta_row_bytes = d / 32 * 4};
    case KvDtype::kKivi2:
    case KvDtype::kKivi4:
      return make_error(Errc::kInvalidArgument,
                        "KV dtype " + std::string(kv_dtype_name(dtype)) +
                            " is not a per-row format (its geometry is in kivi_codec.h)");
  }
  return make_error(Errc::kInvalidArgument, "unknown KV dtype");
}

int64_t kv_head_bytes(const KvRowGeometry& g, int64_t n_tokens, int block_size) {
  const int64_t n_blocks = (n_tokens + block_size - 1) / block_size;
  return n_tokens * (g.row_bytes + g.meta_row_bytes) + n_blocks * g.meta_block_bytes;
}

namespace {

// Float formats: the stored value must be finite (f16 overflows above 65519.99,
// bf16 above its largest finite value plus half an ulp).
Status validate_float_values(KvDtype dtype, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      return make_error(Errc::kInvalidArgument, std::string("element ") + std::to_string(i) +
                                                    " is " + (std::isnan(x[i]) ? "nan" : "inf") +
                                                    "; the KV cache stores only finite values");
    }
    // A value within the format's finite range cannot round outside it:
    // only the rare larger ones need the conversion (which would otherwise
    // dominate this per-step check).
    const float max_finite = dtype == KvDtype::kF16    ? kF16Max
                             : dtype == KvDtype::kBF16 ? kBf16Max
                                                       : INFINITY;
    if (std::fabs(x[i]) <= max_finite) continue;
    const float stored = dtype == KvDtype::kF16    ? f16_to_f32(f32_to_f16(x[i]))
                         : dtype == KvDtype::kBF16 ? bf16_to_f32(f32_to_bf16(x[i]))
                                                   : x[i];
    if (!std::isfinite(stored)) {
      return make_error(Errc::kInvalidArgument, "element " + std::to_string(i) + " = " +
                                                    std::to_string(x[i]) + " overflows KV dtype " +
                                                    kv_dtype_name(dtype));
    }
  }
  return {};
}

}  // namespace

namespace {

// True when every |x[i]| <= bound (false for a NaN): one branch-free pass,
// the common case of the per-step check.
bool all_within(const float* x, int64_t n, float bound) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::fabs(x[i]) <= bound;
  return ok;
}

}  // namespace

Status kv_validate_values(KvDtype dtype, const float* x, int64_t n) {
  // Values no larger than the bound pass every check below (finite, within
  // the format's finite range or its metadata's); the rest take the checks.
  const float bound = kv_dtype_is_kivi(dtype) || dtype == KvDtype::kF16 ? kF16Max
                      : dtype == KvDtype::kBF16                         ? kBf16Max
                      : dtype == KvDtype::kInt8                         ? kF16Max * 127.0f
                      : dtype == KvDtype::kInt4                         ? kF16Max
                                                : std::numeric_limits<float>::max();
  if (all_within(x, n, bound)) return {};
  // KIVI rows enter the cache as f16 (the residual) before their group is
  // quantized: f16 range, checked like f16.
  if (kv_dtype_is_kivi(dtype)) return validate_float_values(KvDtype::kF16, x, n);
  if (!kv_dtype_is_quantized(dtype)) return validate_float_values(dtype, x, n);
  // int8: the f16 scale amax / 127 must be finite; int4: min and scale are f16.
  const float limit = dtype == KvDtype::kInt8   ? kF16Max * 127.0f
                      : dtype == KvDtype::kInt4 ? kF16Max
                                                : INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      return make_error(Errc::kInvalidArgument, std::string("element ") + std::to_string(i) +
                                                    " is " + (std::isnan(x[i]) ? "nan" : "inf") +
                                                    "; KV dtype " + kv_dtype_name(dtype) +
                                                    " stores only finite values");
    }
    if (std::fabs(x[i]) > limit) {
      return make_error(Errc::kInvalidArgument,
                        "element " + std::to_string(i) + " = " + std::to_string(x[i]) +
                            " exceeds the range of KV dtype " + kv_dtype_name(dtype) +
                            " (|x| <= " + std::to_string(limit) + ", its metadata is f16)");
    }
  }
  return {};
}

Status kv_validate_rows(const PagedKvLayerView& view, int64_t pos, const float* k_rows,
                        const float* v_rows, int64_t n_tokens) {
  const int64_t d = view.head_dim;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < view.n_kv_heads; ++h) {
      const int64_t row = (t * view.n_kv_heads + h) * d;
      for (int which = 0; which < 2; ++which) {
        if (which == 1 && view.v == nullptr) continue;
        const Status st = kv_validate_values(which == 0 ? view.dtype : view.value_dtype(),
                                             (which == 0 ? k_rows : v_rows) + row, d);
        if (!st.ok()) {
          return make_error(Errc::kInvalidArgument, std::string(which == 0 ? "K" : "V") +
                                                        " of position " + std::to_string(pos + t) +
                                                        ", head " + std::to_string(h) + ": " +
                                                        st.error().message);
        }
      }
    }
  }
  return {};
}

uint8_t fp8_e4m3_from_f32(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  float a = std::fabs(x);
  if (a >= kFp8Max) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (code 8 is 2^-6)
    const float q = std::nearbyint(a * 512.0f);
    return sign | static_cast<uint8_t>(q);
  }
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  // a = (1 + m/8) * 2^(e-1); mantissa steps of 2^(e-4).
  const float m = std::nearbyint((f * 2.0f - 1.0f) * 8.0f);
  int exp = e - 1 + 7;
  int mant = static_cast<int>(m);
  if (mant == 8) {
    mant = 0;
    ++exp;
  }
  const int code = (exp << 3) | mant;
  return sign | static_cast<uint8_t>(std::min(code, 0x7e));
}

float fp8_e4m3_to_f32(uint8_t code) {
  return fp8_table()[code];
}

float fp8_scale_for(float amax) {
  if (!(amax > 0.0f)) return 0.0f;
  int k = 0;
  const float f = std::frexp(amax / kFp8Max, &k);  // amax/448 = f * 2^k, f in [0.5, 1)
  int e = f == 0.5f ? k - 1 : k;
  e = std::clamp(e, -126, 127);
  return std::ldexp(1.0f, e);
}

void fp8_encode_row(const float* x, int d, float scale, uint8_t* codes) {
  if (scale == 0.0f) {
    std::memset(codes, 0, static_cast<size_t>(d));
    return;
  }
  const float inv = 1.0f / scale;  // exact: scale is a power of two
  for (int i = 0; i < d; ++i) codes[i] = fp8_e4m3_from_f32(x[i] * inv);
}

namespace {

// The row's f16 scale: amax / 127 rounded up (at least the smallest f16
// step for a nonzero row).
uint16_t int8_row_scale(float amax) {
  uint16_t s16 = f16_round_up(amax / 127.0f);
  if (amax > 0.0f && s16 == 0) s16 = 1;
  return s16;
}

void int8_encode_row_scalar(const float* x, int d, uint8_t* codes, uint8_t* meta) {
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t s16 = int8_row_scale(amax);
  const float s = f16_to_f32(s16);
  store_u16(meta, s16);
  for (int i = 0; i < d; ++i) {
    const float q = s > 0.0f ? std::nearbyint(x[i] / s) : 0.0f;
    codes[i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
  }
}

// int8_encode_row_scalar with 8 lanes: the maximum does not depend on the
// order, vdivps and vroundps (nearest even) round like x / s and
// std::nearbyint, and the clamp is exact, so the same bits. A row holding a
// NaN (std::max skips it; the lanes would not) or an infinity, or d % 8 != 0,
// goes the scalar way (returns false).
__attribute__((target("avx2,fma"))) bool int8_encode_row_avx2(const float* x, int d, uint8_t* codes,
                                                              uint8_t* meta) {
  if (d % 8 != 0) return false;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  for (int i = 0; i < d; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, _mm256_and_ps(v, abs_mask));
  }
  if (_mm256_movemask_ps(nan) != 0) return false;
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  if (!std::isfinite(amax)) return false;  // an infinite element: the scalar way too
  const uint16_t s16 = int8_row_scale(amax);
  const float s = f16_to_f32(s16);
  store_u16(meta, s16);
  if (!(s > 0.0f)) {
    std::memset(codes, 0, static_cast<size_t>(d));
    return true;
  }
  const __m256 sv = _mm256_set1_ps(s);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int i = 0; i < d; i += 8) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    const __m256i w = _mm256_cvtps_epi32(q);
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(h, h));
  }
  return true;
}

}  // namespace

void int8_encode_row(const float* x, int d, uint8_t* codes, uint8_t* meta) {
  if (best_isa() >= Isa::kAvx2 && cpu_features().avx2 && int8_encode_row_avx2(x, d, codes, meta)) {
    return;
  }
  int8_encode_row_scalar(x, d, codes, meta);
}

namespace {

// The per-element work of asym_quant_fit's two loops, on contiguous x, in
// arrays: scalar, and AVX2 with the same IEEE operations per element
// (vdivps/vroundps/vfmadd are correctly rounded like their scalar
// counterparts), so both give the same bits. The double sums over the
// arrays stay sequential in the caller, in the same order.

// l[i] = clamp(nearbyint(iscale * (x[i] - mn)), 0, qmax).
void fit_codes_scalar(const float* x, int n, float iscale, float mn, float qmax, float* l) {
  for (int i = 0; i < n; ++i) l[i] = std::clamp(std::nearbyint(iscale * (x[i] - mn)), 0.0f, qmax);
}

// c[i] = clamp(nearbyint((x[i] - m) / s), 0, qmax) (0 when s is 0),
// e2[i] = (fma(s, c, m) - x[i])^2 in double.
void asym_codes_scalar(const float* x, int n, float s, float m, float qmax, float* c, double* e2) {
  for (int i = 0; i < n; ++i) {
    c[i] = s > 0.0f ? std::clamp(std::nearbyint((x[i] - m) / s), 0.0f, qmax) : 0.0f;
    const double e = static_cast<double>(std::fma(s, c[i], m)) - x[i];
    e2[i] = e * e;
  }
}

#define KV_CODEC_AVX2 __attribute__((target("avx2,fma")))

KV_CODEC_AVX2 inline __m256 clamp_round8(__m256 v, __m256 qmax) {
  v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // std::clamp(v, 0, qmax): v < 0 -> 0, qmax < v -> qmax (v is never NaN).
  return _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), qmax);
}

KV_CODEC_AVX2 void fit_codes_avx2(const float* x, int n, float iscale, float mn, float qmax,
                                  float* l) {
  const __m256 is = _mm256_set1_ps(iscale), mv = _mm256_set1_ps(mn), qv = _mm256_set1_ps(qmax);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(is, _mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(l + i, clamp_round8(v, qv));
  }
  fit_codes_scalar(x + i, n - i, iscale, mn, qmax, l + i);
}

// asym_codes_scalar for s > 0.
KV_CODEC_AVX2 void asym_codes_avx2(const float* x, int n, float s, float m, float qmax, float* c,
                                   double* e2) {
  const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m), qv = _mm256_set1_ps(qmax);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 ci = clamp_round8(_mm256_div_ps(_mm256_sub_ps(v, mv), sv), qv);
    _mm256_storeu_ps(c + i, ci);
    const __m256 r = _mm256_fmadd_ps(sv, ci, mv);
    const __m256d lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(r)),
                                     _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    const __m256d hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)),
                                     _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    _mm256_storeu_pd(e2 + i, _mm256_mul_pd(lo, lo));
    _mm256_storeu_pd(e2 + i + 4, _mm256_mul_pd(hi, hi));
  }
  asym_codes_scalar(x + i, n - i, s, m, qmax, c + i, e2 + i);
}

// Codes of the n values of x for (scale, min) = (s, m) to q, and the squared
// error of their decoded values fma(s, q, m).
double asym_codes(bool avx2, const float* x, int n, float s, float m, int qmax, uint8_t* q) {
  float c[kAsymQuantMaxN];
  double e2[kAsymQuantMaxN];
  if (avx2 && s > 0.0f) {
    asym_codes_avx2(x, n, s, m, static_cast<float>(qmax), c, e2);
  } else {
    asym_codes_scalar(x, n, s, m, static_cast<float>(qmax), c, e2);
  }
  double err = 0.0;
  for (int i = 0; i < n; ++i) {
    q[i] = static_cast<uint8_t>(c[i]);
    err += e2[i];
  }
  return err;
}

// The least-squares (s, m) of n codes l with sums sl, sll, slx (of l, l*l,
// l*x) and sx (of x), rounded to f16: false where the codes are all equal or
// the fit is not a positive scale and a min within the f16 range.
bool asym_solve(int n, double sl, double sll, double slx, double sx, uint16_t* s16, uint16_t* m16) {
  const double det = n * sll - sl * sl;  // 0 when every code is equal
  if (!(det > 0.0)) return false;
  const double s_fit = (n * slx - sl * sx) / det;
  const double m_fit = (sll * sx - sl * slx) / det;
  if (!(s_fit > 0.0) || s_fit > kF16Max || std::fabs(m_fit) > kF16Max) return false;
  *s16 = f32_to_f16(static_cast<float>(s_fit));
  *m16 = f32_to_f16(static_cast<float>(m_fit));
  return true;
}

// The inverse scale of search candidate k (-10..10): a range of qmax + k/10
// steps over [mn, mx].
float asym_candidate_iscale(int k, float qmax, float mn, float mx) {
  return (qmax + 0.1f * static_cast<float>(k)) / (mx - mn);
}

// asym_quant_fit_isa's candidate loop with the candidates in AVX-512 lanes
// (kv_codec_avx512.h): the same sums, the same fits (asym_solve's) and the same
// errors per candidate, and the same choice (the first candidate in k order
// whose error is below every earlier one and below the min-max fit's `best`),
// so the same bits. Updates *best_s, *best_m and q only when a candidate wins.
void asym_search_avx512(const float* x, int n, float mn, float mx, double sx, int qmax, double best,
                        uint16_t* best_s, uint16_t* best_m, uint8_t* q) {
  const float qf = static_cast<float>(qmax);
  float iscale[kAsymFitLanes], s[kAsymFitLanes], m[kAsymFitLanes];
  double sl[kAsymFitLanes], sll[kAsymFitLanes], slx[kAsymFitLanes], err[kAsymFitLanes];
  for (int c = 0; c < kAsymFitLanes; ++c) {
    iscale[c] = asym_candidate_iscale(std::min(c, kAsymFitCandidates - 1) - 10, qf, mn, mx);
  }
  asym_fit_sums_avx512(x, n, mn, iscale, qf, sl, sll, slx);
  uint16_t s16[kAsymFitLanes], m16[kAsymFitLanes];
  const uint32_t ok = asym_fit_solve_avx512(n, sx, sl, sll, slx, s16, m16, s, m);
  asym_fit_errors_avx512(x, n, s, m, qf, err);
  int win = -1;
  for (int c = 0; c < kAsymFitCandidates; ++c) {
    if ((ok >> c & 1u) != 0 && err[c] < best) {
      best = err[c];
      win = c;
    }
  }
  if (win < 0) return;
  *best_s = s16[win];
  *best_m = m16[win];
  asym_codes(true, x, n, s[win], m[win], qmax, q);
}

}  // namespace

void asym_quant_fit(int bits, const float* x, int64_t stride, int n, uint16_t* scale, uint16_t* min,
                    uint8_t* q) {
  asym_quant_fit_isa(best_isa(), bits, x, stride, n, scale, min, q);
}

void asym_quant_fit_isa(Isa isa, int bits, const float* xs, int64_t stride, int n, uint16_t* scale,
                        uint16_t* min, uint8_t* q) {
  KV_CHECK(n >= 1 && n <= kAsymQuantMaxN && bits >= 1 && bits <= 8, "asym_quant_fit: bad shape");
  const bool avx2 = isa >= Isa::kAvx2 && cpu_features().avx2 && cpu_features().fma;
  const bool avx512 = avx2 && isa >= Isa::kAvx512 && cpu_features().avx512f &&
                      cpu_features().avx512vl && cpu_features().f16c;
  float x[kAsymQuantMaxN];  // contiguous copy (KIVI keys run along tokens)
  for (int i = 0; i < n; ++i) x[i] = xs[i * stride];
  const int qmax = (1 << bits) - 1;
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
  }
  // Min-max: min rounded down and scale up, so that no code clamps.
  uint16_t best_m = f16_round_down(mn);
  const float range = (mx - f16_to_f32(best_m)) / static_cast<float>(qmax);
  uint16_t best_s = range > 0.0f ? f16_round_up(range) : 0;
  if (range > 0.0f && best_s == 0) best_s = 1;
  double best = asym_codes(avx2, x, n, f16_to_f32(best_s), f16_to_f32(best_m), qmax, q);
  if (!(mx > mn) || best == 0.0) {  // constant or exactly representable group
    *scale = best_s;
    *min = best_m;
    return;
  }
  double sx = 0;
  for (int i = 0; i < n; ++i) sx += x[i];
  if (avx512) {
    asym_search_avx512(x, n, mn, mx, sx, qmax, best, &best_s, &best_m, q);
    *scale = best_s;
    *min = best_m;
    return;
  }
  uint8_t t[kAsymQuantMaxN];
  float lv[kAsymQuantMaxN];
  // Ranges of qmax - 1 .. qmax + 1 steps over [mn, mx].
  for (int k = -10; k <= 10; ++k) {
    const float iscale = asym_candidate_iscale(k, static_cast<float>(qmax), mn, mx);
    if (avx2) {
      fit_codes_avx2(x, n, iscale, mn, static_cast<float>(qmax), lv);
    } else {
      fit_codes_scalar(x, n, iscale, mn, static_cast<float>(qmax), lv);
    }
    double sl = 0, sll = 0, slx = 0;
    for (int i = 0; i < n; ++i) {
      const double l = lv[i];
      sl += l;
      sll += l * l;
      slx += l * x[i];
    }
    uint16_t s16, m16;
    if (!asym_solve(n, sl, sll, slx, sx, &s16, &m16)) continue;
    const double e = asym_codes(avx2, x, n, f16_to_f32(s16), f16_to_f32(m16), qmax, t);
    if (e < best) {
      best = e;
      best_s = s16;
      best_m = m16;
      std::memcpy(q, t, static_cast<size_t>(n));
    }
  }
  *scale = best_s;
  *min = best_m;
}

void int4_encode_row(const float* x, int d, uint8_t* codes, uint8_t* meta) {
  for (int g = 0; g < d / 32; ++g) {
    uint16_t s16, m16;
    uint8_t q[32];
    asym_quant_fit(4, x + 32 * g, 1, 32, &s16, &m16, q);
    store_u16(meta + 4 * g, s16);
    store_u16(meta + 4 * g + 2, m16);
    uint8_t* cg = codes + 16 * g;
    for (int j = 0; j < 16; ++j) cg[j] = static_cast<uint8_t>(q[j] | (q[16 + j] << 4));
  }
}

void kv_decode_row(KvDtype dtype, const uint8_t* row, const uint8_t* meta, int d, float* out) {
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(out, row, sizeof(float) * static_cast<size_t>(d));
      return;
    case KvDtype::kF16:
      for (int i = 0; i < d; ++i) out[i] = f16_to_f32(load_u16(row + 2 * i));
      return;
    case KvDtype::kBF16:
      for (int i = 0; i < d; ++i) out[i] = bf16_to_f32(load_u16(row + 2 * i));
      return;
    case KvDtype::kFp8: {
      float scale;
      std::memcpy(&scale, meta, 4);
      for (int i = 0; i < d; ++i) out[i] = scale * fp8_e4m3_to_f32(row[i]);
      return;
    }
    case KvDtype::kInt8: {
      const float s = f16_to_f32(load_u16(meta));
      for (int i = 0; i < d; ++i) out[i] = s * static_cast<float>(static_cast<int8_t>(row[i]));
      return;
    }
    case KvDtype::kInt4:
      for (int g = 0; g < d / 32; ++g) {
        const float s = f16_to_f32(load_u16(meta + 4 * g));
        const float m = f16_to_f32(load_u16(meta + 4 * g + 2));
        for (int j = 0; j < 16; ++j) {
          const uint8_t b = row[16 * g + j];
          out[32 * g + j] = std::fma(s, static_cast<float>(b & 0xf), m);
          out[32 * g + 16 + j] = std::fma(s, static_cast<float>(b >> 4), m);
        }
      }
      return;
    case KvDtype::kKivi2:
    case KvDtype::kKivi4:
      break;  // not per-row formats: kivi_codec.h decodes them
  }
  KV_CHECK(false, "kv_decode_row: not a per-row KV dtype");
}

void kv_encode_row(KvDtype dtype, const float* x, int d, uint8_t* row, uint8_t* meta) {
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(row, x, sizeof(float) * static_cast<size_t>(d));
      return;
    case KvDtype::kF16:
      for (int i = 0; i < d; ++i) store_u16(row + 2 * i, f32_to_f16(x[i]));
      return;
    case KvDtype::kBF16:
      for (int i = 0; i < d; ++i) store_u16(row + 2 * i, f32_to_bf16(x[i]));
      return;
    case KvDtype::kInt8:
      return int8_encode_row(x, d, row, meta);
    case KvDtype::kInt4:
      return int4_encode_row(x, d, row, meta);
    case KvDtype::kFp8:
      KV_CHECK(false, "kv_encode_row: fp8 rows are encoded with their block's scale");
      return;
    case KvDtype::kKivi2:
    case KvDtype::kKivi4:
      break;  // not per-row formats: kivi_codec.h encodes them
  }
  KV_CHECK(false, "kv_encode_row: not a per-row KV dtype");
}

}  // namespace kvstack

// AVX2+FMA+F16C tile kernels. Every function that uses these instructions
// carries the target attribute; the file is compiled for generic x86-64 and
// is only entered after a run-time check (core/cpu_features.h).
//
// K/V are consumed in chunks of kChunk consecutive logical positions whose
// row addresses come from the block table, so a chunk may span blocks and
// block size 1 costs no more than contiguous storage. f16/bf16 rows are
// widened in registers as they are loaded.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/attention_kernels.h"

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvstack::attn_detail {
namespace {

constexpr int kChunk = 32;  // keys per chunk (multiple of 16)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <KvDtype DT>
constexpr int kElemBytes = DT == KvDtype::kF32 ? 4 : 2;

// Eight consecutive elements of a K/V row, widened to f32.
template <KvDtype DT>
KV_AVX2 inline __m256 load8(const uint8_t* p) {
  if constexpr (DT == KvDtype::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (DT == KvDtype::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

// e^x for x <= 88; returns exactly 0 for x < -87 (and for -inf). Range
// reduction x = n ln2 + r, |r| <= ln2/2, then the degree-7 Taylor polynomial:
// truncation error r^8/8! < 6e-9, so the result is within a few ulp.
KV_AVX2 inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

KV_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KV_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane i of the result is the horizontal sum of v[i].
KV_AVX2 inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

KV_AVX2 inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]);
  const __m256 t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]);
  const __m256 t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]);
  const __m256 t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]);
  const __m256 t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44);
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44);
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44);
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44);
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Row addresses of positions [t0, t0 + n) of one head, walking the table.
inline void chunk_rows(const KeySource& ks, int32_t t0, int n, const uint8_t** kp,
                       const uint8_t** vp) {
  int32_t blk = t0 / ks.block_size;
  int32_t off = t0 % ks.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t o = ks.block_table[blk] * ks.block_stride + off * ks.slot_stride;
    kp[j] = ks.k_head + o;
    vp[j] = ks.v_head + o;
    if (++off == ks.block_size) {
      off = 0;
      ++blk;
    }
  }
}

// ---------------------------------------------------------------- decode --

// s[h * kChunk + j] = qs[h] . K_j for SG heads and n_pad keys (n_pad a
// multiple of J). J keys at a time share each q load; the SG * J dot
// products are reduced together by one hadd tree.
template <KvDtype DT, int SG, int J>
KV_AVX2 void qk_chunk(const float* qs, int d, const uint8_t* const* kp, int n_pad, float* s) {
  static_assert(SG * J <= 8);
  constexpr int eb = kElemBytes<DT>;
  for (int j0 = 0; j0 < n_pad; j0 += J) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      __m256 qv[SG];
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) qv[h] = _mm256_loadu_ps(qs + h * d + c);
#pragma GCC unroll 8
      for (int jj = 0; jj < J; ++jj) {
        const __m256 kv = load8<DT>(kp[j0 + jj] + c * eb);
#pragma GCC unroll 8
        for (int h = 0; h < SG; ++h) acc[h * J + jj] = _mm256_fmadd_ps(qv[h], kv, acc[h * J + jj]);
      }
    }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, hsum8(acc));
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
#pragma GCC unroll 8
      for (int jj = 0; jj < J; ++jj) s[h * kChunk + j0 + jj] = tmp[h * J + jj];
    }
  }
}

// acc[h] = alpha[h] * acc[h] + sum_j p[h * kChunk + j] V_j for SG heads.
template <KvDtype DT, int SG>
KV_AVX2 void pv_chunk(const float* p, const uint8_t* const* vp, int n, const float* alpha,
                      float* acc, int d) {
  constexpr int eb = kElemBytes<DT>;
  int c = 0;
  for (; c + 16 <= d; c += 16) {
    __m256 a0[SG], a1[SG];
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
      const __m256 al = _mm256_broadcast_ss(alpha + h);
      a0[h] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c), al);
      a1[h] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c + 8), al);
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = load8<DT>(vp[j] + c * eb);
      const __m256 v1 = load8<DT>(vp[j] + (c + 8) * eb);
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) {
        const __m256 pb = _mm256_broadcast_ss(p + h * kChunk + j);
        a0[h] = _mm256_fmadd_ps(pb, v0, a0[h]);
        a1[h] = _mm256_fmadd_ps(pb, v1, a1[h]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
      _mm256_storeu_ps(acc + h * d + c, a0[h]);
      _mm256_storeu_ps(acc + h * d + c + 8, a1[h]);
    }
  }
  if (c < d) {  // d % 16 == 8
    __m256 a0[SG];
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
      a0[h] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c), _mm256_broadcast_ss(alpha + h));
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = load8<DT>(vp[j] + c * eb);
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) {
        a0[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * kChunk + j), v0, a0[h]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) _mm256_storeu_ps(acc + h * d + c, a0[h]);
  }
}

// Keys loaded together per q head count: SG * J <= 8 accumulators.
constexpr int keys_per_step(int sg) {
  return sg == 1 ? 8 : sg == 2 ? 4 : 2;
}

template <KvDtype DT>
KV_AVX2 void qk_dispatch(int sg, const float* qs, int d, const uint8_t** kp, int n, float* s) {
  const int j = keys_per_step(sg);
  const int n_pad = (n + j - 1) / j * j;
  for (int x = n; x < n_pad; ++x) kp[x] = kp[0];  // finite filler, scores dropped below
  switch (sg) {
    case 1:
      qk_chunk<DT, 1, 8>(qs, d, kp, n_pad, s);
      break;
    case 2:
      qk_chunk<DT, 2, 4>(qs, d, kp, n_pad, s);
      break;
    case 3:
      qk_chunk<DT, 3, 2>(qs, d, kp, n_pad, s);
      break;
    default:
      qk_chunk<DT, 4, 2>(qs, d, kp, n_pad, s);
      break;
  }
}

template <KvDtype DT>
KV_AVX2 void pv_dispatch(int sg, const float* p, const uint8_t* const* vp, int n,
                         const float* alpha, float* acc, int d) {
  switch (sg) {
    case 1:
      pv_chunk<DT, 1>(p, vp, n, alpha, acc, d);
      break;
    case 2:
      pv_chunk<DT, 2>(p, vp, n, alpha, acc, d);
      break;
    case 3:
      pv_chunk<DT, 3>(p, vp, n, alpha, acc, d);
      break;
    default:
      pv_chunk<DT, 4>(p, vp, n, alpha, acc, d);
      break;
  }
}

// Online-softmax update of one query vector over a chunk of n scores at s
// (s padded to kChunk in place). Leaves p = exp(s - m_new) in s, returns the
// rescale factor of the previous state. An all-masked chunk leaves the state
// unchanged (alpha 1, p 0).
KV_AVX2 inline float softmax_update(float* s, int n, float* m, float* l) {
  for (int j = n; j < kChunk; ++j) s[j] = kNegInf;
  __m256 mx = _mm256_loadu_ps(s);
  for (int j = 8; j < kChunk; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
  const float m_new = std::max(*m, hmax(mx));
  if (m_new == kNegInf) {
    std::memset(s, 0, sizeof(float) * kChunk);
    return 1.0f;
  }
  const float alpha = std::exp(*m - m_new);  // 0 when *m is -inf
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < kChunk; j += 8) {
    const __m256 pj = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, pj);
    sum = _mm256_add_ps(sum, pj);
  }
  *l = *l * alpha + hsum(sum);
  *m = m_new;
  return alpha;
}

inline void finish_tile(const TileArgs& a, int n_vec, const float* acc, const float* m,
                        const float* l) {
  const int d = a.keys.head_dim;
  for (int i = 0; i < n_vec; ++i) {
    const float* ai = acc + static_cast<size_t>(i) * d;
    if (a.part_acc != nullptr) {
      a.part_m[i] = m[i];
      a.part_l[i] = l[i];
      std::memcpy(a.part_acc + static_cast<size_t>(i) * d, ai, sizeof(float) * d);
    } else {
      // One query row: vector i is q head i of the tile (any n_heads).
      float* dst = a.n_rows == 1 ? a.out + static_cast<size_t>(i) * d
                                 : a.out + (i / a.group) * a.row_stride + (i % a.group) * d;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int c = 0; c < d; ++c) dst[c] = ai[c] * inv;
    }
  }
}

template <KvDtype DT>
KV_AVX2 void decode_tile_impl(const TileArgs& a) {
  const int d = a.keys.head_dim;
  const int g = a.group;
  const int n_vec = g * a.n_heads;  // query vectors: q heads of every KV head in the tile
  // Scratch: qs, acc [n_vec, d]; s [n_vec, kChunk]; m, l, alpha [n_vec].
  float* base = thread_scratch().get(static_cast<size_t>(n_vec) * (2 * d + kChunk + 3));
  float* qs = base;
  float* acc = qs + static_cast<size_t>(n_vec) * d;
  float* s = acc + static_cast<size_t>(n_vec) * d;
  float* m = s + static_cast<size_t>(n_vec) * kChunk;
  float* l = m + n_vec;
  float* alpha = l + n_vec;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int h = 0; h < n_vec; ++h) {
    for (int c = 0; c < d; c += 8) {
      _mm256_storeu_ps(qs + h * d + c, _mm256_mul_ps(_mm256_loadu_ps(a.q + h * d + c), scale));
      _mm256_storeu_ps(acc + h * d + c, _mm256_setzero_ps());
    }
    m[h] = kNegInf;
    l[h] = 0.0f;
  }
  // Heads of a group in sub-groups of at most 4, as even as possible; the
  // K/V chunk of a KV head comes from memory once and from L1 for the later
  // sub-groups.
  const int n_sub = (g + 3) / 4;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, a.pos0 + 1);
  // Rows of the next chunk (every KV head of the tile) are prefetched while
  // this one is computed: with scattered blocks the hardware prefetcher loses
  // the stream at every block boundary, and decode is bound by memory.
  const int row_bytes = d * kElemBytes<DT>;
  const uint8_t* rows[2][2][kChunk];  // [buffer][K, V][key], KV head 0 of the tile
  const uint8_t* hk[kChunk + 8];      // one KV head's rows (+ padding for qk_dispatch)
  const uint8_t* hv[kChunk];
  int cur = 0;
  if (t_begin < t_end) {
    chunk_rows(a.keys, t_begin, std::min<int32_t>(kChunk, t_end - t_begin), rows[0][0], rows[0][1]);
  }
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    const uint8_t** kp = rows[cur][0];
    const uint8_t** vp = rows[cur][1];
    if (c0 + kChunk < t_end) {
      const int n_next = std::min<int32_t>(kChunk, t_end - c0 - kChunk);
      const uint8_t** kn = rows[cur ^ 1][0];
      const uint8_t** vn = rows[cur ^ 1][1];
      chunk_rows(a.keys, c0 + kChunk, n_next, kn, vn);
      for (int hh = 0; hh < a.n_heads; ++hh) {
        const int64_t ho = hh * a.head_stride;
        for (int j = 0; j < n_next; ++j) {
          for (int b = 0; b < row_bytes; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kn[j] + ho + b), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vn[j] + ho + b), _MM_HINT_T0);
          }
        }
      }
    }
    cur ^= 1;
    for (int hh = 0; hh < a.n_heads; ++hh) {
      const int64_t ho = hh * a.head_stride;
      for (int j = 0; j < n; ++j) {
        hk[j] = kp[j] + ho;
        hv[j] = vp[j] + ho;
      }
      const int v0 = hh * g;  // first query vector of this KV head
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
        qk_dispatch<DT>(sg, qs + h0 * d, d, hk, n, s + h0 * kChunk);
        h0 += sg;
      }
      for (int h = v0; h < v0 + g; ++h) {
        alpha[h] = softmax_update(s + h * kChunk, n, m + h, l + h);
      }
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
        pv_dispatch<DT>(sg, s + h0 * kChunk, hv, n, alpha + h0, acc + h0 * d, d);
        h0 += sg;
      }
    }
  }
  finish_tile(a, n_vec, acc, m, l);
}

// --------------------------------------------------------------- prefill --

// A tile of up to n_vec query vectors (padded to a multiple of 4) against
// chunks of kChunk keys: S = Qs Kt (4 x 16 register blocks), online softmax
// per vector with causal/window masking, O = alpha O + P V. The chunk's K is
// transposed (and widened) into a kChunk-wide L1 tile because every query
// vector reuses it; V is widened into an L1 tile unless already f32.
template <KvDtype DT>
KV_AVX2 void prefill_tile_impl(const TileArgs& a) {
  constexpr int eb = kElemBytes<DT>;
  const int d = a.keys.head_dim;
  const int g = a.group;
  const int n_vec = a.n_rows * g;
  const int n_vp = (n_vec + 3) / 4 * 4;
  // Scratch: qs, o [n_vp, d]; s [n_vp, kChunk]; kt [d, kChunk]; vc [kChunk, d];
  // m, l, alpha [n_vp].
  const size_t n_floats =
      static_cast<size_t>(n_vp) * (2 * d + kChunk + 3) + 2 * static_cast<size_t>(kChunk) * d;
  float* qs = thread_scratch().get(n_floats);
  float* o = qs + static_cast<size_t>(n_vp) * d;
  float* s = o + static_cast<size_t>(n_vp) * d;
  float* kt = s + static_cast<size_t>(n_vp) * kChunk;
  float* vc = kt + static_cast<size_t>(kChunk) * d;
  float* m = vc + static_cast<size_t>(kChunk) * d;
  float* l = m + n_vp;
  float* alpha = l + n_vp;

  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int i = 0; i < n_vp; ++i) {
    const float* src = a.q + (i / g) * a.row_stride + (i % g) * d;
    for (int c = 0; c < d; c += 8) {
      const __m256 qv =
          i < n_vec ? _mm256_mul_ps(_mm256_loadu_ps(src + c), scale) : _mm256_setzero_ps();
      _mm256_storeu_ps(qs + i * d + c, qv);
      _mm256_storeu_ps(o + i * d + c, _mm256_setzero_ps());
    }
    m[i] = kNegInf;
    l[i] = 0.0f;
    alpha[i] = 1.0f;
  }

  const int32_t pos_last = a.pos0 + a.n_rows - 1;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, pos_last + 1);
  const uint8_t* kp[kChunk];
  const uint8_t* vp[kChunk];
  const float* vr[kChunk];
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    chunk_rows(a.keys, c0, n, kp, vp);
    for (int j = n; j < kChunk; ++j) kp[j] = kp[0];  // finite filler, masked below
    for (int j0 = 0; j0 < kChunk; j0 += 8) {
      for (int c = 0; c < d; c += 8) {
        __m256 r[8];
#pragma GCC unroll 8
        for (int x = 0; x < 8; ++x) r[x] = load8<DT>(kp[j0 + x] + c * eb);
        transpose8(r);
#pragma GCC unroll 8
        for (int x = 0; x < 8; ++x) _mm256_storeu_ps(kt + (c + x) * kChunk + j0, r[x]);
      }
    }
    for (int j = 0; j < n; ++j) {
      if constexpr (DT == KvDtype::kF32) {
        vr[j] = reinterpret_cast<const float*>(vp[j]);
      } else {
        float* dst = vc + static_cast<size_t>(j) * d;
        for (int c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, load8<DT>(vp[j] + c * eb));
        vr[j] = dst;
      }
    }

    // S = Qs Kt, 4 vectors x 16 keys per register block.
    const int n_kb = n > 16 ? 2 : 1;
    for (int i0 = 0; i0 < n_vp; i0 += 4) {
      for (int kb = 0; kb < n_kb; ++kb) {
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float* kcol = kt + kb * 16;
        for (int c = 0; c < d; ++c) {
          const __m256 k0 = _mm256_loadu_ps(kcol + c * kChunk);
          const __m256 k1 = _mm256_loadu_ps(kcol + c * kChunk + 8);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            const __m256 qb = _mm256_broadcast_ss(qs + (i0 + r) * d + c);
            acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          _mm256_storeu_ps(s + (i0 + r) * kChunk + kb * 16, acc[r][0]);
          _mm256_storeu_ps(s + (i0 + r) * kChunk + kb * 16 + 8, acc[r][1]);
        }
      }
    }

    for (int i = 0; i < n_vec; ++i) {
      float* si = s + static_cast<size_t>(i) * kChunk;
      const int32_t pos = a.pos0 + i / g;
      const int32_t lo = first_visible(pos, a.window);
      if (c0 < lo || c0 + n - 1 > pos) {
        for (int j = 0; j < n; ++j) {
          if (c0 + j > pos || c0 + j < lo) si[j] = kNegInf;
        }
      }
      alpha[i] = softmax_update(si, n, m + i, l + i);
    }
    for (int i = n_vec; i < n_vp; ++i) std::memset(s + i * kChunk, 0, sizeof(float) * kChunk);

    // O = alpha O + P V, 4 vectors x 16 dims per register block.
    for (int i0 = 0; i0 < n_vp; i0 += 4) {
      const float* p0 = s + static_cast<size_t>(i0) * kChunk;
      int c = 0;
      for (; c + 16 <= d; c += 16) {
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const __m256 al = _mm256_broadcast_ss(alpha + i0 + r);
          acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + (i0 + r) * d + c), al);
          acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + (i0 + r) * d + c + 8), al);
        }
        for (int j = 0; j < n; ++j) {
          const __m256 v0 = _mm256_loadu_ps(vr[j] + c);
          const __m256 v1 = _mm256_loadu_ps(vr[j] + c + 8);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            const __m256 pb = _mm256_broadcast_ss(p0 + r * kChunk + j);
            acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          _mm256_storeu_ps(o + (i0 + r) * d + c, acc[r][0]);
          _mm256_storeu_ps(o + (i0 + r) * d + c + 8, acc[r][1]);
        }
      }
      if (c < d) {  // d % 16 == 8
        __m256 acc[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          acc[r] = _mm256_mul_ps(_mm256_loadu_ps(o + (i0 + r) * d + c),
                                 _mm256_broadcast_ss(alpha + i0 + r));
        }
        for (int j = 0; j < n; ++j) {
          const __m256 v0 = _mm256_loadu_ps(vr[j] + c);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + r * kChunk + j), v0, acc[r]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + (i0 + r) * d + c, acc[r]);
      }
    }
  }
  finish_tile(a, n_vec, o, m, l);
}

}  // namespace

void decode_tile_avx2(const TileArgs& a) {
  switch (a.keys.dtype) {
    case KvDtype::kF32:
      decode_tile_impl<KvDtype::kF32>(a);
      return;
    case KvDtype::kF16:
      decode_tile_impl<KvDtype::kF16>(a);
      return;
    case KvDtype::kBF16:
      decode_tile_impl<KvDtype::kBF16>(a);
      return;
    default:  // quantized formats take attention_quant_*.cpp
      return;
  }
}

void prefill_tile_avx2(const TileArgs& a) {
  switch (a.keys.dtype) {
    case KvDtype::kF32:
      prefill_tile_impl<KvDtype::kF32>(a);
      return;
    case KvDtype::kF16:
      prefill_tile_impl<KvDtype::kF16>(a);
      return;
    case KvDtype::kBF16:
      prefill_tile_impl<KvDtype::kBF16>(a);
      return;
    default:  // quantized formats take attention_quant_*.cpp
      return;
  }
}

}  // namespace kvstack::attn_detail

// AVX2+FMA+F16C prefill tiles (several query rows) for every K/V format, and
// their AVX-512 F variant (the two products on 16-lane vectors, same bits);
// the decode tiles are in attention_kernels_avx2.cpp, the helpers both use in
// attention_avx2_common.h. Every function that uses these instructions
// carries the target attribute; the file is compiled for generic x86-64 and
// only entered after a run-time check (run_attention).
//
// K/V are consumed in chunks of kChunk consecutive logical positions whose
// row addresses come from the block table. Each chunk's K is decoded (scales
// applied, exactly as kv_decode_row) and transposed into an L1 tile, V into
// a row-major L1 tile, and every query vector of the tile reuses them.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "attention/attention_avx2_common.h"
#include "attention/attention_kernels.h"

// The AVX-512 F products of prefill_tile_avx512 (entered only where
// select_kernels found AVX-512 F).
#define KV_AVX512F __attribute__((target("avx512f,avx2,fma,f16c")))

namespace kvstack::attn_detail {
namespace {

using namespace avx2;  // the AVX2 kernels' shared helpers (attention_avx2_common.h)

// kt[c * kChunk + j] = K_j[c] for the kChunk rows (padding rows included).
// kKiviKey: F is a KIVI K, metas[j] the row's key-group record.
template <KvDtype F, bool kKiviKey = false>
KV_AVX2 void k_tile(const uint8_t* const* rows, const uint8_t* const* metas, int d, float* kt) {
  for (int j0 = 0; j0 < kChunk; j0 += 8) {
    for (int c = 0; c < d; c += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int x = 0; x < 8; ++x) {
        r[x] = kKiviKey ? kivi_key_deq8<F>(rows[j0 + x], metas[j0 + x], c)
                        : deq8<F>(rows[j0 + x], metas[j0 + x], c);
      }
      transpose8(r);
#pragma GCC unroll 8
      for (int x = 0; x < 8; ++x) _mm256_storeu_ps(kt + (c + x) * kChunk + j0, r[x]);
    }
  }
}

// vc[j * d + c] = V_j[c] for j < n.
template <KvDtype F>
KV_AVX2 void v_tile(const uint8_t* const* rows, const uint8_t* const* metas, int n, int d,
                    float* vc) {
  for (int j = 0; j < n; ++j) {
    for (int c = 0; c < d; c += 8) _mm256_storeu_ps(vc + j * d + c, deq8<F>(rows[j], metas[j], c));
  }
}

using KTileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int, float*);
using VTileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int, int, float*);

// A KIVI format as K decodes per-channel key groups, as V per-token groups.
KTileFn k_tile_fn(KvDtype t) {
  if (t == KvDtype::kKivi2) return k_tile<KvDtype::kKivi2, true>;
  if (t == KvDtype::kKivi4) return k_tile<KvDtype::kKivi4, true>;
  return by_format(t, []<KvDtype F>() { return KTileFn{k_tile<F>}; });
}

VTileFn v_tile_fn(KvDtype t) {
  if (t == KvDtype::kKivi2) return v_tile<KvDtype::kKivi2>;
  if (t == KvDtype::kKivi4) return v_tile<KvDtype::kKivi4>;
  return by_format(t, []<KvDtype F>() { return VTileFn{v_tile<F>}; });
}

// Row and metadata addresses of positions [t0, t0 + n) of one stream.
inline void chunk_rows(const TileArgs& a, const HeadStream& s, int32_t t0, int n,
                       const uint8_t** rows, const uint8_t** metas) {
  int32_t blk = t0 / a.block_size;
  int32_t off = t0 % a.block_size;
  for (int j = 0; j < n; ++j) {
    const int64_t base = a.block_table[blk] * a.block_stride;
    rows[j] = s.data + base + off * s.slot_stride;
    metas[j] =
        s.meta == nullptr ? nullptr : s.meta + base + off / s.meta_group * s.meta_slot_stride;
    if (++off == a.block_size) {
      off = 0;
      ++blk;
    }
  }
}

// S = Qs Kt for the n_vp (a multiple of 4) query vectors and the chunk's n
// keys: s[i * kChunk + j], 4 vectors x 16 keys per register block. Per
// score, one FMA per element in element order from zero (the lanes are
// independent, so prefill_scores_avx512 gives the same bits).
KV_AVX2 void prefill_scores_avx2(const float* qs, const float* kt, int n_vp, int d, int n,
                                 float* s) {
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
}

// The last 8 dims [c, c + 8) of vectors [i0, i0 + 4) (head_dim % 16 == 8),
// p0 their weights: both pv functions' tail.
KV_AVX2 inline void pv_tail8(const float* p0, const float* vc, const float* alpha, int i0, int c,
                             int d, int n, float* o) {
  __m256 acc[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    acc[r] =
        _mm256_mul_ps(_mm256_loadu_ps(o + (i0 + r) * d + c), _mm256_broadcast_ss(alpha + i0 + r));
  }
  for (int j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(vc + j * d + c);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + r * kChunk + j), v0, acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + (i0 + r) * d + c, acc[r]);
}

// O = alpha O + P V for the n_vp query vectors over the chunk's n keys:
// per output element, its alpha product, then one FMA per key in key order
// (prefill_pv_avx512 gives the same bits).
KV_AVX2 void prefill_pv_avx2(const float* s, const float* vc, const float* alpha, int n_vp, int d,
                             int n, float* o) {
  // 4 vectors x 16 dims per register block (8 sums, one FMA each per key:
  // enough to cover the FMA latency), then 8 dims.
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
        const __m256 v0 = _mm256_loadu_ps(vc + j * d + c);
        const __m256 v1 = _mm256_loadu_ps(vc + j * d + c + 8);
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
    if (c < d) pv_tail8(p0, vc, alpha, i0, c, d, n, o);  // 8 dims left
  }
}

// The same two products on 16-lane vectors (AVX-512 F): per lane the same
// FMAs in the same order as the AVX2 functions above, so the same bits,
// with half the instructions. Only the products: the K/V tiles, the
// softmax and the final division stay the AVX2 code's.
// Scores of vectors [i0, i0 + 4) against the chunk's first 16 * KB keys
// (KB = 2: 8 sums cover the FMA latency; KB = 1 for a last chunk of at most
// 16 keys).
template <int KB>
KV_AVX512F void scores_block(const float* qs, const float* kt, int i0, int d, float* s) {
  __m512 acc[4][KB];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 2
    for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int c = 0; c < d; ++c) {
    __m512 k[KB];
#pragma GCC unroll 2
    for (int b = 0; b < KB; ++b) k[b] = _mm512_loadu_ps(kt + c * kChunk + 16 * b);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512 qb = _mm512_set1_ps(qs[(i0 + r) * d + c]);
#pragma GCC unroll 2
      for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_fmadd_ps(qb, k[b], acc[r][b]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 2
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(s + (i0 + r) * kChunk + 16 * b, acc[r][b]);
  }
}

KV_AVX512F void prefill_scores_avx512(const float* qs, const float* kt, int n_vp, int d, int n,
                                      float* s) {
  static_assert(kChunk == 32, "two 16-key vectors per chunk");
  for (int i0 = 0; i0 < n_vp; i0 += 4) {
    if (n > 16) {
      scores_block<2>(qs, kt, i0, d, s);
    } else {
      scores_block<1>(qs, kt, i0, d, s);
    }
  }
}

// O = alpha O + P V for vectors [i0, i0 + 4), dims [c, c + 16 * X), p0
// their weights.
template <int X>
KV_AVX512F void pv_block(const float* p0, const float* vc, const float* alpha, int i0, int c, int d,
                         int n, float* o) {
  __m512 acc[4][X];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[i0 + r]);
#pragma GCC unroll 4
    for (int x = 0; x < X; ++x) {
      acc[r][x] = _mm512_mul_ps(_mm512_loadu_ps(o + (i0 + r) * d + c + 16 * x), al);
    }
  }
  for (int j = 0; j < n; ++j) {
    __m512 v[X];
#pragma GCC unroll 4
    for (int x = 0; x < X; ++x) v[x] = _mm512_loadu_ps(vc + j * d + c + 16 * x);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512 pb = _mm512_set1_ps(p0[r * kChunk + j]);
#pragma GCC unroll 4
      for (int x = 0; x < X; ++x) acc[r][x] = _mm512_fmadd_ps(pb, v[x], acc[r][x]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 4
    for (int x = 0; x < X; ++x) _mm512_storeu_ps(o + (i0 + r) * d + c + 16 * x, acc[r][x]);
  }
}

KV_AVX512F void prefill_pv_avx512(const float* s, const float* vc, const float* alpha, int n_vp,
                                  int d, int n, float* o) {
  for (int i0 = 0; i0 < n_vp; i0 += 4) {
    const float* p0 = s + static_cast<size_t>(i0) * kChunk;
    int c = 0;
    // 4 vectors x 64 dims per register block (16 sums), then 16, then 8.
    for (; c + 64 <= d; c += 64) pv_block<4>(p0, vc, alpha, i0, c, d, n, o);
    for (; c + 16 <= d; c += 16) pv_block<1>(p0, vc, alpha, i0, c, d, n, o);
    if (c < d) pv_tail8(p0, vc, alpha, i0, c, d, n, o);  // 8 dims left
  }
}

using ScoresFn = void (*)(const float*, const float*, int, int, int, float*);
using PvFn = void (*)(const float*, const float*, const float*, int, int, int, float*);

KV_AVX2 void prefill_tile(const TileArgs& a, ScoresFn scores, PvFn pv) {
  const int d = a.head_dim;
  const int g = a.group;
  const int n_vec = a.n_rows * g;
  const int n_vp = (n_vec + 3) / 4 * 4;
  const KTileFn k_fn = k_tile_fn(a.k.dtype);
  const VTileFn v_fn = v_tile_fn(a.v.dtype);
  if (k_fn == nullptr || v_fn == nullptr) return;  // validated by the caller
  // qs, o [n_vp, d]; s [n_vp, kChunk]; kt [d, kChunk]; vc [kChunk, d]; m, l, alpha [n_vp].
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
  const uint8_t* km[kChunk];
  const uint8_t* vp[kChunk];
  const uint8_t* vm[kChunk];
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    chunk_rows(a, a.k, c0, n, kp, km);
    chunk_rows(a, a.v, c0, n, vp, vm);
    for (int j = n; j < kChunk; ++j) {  // finite filler, masked below
      kp[j] = kp[0];
      km[j] = km[0];
    }
    // Decode is bound by memory: fetch the next chunk's first rows early.
    if (c0 + kChunk < t_end) {
      const int32_t nb = (c0 + kChunk) / a.block_size;
      const int64_t base = a.block_table[nb] * a.block_stride;
      _mm_prefetch(reinterpret_cast<const char*>(a.k.data + base), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.v.data + base), _MM_HINT_T0);
    }
    k_fn(kp, km, d, kt);
    v_fn(vp, vm, n, d, vc);

    scores(qs, kt, n_vp, d, n, s);

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

    pv(s, vc, alpha, n_vp, d, n, o);
  }

  finish_tile(a, n_vec, o, m, l);
}

}  // namespace

KV_AVX2 void prefill_tile_avx2(const TileArgs& a) {
  prefill_tile(a, prefill_scores_avx2, prefill_pv_avx2);
}

KV_AVX2 void prefill_tile_avx512(const TileArgs& a) {
  prefill_tile(a, prefill_scores_avx512, prefill_pv_avx512);
}

}  // namespace kvstack::attn_detail

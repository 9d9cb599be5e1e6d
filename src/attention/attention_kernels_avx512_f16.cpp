// AVX-512 decode kernel for f16 K and f16 V (the default KV format): the
// AVX2 decode kernel's f16 path on 16 lanes. Every function that uses these
// instructions carries the target attribute; the file is compiled for
// generic x86-64 and only entered after select_kernels() has checked the
// CPU (AVX-512 F).
//
// Keys in chunks of kChunk consecutive positions (rows found through the
// block table, so a chunk may span blocks); per chunk and KV head of the
// tile, its q heads in sub-groups of at most 4:
//   q . K: J keys at a time (SG * J <= 16), each key's f16 row widened 16
//     elements at a time (vcvtph2ps) and FMA'd against every head's q; the
//     SG * J 16-lane sums are reduced together by one shuffle tree into one
//     vector (lane h * J + j = head h . key j) and stored with one masked
//     store per head.
//   online softmax per query vector (running max and sum, a degree-6 exp
//     with vscalefps), then
//   p . V: the accumulators of SG heads x NC 16-column vectors stay in
//     registers over the chunk, one broadcast weight per head and key.
// The next (chunk, KV head) unit's K/V lines are software prefetched, a
// share per q.K step and p.V key, as the AVX2 kernel does for whole chunks:
// with scattered blocks the hardware prefetcher loses the stream at every
// block boundary.
//
// Float results differ from the AVX2 kernel's only in summation order (16
// lanes instead of 8); the tests hold both to the same bound against the
// double reference (paged_attention_test).
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -W(maybe-)uninitialized reports inside the
// system header (GCC bug 105593, as in ops/matmul_avx512.cpp); the values
// are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/attention_kernels.h"
#include "ops/simd_avx512.h"

#define KV_F16_512 __attribute__((target("avx512f,avx2,fma,f16c")))

namespace kvstack::attn_detail {
namespace {

constexpr int kChunk = kMassChunkAvx512F16;  // keys per chunk (a multiple of 16)
constexpr int kVecs = kChunk / 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Software prefetch of the next unit's lines (see decode_tile_avx512_f16),
// spread over the current unit's steps (a burst of a few hundred prefetches
// fills the miss buffers and stalls the kernel): start_heads() lists the
// lines and sets the share per step from the step count of the previous
// unit; step() issues that share. The list is flat (one address per line),
// so a step is a short loop over a cursor: with a queue of runs (as in the
// AVX2 kernel) the bookkeeping per step cost about as much as the p.V
// arithmetic of a key (perf annotate: ~45% of pv_block).
class ChunkPrefetch {
 public:
  // Lists the lines of the rows of positions (base[j], slot[j]), j < n (as
  // chunk_slots() gives them), of KV heads [h_first, h_last) of the tile.
  void start_heads(const TileArgs& a, const int64_t* base, const int32_t* slot, int n,
                   int row_bytes, int h_first, int h_last) {
    flush();
    const size_t steps = n_steps_;
    n_steps_ = 0;
    // One stretch of consecutive slots per block; per stretch and KV head
    // its K rows, then its V rows (adjacent in the block layout).
    size_t need = 0;
    for (int j0 = 0; j0 < n;) {
      const int j1 = std::min(n, j0 + a.block_size - slot[j0]);
      for (const HeadStream* s : {&a.k, &a.v}) {
        need += static_cast<size_t>(((j1 - j0 - 1) * s->slot_stride + row_bytes) / 64 + 2);
      }
      j0 = j1;
    }
    need *= static_cast<size_t>(h_last - h_first);
    if (lines_.size() < need) lines_.resize(need);
    const char** out = lines_.data();
    uintptr_t last = 0;  // the last line listed (runs continue each other)
    for (int j0 = 0; j0 < n;) {
      const int j1 = std::min(n, j0 + a.block_size - slot[j0]);
      for (int hh = h_first; hh < h_last; ++hh) {
        for (const HeadStream* s : {&a.k, &a.v}) {
          const uint8_t* p = s->data + hh * s->head_stride + base[j0];
          auto x = reinterpret_cast<uintptr_t>(p + slot[j0] * s->slot_stride) & ~uintptr_t{63};
          const auto end =
              reinterpret_cast<uintptr_t>(p + slot[j1 - 1] * s->slot_stride + row_bytes);
          if (x == last) x += 64;
          for (; x < end; x += 64) *out++ = reinterpret_cast<const char*>(x);
          last = x - 64;
        }
      }
      j0 = j1;
    }
    cur_ = lines_.data();
    end_ = out;
    const auto n_lines = static_cast<size_t>(end_ - cur_);
    // First unit of a tile: about one q.K step per 4 keys and one p.V step
    // per key, per KV head.
    const size_t n_est = steps > 0 ? steps : static_cast<size_t>(h_last - h_first) * n * 5 / 4;
    per_step_ = static_cast<ptrdiff_t>((n_lines + n_est - 1) / n_est);
  }
  KV_F16_512 void step() {
    ++n_steps_;
    const char* const* c = cur_;
    const char* const* e = end_ - c > per_step_ ? c + per_step_ : end_;
    for (; c < e; ++c) _mm_prefetch(*c, _MM_HINT_T0);
    cur_ = c;
  }
  KV_F16_512 void flush() {
    for (const char* const* c = cur_; c < end_; ++c) _mm_prefetch(*c, _MM_HINT_T0);
    cur_ = end_;
  }

 private:
  std::vector<const char*> lines_;  // grows only: no allocation in steady state
  const char* const* cur_ = nullptr;
  const char* const* end_ = nullptr;
  ptrdiff_t per_step_ = 0;
  size_t n_steps_ = 0;
};

thread_local ChunkPrefetch tl_prefetch;

// Elements [c, c + 16) of an f16 row, widened.
KV_F16_512 inline __m512 f16x16(const uint8_t* row, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c)));
}

// Per 128-bit lane k: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of that lane's
// four elements.
KV_F16_512 inline __m512 pair_sum(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// Lane i of the result is the sum of the 16 lanes of v[i] (v[i] for i >= N
// taken as 0).
template <int N>
KV_F16_512 inline __m512 reduce16(const __m512* v) {
  const __m512 z = _mm512_setzero_ps();
  __m512 t[8], u[4], w[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[i] = 2 * i + 1 < N ? pair_sum(v[2 * i], v[2 * i + 1]) : 2 * i < N ? pair_sum(v[2 * i], z) : z;
  }
  // u[i], 128-bit lane k: quarter k of each of v[4i .. 4i + 3], summed.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) u[i] = 4 * i < N ? pair_sum(t[2 * i], t[2 * i + 1]) : z;
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// s[h * kChunk + j] = qs[h] . K_j for SG heads and keys j < n_pad (a
// multiple of J; rows past the chunk's keys are fillers whose scores the
// softmax drops).
template <int SG, int J>
KV_F16_512 void qk_chunk(const float* qs, int d, const uint8_t* const* kp, int n_pad, float* s,
                         ChunkPrefetch* pf) {
  static_assert(SG * J <= 16 && kChunk % J == 0);
  for (int j0 = 0; j0 < n_pad; j0 += J) {
    pf->step();
    __m512 acc[SG * J];
#pragma GCC unroll 16
    for (int i = 0; i < SG * J; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
      __m512 qv[SG];
#pragma GCC unroll 4
      for (int h = 0; h < SG; ++h) qv[h] = _mm512_loadu_ps(qs + h * d + c);
#pragma GCC unroll 16
      for (int jj = 0; jj < J; ++jj) {
        const __m512 kv = f16x16(kp[j0 + jj], c);
#pragma GCC unroll 4
        for (int h = 0; h < SG; ++h) acc[h * J + jj] = _mm512_fmadd_ps(qv[h], kv, acc[h * J + jj]);
      }
    }
    const __m512 r = reduce16<SG * J>(acc);
    // Lanes [h J, h J + J) go to s[h * kChunk + j0 ..]: the store's base is
    // h J floats before it (still inside s: J <= kChunk).
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) {
      const auto mask = static_cast<__mmask16>(((1u << J) - 1) << (h * J));
      _mm512_mask_storeu_ps(s + h * kChunk + j0 - h * J, mask, r);
    }
  }
}

// Keys per q.K step for SG heads: SG * J accumulators, at most 16.
constexpr int keys_per_step(int sg) {
  return sg == 1 ? 16 : sg == 2 ? 8 : 4;
}

void qk_any(int sg, const float* qs, int d, const uint8_t** kp, int n, float* s,
            ChunkPrefetch* pf) {
  const int j = keys_per_step(sg);
  const int n_pad = (n + j - 1) / j * j;
  for (int x = n; x < n_pad; ++x) kp[x] = kp[0];  // finite filler, scores dropped
  switch (sg) {
    case 1:
      return qk_chunk<1, 16>(qs, d, kp, n_pad, s, pf);
    case 2:
      return qk_chunk<2, 8>(qs, d, kp, n_pad, s, pf);
    case 3:
      return qk_chunk<3, 4>(qs, d, kp, n_pad, s, pf);
    default:
      return qk_chunk<4, 4>(qs, d, kp, n_pad, s, pf);
  }
}

// Online-softmax update of one query vector over a chunk of n scores at s
// (padded to kChunk in place): leaves p = exp(s - m_new) in s (0 past n),
// returns the rescale factor of the old state. An all-masked chunk leaves
// the state unchanged (alpha 1, p 0).
KV_F16_512 inline float softmax_update(float* s, int n, float* m, float* l) {
  for (int j = n; j < kChunk; ++j) s[j] = kNegInf;
  __m512 mx = _mm512_loadu_ps(s);
#pragma GCC unroll 4
  for (int x = 1; x < kVecs; ++x) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + 16 * x));
  const float m_new = std::max(*m, _mm512_reduce_max_ps(mx));
  if (m_new == kNegInf) {
    std::memset(s, 0, sizeof(float) * kChunk);
    return 1.0f;
  }
  // 0 when *m is -inf; exactly 1 when the max did not move.
  const float alpha = m_new == *m ? 1.0f : std::exp(*m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int x = 0; x < kVecs; ++x) {
    const __m512 px = simd::exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * x), mv));
    _mm512_storeu_ps(s + 16 * x, px);
    sum = _mm512_add_ps(sum, px);
  }
  *l = *l * alpha + _mm512_reduce_add_ps(sum);
  *m = m_new;
  return alpha;
}

// acc[h][c] = alpha[h] acc[h][c] + sum_{j < n} w[h * kChunk + j] V_j[c] for
// SG heads and the 16 * NC columns from c, the SG * NC sums in registers.
template <int SG, int NC>
KV_F16_512 inline void pv_block(const float* w, const uint8_t* const* vp, int n, const float* alpha,
                                float* acc, int d, int c, ChunkPrefetch* pf) {
  __m512 a[SG][NC];
#pragma GCC unroll 4
  for (int h = 0; h < SG; ++h) {
    const __m512 al = _mm512_set1_ps(alpha[h]);
#pragma GCC unroll 8
    for (int x = 0; x < NC; ++x)
      a[h][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * d + c + 16 * x), al);
  }
  for (int j = 0; j < n; ++j) {
    if (pf != nullptr) pf->step();
    __m512 pb[SG];
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) pb[h] = _mm512_set1_ps(w[h * kChunk + j]);
#pragma GCC unroll 8
    for (int x = 0; x < NC; ++x) {
      const __m512 v = f16x16(vp[j], c + 16 * x);
#pragma GCC unroll 4
      for (int h = 0; h < SG; ++h) a[h][x] = _mm512_fmadd_ps(pb[h], v, a[h][x]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < SG; ++h) {
#pragma GCC unroll 8
    for (int x = 0; x < NC; ++x) _mm512_storeu_ps(acc + h * d + c + 16 * x, a[h][x]);
  }
}

// Largest power of two NC <= 8 with SG * NC <= 24 accumulators (plus SG
// weights and one V vector: at most 29 of the 32 registers).
constexpr int pv_vectors(int sg) {
  int nc = 8;
  while (nc > 1 && sg * nc > 24) nc /= 2;
  return nc;
}

// pv_block over columns [c, d), NC vectors per pass while they fit, then
// halves (d is a multiple of 16). Only the first pass steps the prefetch
// (one step per key).
template <int SG, int NC>
KV_F16_512 void pv_cols(const float* w, const uint8_t* const* vp, int n, const float* alpha,
                        float* acc, int d, int c, ChunkPrefetch* pf) {
  for (; d - c >= 16 * NC; c += 16 * NC) {
    pv_block<SG, NC>(w, vp, n, alpha, acc, d, c, pf);
    pf = nullptr;
  }
  if constexpr (NC > 1) {
    if (c < d) pv_cols<SG, NC / 2>(w, vp, n, alpha, acc, d, c, pf);
  }
}

void pv_any(int sg, const float* p, const uint8_t* const* vp, int n, const float* alpha, float* acc,
            int d, ChunkPrefetch* pf) {
  switch (sg) {
    case 1:
      return pv_cols<1, pv_vectors(1)>(p, vp, n, alpha, acc, d, 0, pf);
    case 2:
      return pv_cols<2, pv_vectors(2)>(p, vp, n, alpha, acc, d, 0, pf);
    case 3:
      return pv_cols<3, pv_vectors(3)>(p, vp, n, alpha, acc, d, 0, pf);
    default:
      return pv_cols<4, pv_vectors(4)>(p, vp, n, alpha, acc, d, 0, pf);
  }
}

}  // namespace

bool avx512_f16_decode_serves(KvDtype k, KvDtype v, int head_dim) {
  return k == KvDtype::kF16 && v == KvDtype::kF16 && head_dim > 0 && head_dim % 16 == 0;
}

KV_F16_512 void decode_tile_avx512_f16(const TileArgs& a) {
  KV_CHECK(a.n_rows == 1 && avx512_f16_decode_serves(a.k.dtype, a.v.dtype, a.head_dim),
           "decode_tile_avx512_f16: one f16 query row, head_dim % 16 == 0");
  const int d = a.head_dim;
  const int g = a.group;
  const int n_vec = g * a.n_heads;  // q heads of every KV head of the tile
  // Scratch: qs, acc [n_vec, d]; s [n_vec, kChunk]; m, l, alpha [n_vec].
  float* qs = thread_scratch().get(static_cast<size_t>(n_vec) * (2 * d + kChunk + 3));
  float* acc = qs + static_cast<size_t>(n_vec) * d;
  float* s = acc + static_cast<size_t>(n_vec) * d;
  float* m = s + static_cast<size_t>(n_vec) * kChunk;
  float* l = m + n_vec;
  float* alpha = l + n_vec;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int h = 0; h < n_vec; ++h) {
    for (int c = 0; c < d; c += 16) {
      _mm512_storeu_ps(qs + h * d + c, _mm512_mul_ps(_mm512_loadu_ps(a.q + h * d + c), scale));
      _mm512_storeu_ps(acc + h * d + c, _mm512_setzero_ps());
    }
    m[h] = kNegInf;
    l[h] = 0.0f;
  }
  // q heads of a group in sub-groups of at most 4, as even as possible: the
  // chunk of a KV head comes from memory once, from L1 for later sub-groups.
  const int n_sub = (g + 3) / 4;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, a.pos0 + 1);
  const int row_bytes = 2 * d;
  // Prefetch distance: one (chunk, KV head) unit. While KV head hh of chunk
  // c is computed, head hh + 1 of chunk c (or head 0 of chunk c + 1) is
  // prefetched: the lines in flight stay within L1 beside the unit in use
  // (a whole chunk ahead, 3 heads x 8 KiB on SmolLM2, measured ~7% slower
  // from memory; two chunks or into L2, slower still).
  int64_t base[2][kChunk];  // slots of the current and the next chunk
  int32_t slot[2][kChunk];
  const uint8_t* kp[kChunk];
  const uint8_t* vp[kChunk];
  ChunkPrefetch& pf = tl_prefetch;
  int cur = 0;
  if (t_begin < t_end) {
    const int n0 = std::min<int32_t>(kChunk, t_end - t_begin);
    chunk_slots(a, t_begin, n0, base[0], slot[0]);
    pf.start_heads(a, base[0], slot[0], n0, row_bytes, 0, 1);
    pf.flush();
  }
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    const int64_t* cb = base[cur];
    const int32_t* cs = slot[cur];
    const int32_t ca = c0 + kChunk;
    const int na = std::min<int32_t>(kChunk, t_end - ca);
    if (ca < t_end) chunk_slots(a, ca, na, base[cur ^ 1], slot[cur ^ 1]);
    for (int hh = 0; hh < a.n_heads; ++hh) {
      if (hh + 1 < a.n_heads) {
        pf.start_heads(a, cb, cs, n, row_bytes, hh + 1, hh + 2);
      } else if (ca < t_end) {
        pf.start_heads(a, base[cur ^ 1], slot[cur ^ 1], na, row_bytes, 0, 1);
      }
      const uint8_t* kd = a.k.data + hh * a.k.head_stride;
      const uint8_t* vd = a.v.data + hh * a.v.head_stride;
      for (int j = 0; j < n; ++j) {
        kp[j] = kd + cb[j] + cs[j] * a.k.slot_stride;
        vp[j] = vd + cb[j] + cs[j] * a.v.slot_stride;
      }
      const int v0 = hh * g;  // first query vector of this KV head
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
        qk_any(sg, qs + static_cast<size_t>(h0) * d, d, kp, n, s + h0 * kChunk, &pf);
        h0 += sg;
      }
      for (int h = v0; h < v0 + g; ++h) alpha[h] = softmax_update(s + h * kChunk, n, m + h, l + h);
      if (a.mass_p != nullptr) {  // H2O key mass: this chunk's p (0-padded, f16) and max
        uint16_t* mp = a.mass_p + (c0 / kChunk) * a.mass_stride;
        for (int h = v0; h < v0 + g; ++h) {
          for (int x = 0; x < kVecs; ++x) {
            const int left = std::clamp(n - 16 * x, 0, 16);
            const auto live = static_cast<__mmask16>((1u << left) - 1u);
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(mp + h * kChunk + 16 * x),
                _mm512_cvtps_ph(_mm512_maskz_loadu_ps(live, s + h * kChunk + 16 * x),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          }
          a.mass_m[(c0 / kChunk) * a.mass_m_stride + h] = m[h];
        }
      }
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
        pv_any(sg, s + h0 * kChunk, vp, n, alpha + h0, acc + static_cast<size_t>(h0) * d, d, &pf);
        h0 += sg;
      }
    }
    cur ^= 1;
  }
  pf.flush();  // nothing is left queued for the next tile
  finish_tile(a, n_vec, acc, m, l);
}

}  // namespace kvstack::attn_detail

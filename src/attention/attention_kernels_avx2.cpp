// AVX2+FMA+F16C tile kernels for every K/V format. Every function that uses
// these instructions carries the target attribute; the file is compiled for
// generic x86-64 and only entered after a run-time check (run_attention).
//
// K/V are consumed in chunks of kChunk consecutive logical positions whose
// row addresses come from the block table, so a chunk may span blocks and
// block size 1 costs no more than contiguous storage.
//
// Decode (one query row): the rows are read once per KV head and used by all
// q heads of its group, in their stored form: q . K is computed on the raw
// values (f16/bf16 widened; int8 codes; fp8 codes as f16 bits, i.e. value *
// 2^-8 / scale) and the per-token (int8) or per-block (fp8) scale is applied
// once per key after the dot. int4 keys are dotted in integers with q^, the
// query rounded to int8 per group of 32 (attention_quant.h: vpmaddubsw on
// the nibbles), then scaled per group, the minimum through sum(q^) of the
// group. For V the scale is folded into the softmax weight and the int4
// minimum into one per-group sum of weights. KIVI (decode only): a K's
// per-channel group scale is folded into q once per key group (q * scale,
// plus the bias q . min), a V is read as int4's per-token groups (2- or
// 4-bit codes). The next chunk's rows (every KV head of the tile) are
// prefetched while a chunk is computed: with scattered blocks the hardware
// prefetcher loses the stream at every block boundary.
//
// Prefill tiles: attention_prefill_avx2.cpp; the helpers both use:
// attention_avx2_common.h.
// row-major L1 tile, and every query vector of the tile reuses them.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/attention_avx2_common.h"
#include "attention/attention_kernels.h"
#include "attention/attention_quant.h"
#include "ops/simd_avx2.h"

namespace kvstack::attn_detail {
namespace {

using namespace avx2;  // the AVX2 kernels' shared helpers (attention_avx2_common.h)

// Decode: chunk i + kAhead is prefetched while chunk i is computed (2 and 3
// measured no faster).
constexpr int kAhead = 1;

// Software prefetch of the next chunk's K/V lines, spread over the current
// chunk's work: step() is called once per q.K key step and once per key of
// p.V and issues a share of the lines, so that the misses overlap the
// arithmetic instead of queueing behind each other in one burst (a burst of
// a few hundred prefetches fills the miss buffers and stalls the kernel).
// The share is calibrated from the number of steps the previous chunk took.
// The lines are queued as runs of consecutive lines (the rows of one KV head
// in one block are adjacent), a few per chunk, so queueing costs next to
// nothing beside the kernel.
class KvPrefetch {
 public:
  // Queues every line of positions (base[j], slot[j]), j < n, as
  // chunk_slots() gives them (consecutive slots within a block), of the tile's
  // KV heads; lines not yet issued from the previous chunk are issued now.
  void start(const TileArgs& a, const int64_t* base, const int32_t* slot, int n, int k_row_bytes,
             int v_row_bytes);
  KV_AVX2 void step() {
    ++n_steps_;
    for (size_t k = 0; k < per_step_ && run_ < runs_.size(); ++k) issue_one();
  }
  KV_AVX2 void flush() {
    while (run_ < runs_.size()) issue_one();
  }

 private:
  struct Run {
    const char* first;  // 64-byte aligned
    int64_t n_lines;
  };
  KV_AVX2 void issue_one() {
    const Run& r = runs_[run_];
    _mm_prefetch(r.first + 64 * line_, _MM_HINT_T0);
    if (++line_ == r.n_lines) {
      line_ = 0;
      ++run_;
    }
  }
  // Appends the lines of [p, end) to the queue, merged with the last run
  // when they continue it.
  void add_range(const uint8_t* p, const uint8_t* end);
  // Appends the rows [slot0, slot1) of KV head hh in the block at byte
  // offset `base` (and their metadata records).
  void add_stream(const HeadStream& s, int hh, int64_t base, int32_t slot0, int32_t slot1,
                  int row_bytes);

  std::vector<Run> runs_;  // grows only: no allocation in steady state
  size_t run_ = 0;         // next run to issue from
  int64_t line_ = 0;       // next line of runs_[run_]
  size_t n_lines_ = 0;     // lines queued by the last start()
  size_t per_step_ = 0;
  size_t n_steps_ = 0;  // step() calls since start()
};

thread_local KvPrefetch tl_prefetch;

// Int4 metadata of keys [0, n_pad) of a chunk, widened once per chunk:
// sc[g * kChunk + j], mn[g * kChunk + j] = scale and minimum of group g of
// key j; keys [n, n_pad) (padding) get 0.
KV_AVX2 inline void int4_meta(const uint8_t* const* metas, int n, int n_pad, int n_groups,
                              float* sc, float* mn) {
  for (int j = 0; j < n; ++j) {
    const uint8_t* mj = metas[j];
    int gi = 0;
    for (; gi + 2 <= n_groups; gi += 2) {  // (scale, min) x 2 = 8 bytes
      alignas(16) float t[4];
      _mm_store_ps(t, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mj + 4 * gi))));
      sc[gi * kChunk + j] = t[0];
      mn[gi * kChunk + j] = t[1];
      sc[(gi + 1) * kChunk + j] = t[2];
      mn[(gi + 1) * kChunk + j] = t[3];
    }
    if (gi < n_groups) {
      sc[gi * kChunk + j] = f16_scalar(mj + 4 * gi);
      mn[gi * kChunk + j] = f16_scalar(mj + 4 * gi + 2);
    }
  }
  for (int gi = 0; gi < n_groups; ++gi) {
    for (int j = n; j < n_pad; ++j) sc[gi * kChunk + j] = mn[gi * kChunk + j] = 0.0f;
  }
}

// ---------------------------------------------------------------- decode --

// s[h * kChunk + j] = qs[h] . K_j for SG heads and n_pad keys (a multiple of
// J), K in a float, int8 or fp8 format (or KIVI codes against a folded q).
// J keys at a time share each q load; the SG * J dots are reduced together
// by one hadd tree.
template <KvDtype F, int SG, int J>
KV_AVX2 void qk_chunk(const float* qs, int d, const uint8_t* const* kp, const uint8_t* const* km,
                      int n_pad, float* s, KvPrefetch* pf) {
  static_assert(F != KvDtype::kInt4 && SG * J <= 12);
  constexpr int kAcc = SG * J > 8 ? 16 : 8;  // hsum8 reduces 8 at a time
  for (int j0 = 0; j0 < n_pad; j0 += J) {
    pf->step();
    __m256 acc[kAcc];
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_setzero_ps();
    if constexpr (kGroupScaled<F>) {  // KIVI codes: a whole group per key load
      for (int c = 0; c < d; c += 32) {
#pragma GCC unroll 8
        for (int jj = 0; jj < J; ++jj) {
          __m256 kv[4];
          raw32<F>(kp[j0 + jj], c, kv);
#pragma GCC unroll 4
          for (int x = 0; x < 4; ++x) {
#pragma GCC unroll 8
            for (int h = 0; h < SG; ++h) {
              acc[h * J + jj] =
                  _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * d + c + 8 * x), kv[x], acc[h * J + jj]);
            }
          }
        }
      }
    } else {
      for (int c = 0; c < d; c += 8) {
        __m256 qv[SG];
#pragma GCC unroll 8
        for (int h = 0; h < SG; ++h) qv[h] = _mm256_loadu_ps(qs + h * d + c);
#pragma GCC unroll 8
        for (int jj = 0; jj < J; ++jj) {
          const __m256 kv = raw8<F>(kp[j0 + jj], c);
#pragma GCC unroll 8
          for (int h = 0; h < SG; ++h)
            acc[h * J + jj] = _mm256_fmadd_ps(qv[h], kv, acc[h * J + jj]);
        }
      }
    }
    alignas(32) float tmp[kAcc];
    _mm256_store_ps(tmp, hsum8(acc));
    if constexpr (kAcc > 8) _mm256_store_ps(tmp + 8, hsum8(acc + 8));
#pragma GCC unroll 8
    for (int jj = 0; jj < J; ++jj) {
      const float rs = row_scale<F>(km[j0 + jj]);
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) {
        s[h * kChunk + j0 + jj] = kRowScaled<F> ? tmp[h * J + jj] * rs : tmp[h * J + jj];
      }
    }
  }
}

// ---- int4 K: integer dots against q^ (round_query_int8) ----
//
// A query vector's q^ packed for qk_int4 (pack_query_i8), per pair of int4
// groups (2p, 2p + 1), in the order of the nibbles of the pair's 32 code
// bytes (byte j of group g holds elements j and 16 + j): 32 codes "lo" =
// elements 0..15 of group 2p then of group 2p + 1, 32 codes "hi" = their
// elements 16..31; then 8 floats: group 2p's q^ scale x4, group 2p + 1's x4;
// then 8 floats: sum(q^) / 4 of group 2p x4 and of group 2p + 1 x4 (the
// key minimum's weight, spread over the 4 lanes of its group). A lone last
// group leaves the pair's second half zero.
constexpr int kPackPairFloats = 32;

inline int query_pack_floats(int d) {
  return kPackPairFloats * ((d / 32 + 1) / 2);
}

// Packs q^ of qs [d] into pack.
void pack_query_i8(const float* qs, int d, float* pack) {
  const int n_groups = d / 32;
  std::memset(pack, 0, sizeof(float) * query_pack_floats(d));
  for (int g = 0; g < n_groups; ++g) {
    int8_t codes[kQueryGroup];
    float gs = 0.0f;
    round_query_int8(qs + 32 * g, 32, codes, &gs);
    float* pair = pack + kPackPairFloats * (g / 2);
    auto* lo = reinterpret_cast<int8_t*>(pair);
    const int half = g % 2;
    std::memcpy(lo + 16 * half, codes, 16);
    std::memcpy(lo + 32 + 16 * half, codes + 16, 16);
    int sum = 0;
    for (int8_t c : codes) sum += c;
    for (int k = 0; k < 4; ++k) {
      pair[16 + 4 * half + k] = gs;
      pair[24 + 4 * half + k] = gs * static_cast<float>(sum) * 0.25f;
    }
  }
}

// s[h * kChunk + j] = q^[h] . K_j for SG packed query vectors (pack, stride
// query_pack_floats(d)) and n_pad int4 keys (a multiple of J). Per key and
// pair of groups: the 32 code bytes split into low and high nibbles, two
// vpmaddubsw against the int8 codes (16-bit sums: at most 2 * 2 * 15 * 127),
// vpmaddwd to 32 bits (lanes 0-3: group 2p, 4-7: group 2p + 1), times the
// key's group scales times q^'s; plus the key's group minimums times
// sum(q^) / 4 in the same lanes.
template <int SG, int J>
KV_AVX2 void qk_int4(const float* pack, int d, const uint8_t* const* kp, const uint8_t* const* km,
                     int n_pad, float* s, KvPrefetch* pf) {
  static_assert(SG * J <= 8);
  const int n_groups = d / 32;
  const int n_pairs = (n_groups + 1) / 2;
  const int stride = query_pack_floats(d);
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);      // scales
  const __m256i pick_min = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);  // minimums
  for (int j0 = 0; j0 < n_pad; j0 += J) {
    pf->step();
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int jj = 0; jj < J; ++jj) {
      __m256 a[SG];  // this key's dot per head, over the pairs
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) a[h] = _mm256_setzero_ps();
      for (int pi = 0; pi < n_pairs; ++pi) {
        const uint8_t* row = kp[j0 + jj] + 32 * pi;
        const uint8_t* meta = km[j0 + jj] + 8 * pi;  // (scale, min) f16 per group
        __m256i codes;
        __m128 sm;
        if (2 * pi + 1 < n_groups) {
          codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
          sm = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta)));
        } else {  // a lone last group
          codes = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
          uint32_t m4;
          std::memcpy(&m4, meta, 4);
          sm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(m4)));
        }
        const __m256i lo = _mm256_and_si256(codes, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nib);
        const __m256 ks = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sm), pick);
        const __m256 kmin = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sm), pick_min);
#pragma GCC unroll 8
        for (int h = 0; h < SG; ++h) {
          const float* ph = pack + h * stride + kPackPairFloats * pi;
          const __m256i t = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph))),
              _mm256_maddubs_epi16(hi,
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + 8))));
          const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(t, ones));
          a[h] = _mm256_fmadd_ps(f, _mm256_mul_ps(ks, _mm256_loadu_ps(ph + 16)), a[h]);
          a[h] = _mm256_fmadd_ps(kmin, _mm256_loadu_ps(ph + 24), a[h]);
        }
      }
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) acc[h * J + jj] = a[h];
    }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, hsum8(acc));
#pragma GCC unroll 8
    for (int jj = 0; jj < J; ++jj) {
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) s[h * kChunk + j0 + jj] = tmp[h * J + jj];
    }
  }
}

// acc[h][c] = alpha[h] * acc[h][c] + sum_j w[h * kChunk + j] raw(V_j)[c]
// (+ add[h]) for SG heads and the 8 * NC columns from c, the SG * NC sums in
// registers (each sum gets one FMA per key, so SG * NC >= 8 keeps both FMA
// pipes busy despite the FMA latency).
template <KvDtype F, int SG, int NC, bool kAdd>
KV_AVX2 inline void pv_block(const float* w, const uint8_t* const* vp, int n, const float* alpha,
                             float* acc, int d, int c, const float* add, KvPrefetch* pf) {
  __m256 a[SG][NC];
#pragma GCC unroll 8
  for (int h = 0; h < SG; ++h) {
    const __m256 al = _mm256_broadcast_ss(alpha + h);
#pragma GCC unroll 8
    for (int x = 0; x < NC; ++x) {
      a[h][x] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c + 8 * x), al);
      if constexpr (kAdd) a[h][x] = _mm256_add_ps(a[h][x], _mm256_broadcast_ss(add + h));
    }
  }
  for (int j = 0; j < n; ++j) {
    if (pf != nullptr) pf->step();
    // SG * NC sums + SG weights + one V vector: at most 16 registers.
    __m256 pb[SG];
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) pb[h] = _mm256_broadcast_ss(w + h * kChunk + j);
    if constexpr (kGroupScaled<F> && NC == 4) {  // one whole group (c % 32 == 0)
      __m256 v[4];
      raw32<F>(vp[j], c, v);
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) {
#pragma GCC unroll 8
        for (int h = 0; h < SG; ++h) a[h][x] = _mm256_fmadd_ps(pb[h], v[x], a[h][x]);
      }
    } else {
#pragma GCC unroll 8
      for (int x = 0; x < NC; ++x) {
        const __m256 v = raw8<F>(vp[j], c + 8 * x);
#pragma GCC unroll 8
        for (int h = 0; h < SG; ++h) a[h][x] = _mm256_fmadd_ps(pb[h], v, a[h][x]);
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < SG; ++h) {
#pragma GCC unroll 8
    for (int x = 0; x < NC; ++x) _mm256_storeu_ps(acc + h * d + c + 8 * x, a[h][x]);
  }
}

// pv_block over columns [c, c1) (multiples of 8), NC vectors per pass while
// they fit, then halves.
template <KvDtype F, int SG, int NC, bool kAdd>
KV_AVX2 void pv_cols_from(const float* w, const uint8_t* const* vp, int n, const float* alpha,
                          float* acc, int d, int c, int c1, const float* add, KvPrefetch* pf) {
  for (; c1 - c >= 8 * NC; c += 8 * NC) {
    pv_block<F, SG, NC, kAdd>(w, vp, n, alpha, acc, d, c, add, pf);
    pf = nullptr;  // one prefetch step per key
  }
  if constexpr (NC > 1) {
    if (c < c1) pv_cols_from<F, SG, NC / 2, kAdd>(w, vp, n, alpha, acc, d, c, c1, add, pf);
  }
}

// Largest power of two NC <= 8 with SG * NC <= 12 accumulators and
// SG * NC + SG + 1 <= 16 registers.
constexpr int pv_vectors(int sg) {
  int nc = 8;
  while (nc > 1 && (sg * nc > 12 || sg * nc + sg + 1 > 16)) nc /= 2;
  return nc;
}

template <KvDtype F, int SG, bool kAdd>
KV_AVX2 void pv_cols(const float* w, const uint8_t* const* vp, int n, const float* alpha,
                     float* acc, int d, int c0, int c1, const float* add, KvPrefetch* pf) {
  pv_cols_from<F, SG, pv_vectors(SG), kAdd>(w, vp, n, alpha, acc, d, c0, c1, add, pf);
}

// acc[h] = alpha[h] * acc[h] + sum_j p[h * kChunk + j] V_j for SG heads, the
// V scales folded into the weights (wbuf: [4, kChunk] scratch, then int4:
// [2, d / 32, kChunk]).
template <KvDtype F, int SG>
KV_AVX2 void pv_chunk(const float* p, const uint8_t* const* vp, const uint8_t* const* vm, int n,
                      const float* alpha, float* acc, int d, float* wbuf, KvPrefetch* pf) {
  if constexpr (kGroupScaled<F>) {
    const int n_groups = d / 32;
    const int n8 = (n + 7) / 8 * 8;  // p is 0 past n (softmax_update pads the chunk)
    float* sc = wbuf + 4 * kChunk;
    float* mn = sc + n_groups * kChunk;
    int4_meta(vm, n, n8, n_groups, sc, mn);
    for (int gi = 0; gi < n_groups; ++gi) {
      float add[SG];
#pragma GCC unroll 8
      for (int h = 0; h < SG; ++h) {
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < n8; j += 8) {
          const __m256 pj = _mm256_loadu_ps(p + h * kChunk + j);
          _mm256_storeu_ps(wbuf + h * kChunk + j,
                           _mm256_mul_ps(pj, _mm256_loadu_ps(sc + gi * kChunk + j)));
          sum = _mm256_fmadd_ps(pj, _mm256_loadu_ps(mn + gi * kChunk + j), sum);
        }
        add[h] = hsum(sum);
      }
      pv_cols<F, SG, true>(wbuf, vp, n, alpha, acc, d, 32 * gi, 32 * gi + 32, add,
                           gi == 0 ? pf : nullptr);
    }
  } else if constexpr (kRowScaled<F>) {
    alignas(32) float sc[kChunk];
    for (int j = 0; j < n; ++j) sc[j] = row_scale<F>(vm[j]);
#pragma GCC unroll 8
    for (int h = 0; h < SG; ++h) {
      for (int j = 0; j < n; ++j) wbuf[h * kChunk + j] = p[h * kChunk + j] * sc[j];
    }
    pv_cols<F, SG, false>(wbuf, vp, n, alpha, acc, d, 0, d, nullptr, pf);
  } else {
    pv_cols<F, SG, false>(p, vp, n, alpha, acc, d, 0, d, nullptr, pf);
  }
}

// Keys loaded together per q head count: SG * J <= 8 accumulators (12 for
// three heads, SmolLM2's group: one FMA per accumulator per step then fills
// both FMA pipes), J dividing kChunk.
constexpr int keys_per_step(int sg) {
  return sg == 1 ? 8 : sg == 2 ? 4 : sg == 3 ? 4 : 2;
}

template <KvDtype F>
KV_AVX2 void qk_any(int sg, const float* qs, int d, const uint8_t** kp, const uint8_t** km, int n,
                    float* s, float* /*kbuf*/, KvPrefetch* pf) {
  const int j = keys_per_step(sg);
  const int n_pad = (n + j - 1) / j * j;
  for (int x = n; x < n_pad; ++x) {  // finite filler, scores dropped
    kp[x] = kp[0];
    km[x] = km[0];
  }
  switch (sg) {
    case 1:
      return qk_chunk<F, 1, 8>(qs, d, kp, km, n_pad, s, pf);
    case 2:
      return qk_chunk<F, 2, 4>(qs, d, kp, km, n_pad, s, pf);
    case 3:
      return qk_chunk<F, 3, 4>(qs, d, kp, km, n_pad, s, pf);
    default:
      return qk_chunk<F, 4, 2>(qs, d, kp, km, n_pad, s, pf);
  }
}

// int4 K: qs is the packed q^ of the sub-group's first vector
// (pack_query_i8).
KV_AVX2 void qk_int4_any(int sg, const float* pack, int d, const uint8_t** kp, const uint8_t** km,
                         int n, float* s, float* /*kbuf*/, KvPrefetch* pf) {
  const int j = keys_per_step(sg);  // a multiple of qk_int4's J
  const int n_pad = (n + j - 1) / j * j;
  for (int x = n; x < n_pad; ++x) {  // finite filler, scores dropped
    kp[x] = kp[0];
    km[x] = km[0];
  }
  switch (sg) {
    case 1:
      return qk_int4<1, 8>(pack, d, kp, km, n_pad, s, pf);
    case 2:
      return qk_int4<2, 4>(pack, d, kp, km, n_pad, s, pf);
    case 3:
      return qk_int4<3, 2>(pack, d, kp, km, n_pad, s, pf);
    default:
      return qk_int4<4, 2>(pack, d, kp, km, n_pad, s, pf);
  }
}

// KIVI K (kivi_codec.h): a key group's G tokens share per-channel (scale,
// min), so over one group q . K_t = (q * scale) . code_t + q . min. Per run
// of keys of one group (equal metadata pointers), q' = q * scale and the
// bias q . min are formed once (buf: [2 + SG, d] floats), then the codes are
// dotted with q' as the float formats' rows are.
KV_AVX2 inline void kivi_key_meta(const uint8_t* meta, int d, float* sc, float* mn) {
  for (int c = 0; c < d; c += 8) {
    __m256 s8, m8;
    kivi_pairs8(meta, c, &s8, &m8);
    _mm256_storeu_ps(sc + c, s8);
    _mm256_storeu_ps(mn + c, m8);
  }
}

template <KvDtype F, int SG>
KV_AVX2 void qk_kivi(const float* qs, int d, const uint8_t* const* kp, const uint8_t* const* km,
                     int n, float* s, float* buf, KvPrefetch* pf) {
  constexpr int J = keys_per_step(SG);
  float* sc = buf;
  float* mn = buf + d;
  float* qp = buf + 2 * d;
  const uint8_t* kr[kChunk + 8];
  alignas(32) float tmp[SG * kChunk];
  for (int r0 = 0; r0 < n;) {
    int r1 = r0 + 1;
    while (r1 < n && km[r1] == km[r0]) ++r1;
    kivi_key_meta(km[r0], d, sc, mn);
    float bias[SG];
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) {
      __m256 b = _mm256_setzero_ps();
      for (int c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qs + h * d + c);
        _mm256_storeu_ps(qp + h * d + c, _mm256_mul_ps(qv, _mm256_loadu_ps(sc + c)));
        b = _mm256_fmadd_ps(qv, _mm256_loadu_ps(mn + c), b);
      }
      bias[h] = hsum(b);
    }
    const int nr = r1 - r0;
    const int n_pad = (nr + J - 1) / J * J;  // <= kChunk: J divides kChunk
    for (int j = 0; j < n_pad; ++j) kr[j] = kp[j < nr ? r0 + j : r0];
    qk_chunk<F, SG, J>(qp, d, kr, kr, n_pad, tmp, pf);
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) {
      for (int j = 0; j < nr; ++j) s[h * kChunk + r0 + j] = tmp[h * kChunk + j] + bias[h];
    }
    r0 = r1;
  }
}

template <KvDtype F>
KV_AVX2 void qk_kivi_any(int sg, const float* qs, int d, const uint8_t** kp, const uint8_t** km,
                         int n, float* s, float* buf, KvPrefetch* pf) {
  switch (sg) {
    case 1:
      return qk_kivi<F, 1>(qs, d, kp, km, n, s, buf, pf);
    case 2:
      return qk_kivi<F, 2>(qs, d, kp, km, n, s, buf, pf);
    case 3:
      return qk_kivi<F, 3>(qs, d, kp, km, n, s, buf, pf);
    default:
      return qk_kivi<F, 4>(qs, d, kp, km, n, s, buf, pf);
  }
}

template <KvDtype F>
KV_AVX2 void pv_any(int sg, const float* p, const uint8_t* const* vp, const uint8_t* const* vm,
                    int n, const float* alpha, float* acc, int d, float* wbuf, KvPrefetch* pf) {
  switch (sg) {
    case 1:
      return pv_chunk<F, 1>(p, vp, vm, n, alpha, acc, d, wbuf, pf);
    case 2:
      return pv_chunk<F, 2>(p, vp, vm, n, alpha, acc, d, wbuf, pf);
    case 3:
      return pv_chunk<F, 3>(p, vp, vm, n, alpha, acc, d, wbuf, pf);
    default:
      return pv_chunk<F, 4>(p, vp, vm, n, alpha, acc, d, wbuf, pf);
  }
}

using QkFn = void (*)(int, const float*, int, const uint8_t**, const uint8_t**, int, float*, float*,
                      KvPrefetch*);
using PvFn = void (*)(int, const float*, const uint8_t* const*, const uint8_t* const*, int,
                      const float*, float*, int, float*, KvPrefetch*);

// Code bits per element.
template <KvDtype F>
constexpr int code_bits() {
  return F == KvDtype::kF32                          ? 32
         : F == KvDtype::kF16 || F == KvDtype::kBF16 ? 16
         : F == KvDtype::kFp8 || F == KvDtype::kInt8 ? 8
         : F == KvDtype::kKivi2                      ? 2
                                                     : 4;
}

// The format-specific part of the decode kernel.
struct DecodeFns {
  QkFn qk = nullptr;
  PvFn pv = nullptr;
  int code_bits = 0;          // row bytes = head_dim * code_bits / 8
  bool packed_query = false;  // qk takes q^ packed by pack_query_i8 (int4 K)
};

// A KIVI format's qk is its K side (per-channel key groups) and its pv its V
// side (per-token groups, as int4).
DecodeFns decode_table(KvDtype t) {
  if (t == KvDtype::kKivi2) {
    return DecodeFns{qk_kivi_any<KvDtype::kKivi2>, pv_any<KvDtype::kKivi2>, 2};
  }
  if (t == KvDtype::kKivi4) {
    return DecodeFns{qk_kivi_any<KvDtype::kKivi4>, pv_any<KvDtype::kKivi4>, 4};
  }
  return by_format(t, []<KvDtype F>() {
    if constexpr (F == KvDtype::kInt4) {
      return DecodeFns{qk_int4_any, pv_any<F>, code_bits<F>(), true};
    } else {
      return DecodeFns{qk_any<F>, pv_any<F>, code_bits<F>()};
    }
  });
}

inline void stream_rows(const HeadStream& s, int hh, const int64_t* base, const int32_t* slot,
                        int n, const uint8_t** rows, const uint8_t** metas) {
  const uint8_t* data = s.data + hh * s.head_stride;
  for (int j = 0; j < n; ++j) rows[j] = data + base[j] + slot[j] * s.slot_stride;
  // Float formats: the caller's metas stay null (filling them per chunk cost
  // a `rep stos` per chunk and head, ~1.5% of the f16 kernel).
  if (s.meta == nullptr) return;
  const uint8_t* meta = s.meta + hh * s.meta_head_stride;
  if (s.meta_group == 1) {
    for (int j = 0; j < n; ++j) metas[j] = meta + base[j] + slot[j] * s.meta_slot_stride;
  } else {
    for (int j = 0; j < n; ++j)
      metas[j] = meta + base[j] + slot[j] / s.meta_group * s.meta_slot_stride;
  }
}

void KvPrefetch::add_range(const uint8_t* p, const uint8_t* end) {
  const auto a0 = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto a1 = (reinterpret_cast<uintptr_t>(end) + 63) & ~uintptr_t{63};
  const auto* first = reinterpret_cast<const char*>(a0);
  const auto n_lines = static_cast<int64_t>((a1 - a0) / 64);
  n_lines_ += static_cast<size_t>(n_lines);
  if (!runs_.empty() && runs_.back().first + 64 * runs_.back().n_lines >= first &&
      runs_.back().first <= first) {  // continues (or overlaps) the last run
    Run& r = runs_.back();
    r.n_lines = std::max(r.n_lines, (first - r.first) / 64 + n_lines);
    return;
  }
  runs_.push_back(Run{first, n_lines});
}

void KvPrefetch::add_stream(const HeadStream& s, int hh, int64_t base, int32_t slot0, int32_t slot1,
                            int row_bytes) {
  const uint8_t* data = s.data + hh * s.head_stride + base;
  add_range(data + slot0 * s.slot_stride, data + (slot1 - 1) * s.slot_stride + row_bytes);
  if (s.meta != nullptr) {  // per-row or per-group records, or one per block (stride 0)
    const uint8_t* meta = s.meta + hh * s.meta_head_stride + base;
    add_range(meta + slot0 / s.meta_group * s.meta_slot_stride,
              meta + (slot1 - 1) / s.meta_group * s.meta_slot_stride +
                  std::max<int64_t>(s.meta_slot_stride, 1));
  }
}

void KvPrefetch::start(const TileArgs& a, const int64_t* base, const int32_t* slot, int n,
                       int k_row_bytes, int v_row_bytes) {
  flush();
  const size_t steps = n_steps_;
  runs_.clear();
  run_ = 0;
  line_ = 0;
  n_lines_ = 0;
  n_steps_ = 0;
  // chunk_slots() gives consecutive slots within each block: one stretch per
  // block, and per stretch each head's K rows then its V rows, which the
  // block layout (kv/layout.h) puts next to each other, so a block whose
  // slots the chunk covers entirely becomes a single run.
  for (int j0 = 0; j0 < n;) {
    const int j1 = std::min(n, j0 + a.block_size - slot[j0]);
    for (int hh = 0; hh < a.n_heads; ++hh) {
      add_stream(a.k, hh, base[j0], slot[j0], slot[j1 - 1] + 1, k_row_bytes);
      add_stream(a.v, hh, base[j0], slot[j0], slot[j1 - 1] + 1, v_row_bytes);
    }
    j0 = j1;
  }
  // First chunk of a tile: about one q.K step per key pair and one p.V step
  // per key for every head.
  const size_t n_est = steps > 0 ? steps : static_cast<size_t>(a.n_heads) * n * 3 / 2;
  per_step_ = (n_lines_ + n_est - 1) / n_est;
}

}  // namespace

KV_AVX2 void decode_tile_avx2(const TileArgs& a) {
  const int d = a.head_dim;
  const int g = a.group;
  const int n_vec = g * a.n_heads;  // query vectors: q heads of every KV head in the tile
  const int n_groups = d / 32;      // int4 groups
  const DecodeFns kf = decode_table(a.k.dtype);
  const DecodeFns vf = decode_table(a.v.dtype);
  if (kf.qk == nullptr || vf.pv == nullptr) return;  // validated by the caller
  KV_CHECK(a.round_query == kf.packed_query, "decode: int4 keys are read with q^ only");
  const int pack_floats = kf.packed_query ? query_pack_floats(d) : 0;
  // Scratch: qs, acc [n_vec, d]; s [n_vec, kChunk]; m, l, alpha [n_vec];
  // wbuf [4, kChunk] + V int4 metadata [2, n_groups, kChunk]; kbuf: a KIVI
  // K's scale, min and q * scale [2 + 4, d]; int4 K: packed q^ [n_vec,
  // pack_floats].
  float* qs = thread_scratch().get(static_cast<size_t>(n_vec) * (2 * d + kChunk + 3 + pack_floats) +
                                   4 * kChunk + 2 * static_cast<size_t>(n_groups) * kChunk +
                                   6 * static_cast<size_t>(d));
  float* acc = qs + static_cast<size_t>(n_vec) * d;
  float* s = acc + static_cast<size_t>(n_vec) * d;
  float* m = s + static_cast<size_t>(n_vec) * kChunk;
  float* l = m + n_vec;
  float* alpha = l + n_vec;
  float* wbuf = alpha + n_vec;
  float* kbuf = wbuf + 4 * kChunk + 2 * static_cast<size_t>(n_groups) * kChunk;
  float* qpack = kbuf + 6 * static_cast<size_t>(d);
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int h = 0; h < n_vec; ++h) {
    for (int c = 0; c < d; c += 8) {
      _mm256_storeu_ps(qs + h * d + c, _mm256_mul_ps(_mm256_loadu_ps(a.q + h * d + c), scale));
      _mm256_storeu_ps(acc + h * d + c, _mm256_setzero_ps());
    }
    if (kf.packed_query) {  // q^ (qk_int4) replaces qs
      pack_query_i8(qs + h * d, d, qpack + static_cast<size_t>(h) * pack_floats);
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
  const int k_row_bytes = d * kf.code_bits / 8;
  const int v_row_bytes = d * vf.code_bits / 8;
  // Slots of chunks i .. i + kAhead (a ring): while chunk i is computed,
  // chunk i + kAhead is prefetched (KvPrefetch); the first kAhead chunks'
  // lines are requested at once.
  int64_t base[kAhead + 1][kChunk];
  int32_t slot[kAhead + 1][kChunk];
  const uint8_t* kp[kChunk + 8];       // + padding for qk_any
  const uint8_t* km[kChunk + 8] = {};  // stay null for float formats (stream_rows)
  const uint8_t* vp[kChunk];
  const uint8_t* vm[kChunk] = {};
  KvPrefetch& pf = tl_prefetch;
  for (int i = 0; i < kAhead; ++i) {
    const int32_t c = t_begin + i * kChunk;
    if (c >= t_end) break;
    const int n0 = std::min<int32_t>(kChunk, t_end - c);
    chunk_slots(a, c, n0, base[i], slot[i]);
    pf.start(a, base[i], slot[i], n0, k_row_bytes, v_row_bytes);
  }
  pf.flush();
  int cur = 0;
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    const int64_t* cb = base[cur];
    const int32_t* cs = slot[cur];
    const int32_t ca = c0 + kAhead * kChunk;
    if (ca < t_end) {
      const int ra = (cur + kAhead) % (kAhead + 1);
      const int na = std::min<int32_t>(kChunk, t_end - ca);
      chunk_slots(a, ca, na, base[ra], slot[ra]);
      pf.start(a, base[ra], slot[ra], na, k_row_bytes, v_row_bytes);
    }
    cur = (cur + 1) % (kAhead + 1);
    for (int hh = 0; hh < a.n_heads; ++hh) {
      stream_rows(a.k, hh, cb, cs, n, kp, km);
      stream_rows(a.v, hh, cb, cs, n, vp, vm);
      const int v0 = hh * g;  // first query vector of this KV head
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
        const float* qh = kf.packed_query ? qpack + static_cast<size_t>(h0) * pack_floats
                                          : qs + static_cast<size_t>(h0) * d;
        kf.qk(sg, qh, d, kp, km, n, s + h0 * kChunk, kbuf, &pf);
        h0 += sg;
      }
      for (int h = v0; h < v0 + g; ++h) {
        alpha[h] = softmax_update(s + h * kChunk, n, m + h, l + h);
      }
      if (a.mass_p != nullptr) {  // H2O key mass: this chunk's p (0-padded) and max
        uint16_t* mp = a.mass_p + (c0 / kChunk) * a.mass_stride;
        for (int h = v0; h < v0 + g; ++h) {
#pragma GCC unroll 4
          for (int j = 0; j < kChunk; j += 8) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(mp + h * kChunk + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(s + h * kChunk + j),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          }
          a.mass_m[(c0 / kChunk) * a.mass_m_stride + h] = m[h];
        }
      }
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int sg = g / n_sub + (sub < g % n_sub ? 1 : 0);
        vf.pv(sg, s + h0 * kChunk, vp, vm, n, alpha + h0, acc + h0 * d, d, wbuf, &pf);
        h0 += sg;
      }
    }
  }
  pf.flush();  // nothing is left queued for the next tile
  finish_tile(a, n_vec, acc, m, l);
}

KV_AVX2 void mass_add_rows_avx2(const uint16_t* const* rows, const float* f, int n_rows, int n,
                                float* dst) {
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int r = 0; r < n_rows; ++r) {
      const __m256 fr = _mm256_broadcast_ss(f + r);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + j));
      s0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(x)), fr, s0);
      s1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(x, 1)), fr, s1);
    }
    _mm256_storeu_ps(dst + j, _mm256_add_ps(_mm256_loadu_ps(dst + j), s0));
    _mm256_storeu_ps(dst + j + 8, _mm256_add_ps(_mm256_loadu_ps(dst + j + 8), s1));
  }
  for (; j < n; ++j) {
    float s = 0.0f;
    for (int r = 0; r < n_rows; ++r) s = std::fma(_cvtsh_ss(rows[r][j]), f[r], s);
    dst[j] += s;
  }
}

}  // namespace kvstack::attn_detail

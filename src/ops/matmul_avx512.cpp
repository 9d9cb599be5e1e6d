// AVX-512 + VNNI kernels for the legacy 32-block weight formats (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0) against Q8_0/Q8_1 activations and, for 4 or more rows,
// the k-quants (Q4_K, Q5_K, Q6_K; see their section below), bit-identical to
// the scalar reference (matmul_scalar.cpp).
//
// Layout: one zmm lane per weight row (output column). For a group of 16
// columns and one 32-block, the 16 unpacked blocks (32 unsigned bytes each)
// are transposed into 8 vectors T[k] with lane c = bytes 4k..4k+3 of column c;
// then for an activation row y, vpdpbusd(T[k], broadcast(y dword k)) summed
// over k gives the 16 exact integer block dots at once. Signed formats are
// made unsigned by an offset (Q8_0: q + 128, Q4_0: q + 8, Q5_0: q + 16) that
// is taken back exactly as offset * sum(y block) (PreparedAct::qsum). The
// float update per block is then the scalar kernel's, lane by lane:
//   sum = sum + (d * dy) * float(sumi);   sum = sum + m * s   (Q4_1/Q5_1)
// in block order (this file is compiled with -ffp-contract=off, see
// CMakeLists.txt), so every lane equals the scalar result bit for bit, for any
// row count, row position, column split or thread count (batch invariant).
//
// A group's transposed blocks (a "panel") are built once per block of up to
// kLegacyRowBlock activation rows and reused by every row; fewer than 4 rows
// (decode) skip the panel and reduce per-column partial sums instead
// (decode_rows), which gives the same integers. Weights packed at load into
// that transposed layout (WeightLayout::kPanels16, matmul.h) skip the
// transpose: their panel is an unpack (unpack_panel), and decode rows read
// them directly (packed_decode), with the same integers and float update.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/cpu_features.h"
#include "core/half.h"
#include "ops/matmul_k_unpack.h"
#include "ops/matmul_kernels.h"

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -Wmaybe-uninitialized reports inside the
// system header (GCC bug 105593); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#define KV_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace kvstack::ops_detail {
namespace {

// Activation rows per k-quant panel (their Q8_K data stays in L2).
constexpr int64_t kRowBlock = 64;
// Activation rows per legacy-format panel: 256 rows of Q8_0 data are 157-418
// KB for SmolLM2's 576- and 1536-element rows, within a 1 MB L2, and a
// 512-token prefill chunk builds each panel twice instead of 8 times. SmolLM2
// prefill of 512 tokens against 64 rows: 5-7% faster on one core (AMD host,
// session 15, under load), +2% in medians of 6 alternated rounds on 1 and 2
// threads (Intel host, session 16, within its noise); m <= 64 unchanged.
constexpr int64_t kLegacyRowBlock = 256;
constexpr int kCols = 16;  // columns per group (zmm lanes)

// One 32-block of a 16-column group: the transposed quants and per-column
// scales (f32), aligned for full-width loads. Plain arrays (not vector types) so that code outside
// the AVX-512 functions never handles zmm values.
struct alignas(64) PanelBlock {
  int32_t t[8][kCols];  // t[k][c]: bytes 4k..4k+3 of column c's unsigned quants
  float d[kCols];
  float m[kCols];  // min (Q4_1/Q5_1), else unused
};

// Per format: how to turn a block into 32 unsigned bytes (elements 0..31),
// the offset subtracted from them, and whether a min term follows.
struct Q4_0A {
  using Block = BlockQ4_0;
  static constexpr int kOffset = 8;
  static constexpr bool kMin = false;
};
struct Q4_1A {
  using Block = BlockQ4_1;
  static constexpr int kOffset = 0;
  static constexpr bool kMin = true;
};
struct Q5_0A {
  using Block = BlockQ5_0;
  static constexpr int kOffset = 16;
  static constexpr bool kMin = false;
};
struct Q5_1A {
  using Block = BlockQ5_1;
  static constexpr int kOffset = 0;
  static constexpr bool kMin = true;
};
struct Q8_0A {
  using Block = BlockQ8_0;
  static constexpr int kOffset = 128;
  static constexpr bool kMin = false;
};

// Q8_0's bytes as stored (signed), for the panel build's xor after the
// transpose.
struct Q8Raw {
  using Block = BlockQ8_0;
};

// 16 nibble bytes -> 32 bytes: low nibbles (elements 0..15), then high.
KV_AVX512 inline __m256i nibbles32(const uint8_t* p) {
  const __m256i t =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_srlv_epi32(t, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}

// 32 bits -> 32 bytes, byte j = 0x10 if bit j is set, else 0.
KV_AVX512 inline __m256i fifth_bits32(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __mmask32 k = bits;
  return _mm256_maskz_mov_epi8(k, _mm256_set1_epi8(0x10));
}

template <class F>
KV_AVX512 inline __m256i unsigned_quants(const typename F::Block& b) {
  if constexpr (std::is_same_v<F, Q8Raw>) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  } else if constexpr (std::is_same_v<F, Q8_0A>) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
  } else if constexpr (std::is_same_v<F, Q5_0A> || std::is_same_v<F, Q5_1A>) {
    return _mm256_or_si256(nibbles32(b.qs), fifth_bits32(b.qh));
  } else {
    return nibbles32(b.qs);
  }
}

// Transposes rows r[i] = [column i | column i + 8] (8 dwords each half) so
// that out[k] lane c = dword k of column c.
KV_AVX512 inline void transpose_16x8(const __m512i* r, __m512i* out) {
  __m512i t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0..3, then 4..7
    const __m512i* th = t + 4 * h;
    s[4 * h + 0] = _mm512_unpacklo_epi64(th[0], th[2]);  // k = 0 | 4
    s[4 * h + 1] = _mm512_unpackhi_epi64(th[0], th[2]);  // k = 1 | 5
    s[4 * h + 2] = _mm512_unpacklo_epi64(th[1], th[3]);  // k = 2 | 6
    s[4 * h + 3] = _mm512_unpackhi_epi64(th[1], th[3]);  // k = 3 | 7
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int k = 0; k < 4; ++k) {
    out[k] = _mm512_permutex2var_epi64(s[k], lo, s[4 + k]);
    out[k + 4] = _mm512_permutex2var_epi64(s[k], hi, s[4 + k]);
  }
}

// The first dword of block b of columns 0..n_cols-1 (lane c; 0 beyond
// n_cols): d (f16) and, for Q4_1/Q5_1, m (f16) in the upper half (one masked
// gather; lanes beyond n_cols read nothing).
template <class Block>
KV_AVX512 inline __m512i block_headers(const uint8_t* col0, size_t row_bytes, int64_t b,
                                       int n_cols) {
  const __m512i off =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(row_bytes)));
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                     static_cast<__mmask16>((1u << n_cols) - 1), off,
                                     col0 + b * sizeof(Block), 1);
}

// The f16 at byte offset `off` of block b of 16 full columns, packed (lane c
// = column c): 16 scalar loads assembled in general registers, four to a
// qword. The masked gather in block_headers costs about as much as the rest
// of a Q8_0 panel build (m = 8: 14% of the call); these integer ops run on
// ports the panel's shuffles and stores leave idle.
template <class Block>
KV_AVX512 inline __m256i block_f16s(const uint8_t* col0, size_t row_bytes, int64_t b, size_t off) {
  const uint8_t* p = col0 + b * sizeof(Block) + off;
  uint64_t q[4];
  for (int g = 0; g < 4; ++g) {
    uint64_t v = 0;
    for (int i = 0; i < 4; ++i) {
      uint16_t h;
      std::memcpy(&h, p + (4 * g + i) * row_bytes, 2);
      v |= static_cast<uint64_t>(h) << (16 * i);
    }
    q[g] = v;
  }
  const __m128i lo = _mm_insert_epi64(_mm_cvtsi64_si128(static_cast<long long>(q[0])),
                                      static_cast<long long>(q[1]), 1);
  const __m128i hi = _mm_insert_epi64(_mm_cvtsi64_si128(static_cast<long long>(q[2])),
                                      static_cast<long long>(q[3]), 1);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// A byte range to bring into cache while a group computes, spread over its
// blocks (a burst of a hundred prefetches at once would overflow the
// core's outstanding-miss slots and be dropped).
struct Prefetch {
  const char* p;
  int64_t bytes;
};

// The weight rows of the group after next of [c, c + 16) (one contiguous
// range), to request while this group computes: one group ahead is too
// short a lead for DRAM.
inline Prefetch group_after_next(const WeightView& w, size_t row_bytes, int64_t c) {
  const int64_t nc = std::max<int64_t>(0, std::min<int64_t>(kCols, w.n_out - (c + 2 * kCols)));
  return Prefetch{reinterpret_cast<const char*>(w.data + (c + 2 * kCols) * row_bytes),
                  nc * static_cast<int64_t>(row_bytes)};
}

// A Prefetch issued over nb blocks: a fixed number of lines per block
// (rounded up) from a running pointer, prefetch_step() once per block. An
// even share computed per block (b * lines / nb) cost two idiv per block,
// which the one-row kernels and the panel unpack felt.
struct PrefetchCursor {
  const char* p;
  const char* end;
  int64_t per_block;  // lines per block
};
inline PrefetchCursor prefetch_cursor(const Prefetch& next, int64_t nb) {
  const int64_t n_lines = (next.bytes + 63) / 64;
  return PrefetchCursor{next.p, next.p + 64 * n_lines, (n_lines + nb - 1) / nb};
}
KV_AVX512 inline void prefetch_step(PrefetchCursor& pc) {
  for (int64_t l = 0; l < pc.per_block && pc.p < pc.end; ++l, pc.p += 64) {
    _mm_prefetch(pc.p, _MM_HINT_T0);
  }
}

// The 16 columns' qs nibbles of one Q4_0/Q4_1 block, transposed in place:
// a block's 16 qs bytes hold elements 4k..4k+3 in the low nibbles of dword
// k and elements 16+4k.. in its high nibbles, so only the 4 qs dwords of
// each column need transposing (a 16 x 4 dword transpose: 4 loads per
// vector, 8 unpacks), and T[k] = D[k] & 0x0f, T[k + 4] = (D[k] >> 4) & 0x0f.
// Vector i is loaded as columns (i, 4 + i, 8 + i, 12 + i) in its 128-bit
// lanes, so that after the in-lane 4 x 4 transpose lane c is column c.
// The same unsigned bytes as unsigned_quants(), so the same panel.
// nibble_dwords gives the transposed D[k] (k < 4), nibble_panel_quants the T.
template <class Block>
KV_AVX512 inline void nibble_dwords(const uint8_t* col0, size_t row_bytes, int64_t b, int n_cols,
                                    __m512i* dq) {
  constexpr size_t kQsOff = offsetof(Block, qs);
  auto ld = [&](int j) {
    return j < n_cols ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                            col0 + j * row_bytes + b * sizeof(Block) + kQsOff))
                      : _mm_setzero_si128();
  };
  __m512i r[4];
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_castsi128_si512(ld(i));
    v = _mm512_inserti32x4(v, ld(4 + i), 1);
    v = _mm512_inserti32x4(v, ld(8 + i), 2);
    r[i] = _mm512_inserti32x4(v, ld(12 + i), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]);  // lane: r0.d0 r1.d0 r0.d1 r1.d1
  const __m512i t1 = _mm512_unpackhi_epi32(r[0], r[1]);  // lane: r0.d2 r1.d2 r0.d3 r1.d3
  const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]);
  const __m512i t3 = _mm512_unpackhi_epi32(r[2], r[3]);
  dq[0] = _mm512_unpacklo_epi64(t0, t2);
  dq[1] = _mm512_unpackhi_epi64(t0, t2);
  dq[2] = _mm512_unpacklo_epi64(t1, t3);
  dq[3] = _mm512_unpackhi_epi64(t1, t3);
}

template <class Block>
KV_AVX512 inline void nibble_panel_quants(const uint8_t* col0, size_t row_bytes, int64_t b,
                                          int n_cols, __m512i* t) {
  __m512i dq[4];
  nibble_dwords<Block>(col0, row_bytes, b, n_cols, dq);
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_and_si512(dq[k], low4);
    t[k + 4] = _mm512_and_si512(_mm512_srli_epi32(dq[k], 4), low4);
  }
}

// Four consecutive Q4_1 blocks b..b+3 of 16 full columns, headers included,
// without the per-block header gather (which, with its f16 conversions
// waiting on it, took about half of build_panel's time): a Q4_1 block is 20
// bytes (5 dwords: d|m, then the 4 qs dwords), so four blocks are 80
// contiguous bytes per column, 5 xmm loads. Transposing each of the 5 xmm
// positions as nibble_panel_quants does (columns (i, 4 + i, 8 + i, 12 + i) in
// the 128-bit lanes of vector i, an in-lane 4 x 4 transpose) gives dword t
// (0..19) of the 80 bytes for all 16 columns: block t / 5, field t % 5.
// The panel is the one nibble_panel_quants + block_headers build.
KV_AVX512 inline void q4_1_panel4(const uint8_t* col0, size_t row_bytes, int64_t b,
                                  PanelBlock* panel) {
  static_assert(sizeof(BlockQ4_1) == 20 && offsetof(BlockQ4_1, qs) == 4);
  const uint8_t* p0 = col0 + b * sizeof(BlockQ4_1);
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int x = 0; x < 5; ++x) {  // xmm position: dwords 4x..4x+3 of the 80 bytes
    auto ld = [&](int j) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + j * row_bytes + 16 * x));
    };
    __m512i r[4];
    for (int i = 0; i < 4; ++i) {
      __m512i v = _mm512_castsi128_si512(ld(i));
      v = _mm512_inserti32x4(v, ld(4 + i), 1);
      v = _mm512_inserti32x4(v, ld(8 + i), 2);
      r[i] = _mm512_inserti32x4(v, ld(12 + i), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]);
    const __m512i t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]);
    const __m512i t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    const __m512i dq[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                           _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    for (int k = 0; k < 4; ++k) {
      const int t = 4 * x + k;
      PanelBlock& pb = panel[b + t / 5];
      const int f = t % 5;
      if (f == 0) {
        _mm512_store_ps(pb.d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dq[k])));
        _mm512_store_ps(pb.m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dq[k], 16))));
      } else {
        _mm512_store_si512(pb.t[f - 1], _mm512_and_si512(dq[k], low4));
        _mm512_store_si512(pb.t[f + 3], _mm512_and_si512(_mm512_srli_epi32(dq[k], 4), low4));
      }
    }
  }
}

// The 16 columns' unsigned quants of block b of a Q5_0/Q5_1/Q8_0 row
// (32 bytes each, a 16 x 8 dword transpose; columns past n_cols are zero,
// which Q8_0's + 128 turns into 0x80 bytes: finite sums never stored).
// Q8_0's signed bytes are made unsigned after the transpose (a byte
// permutation, so the xor commutes with it): 8 xors instead of 16.
template <class F>
KV_AVX512 inline void wide_panel_quants(const uint8_t* col0, size_t row_bytes, int64_t b,
                                        int n_cols, __m512i* t) {
  using Block = typename F::Block;
  using U = std::conditional_t<std::is_same_v<F, Q8_0A>, Q8Raw, F>;
  __m256i u[kCols];
  for (int j = 0; j < kCols; ++j) {
    u[j] = j < n_cols ? unsigned_quants<U>(reinterpret_cast<const Block*>(col0 + j * row_bytes)[b])
                      : _mm256_setzero_si256();
  }
  __m512i r[8];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(u[i]), u[i + 8], 1);
  }
  transpose_16x8(r, t);
  if constexpr (std::is_same_v<F, Q8_0A>) {
    for (int k = 0; k < 8; ++k) {
      t[k] = _mm512_xor_si512(t[k], _mm512_set1_epi8(static_cast<char>(0x80)));
    }
  }
}

// Builds the panel of columns [c, c + n_cols) (n_cols <= 16; missing columns
// are zero) over every block of the row, prefetching `next` meanwhile.
template <class F>
KV_AVX512 void build_panel(const uint8_t* base, size_t row_bytes, int64_t c, int n_cols, int64_t nb,
                           Prefetch next, PanelBlock* panel) {
  using Block = typename F::Block;
  const uint8_t* col0 = base + c * row_bytes;
  PrefetchCursor pc = prefetch_cursor(next, nb);
  int64_t b = 0;
  if constexpr (std::is_same_v<F, Q4_1A>) {
    if (n_cols == kCols) {
      for (; b + 4 <= nb; b += 4) {
        for (int k = 0; k < 4; ++k) prefetch_step(pc);
        q4_1_panel4(col0, row_bytes, b, panel);
      }
    }
  }
  for (; b < nb; ++b) {
    prefetch_step(pc);
    PanelBlock& pb = panel[b];
    __m512i t[8];
    if constexpr (std::is_same_v<F, Q4_0A> || std::is_same_v<F, Q4_1A>) {
      nibble_panel_quants<Block>(col0, row_bytes, b, n_cols, t);
    } else {
      wide_panel_quants<F>(col0, row_bytes, b, n_cols, t);
    }
    for (int k = 0; k < 8; ++k) _mm512_store_si512(pb.t[k], t[k]);
    if (n_cols == kCols) {
      _mm512_store_ps(pb.d, _mm512_cvtph_ps(block_f16s<Block>(col0, row_bytes, b, 0)));
      if constexpr (F::kMin) {
        _mm512_store_ps(pb.m, _mm512_cvtph_ps(block_f16s<Block>(col0, row_bytes, b, 2)));
      }
      continue;
    }
    const __m512i hdr = block_headers<Block>(col0, row_bytes, b, n_cols);
    _mm512_store_ps(pb.d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr)));
    if constexpr (F::kMin) {
      _mm512_store_ps(pb.m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16))));
    }
  }
}

// Rows [r0, r0 + MR) against a built panel; lanes of y beyond n_cols are not
// written.
template <class F, int MR>
KV_AVX512 void panel_rows(const PanelBlock* panel, int64_t nb, const PreparedAct& a, int64_t r0,
                          __mmask16 cmask, float* y, int64_t ldy) {
  __m512 acc[MR];
  const int8_t* yq[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    yq[r] = a.qs + (r0 + r) * a.n_in;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const PanelBlock& pb = panel[b];
    __m512i i0[MR], i1[MR];
    for (int r = 0; r < MR; ++r) i0[r] = i1[r] = _mm512_setzero_si512();
    for (int k = 0; k < 8; k += 2) {
      const __m512i t0 = _mm512_load_si512(pb.t[k]);
      const __m512i t1 = _mm512_load_si512(pb.t[k + 1]);
      for (int r = 0; r < MR; ++r) {
        int32_t w0, w1;
        std::memcpy(&w0, yq[r] + b * kQK + 4 * k, 4);
        std::memcpy(&w1, yq[r] + b * kQK + 4 * k + 4, 4);
        i0[r] = _mm512_dpbusd_epi32(i0[r], t0, _mm512_set1_epi32(w0));
        i1[r] = _mm512_dpbusd_epi32(i1[r], t1, _mm512_set1_epi32(w1));
      }
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t rb = (r0 + r) * nb + b;  // (row, block) index of a.d / a.s / a.qsum
      __m512i sumi = _mm512_add_epi32(i0[r], i1[r]);
      if constexpr (F::kOffset != 0) {
        sumi = _mm512_sub_epi32(sumi, _mm512_set1_epi32(F::kOffset * a.qsum[rb]));
      }
      const __m512 dd = _mm512_mul_ps(_mm512_load_ps(pb.d), _mm512_set1_ps(a.d[rb]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
      if constexpr (F::kMin) {
        acc[r] =
            _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_load_ps(pb.m), _mm512_set1_ps(a.s[rb])));
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy, cmask, acc[r]);
}

// Rows [r0, r0 + MR) against NP (2 or 3) built panels: panel p (columns
// [c + 16p, c + 16p + 16), at panels + p * nb) lands at y + 16p, the last
// one masked by cmask_last. Each broadcast activation dword feeds all NP
// groups' vpdpbusd (1/NP of the broadcasts per multiply-add of panel_rows),
// one dependent chain per (row, group) over the block's 8 dwords. Three
// panels take a range of 3 groups (a 48-column grain: every 576-column
// output of SmolLM2 at 16 rows) in one pass instead of a pair and a
// single panel. The integers and the float update per block are
// panel_rows', so the bits are too.
template <class F, int MR, int NP>
KV_AVX512 void panel_rows_n(const PanelBlock* panels, int64_t nb, const PreparedAct& a, int64_t r0,
                            __mmask16 cmask_last, float* y, int64_t ldy, Prefetch next,
                            int64_t step0, int64_t n_steps) {
  static_assert(NP * MR <= 12, "NP x MR integer and float accumulators must fit the registers");
  __m512 acc[NP][MR];
  const int8_t* yq[MR];
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < NP; ++h) acc[h][r] = _mm512_setzero_ps();
    yq[r] = a.qs + (r0 + r) * a.n_in;
  }
  // Lines of `next` per step, rounded up (no division in the block loop).
  const int64_t n_lines = (next.bytes + 63) / 64;
  const int64_t per_step = (n_lines + n_steps - 1) / n_steps;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = (step0 + b) * per_step, e = std::min(n_lines, l + per_step); l < e; ++l) {
      _mm_prefetch(next.p + 64 * l, _MM_HINT_T0);
    }
    const PanelBlock* g[NP];
    for (int h = 0; h < NP; ++h) g[h] = panels + h * nb + b;
    __m512i is[NP][MR];
    for (int r = 0; r < MR; ++r) {
      for (int h = 0; h < NP; ++h) is[h][r] = _mm512_setzero_si512();
    }
    for (int k = 0; k < 8; ++k) {
      __m512i t[NP];
      for (int h = 0; h < NP; ++h) t[h] = _mm512_load_si512(g[h]->t[k]);
      for (int r = 0; r < MR; ++r) {
        int32_t wk;
        std::memcpy(&wk, yq[r] + b * kQK + 4 * k, 4);
        const __m512i yv = _mm512_set1_epi32(wk);
        for (int h = 0; h < NP; ++h) is[h][r] = _mm512_dpbusd_epi32(is[h][r], t[h], yv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t rb = (r0 + r) * nb + b;  // (row, block) index of a.d / a.s / a.qsum
      const __m512 dy = _mm512_set1_ps(a.d[rb]);
      for (int h = 0; h < NP; ++h) {
        __m512i sumi = is[h][r];
        if constexpr (F::kOffset != 0) {
          sumi = _mm512_sub_epi32(sumi, _mm512_set1_epi32(F::kOffset * a.qsum[rb]));
        }
        const __m512 dd = _mm512_mul_ps(_mm512_load_ps(g[h]->d), dy);
        acc[h][r] = _mm512_add_ps(acc[h][r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
        if constexpr (F::kMin) {
          acc[h][r] = _mm512_add_ps(
              acc[h][r], _mm512_mul_ps(_mm512_load_ps(g[h]->m), _mm512_set1_ps(a.s[rb])));
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h + 1 < NP; ++h) _mm512_storeu_ps(y + (r0 + r) * ldy + h * kCols, acc[h][r]);
    _mm512_mask_storeu_ps(y + (r0 + r) * ldy + (NP - 1) * kCols, cmask_last, acc[NP - 1][r]);
  }
}

// Decode variant (fewer than 4 activation rows, where a panel would be built
// for one use): per block, each column's 32 unsigned bytes are dotted with
// the row's block by vpdpbusd into 8 dword partial sums, and a reduction tree
// turns the 16 columns' partials into one vector of 16 exact block sums (lane
// c = column c). Same integers, same float update as panel_rows, so the bits
// are the same as the panel path's and the scalar reference's.
//
// Z[i] pairs columns (lo, hi) = (i, i + 4) for i < 4 and (i + 4, i + 8) for
// i >= 4, so that the tree's last step lands column c in lane c.
KV_AVX512 inline __m512i reduce_pairs32(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
KV_AVX512 inline __m512i reduce_pairs64(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// kFull: n_cols == 16 (every group but a range's last), so the column tests
// fold away.
template <class F, int MR, bool kFull>
KV_AVX512 void decode_rows(const uint8_t* base, size_t row_bytes, const PreparedAct& a, int64_t c,
                           int n_cols_in, Prefetch next, float* y, int64_t ldy) {
  using Block = typename F::Block;
  const int n_cols = kFull ? kCols : n_cols_in;
  const int64_t nb = a.n_in / kQK;
  const __mmask16 cmask =
      kFull ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n_cols) - 1);
  const uint8_t* col0 = base + c * row_bytes;
  static constexpr int kLo[8] = {0, 1, 2, 3, 8, 9, 10, 11};
  PrefetchCursor pc = prefetch_cursor(next, nb);
  __m512 acc[MR];
  const int8_t* yq[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    yq[r] = a.qs + r * a.n_in;
  }
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_step(pc);
    const uint8_t* blk0 = col0 + b * sizeof(Block);
    __m512i z[8];
    for (int i = 0; i < 8; ++i) {
      const int lo = kLo[i], hi = kLo[i] + 4;
      const __m256i ul =
          lo < n_cols ? unsigned_quants<F>(*reinterpret_cast<const Block*>(blk0 + lo * row_bytes))
                      : _mm256_setzero_si256();
      const __m256i uh =
          hi < n_cols ? unsigned_quants<F>(*reinterpret_cast<const Block*>(blk0 + hi * row_bytes))
                      : _mm256_setzero_si256();
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(ul), uh, 1);
    }
    const __m512i hdr = block_headers<Block>(col0, row_bytes, b, n_cols);
    const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
    for (int r = 0; r < MR; ++r) {
      const __m512i yv = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yq[r] + b * kQK)));
      __m512i p[8];
      for (int i = 0; i < 8; ++i) p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[i], yv);
      const __m512i q0 = reduce_pairs64(reduce_pairs32(p[0], p[1]), reduce_pairs32(p[2], p[3]));
      const __m512i q1 = reduce_pairs64(reduce_pairs32(p[4], p[5]), reduce_pairs32(p[6], p[7]));
      // q0 128-bit lanes: cols 0-3 (dwords 0-3), cols 0-3 (4-7), cols 4-7 (0-3), cols 4-7 (4-7);
      // q1 the same for cols 8-15.
      __m512i sumi = _mm512_add_epi32(_mm512_shuffle_i32x4(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
      const int64_t rb = r * nb + b;
      if constexpr (F::kOffset != 0) {
        sumi = _mm512_sub_epi32(sumi, _mm512_set1_epi32(F::kOffset * a.qsum[rb]));
      }
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[rb]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
      if constexpr (F::kMin) {
        const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.s[rb])));
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + c, cmask, acc[r]);
}

// Columns [c0, c1) of MR (< 4) decode rows, 16 at a time.
template <class F, int MR>
KV_AVX512 void decode_range(const WeightView& w, size_t row_bytes, const PreparedAct& a, int64_t c0,
                            int64_t c1, float* y, int64_t ldy) {
  int64_t c = c0;
  for (; c + kCols <= c1; c += kCols) {
    decode_rows<F, MR, true>(w.data, row_bytes, a, c, kCols, group_after_next(w, row_bytes, c), y,
                             ldy);
  }
  if (c < c1) {
    decode_rows<F, MR, false>(w.data, row_bytes, a, c, static_cast<int>(c1 - c),
                              group_after_next(w, row_bytes, c), y, ldy);
  }
}

// Per thread: the current panel (grows to the widest n_in seen).
PanelBlock* panel_buffer(int64_t nb) {
  static thread_local std::vector<PanelBlock> buf;
  if (static_cast<int64_t>(buf.size()) < nb) buf.resize(static_cast<size_t>(nb));
  return buf.data();
}

// ---- kPanels16 weights (pack_weight_panels, matmul.h). ----
//
// A group-block (16 columns, one 32-block) of packed Q4_0/Q4_1 holds the 4
// transposed qs dwords per column, so the panel's T[k] = D[k] & 0x0f and
// T[k + 4] = (D[k] >> 4) & 0x0f (nibble_panel_quants' last step, without its
// loads and transpose); packed Q8_0 holds T[k] itself (already unsigned).
// The f16 scales (and mins) of the 16 columns follow. Same unsigned bytes,
// same scales: the same panel as build_panel's, so the same bits.
template <class F>
constexpr size_t kPackedQsBytes = std::is_same_v<F, Q8_0A> ? kPanelsQsBytesQ8 : kPanelsQsBytesQ4;

// The 8 transposed unsigned-quant vectors of packed group-block p.
template <class F>
KV_AVX512 inline void packed_quants(const uint8_t* p, __m512i* t) {
  if constexpr (std::is_same_v<F, Q8_0A>) {
    for (int k = 0; k < 8; ++k) t[k] = _mm512_loadu_si512(p + 64 * k);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; ++k) {
      const __m512i dq = _mm512_loadu_si512(p + 64 * k);
      t[k] = _mm512_and_si512(dq, low4);
      t[k + 4] = _mm512_and_si512(_mm512_srli_epi32(dq, 4), low4);
    }
  }
}

// The 16 columns' f16 at byte `off` of packed group-block p, as floats.
KV_AVX512 inline __m512 packed_f16s(const uint8_t* p, size_t off) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off)));
}

// The panel of one packed group (nb group-blocks from `group`), prefetching
// `next` meanwhile.
template <class F>
KV_AVX512 void unpack_panel(const uint8_t* group, int64_t nb, Prefetch next, PanelBlock* panel) {
  constexpr size_t kBlockBytes = kCols * sizeof(typename F::Block);
  PrefetchCursor pc = prefetch_cursor(next, nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_step(pc);
    const uint8_t* p = group + b * kBlockBytes;
    __m512i t[8];
    packed_quants<F>(p, t);
    PanelBlock& pb = panel[b];
    for (int k = 0; k < 8; ++k) _mm512_store_si512(pb.t[k], t[k]);
    _mm512_store_ps(pb.d, packed_f16s(p, kPackedQsBytes<F>));
    if constexpr (F::kMin) _mm512_store_ps(pb.m, packed_f16s(p, kPackedQsBytes<F> + 32));
  }
}

// Packs the 16 rows at `rows` (GGUF's layout, row_bytes each, nb blocks)
// into the kPanels16 group at `dst` (must not overlap them): per block the
// transposed qs dwords (Q4_0/Q4_1: nibble_dwords; Q8_0: the panel's
// unsigned quants, wide_panel_quants), then the f16 scales (and mins)
// gathered four to a qword (block_f16s).
template <class F>
KV_AVX512 void pack_group(const uint8_t* rows, size_t row_bytes, int64_t nb, uint8_t* dst) {
  using Block = typename F::Block;
  constexpr size_t kBlockBytes = kCols * sizeof(Block);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* p = dst + b * kBlockBytes;
    if constexpr (std::is_same_v<F, Q8_0A>) {
      __m512i t[8];
      wide_panel_quants<F>(rows, row_bytes, b, kCols, t);
      for (int k = 0; k < 8; ++k) _mm512_storeu_si512(p + 64 * k, t[k]);
    } else {
      __m512i dq[4];
      nibble_dwords<Block>(rows, row_bytes, b, kCols, dq);
      for (int k = 0; k < 4; ++k) _mm512_storeu_si512(p + 64 * k, dq[k]);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + kPackedQsBytes<F>),
                        block_f16s<Block>(rows, row_bytes, b, 0));
    if constexpr (F::kMin) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + kPackedQsBytes<F> + 32),
                          block_f16s<Block>(rows, row_bytes, b, 2));
    }
  }
}

// Decode rows (MR < 4) against NP adjacent packed groups starting at column
// c, straight from the packed bytes (a panel would serve one use). Per block
// and row, the integer sums of panel_rows (two chains over the 8 dwords) and
// its float update, lane by lane: the same bits. NP groups at once give
// 2 * NP * MR independent vpdpbusd chains and NP * MR float chains, which
// one group alone (2 and 1 per row) would leave waiting on latency.
template <class F, int MR, int NP>
KV_AVX512 void packed_decode(const uint8_t* base, size_t row_bytes, const PreparedAct& a, int64_t c,
                             Prefetch next, float* y, int64_t ldy) {
  constexpr size_t kBlockBytes = kCols * sizeof(typename F::Block);
  const int64_t nb = a.n_in / kQK;
  const uint8_t* g0 = base + c * row_bytes;
  PrefetchCursor pc = prefetch_cursor(next, nb);
  __m512 acc[NP][MR];
  const int8_t* yq[MR];
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < NP; ++h) acc[h][r] = _mm512_setzero_ps();
    yq[r] = a.qs + r * a.n_in;
  }
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_step(pc);
    __m512i i0[NP][MR], i1[NP][MR];
    for (int h = 0; h < NP; ++h) {
      for (int r = 0; r < MR; ++r) i0[h][r] = i1[h][r] = _mm512_setzero_si512();
    }
    for (int k = 0; k < 8; k += 2) {
      for (int h = 0; h < NP; ++h) {
        const uint8_t* p = g0 + h * kCols * row_bytes + b * kBlockBytes;
        __m512i t0, t1;
        if constexpr (std::is_same_v<F, Q8_0A>) {
          t0 = _mm512_loadu_si512(p + 64 * k);
          t1 = _mm512_loadu_si512(p + 64 * (k + 1));
        } else {
          // Dwords k and k + 1 of the panel: T[j] for j < 4 is D[j] & 0x0f,
          // T[j] for j >= 4 is (D[j - 4] >> 4) & 0x0f.
          const __m512i low4 = _mm512_set1_epi8(0x0f);
          const __m512i d0 = _mm512_loadu_si512(p + 64 * (k & 3));
          const __m512i d1 = _mm512_loadu_si512(p + 64 * ((k + 1) & 3));
          t0 = _mm512_and_si512(k < 4 ? d0 : _mm512_srli_epi32(d0, 4), low4);
          t1 = _mm512_and_si512(k < 4 ? d1 : _mm512_srli_epi32(d1, 4), low4);
        }
        for (int r = 0; r < MR; ++r) {
          int32_t w0, w1;
          std::memcpy(&w0, yq[r] + b * kQK + 4 * k, 4);
          std::memcpy(&w1, yq[r] + b * kQK + 4 * k + 4, 4);
          i0[h][r] = _mm512_dpbusd_epi32(i0[h][r], t0, _mm512_set1_epi32(w0));
          i1[h][r] = _mm512_dpbusd_epi32(i1[h][r], t1, _mm512_set1_epi32(w1));
        }
      }
    }
    for (int h = 0; h < NP; ++h) {
      const uint8_t* p = g0 + h * kCols * row_bytes + b * kBlockBytes;
      const __m512 dw = packed_f16s(p, kPackedQsBytes<F>);
      for (int r = 0; r < MR; ++r) {
        const int64_t rb = r * nb + b;  // (row, block) index of a.d / a.s / a.qsum
        __m512i sumi = _mm512_add_epi32(i0[h][r], i1[h][r]);
        if constexpr (F::kOffset != 0) {
          sumi = _mm512_sub_epi32(sumi, _mm512_set1_epi32(F::kOffset * a.qsum[rb]));
        }
        const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[rb]));
        acc[h][r] = _mm512_add_ps(acc[h][r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
        if constexpr (F::kMin) {
          const __m512 mw = packed_f16s(p, kPackedQsBytes<F> + 32);
          acc[h][r] = _mm512_add_ps(acc[h][r], _mm512_mul_ps(mw, _mm512_set1_ps(a.s[rb])));
        }
      }
    }
  }
  for (int h = 0; h < NP; ++h) {
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy + c + h * kCols, acc[h][r]);
  }
}

// Columns [c0, c1) (whole groups) of MR (< 4) decode rows: NP groups at a
// time (NP * MR float chains: 4 for one row, 4 and 6 for two and three),
// then the remaining groups one by one; each pass prefetches the groups
// after it.
template <class F, int MR>
KV_AVX512 void packed_decode_range(const WeightView& w, size_t row_bytes, const PreparedAct& a,
                                   int64_t c0, int64_t c1, float* y, int64_t ldy) {
  constexpr int NP = MR == 1 ? 4 : 2;
  auto ahead = [&](int64_t c, int64_t width) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(width, w.n_out - (c + width)));
    return Prefetch{reinterpret_cast<const char*>(w.data + (c + width) * row_bytes),
                    n * static_cast<int64_t>(row_bytes)};
  };
  int64_t c = c0;
  for (; c + NP * kCols <= c1; c += NP * kCols) {
    packed_decode<F, MR, NP>(w.data, row_bytes, a, c, ahead(c, NP * kCols), y, ldy);
  }
  for (; c < c1; c += kCols) {
    packed_decode<F, MR, 1>(w.data, row_bytes, a, c, ahead(c, kCols), y, ldy);
  }
}

// The panel path of legacy_kernel (4 or more rows). Kept out of line: inlined
// into legacy_kernel next to the one-row loops, it cost those loops 7-14%
// (ops_bench BM_MatmulModel m:1, 1 thread), through the shared function's
// register allocation.
template <class F, bool kPacked>
__attribute__((noinline)) KV_AVX512 void legacy_panels(const WeightView& w, const PreparedAct& a,
                                                       int64_t c0, int64_t c1, float* y,
                                                       int64_t ldy) {
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  const int64_t nb = a.n_in / kQK;
  // The panel of columns [ch, ch + n_cols): transposed from the row-major
  // weights, or (kPanels16) unpacked from the group's packed bytes, which sit
  // where its rows did, so every prefetch range below is the same.
  auto make_panel = [&](int64_t ch, int n_cols, Prefetch next, PanelBlock* dst) {
    if constexpr (kPacked) {
      unpack_panel<F>(w.data + ch * row_bytes, nb, next, dst);
    } else {
      build_panel<F>(w.data, row_bytes, ch, n_cols, nb, next, dst);
    }
  };
  // Two or three panels (32 or 48 columns) at a time where the range has
  // them: the later groups' rows share the first's activation broadcasts
  // (panel_rows_n). A range of 3 groups runs as one triple; otherwise pairs,
  // then a last triple or a single panel for an odd count.
  PanelBlock* panel = panel_buffer(3 * nb);
  for (int64_t rb = 0; rb < a.m; rb += kLegacyRowBlock) {
    const int64_t rb_end = std::min(a.m, rb + kLegacyRowBlock);
    for (int64_t c = c0; c < c1;) {
      const int64_t groups_left = (c1 - c + kCols - 1) / kCols;
      const int np = groups_left == 3 ? 3 : std::min<int64_t>(groups_left, 2);
      const int n_cols = static_cast<int>(std::min<int64_t>(kCols, c1 - c));
      // Weights come from DRAM on the first row block only.
      float* yc = y + c;
      int64_t r = rb;
      if (np > 1) {
        int n_cols_last = kCols;
        for (int h = 0; h < np; ++h) {
          const int64_t ch = c + h * kCols;
          n_cols_last = static_cast<int>(std::min<int64_t>(kCols, c1 - ch));
          make_panel(ch, n_cols_last, Prefetch{nullptr, 0}, panel + h * nb);
        }
        const int64_t width = np * kCols;
        // The next groups' weight rows (first row block only: later ones find
        // them in cache), requested over every (row group, block) step of
        // this pass's arithmetic, which is where the time goes: issued
        // during the short panel build instead, they came in a burst and
        // the build still waited on DRAM.
        Prefetch next{nullptr, 0};
        if (rb == 0) {
          // Past c1 too (up to the matrix's end): a thread's next grain
          // usually starts there (matmul.cpp claims each share front to back).
          const int64_t n_next =
              std::max<int64_t>(0, std::min<int64_t>(2 * kCols, w.n_out - (c + width)));
          next = Prefetch{reinterpret_cast<const char*>(w.data + (c + width) * row_bytes),
                          n_next * static_cast<int64_t>(row_bytes)};
        }
        // Over the 4-row groups only (a first row block has at least one: m >= 4).
        const int64_t n_steps = (rb_end - rb) / 4 * nb;
        const __mmask16 cmask_last = static_cast<__mmask16>((1u << n_cols_last) - 1);
        const Prefetch none{nullptr, 0};
        for (int64_t step = 0; r + 4 <= rb_end; r += 4, step += nb) {
          if (np == 3) {
            panel_rows_n<F, 4, 3>(panel, nb, a, r, cmask_last, yc, ldy, next, step, n_steps);
          } else {
            panel_rows_n<F, 4, 2>(panel, nb, a, r, cmask_last, yc, ldy, next, step, n_steps);
          }
        }
        for (; r < rb_end; ++r) {
          if (np == 3) {
            panel_rows_n<F, 1, 3>(panel, nb, a, r, cmask_last, yc, ldy, none, 0, 1);
          } else {
            panel_rows_n<F, 1, 2>(panel, nb, a, r, cmask_last, yc, ldy, none, 0, 1);
          }
        }
        c += width;
        continue;
      }
      const Prefetch next = rb == 0 ? group_after_next(w, row_bytes, c) : Prefetch{nullptr, 0};
      make_panel(c, n_cols, next, panel);
      const __mmask16 cmask = static_cast<__mmask16>((1u << n_cols) - 1);
      for (; r + 4 <= rb_end; r += 4) panel_rows<F, 4>(panel, nb, a, r, cmask, yc, ldy);
      for (; r < rb_end; ++r) panel_rows<F, 1>(panel, nb, a, r, cmask, yc, ldy);
      c += kCols;
    }
  }
}

// The legacy formats' kernel: the panel path for 4 or more rows, else the
// decode rows. kPacked: kPanels16 weights, columns [c0, c1) in whole groups
// of 16 (run_parts splits at multiples of 16, and packed matrices have
// n_out % 16 == 0).
template <class F, bool kPacked>
KV_AVX512 void legacy_kernel(const WeightView& w, const PreparedAct& a, int64_t c0, int64_t c1,
                             float* y, int64_t ldy) {
  if (a.m >= 4) return legacy_panels<F, kPacked>(w, a, c0, c1, y, ldy);
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  auto rows = [&]<int MR>() {
    if constexpr (kPacked) {
      packed_decode_range<F, MR>(w, row_bytes, a, c0, c1, y, ldy);
    } else {
      decode_range<F, MR>(w, row_bytes, a, c0, c1, y, ldy);
    }
  };
  switch (a.m) {
    case 1:
      rows.template operator()<1>();
      break;
    case 2:
      rows.template operator()<2>();
      break;
    default:
      rows.template operator()<3>();
      break;
  }
}

// ---- k-quants (Q4_K, Q5_K, Q6_K) against Q8_K, prefill rows. ----
//
// The same panel idea per 256-element super-block: 16 columns' unpacked
// quants (0..31 or 0..63, unsigned) transposed into 64 vectors (dword k of the
// super-block, lane = column), with per column the 16 group scales (one per 16
// elements), the 8 mins and d / dmin. For a row, the 4 vpdpbusd of a group
// give its exact dot per column, and
//   sumi = sum_g scale_g * dot_g             (Q6_K: - 32 * sum_g scale_g * bsum_g)
//   summ = sum_j min_j * (bsum_2j + bsum_2j+1)  (Q4_K/Q5_K)
// are the scalar kernel's integers; the float update per super-block is its
// expression, lane by lane. Rows below 4 run k_decode (below), which gives
// the same (scalar) bits.
struct alignas(64) PanelK {
  int32_t t[64][kCols];
  int32_t scale[16][kCols];
  int32_t mn[8][kCols];
  float d[kCols];
  float dmin[kCols];
};

template <int kKind>  // 4: Q4_K, 5: Q5_K, 6: Q6_K
KV_AVX512 void build_panel_k(const uint8_t* col0, size_t row_bytes, size_t block_bytes, int n_cols,
                             int64_t nb, Prefetch next, PanelK* panel) {
  PrefetchCursor pc = prefetch_cursor(next, nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_step(pc);
    UnpackedK u[kCols];
    for (int j = 0; j < n_cols; ++j) {
      const uint8_t* blk = col0 + j * row_bytes + b * block_bytes;
      if constexpr (kKind == 6) {
        unpack_q6_k(blk, &u[j]);
      } else {
        unpack_q45_k<kKind == 5>(blk, &u[j]);
      }
    }
    PanelK& pk = panel[b];
    for (int i = 0; i < 8; ++i) {  // 32-element sub-block i: dwords 8 i .. 8 i + 7
      __m512i r[8];
      for (int j = 0; j < 8; ++j) {
        const __m256i lo = j < n_cols ? u[j].q[i] : _mm256_setzero_si256();
        const __m256i hi = j + 8 < n_cols ? u[j + 8].q[i] : _mm256_setzero_si256();
        r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      __m512i t[8];
      transpose_16x8(r, t);
      for (int k = 0; k < 8; ++k) _mm512_store_si512(pk.t[8 * i + k], t[k]);
    }
    for (int j = 0; j < kCols; ++j) {
      const bool on = j < n_cols;
      for (int g = 0; g < 16; ++g) pk.scale[g][j] = on ? u[j].scale[g] : 0;
      for (int s = 0; s < 8; ++s) pk.mn[s][j] = on && kKind != 6 ? u[j].mn[s] : 0;
      pk.d[j] = on ? u[j].d : 0.f;
      pk.dmin[j] = on ? u[j].dmin : 0.f;
    }
  }
}

template <int kKind, int MR>
KV_AVX512 void panel_rows_k(const PanelK* panel, int64_t nb, const PreparedAct& a, int64_t r0,
                            __mmask16 cmask, float* y, int64_t ldy) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PanelK& pk = panel[b];
    __m512i sumi[MR];
    for (int r = 0; r < MR; ++r) sumi[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      const __m512i t0 = _mm512_load_si512(pk.t[4 * g]);
      const __m512i t1 = _mm512_load_si512(pk.t[4 * g + 1]);
      const __m512i t2 = _mm512_load_si512(pk.t[4 * g + 2]);
      const __m512i t3 = _mm512_load_si512(pk.t[4 * g + 3]);
      const __m512i sc = _mm512_load_si512(pk.scale[g]);
      for (int r = 0; r < MR; ++r) {
        const int8_t* yq = a.q8k[(r0 + r) * nb + b].qs + 16 * g;
        int32_t w[4];
        std::memcpy(w, yq, 16);
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), t0, _mm512_set1_epi32(w[0]));
        __m512i q = _mm512_dpbusd_epi32(_mm512_setzero_si512(), t1, _mm512_set1_epi32(w[1]));
        p = _mm512_dpbusd_epi32(p, t2, _mm512_set1_epi32(w[2]));
        q = _mm512_dpbusd_epi32(q, t3, _mm512_set1_epi32(w[3]));
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(sc, _mm512_add_epi32(p, q)));
      }
    }
    const __m512 d = _mm512_load_ps(pk.d);
    for (int r = 0; r < MR; ++r) {
      const BlockQ8_K& yb = a.q8k[(r0 + r) * nb + b];
      const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(yb.d));
      if constexpr (kKind == 6) {
        __m512i offset = _mm512_setzero_si512();
        for (int g = 0; g < 16; ++g) {
          offset = _mm512_add_epi32(offset, _mm512_mullo_epi32(_mm512_load_si512(pk.scale[g]),
                                                               _mm512_set1_epi32(yb.bsums[g])));
        }
        const __m512i s = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(offset, 5));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s)));
      } else {
        __m512i summ = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
          summ = _mm512_add_epi32(
              summ, _mm512_mullo_epi32(_mm512_load_si512(pk.mn[j]),
                                       _mm512_set1_epi32(yb.bsums[2 * j] + yb.bsums[2 * j + 1])));
        }
        const __m512 dm = _mm512_mul_ps(_mm512_load_ps(pk.dmin), _mm512_set1_ps(yb.d));
        const __m512 term = _mm512_sub_ps(_mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi[r])),
                                          _mm512_mul_ps(dm, _mm512_cvtepi32_ps(summ)));
        acc[r] = _mm512_add_ps(acc[r], term);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy, cmask, acc[r]);
}

PanelK* panel_k_buffer(int64_t nb) {
  static thread_local std::vector<PanelK> buf;
  if (static_cast<int64_t>(buf.size()) < nb) buf.resize(static_cast<size_t>(nb));
  return buf.data();
}

// ---- k-quants against Q8_K, decode rows (fewer than 4). ----
//
// One weight row (output column) at a time, as the scalar reference does,
// but 64 quants per vector: a super-block's 256 quants are unpacked into 4
// zmm of unsigned bytes, vpmaddubsw with the activation gives exact int16
// pair sums (|pair| <= 2 * 63 * 128 < 32767) and vpdpwssd multiplies them by
// the sub-block scale (int16 lanes) and accumulates in int32, so
//   sumi = sum_j sc_j * dot_j   (Q6_K: - 32 * sum_g scale_g * bsum_g)
//   summ = sum_j mn_j * (bsum_2j + bsum_2j+1)   (Q4_K/Q5_K)
// are the scalar kernel's integers, and the float update per super-block is
// its expression, so the bits are the scalar reference's.
//
// Q4_K/Q5_K nibbles: a 64-byte load of qs holds sub-blocks (4k, 4k+2) in its
// low nibbles and (4k+1, 4k+3) in its high nibbles (k = 0, 1); the
// activation is permuted once per call into that order (KActs). Q6_K's
// unpacked vectors are in element order.

// Per decode row and super-block: the activation's 256 quants in the order
// of the unpacked weight vectors, and its 8 sums of 32 (bsum pairs).
struct alignas(64) KAct {
  int8_t qs[4][64];
  int16_t pair_sums[8];
  float d;
};

// Lanes (int16) 0..15 take scale lo, 16..31 scale hi: the sub-block pair of
// unpacked vector k.
KV_AVX512 inline __m512i scale_pair_index(int lo, int hi) {
  return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<int16_t>(lo)),
                                 _mm512_set1_epi16(static_cast<int16_t>(hi)));
}

// Sub-block pairs (low half, high half) of the 4 unpacked Q4_K/Q5_K vectors.
constexpr int kQ45Pair[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

// Builds the permuted activations of rows [0, m) (m <= 3) in `out`.
KV_AVX512 void k_acts(const PreparedAct& a, int64_t nb, bool q45, KAct* out) {
  for (int64_t r = 0; r < a.m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ8_K& y = a.q8k[r * nb + b];
      KAct& o = out[r * nb + b];
      for (int k = 0; k < 4; ++k) {
        const int lo = q45 ? kQ45Pair[k][0] : 2 * k, hi = q45 ? kQ45Pair[k][1] : 2 * k + 1;
        std::memcpy(o.qs[k], y.qs + 32 * lo, 32);
        std::memcpy(o.qs[k] + 32, y.qs + 32 * hi, 32);
      }
      for (int j = 0; j < 8; ++j) {
        o.pair_sums[j] = static_cast<int16_t>(y.bsums[2 * j] + y.bsums[2 * j + 1]);
      }
      o.d = y.d;
    }
  }
}

KAct* k_act_buffer(size_t n) {
  static thread_local std::vector<KAct> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The 8 6-bit scales (sc) and mins (mn) of a Q4_K/Q5_K super-block as bytes
// j = 0..7, the scalar scale_min_k4 on all pairs at once.
inline void scales_mins_k4(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, s, 4);
  std::memcpy(&w1, s + 4, 4);
  std::memcpy(&w2, s + 8, 4);
  const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
  *sc = sc_lo | static_cast<uint64_t>(sc_hi) << 32;
  *mn = mn_lo | static_cast<uint64_t>(mn_hi) << 32;
}

// int16 lane i of a maddubs result -> its 16-element group within the vector.
alignas(64) constexpr int16_t kLaneGroup[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};

KV_AVX512 inline int hsum128_i32(__m128i v) {
  v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 1));
  return _mm_cvtsi128_si32(v);
}
KV_AVX512 inline int hsum256_i32(__m256i v) {
  return hsum128_i32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

template <int kKind, int MR>
KV_AVX512 void k_decode_column(const uint8_t* wrow, int64_t nb, const KAct* acts,
                               const PreparedAct& a, float* y, int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  float sum[MR];
  for (int r = 0; r < MR; ++r) sum[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i q[4], sc[4];
    __m128i mn16 = _mm_setzero_si128();
    float d, dmin = 0.f;
    if constexpr (kKind == 6) {
      const auto* blk = reinterpret_cast<const BlockQ6_K*>(wrow) + b;
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      // Word shift counts per 256-bit half: (lower, upper).
      const __m512i sl =
          _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
      const __m512i sr =
          _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(), _mm512_set1_epi16(2));
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(blk->ql + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(load256(blk->qh + 32 * h));
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                   _mm512_and_si512(_mm512_sllv_epi16(qh, sl), bits45));
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                       _mm512_and_si512(_mm512_srlv_epi16(qh, sr), bits45));
      }
      const __m512i s16 = _mm512_castsi256_si512(
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk->scales))));
      for (int k = 0; k < 4; ++k) {
        // int16 lane i covers elements 64 k + 2 i, + 1: group 4 k + i / 8.
        const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(4 * k)),
                                             _mm512_loadu_si512(kLaneGroup));
        sc[k] = _mm512_permutexvar_epi16(idx, s16);
      }
      d = f16_to_f32(blk->d);
    } else {
      using Block = std::conditional_t<kKind == 5, BlockQ5_K, BlockQ4_K>;
      const auto* blk = reinterpret_cast<const Block*>(wrow) + b;
      uint64_t sc8, mn8;
      scales_mins_k4(blk->scales, &sc8, &mn8);
      const __m512i s16 =
          _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc8))));
      mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)));
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(blk->qs + 64 * h);
        q[2 * h] = _mm512_and_si512(v, low4);
        q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (kKind == 5) {
        const __m512i qh = _mm512_broadcast_i64x4(load256(blk->qh));
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        for (int k = 0; k < 4; ++k) {
          const __m512i sel = _mm512_mask_blend_epi8(
              0xFFFFFFFF00000000ull, _mm512_set1_epi8(static_cast<char>(1u << kQ45Pair[k][0])),
              _mm512_set1_epi8(static_cast<char>(1u << kQ45Pair[k][1])));
          q[k] = _mm512_mask_add_epi8(q[k], _mm512_test_epi8_mask(qh, sel), q[k], bit4);
        }
      }
      for (int k = 0; k < 4; ++k) {
        sc[k] = _mm512_permutexvar_epi16(scale_pair_index(kQ45Pair[k][0], kQ45Pair[k][1]), s16);
      }
      d = f16_to_f32(blk->d);
      dmin = f16_to_f32(blk->dmin);
    }
    for (int r = 0; r < MR; ++r) {
      // Q6_K reads the activation in element order; Q4_K/Q5_K its permuted copy.
      const int8_t* yq = kKind == 6 ? a.q8k[r * nb + b].qs : acts[r * nb + b].qs[0];
      __m512i acc = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        const __m512i yv = _mm512_loadu_si512(yq + 64 * k);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q[k], yv), sc[k]);
      }
      __m256i acc8 =
          _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
      if constexpr (kKind == 6) {
        const BlockQ8_K& yb = a.q8k[r * nb + b];
        const auto* blk = reinterpret_cast<const BlockQ6_K*>(wrow) + b;
        const __m256i s16 =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk->scales)));
        const __m256i off = _mm256_madd_epi16(s16, load256(yb.bsums));
        acc8 = _mm256_sub_epi32(acc8, _mm256_slli_epi32(off, 5));
        const int sumi = hsum256_i32(acc8);
        sum[r] += d * yb.d * static_cast<float>(sumi);
      } else {
        const KAct& ya = acts[r * nb + b];
        const int sumi = hsum256_i32(acc8);
        const __m128i m4 =
            _mm_madd_epi16(mn16, _mm_load_si128(reinterpret_cast<const __m128i*>(ya.pair_sums)));
        const int summ = hsum128_i32(m4);
        sum[r] += d * ya.d * static_cast<float>(sumi) - dmin * ya.d * static_cast<float>(summ);
      }
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = sum[r];
}

template <int kKind>
KV_AVX512 void k_decode(const WeightView& w, const PreparedAct& a, int64_t c0, int64_t c1, float* y,
                        int64_t ldy) {
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  const int64_t nb = a.n_in / kQK_K;
  KAct* acts = nullptr;
  if constexpr (kKind != 6) {
    acts = k_act_buffer(static_cast<size_t>(a.m * nb));
    k_acts(a, nb, true, acts);
  }
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* wrow = w.data + c * row_bytes;
    if (c + 2 < w.n_out) {  // the row after next, from DRAM, while this one computes
      const char* p = reinterpret_cast<const char*>(wrow + 2 * row_bytes);
      for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
    switch (a.m) {
      case 1:
        k_decode_column<kKind, 1>(wrow, nb, acts, a, y + c, ldy);
        break;
      case 2:
        k_decode_column<kKind, 2>(wrow, nb, acts, a, y + c, ldy);
        break;
      default:
        k_decode_column<kKind, 3>(wrow, nb, acts, a, y + c, ldy);
        break;
    }
  }
}

template <int kKind>
KV_AVX512 void k_kernel512(const WeightView& w, const PreparedAct& a, int64_t c0, int64_t c1,
                           float* y, int64_t ldy) {
  if (a.m < 4) {
    k_decode<kKind>(w, a, c0, c1, y, ldy);
    return;
  }
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  const size_t block_bytes = row_bytes / static_cast<size_t>(a.n_in / kQK_K);
  const int64_t nb = a.n_in / kQK_K;
  PanelK* panel = panel_k_buffer(nb);
  for (int64_t rb = 0; rb < a.m; rb += kRowBlock) {
    const int64_t rb_end = std::min(a.m, rb + kRowBlock);
    for (int64_t c = c0; c < c1; c += kCols) {
      const int n_cols = static_cast<int>(std::min<int64_t>(kCols, c1 - c));
      const Prefetch next = rb == 0 ? group_after_next(w, row_bytes, c) : Prefetch{nullptr, 0};
      build_panel_k<kKind>(w.data + c * row_bytes, row_bytes, block_bytes, n_cols, nb, next, panel);
      const __mmask16 cmask = static_cast<__mmask16>((1u << n_cols) - 1);
      int64_t r = rb;
      for (; r + 4 <= rb_end; r += 4) panel_rows_k<kKind, 4>(panel, nb, a, r, cmask, y + c, ldy);
      for (; r < rb_end; ++r) panel_rows_k<kKind, 1>(panel, nb, a, r, cmask, y + c, ldy);
    }
  }
}

}  // namespace

bool avx512_vnni_present() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.avx512dq;
}

bool avx512_vnni_usable() {
  return best_isa() >= Isa::kAvx512 && avx512_vnni_present();
}

bool avx512_pack_group(GgmlType type, const uint8_t* rows, size_t row_bytes, int64_t nb,
                       uint8_t* dst) {
  if (!avx512_vnni_present()) return false;
  switch (type) {
    case GgmlType::kQ4_0:
      pack_group<Q4_0A>(rows, row_bytes, nb, dst);
      return true;
    case GgmlType::kQ4_1:
      pack_group<Q4_1A>(rows, row_bytes, nb, dst);
      return true;
    case GgmlType::kQ8_0:
      pack_group<Q8_0A>(rows, row_bytes, nb, dst);
      return true;
    default:
      return false;
  }
}

MatmulKernel avx512_panels_kernel(GgmlType type) {
  if (!avx512_vnni_present()) return nullptr;
  switch (type) {
    case GgmlType::kQ4_0:
      return legacy_kernel<Q4_0A, true>;
    case GgmlType::kQ4_1:
      return legacy_kernel<Q4_1A, true>;
    case GgmlType::kQ8_0:
      return legacy_kernel<Q8_0A, true>;
    default:
      return nullptr;
  }
}

const char* avx512_kernel_path(GgmlType) {
  return "avx512-vnni";  // every type, decode rows and prefill panels alike
}

MatmulKernel avx512_kernel(GgmlType type) {
  if (!avx512_vnni_usable()) return nullptr;
  switch (type) {
    case GgmlType::kQ4_0:
      return legacy_kernel<Q4_0A, false>;
    case GgmlType::kQ4_1:
      return legacy_kernel<Q4_1A, false>;
    case GgmlType::kQ5_0:
      return legacy_kernel<Q5_0A, false>;
    case GgmlType::kQ5_1:
      return legacy_kernel<Q5_1A, false>;
    case GgmlType::kQ8_0:
      return legacy_kernel<Q8_0A, false>;
    case GgmlType::kQ4_K:
      return k_kernel512<4>;
    case GgmlType::kQ5_K:
      return k_kernel512<5>;
    case GgmlType::kQ6_K:
      return k_kernel512<6>;
    default:
      return nullptr;
  }
}

}  // namespace kvstack::ops_detail

#else  // !__x86_64__

namespace kvstack::ops_detail {
bool avx512_vnni_present() {
  return false;
}
bool avx512_vnni_usable() {
  return false;
}
MatmulKernel avx512_panels_kernel(GgmlType) {
  return nullptr;
}
bool avx512_pack_group(GgmlType, const uint8_t*, size_t, int64_t, uint8_t*) {
  return false;
}
const char* avx512_kernel_path(GgmlType) {
  return "avx512-vnni";
}
MatmulKernel avx512_kernel(GgmlType) {
  return nullptr;
}
}  // namespace kvstack::ops_detail

#endif

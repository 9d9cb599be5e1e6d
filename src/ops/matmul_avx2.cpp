// AVX2 matmul kernels. Register-tiled: a tile of MR activation rows x NR
// weight rows keeps MR*NR float accumulators, so each weight block is unpacked
// once per MR activation rows (prefill) and NR weight rows stream together
// (decode, MR = 1). Integer block dots use maddubs/madd like ggml's x86 path.
#include <algorithm>
#include <cstring>

#include "core/half.h"
#include "ops/matmul_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvstack::ops_detail {
namespace {

constexpr int64_t kRowBlock = 64;  // activation rows per pass over a column chunk (fits L2)

KV_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high.
KV_AVX2 inline __m256i nibbles(const uint8_t* p) {
  const __m256i t =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_srlv_epi32(t, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}

// 32 bits -> 32 bytes, byte j = 0x10 if bit j is set, else 0.
KV_AVX2 inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                          _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                             0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Legacy block formats. kSigned: q() returns signed int8 values (dotted with
// the sign trick); otherwise unsigned values plus a per-block min.
// scales(): the block's f16 header converted in one instruction, broadcast
// over the register: [d, d, ...] (kSigned) or [d, m, d, m, ...] (the f16 pair
// d, m is the first 4 bytes of Q4_1/Q5_1 blocks).
KV_AVX2 inline __m256 scale_d(const uint16_t* d) {
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(*d)));
}
KV_AVX2 inline __m256 scale_dm(const void* dm) {
  int32_t bits;
  std::memcpy(&bits, dm, 4);
  return _mm256_cvtph_ps(_mm_set1_epi32(bits));
}
struct Q4_0T {
  using Block = BlockQ4_0;
  static constexpr bool kSigned = true;
  KV_AVX2 static __m256i q(const Block& b) {
    return _mm256_sub_epi8(nibbles(b.qs), _mm256_set1_epi8(8));
  }
  KV_AVX2 static __m256 scales(const Block& b) { return scale_d(&b.d); }
};
struct Q4_1T {
  using Block = BlockQ4_1;
  static constexpr bool kSigned = false;
  KV_AVX2 static __m256i q(const Block& b) { return nibbles(b.qs); }
  KV_AVX2 static __m256 scales(const Block& b) { return scale_dm(&b.d); }
};
struct Q5_0T {
  using Block = BlockQ5_0;
  static constexpr bool kSigned = true;
  KV_AVX2 static __m256i q(const Block& b) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(b.qs), fifth_bits(b.qh)), _mm256_set1_epi8(16));
  }
  KV_AVX2 static __m256 scales(const Block& b) { return scale_d(&b.d); }
};
struct Q5_1T {
  using Block = BlockQ5_1;
  static constexpr bool kSigned = false;
  KV_AVX2 static __m256i q(const Block& b) {
    return _mm256_or_si256(nibbles(b.qs), fifth_bits(b.qh));
  }
  KV_AVX2 static __m256 scales(const Block& b) { return scale_dm(&b.d); }
};
struct Q8_0T {
  using Block = BlockQ8_0;
  static constexpr bool kSigned = true;
  KV_AVX2 static __m256i q(const Block& b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  }
  KV_AVX2 static __m256 scales(const Block& b) { return scale_d(&b.d); }
};

// Integer dot of one weight block with one activation block: 8 int32 partial
// sums as floats. wa = |wq| for signed formats (maddubs needs an unsigned
// operand), else wq itself.
template <bool kSigned>
KV_AVX2 inline __m256 block_dot(__m256i wq, __m256i wa, __m256i yv) {
  const __m256i p16 =
      kSigned ? _mm256_maddubs_epi16(wa, _mm256_sign_epi8(yv, wq)) : _mm256_maddubs_epi16(wq, yv);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// Decode (one activation row) x NR weight rows over all n_in. Per block and
// weight row: one f16 conversion gives d (and m); for Q4_1/Q5_1 the product
// [d, m] * [dy, s] yields both d * dy and the min term m * s, which goes to a
// separate accumulator (its odd lanes) so the main accumulator sees one FMA per
// block.
//
// Batch invariance: every kernel shape (this one and legacy_tile for any MR,
// NR) computes an output element with the same operations in the same order:
//   acc (8 lanes) = fma(int_dot_lanes(b), d_b * dy_b, acc)  for b = 0, 1, ...
//   M = M + m_b * s_b                                        (Q4_1/Q5_1 only)
//   y = hsum(acc) + M
// so a row's result does not depend on how many rows share the call, where
// it sits, or how columns were split across threads.
template <class T, int NR>
KV_AVX2 void legacy_row(const typename T::Block* const* w, const PreparedAct& a, int64_t r0,
                        float* y) {
  const int64_t nb = a.n_in / kQK;
  const int8_t* yq = a.qs + r0 * a.n_in;
  const float* yd = a.d + r0 * nb;
  const float* yds = T::kSigned ? nullptr : a.ds + r0 * nb * 2;
  __m256 acc[NR], accm[NR];
  for (int c = 0; c < NR; ++c) acc[c] = accm[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yq + b * kQK));
    if constexpr (T::kSigned) {
      const __m256 dy = _mm256_broadcast_ss(yd + b);
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) {
        const auto& blk = w[c][b];
        const __m256i wq = T::q(blk);
        const __m256 pf = block_dot<true>(wq, _mm256_sign_epi8(wq, wq), yv);
        acc[c] = _mm256_fmadd_ps(pf, _mm256_mul_ps(T::scales(blk), dy), acc[c]);
      }
    } else {
      // [dy, s, dy, s, ...]: the pair is adjacent in a.ds.
      const __m256 ds =
          _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(yds + 2 * b)));
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) {
        const auto& blk = w[c][b];
        const __m256 prod = _mm256_mul_ps(T::scales(blk), ds);  // [d*dy, m*s, ...]
        const __m256i wq = T::q(blk);
        acc[c] = _mm256_fmadd_ps(block_dot<false>(wq, wq, yv), _mm256_moveldup_ps(prod), acc[c]);
        accm[c] = _mm256_add_ps(accm[c], prod);
      }
    }
  }
  for (int c = 0; c < NR; ++c) {
    if constexpr (T::kSigned) {
      y[c] = hsum(acc[c]);
    } else {
      // Lane 1 of accm: sum over blocks of m * s, in block order (see
      // legacy_tile, which must produce the same bits).
      y[c] = hsum(acc[c]) + _mm_cvtss_f32(_mm_movehdup_ps(_mm256_castps256_ps128(accm[c])));
    }
  }
}

// One MR x NR tile over all n_in: y[r * ldy + c] for r < MR, c < NR.
// w[c]: weight row c; activation row r at a.qs/d/s + (r0 + r) * stride.
template <class T, int MR, int NR>
KV_AVX2 void legacy_tile(const typename T::Block* const* w, const PreparedAct& a, int64_t r0,
                         float* y, int64_t ldy) {
  if constexpr (MR == 1) {
    legacy_row<T, NR>(w, a, r0, y);
    return;
  }
  const int64_t nb = a.n_in / kQK;
  const int8_t* yq[MR];
  const float* yd[MR];
  const float* ys[MR];
  for (int r = 0; r < MR; ++r) {
    yq[r] = a.qs + (r0 + r) * a.n_in;
    yd[r] = a.d + (r0 + r) * nb;
    ys[r] = T::kSigned ? nullptr : a.s + (r0 + r) * nb;
  }
  static_assert(T::kSigned || MR * NR <= 8, "min-term lanes: one per (row, column)");
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  // Min terms of unsigned formats: lane r * NR + c accumulates m * s of
  // (row r, column c), the same sequence of float ops as legacy_row's accm.
  __m256 macc = _mm256_setzero_ps();

  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[NR], wa[NR];
    __m256 wd[NR];
    float wm[NR];
    for (int c = 0; c < NR; ++c) {
      const auto& blk = w[c][b];
      wq[c] = T::q(blk);
      wa[c] = T::kSigned ? _mm256_sign_epi8(wq[c], wq[c]) : wq[c];
      const __m256 sc = T::scales(blk);
      if constexpr (T::kSigned) {
        wd[c] = sc;
      } else {
        wd[c] = _mm256_moveldup_ps(sc);
        wm[c] = _mm_cvtss_f32(_mm_movehdup_ps(_mm256_castps256_ps128(sc)));
      }
    }
    if constexpr (!T::kSigned) {
      auto m_lane = [&](int l) { return l < MR * NR ? wm[l % NR] : 0.f; };
      auto s_lane = [&](int l) { return l < MR * NR ? ys[l / NR][b] : 0.f; };
      const __m256 mv = _mm256_setr_ps(m_lane(0), m_lane(1), m_lane(2), m_lane(3), m_lane(4),
                                       m_lane(5), m_lane(6), m_lane(7));
      const __m256 sv = _mm256_setr_ps(s_lane(0), s_lane(1), s_lane(2), s_lane(3), s_lane(4),
                                       s_lane(5), s_lane(6), s_lane(7));
      macc = _mm256_add_ps(macc, _mm256_mul_ps(mv, sv));
    }
    for (int r = 0; r < MR; ++r) {
      const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yq[r] + b * kQK));
      const __m256 dy = _mm256_broadcast_ss(yd[r] + b);
      for (int c = 0; c < NR; ++c) {
        const __m256 pf = block_dot<T::kSigned>(wq[c], wa[c], yv);
        acc[r][c] = _mm256_fmadd_ps(pf, _mm256_mul_ps(wd[c], dy), acc[r][c]);
      }
    }
  }
  alignas(32) float mins[8];
  _mm256_store_ps(mins, macc);
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      y[r * ldy + c] = T::kSigned ? hsum(acc[r][c]) : hsum(acc[r][c]) + mins[r * NR + c];
    }
  }
}

// Float weights (F32, or F16 converted on load) against f32 activations.
template <bool kHalf>
KV_AVX2 inline __m256 load_w8(const void* w, int64_t k) {
  if constexpr (kHalf) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(w) + k);
  }
}
template <bool kHalf>
inline float load_w1(const void* w, int64_t k) {
  if constexpr (kHalf) {
    return f16_to_f32(static_cast<const uint16_t*>(w)[k]);
  } else {
    return static_cast<const float*>(w)[k];
  }
}

template <bool kHalf, int MR, int NR>
KV_AVX2 void float_tile(const void* const* w, const PreparedAct& a, int64_t r0, float* y,
                        int64_t ldy) {
  const int64_t n = a.n_in;
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = a.f32 + (r0 + r) * n;
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = load_w8<kHalf>(w[c], k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x[r] + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      float sum = hsum(acc[r][c]);
      for (int64_t kk = k; kk < n; ++kk) sum += load_w1<kHalf>(w[c], kk) * x[r][kk];
      y[r * ldy + c] = sum;
    }
  }
}

// Tile dispatch: Tile<MR, NR>::run(...) for the shapes the driver uses.
template <template <int, int> class Tile>
struct Driver {
  template <int MR>
  static void cols(const uint8_t* base, size_t row_bytes, const PreparedAct& a, int64_t r0,
                   int64_t c0, int64_t c1, float* y, int64_t ldy) {
    // MR = 1 (decode) streams 4 weight rows at a time; larger MR uses 2.
    constexpr int kNr = MR == 1 ? 4 : 2;
    int64_t c = c0;
    for (; c + kNr <= c1; c += kNr) {
      const uint8_t* rows[kNr];
      for (int j = 0; j < kNr; ++j) rows[j] = base + (c + j) * row_bytes;
      Tile<MR, kNr>::run(rows, a, r0, y + r0 * ldy + c, ldy);
    }
    for (; c < c1; ++c) {
      const uint8_t* rows[1] = {base + c * row_bytes};
      Tile<MR, 1>::run(rows, a, r0, y + r0 * ldy + c, ldy);
    }
  }

  // Decode (and a batch's first row block) reads every weight once, a few
  // rows of a few hundred bytes at a time: too short a stream for the
  // hardware prefetcher to run ahead of, so the rows kPrefetchRows ahead are
  // requested while the current tile computes
  // (past this call's columns too: harmless, and the next grain usually
  // starts there).
  static constexpr int64_t kPrefetchRows = 8;
  static void prefetch_rows(const WeightView& w, size_t row_bytes, int64_t r, int64_t n) {
    if (r >= w.n_out) return;
    const char* p = reinterpret_cast<const char*>(w.data) + r * row_bytes;
    const char* e = p + static_cast<size_t>(std::min(n, w.n_out - r)) * row_bytes;
    for (; p < e; p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }

  static void kernel(const WeightView& w, const PreparedAct& a, int64_t c0, int64_t c1, float* y,
                     int64_t ldy) {
    const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
    for (int64_t rb = 0; rb < a.m; rb += kRowBlock) {
      const int64_t rb_end = std::min(a.m, rb + kRowBlock);
      // Column pairs outermost within the row block: a weight tile is read from
      // L1 by every 4-row activation tile.
      const int64_t step = a.m == 1 ? 4 : 2;
      for (int64_t cb = c0; cb < c1; cb += step) {
        const int64_t cb_end = std::min(c1, cb + step);
        // The first row block reads the weights from memory (later ones
        // find them in L2): request the rows ahead.
        if (rb == 0) prefetch_rows(w, row_bytes, cb + kPrefetchRows, step);
        int64_t r = rb;
        for (; r + 4 <= rb_end; r += 4) cols<4>(w.data, row_bytes, a, r, cb, cb_end, y, ldy);
        switch (rb_end - r) {
          case 3:
            cols<3>(w.data, row_bytes, a, r, cb, cb_end, y, ldy);
            break;
          case 2:
            cols<2>(w.data, row_bytes, a, r, cb, cb_end, y, ldy);
            break;
          case 1:
            cols<1>(w.data, row_bytes, a, r, cb, cb_end, y, ldy);
            break;
          default:
            break;
        }
      }
    }
  }
};

template <class T>
struct LegacyTile {
  template <int MR, int NR>
  struct Shape {
    static void run(const uint8_t* const* rows, const PreparedAct& a, int64_t r0, float* y,
                    int64_t ldy) {
      const typename T::Block* w[NR];
      for (int j = 0; j < NR; ++j) w[j] = reinterpret_cast<const typename T::Block*>(rows[j]);
      legacy_tile<T, MR, NR>(w, a, r0, y, ldy);
    }
  };
};

template <bool kHalf>
struct FloatTile {
  template <int MR, int NR>
  struct Shape {
    static void run(const uint8_t* const* rows, const PreparedAct& a, int64_t r0, float* y,
                    int64_t ldy) {
      const void* w[NR];
      for (int j = 0; j < NR; ++j) w[j] = rows[j];
      float_tile<kHalf, MR, NR>(w, a, r0, y, ldy);
    }
  };
};

}  // namespace

MatmulKernel avx2_kernel(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return Driver<FloatTile<false>::Shape>::kernel;
    case GgmlType::kF16:
      return Driver<FloatTile<true>::Shape>::kernel;
    case GgmlType::kQ4_0:
      return Driver<LegacyTile<Q4_0T>::Shape>::kernel;
    case GgmlType::kQ4_1:
      return Driver<LegacyTile<Q4_1T>::Shape>::kernel;
    case GgmlType::kQ5_0:
      return Driver<LegacyTile<Q5_0T>::Shape>::kernel;
    case GgmlType::kQ5_1:
      return Driver<LegacyTile<Q5_1T>::Shape>::kernel;
    case GgmlType::kQ8_0:
      return Driver<LegacyTile<Q8_0T>::Shape>::kernel;
    default:
      return avx2_k_kernel(type);  // Q4_K, Q5_K, Q6_K (matmul_avx2_k.cpp)
  }
}

}  // namespace kvstack::ops_detail

#else  // !__x86_64__

namespace kvstack::ops_detail {
MatmulKernel avx2_kernel(GgmlType) {
  return nullptr;
}
}  // namespace kvstack::ops_detail

#endif

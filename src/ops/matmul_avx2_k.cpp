// AVX2 kernels for k-quant weights (Q4_K, Q5_K, Q6_K) against Q8_K
// activations, bit-identical to the scalar reference (matmul_scalar.cpp).
//
// Why the bits match: per super-block the scalar kernel forms exact integer
// sums (sumi = sum_j sc_j * dot_j, summ = sum_j m_j * bsum_j; Q6_K: sumi =
// sum_g scale_g * dot_g) and then one float update in a fixed order:
//   Q4_K/Q5_K: sum = sum + ((d * dy) * float(sumi) - (dmin * dy) * float(summ))
//   Q6_K:      sum = sum + (d * dy) * float(sumi)
// Here the integer sums come from maddubs/madd (no saturation: |u8 * s8 pair|
// <= 63 * 127 * 2 < 32767, and int32 sums of integers are order-free), and the
// float update is the same scalar expression. This file is compiled with
// -ffp-contract=off (src/ops/CMakeLists.txt) so the compiler cannot fuse that
// update into an FMA the scalar build does not use. Every output element is
// computed by the same operations whatever the tile shape, row count or
// column split, so the kernels are batch invariant like the others.
#include <algorithm>
#include <cstring>

#include "core/half.h"
#include "ops/matmul_k_unpack.h"
#include "ops/matmul_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvstack::ops_detail {
namespace {

constexpr int64_t kRowBlock = 64;  // activation rows per pass over a column chunk (fits L2)
constexpr int kMr = 4;             // activation rows sharing one unpacked weight super-block

KV_AVX2 inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// sum_i sc[i] * dot(q[i], y[32 i ..]): the scalar kernel's sumi before any
// offset/min term.
KV_AVX2 inline int scaled_dot(const UnpackedK& u, const int8_t* y) {
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 8; ++i) {
    const __m256i p16 = _mm256_maddubs_epi16(u.q[i], load256(y + 32 * i));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, u.sc[i]));
  }
  return hsum_i32(acc);
}

struct Q4KT {
  static constexpr size_t kBytes = sizeof(BlockQ4_K);
  KV_AVX2 static void unpack(const uint8_t* b, UnpackedK* u) { unpack_q45_k<false>(b, u); }
  // One super-block's contribution, exactly the scalar expression.
  KV_AVX2 static float term(const UnpackedK& u, const BlockQ8_K& y) {
    const int sumi = scaled_dot(u, y.qs);
    int summ = 0;
    for (int j = 0; j < 8; ++j) summ += u.mn[j] * (y.bsums[2 * j] + y.bsums[2 * j + 1]);
    return u.d * y.d * static_cast<float>(sumi) - u.dmin * y.d * static_cast<float>(summ);
  }
};
struct Q5KT {
  static constexpr size_t kBytes = sizeof(BlockQ5_K);
  KV_AVX2 static void unpack(const uint8_t* b, UnpackedK* u) { unpack_q45_k<true>(b, u); }
  KV_AVX2 static float term(const UnpackedK& u, const BlockQ8_K& y) { return Q4KT::term(u, y); }
};
struct Q6KT {
  static constexpr size_t kBytes = sizeof(BlockQ6_K);
  KV_AVX2 static void unpack(const uint8_t* b, UnpackedK* u) { unpack_q6_k(b, u); }
  KV_AVX2 static float term(const UnpackedK& u, const BlockQ8_K& y) {
    int offset = 0;
    for (int g = 0; g < 16; ++g) offset += u.scale[g] * y.bsums[g];
    const int sumi = scaled_dot(u, y.qs) - 32 * offset;
    return u.d * y.d * static_cast<float>(sumi);
  }
};

// Weight row `c` against activation rows [r0, r0 + MR): each super-block is
// unpacked once and dotted with every row; per row the float sum runs over
// super-blocks in order, as in the scalar kernel.
template <class T, int MR>
KV_AVX2 void k_tile(const uint8_t* wrow, const PreparedAct& a, int64_t r0, float* y, int64_t ldy) {
  const int64_t nb = a.n_in / kQK_K;
  float sum[MR];
  for (int r = 0; r < MR; ++r) sum[r] = 0.f;
  UnpackedK u;
  for (int64_t b = 0; b < nb; ++b) {
    T::unpack(wrow + b * T::kBytes, &u);
    for (int r = 0; r < MR; ++r) sum[r] += T::term(u, a.q8k[(r0 + r) * nb + b]);
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = sum[r];
}

template <class T>
KV_AVX2 void k_kernel(const WeightView& w, const PreparedAct& a, int64_t c0, int64_t c1, float* y,
                      int64_t ldy) {
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  for (int64_t rb = 0; rb < a.m; rb += kRowBlock) {
    const int64_t rb_end = std::min(a.m, rb + kRowBlock);
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t* wrow = w.data + c * row_bytes;
      if (rb == 0 && c + 2 < w.n_out) {
        // The first row block streams each row from memory once; request the
        // row after next early.
        const char* p = reinterpret_cast<const char*>(wrow + 2 * row_bytes);
        for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
      }
      int64_t r = rb;
      for (; r + kMr <= rb_end; r += kMr) k_tile<T, kMr>(wrow, a, r, y + r * ldy + c, ldy);
      switch (rb_end - r) {
        case 3:
          k_tile<T, 3>(wrow, a, r, y + r * ldy + c, ldy);
          break;
        case 2:
          k_tile<T, 2>(wrow, a, r, y + r * ldy + c, ldy);
          break;
        case 1:
          k_tile<T, 1>(wrow, a, r, y + r * ldy + c, ldy);
          break;
        default:
          break;
      }
    }
  }
}

}  // namespace

MatmulKernel avx2_k_kernel(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_K:
      return k_kernel<Q4KT>;
    case GgmlType::kQ5_K:
      return k_kernel<Q5KT>;
    case GgmlType::kQ6_K:
      return k_kernel<Q6KT>;
    default:
      return nullptr;
  }
}

}  // namespace kvstack::ops_detail

#else  // !__x86_64__

namespace kvstack::ops_detail {
MatmulKernel avx2_k_kernel(GgmlType) {
  return nullptr;
}
}  // namespace kvstack::ops_detail

#endif

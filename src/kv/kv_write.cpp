#include "kv/kv_write.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/half.h"

namespace kvstack {

namespace {

void convert_scalar(KvDtype dtype, const float* src, void* dst, int64_t n) {
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case KvDtype::kF16: {
      auto* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(src[i]);
        std::memcpy(d + 2 * i, &h, 2);
      }
      return;
    }
    case KvDtype::kBF16: {
      auto* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(d + 2 * i, &h, 2);
      }
      return;
    }
  }
  KV_CHECK(false, "convert: unknown KV dtype");
}

// F16C rounds to nearest even like f32_to_f16, including subnormals and
// overflow to inf; only NaN payloads differ (F16C keeps the top mantissa
// bits), so chunks containing a NaN take the scalar path to stay bit-exact.
__attribute__((target("avx2,fma,f16c"))) void convert_f16_avx2(const float* src, uint8_t* dst,
                                                               int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (!_mm256_testz_ps(nan, nan)) {
      convert_scalar(KvDtype::kF16, src + i, dst + 2 * i, 8);
      continue;
    }
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), h);
  }
  if (i < n) convert_scalar(KvDtype::kF16, src + i, dst + 2 * i, n - i);
}

// bf16 = upper half of x + 0x7fff + ((x >> 16) & 1) (round to nearest even);
// NaN -> (x >> 16) | 0x40 (quiet), as f32_to_bf16.
__attribute__((target("avx2,fma,f16c"))) void convert_bf16_avx2(const float* src, uint8_t* dst,
                                                                int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i r[2];
    for (int half = 0; half < 2; ++half) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8 * half));
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, bias),
                                             _mm256_and_si256(_mm256_srli_epi32(x, 16), one)),
                            16);
      const __m256i nan_val = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
      r[half] = _mm256_blendv_epi8(rounded, nan_val, is_nan);
    }
    // packus works per 128-bit lane: [a0..3 b0..3 | a4..7 b4..7] -> fix order.
    const __m256i packed = _mm256_packus_epi32(r[0], r[1]);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), ordered);
  }
  if (i < n) convert_scalar(KvDtype::kBF16, src + i, dst + 2 * i, n - i);
}

bool avx2_usable() {
  const CpuFeatures& f = cpu_features();
  return f.avx2 && f.fma && f.f16c;
}

}  // namespace

void convert_f32_row(Isa isa, KvDtype dtype, const float* src, void* dst, int64_t n) {
  if (isa >= Isa::kAvx2 && avx2_usable()) {
    if (dtype == KvDtype::kF16) return convert_f16_avx2(src, static_cast<uint8_t*>(dst), n);
    if (dtype == KvDtype::kBF16) return convert_bf16_avx2(src, static_cast<uint8_t*>(dst), n);
  }
  convert_scalar(dtype, src, dst, n);
}

void write_kv_isa(Isa isa, const PagedKvLayerView& view, std::span<const int32_t> block_table,
                  int64_t pos, const float* k_rows, const float* v_rows, int64_t n_tokens) {
  if (n_tokens == 0) return;
  const int64_t p = view.block_size;
  KV_CHECK(pos >= 0 && n_tokens > 0, "write_kv: negative position or token count");
  KV_CHECK(pos + n_tokens <= static_cast<int64_t>(block_table.size()) * p,
           "write_kv: positions beyond the block table");
  KV_CHECK(k_rows != nullptr && (view.v == nullptr || v_rows != nullptr),
           "write_kv: missing K or V rows");
  const int64_t h_kv = view.n_kv_heads;
  const int64_t d = view.head_dim;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t lp = pos + t;
    const int32_t b = block_table[lp / p];
    KV_CHECK(b >= 0, "write_kv: null block table entry");
    const int64_t base = b * view.block_stride + (lp % p) * view.slot_stride;
    for (int64_t h = 0; h < h_kv; ++h) {
      const int64_t off = base + h * view.head_stride;
      const int64_t row = (t * h_kv + h) * d;
      convert_f32_row(isa, view.dtype, k_rows + row, view.k + off, d);
      if (view.v != nullptr) convert_f32_row(isa, view.dtype, v_rows + row, view.v + off, d);
    }
  }
}

void write_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
              const float* k_rows, const float* v_rows, int64_t n_tokens) {
  write_kv_isa(best_isa(), view, block_table, pos, k_rows, v_rows, n_tokens);
}

}  // namespace kvstack

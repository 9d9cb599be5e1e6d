#include "kv/kv_write.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <string>

#include "core/check.h"
#include "core/half.h"
#include "kv/kivi_codec.h"
#include "kv/kv_codec.h"

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
    default:
      break;
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

namespace {

// One stream (K or V) of a view: where rows and metadata are.
struct Stream {
  uint8_t* data;
  uint8_t* meta;
  KvDtype dtype;
  int64_t head_stride;
  int64_t slot_stride;
  int64_t meta_head_stride;
  int64_t meta_slot_stride;
};

Stream k_stream(const PagedKvLayerView& v) {
  return {v.k,
          v.k_meta,
          v.dtype,
          v.head_stride,
          v.slot_stride,
          v.k_meta_head_stride,
          v.k_meta_slot_stride};
}
Stream v_stream(const PagedKvLayerView& v) {
  return {v.v,
          v.v_meta,
          v.value_dtype(),
          v.value_head_stride(),
          v.value_slot_stride(),
          v.v_meta_head_stride,
          v.v_meta_slot_stride};
}

// fp8: encodes `x` into slot `slot` of block `b`, head `h`, raising the
// block's scale (and re-encoding slots [0, slot)) when x needs a larger one.
void write_fp8_row(const Stream& st, int64_t block_stride, int32_t b, int64_t h, int64_t slot,
                   const float* x, int d) {
  uint8_t* meta = st.meta + b * block_stride + h * st.meta_head_stride;
  uint8_t* head = st.data + b * block_stride + h * st.head_stride;
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float need = fp8_scale_for(amax);
  float scale = 0.0f;
  if (slot > 0) std::memcpy(&scale, meta, 4);  // slot 0: the block's old scale is stale
  if (need > scale) {
    if (scale > 0.0f) {
      const float ratio = scale / need;  // a power of two < 1
      for (int64_t s = 0; s < slot; ++s) {
        uint8_t* row = head + s * st.slot_stride;
        for (int i = 0; i < d; ++i) row[i] = fp8_e4m3_from_f32(fp8_e4m3_to_f32(row[i]) * ratio);
      }
    }
    scale = need;
    std::memcpy(meta, &scale, 4);
  }
  fp8_encode_row(x, d, scale, head + slot * st.slot_stride);
}

void write_stream_row(Isa isa, const Stream& st, int64_t block_stride, int32_t b, int64_t h,
                      int64_t slot, const float* x, int d) {
  if (st.dtype == KvDtype::kFp8) return write_fp8_row(st, block_stride, b, h, slot, x, d);
  uint8_t* row = st.data + b * block_stride + h * st.head_stride + slot * st.slot_stride;
  if (!kv_dtype_is_quantized(st.dtype)) return convert_f32_row(isa, st.dtype, x, row, d);
  uint8_t* meta = st.meta + b * block_stride + h * st.meta_head_stride + slot * st.meta_slot_stride;
  kv_encode_row(st.dtype, x, d, row, meta);
}

}  // namespace

Status validate_kv_rows(const PagedKvLayerView& view, int64_t pos, const float* k_rows,
                        const float* v_rows, int64_t n_tokens) {
  const bool check_k = kv_dtype_is_quantized(view.dtype) && view.k != nullptr;
  const bool check_v = view.v != nullptr && kv_dtype_is_quantized(view.value_dtype());
  if (!check_k && !check_v) return {};
  const int64_t d = view.head_dim;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < view.n_kv_heads; ++h) {
      const int64_t row = (t * view.n_kv_heads + h) * d;
      for (int which = 0; which < 2; ++which) {
        if (which == 0 ? !check_k : !check_v) continue;
        const KvDtype dt = which == 0 ? view.dtype : view.value_dtype();
        const float* x = (which == 0 ? k_rows : v_rows) + row;
        const Status st =
            kv_dtype_is_kivi(dt) ? kivi_validate_values(x, d) : kv_validate_values(dt, x, d);
        if (!st.ok()) {
          return make_error(Errc::kInvalidArgument,
                            std::string("KV write: ") + (which == 0 ? "K" : "V") + " of position " +
                                std::to_string(pos + t) + ", head " + std::to_string(h) + ": " +
                                st.error().message);
        }
      }
    }
  }
  return {};
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
  const Status valid = validate_kv_rows(view, pos, k_rows, v_rows, n_tokens);
  KV_CHECK(valid.ok(), valid.ok() ? "" : valid.error().message.c_str());
  const int64_t h_kv = view.n_kv_heads;
  const int d = view.head_dim;
  const Stream ks = k_stream(view);
  const Stream vs = v_stream(view);
  const bool kivi_k = kv_dtype_is_kivi(view.dtype);
  const bool kivi_v = kv_dtype_is_kivi(view.value_dtype());
  if (kivi_k) {
    // Keys are quantized per channel over whole groups of G tokens.
    const int64_t g = view.kivi_group;
    KV_CHECK(g > 0 && pos % g == 0 && n_tokens % g == 0,
             "write_kv: KIVI keys are written in whole, aligned groups of G tokens");
    const int bits = kv_dtype_kivi_bits(view.dtype);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += g) {
      const int64_t lp = pos + t0;
      const int32_t b = block_table[lp / p];
      KV_CHECK(b >= 0, "write_kv: null block table entry");
      const int64_t slot = lp % p;
      for (int64_t h = 0; h < h_kv; ++h) {
        uint8_t* codes =
            view.k + b * view.block_stride + h * view.head_stride + slot * view.slot_stride;
        uint8_t* meta =
            view.k_meta + b * view.block_stride + h * view.k_meta_head_stride + (slot / g) * d * 4;
        kivi_encode_key_group(bits, k_rows + (t0 * h_kv + h) * d, h_kv * d, static_cast<int>(g), d,
                              codes, view.slot_stride, meta);
      }
    }
  }
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t lp = pos + t;
    const int32_t b = block_table[lp / p];
    KV_CHECK(b >= 0, "write_kv: null block table entry");
    for (int64_t h = 0; h < h_kv; ++h) {
      const int64_t row = (t * h_kv + h) * d;
      if (!kivi_k) write_stream_row(isa, ks, view.block_stride, b, h, lp % p, k_rows + row, d);
      if (view.v == nullptr) continue;
      if (kivi_v) {
        const int64_t base = b * view.block_stride + h * vs.head_stride;
        kivi_encode_value_row(kv_dtype_kivi_bits(vs.dtype), v_rows + row, d,
                              vs.data + base + (lp % p) * vs.slot_stride,
                              vs.meta + b * view.block_stride + h * vs.meta_head_stride +
                                  (lp % p) * vs.meta_slot_stride);
      } else {
        write_stream_row(isa, vs, view.block_stride, b, h, lp % p, v_rows + row, d);
      }
    }
  }
}

void read_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
             int64_t n_tokens, float* k_rows, float* v_rows) {
  const int64_t p = view.block_size;
  KV_CHECK(
      pos >= 0 && n_tokens >= 0 && pos + n_tokens <= static_cast<int64_t>(block_table.size()) * p,
      "read_kv: positions beyond the block table");
  const int64_t h_kv = view.n_kv_heads;
  const int d = view.head_dim;
  for (int which = 0; which < 2; ++which) {
    if (which == 1 && view.v == nullptr) break;
    const Stream st = which == 0 ? k_stream(view) : v_stream(view);
    float* out = which == 0 ? k_rows : v_rows;
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int64_t lp = pos + t;
      const int32_t b = block_table[lp / p];
      KV_CHECK(b >= 0, "read_kv: null block table entry");
      const int64_t slot = lp % p;
      for (int64_t h = 0; h < h_kv; ++h) {
        const uint8_t* row =
            st.data + b * view.block_stride + h * st.head_stride + slot * st.slot_stride;
        const uint8_t* meta = st.meta == nullptr
                                  ? nullptr
                                  : st.meta + b * view.block_stride + h * st.meta_head_stride +
                                        slot * st.meta_slot_stride;
        float* o = out + (t * h_kv + h) * d;
        if (kv_dtype_is_kivi(st.dtype) && which == 0) {
          kivi_decode_key_row(kv_dtype_kivi_bits(st.dtype), row,
                              meta + (slot / view.kivi_group) * d * 4, d, o);
        } else if (kv_dtype_is_kivi(st.dtype)) {
          kivi_decode_value_row(kv_dtype_kivi_bits(st.dtype), row, meta, d, o);
        } else {
          kv_decode_row(st.dtype, row, meta, d, o);
        }
      }
    }
  }
}

void write_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
              const float* k_rows, const float* v_rows, int64_t n_tokens) {
  write_kv_isa(best_isa(), view, block_table, pos, k_rows, v_rows, n_tokens);
}

Status try_write_kv(const PagedKvLayerView& view, std::span<const int32_t> block_table, int64_t pos,
                    const float* k_rows, const float* v_rows, int64_t n_tokens) {
  KV_TRY_STATUS(validate_kv_rows(view, pos, k_rows, v_rows, n_tokens));
  write_kv(view, block_table, pos, k_rows, v_rows, n_tokens);
  return {};
}

}  // namespace kvstack

#include "kv/kivi_codec.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/half.h"

namespace kvstack {
namespace {

void store_u16(uint8_t* p, uint16_t v) {
  std::memcpy(p, &v, 2);
}
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

Status check_dtype(KvDtype dtype, int head_dim) {
  if (!kv_dtype_is_kivi(dtype)) {
    return make_error(Errc::kInvalidArgument, "not a KIVI KV dtype");
  }
  if (head_dim <= 0 || head_dim % 32 != 0) {
    return make_error(Errc::kUnsupported, std::string("KV dtype ") + kv_dtype_name(dtype) +
                                              " needs head_dim % 32 == 0 (head_dim " +
                                              std::to_string(head_dim) + ")");
  }
  return {};
}

}  // namespace

Result<KvRowGeometry> kivi_key_geometry(KvDtype dtype, int head_dim, int block_size) {
  KV_TRY_STATUS(check_dtype(dtype, head_dim));
  const int64_t d = head_dim;
  const int g = kivi_group_size(block_size);
  return KvRowGeometry{.row_bytes = d * kv_dtype_kivi_bits(dtype) / 8,
                       .meta_row_bytes = 0,
                       .meta_block_bytes = static_cast<int64_t>(block_size / g) * d * 4};
}

Result<KvRowGeometry> kivi_value_geometry(KvDtype dtype, int head_dim) {
  KV_TRY_STATUS(check_dtype(dtype, head_dim));
  const int64_t d = head_dim;
  return KvRowGeometry{.row_bytes = d * kv_dtype_kivi_bits(dtype) / 8,
                       .meta_row_bytes = d / kKiviValueGroup * 4};
}

Status kivi_validate_values(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      return make_error(Errc::kInvalidArgument, "element " + std::to_string(i) + " is " +
                                                    std::to_string(x[i]) +
                                                    " (KIVI formats store finite values only)");
    }
    if (std::fabs(x[i]) > kF16Max) {
      return make_error(Errc::kInvalidArgument,
                        "element " + std::to_string(i) + " = " + std::to_string(x[i]) +
                            " exceeds the f16 range (65504) of KIVI's scale/min metadata");
    }
  }
  return {};
}

void kivi_unpack_codes(int bits, const uint8_t* codes, int d, uint8_t* out) {
  const int chunk_bytes = 4 * bits;
  const int per_byte = 8 / bits;
  const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1);
  for (int c = 0; c < d / 32; ++c) {
    const uint8_t* src = codes + c * chunk_bytes;
    uint8_t* dst = out + 32 * c;
    for (int j = 0; j < chunk_bytes; ++j) {
      for (int k = 0; k < per_byte; ++k) {
        dst[j + k * chunk_bytes] = static_cast<uint8_t>((src[j] >> (k * bits)) & mask);
      }
    }
  }
}

void kivi_pack_codes(int bits, const uint8_t* q, int d, uint8_t* codes) {
  const int chunk_bytes = 4 * bits;
  const int per_byte = 8 / bits;
  for (int c = 0; c < d / 32; ++c) {
    const uint8_t* src = q + 32 * c;
    uint8_t* dst = codes + c * chunk_bytes;
    for (int j = 0; j < chunk_bytes; ++j) {
      unsigned b = 0;
      for (int k = 0; k < per_byte; ++k)
        b |= static_cast<unsigned>(src[j + k * chunk_bytes]) << (k * bits);
      dst[j] = static_cast<uint8_t>(b);
    }
  }
}

void kivi_encode_key_group(int bits, const float* x, int64_t x_stride, int n_tokens, int d,
                           uint8_t* codes, int64_t code_stride, uint8_t* meta) {
  uint8_t q[kKiviMaxKeyGroup][512];
  uint8_t qc[kKiviMaxKeyGroup];
  KV_CHECK(n_tokens >= 1 && n_tokens <= kKiviMaxKeyGroup, "kivi key group: bad token count");
  for (int c0 = 0; c0 < d; c0 += 512) {
    const int nc = d - c0 < 512 ? d - c0 : 512;
    for (int c = 0; c < nc; ++c) {
      uint16_t sh, mh;
      asym_quant_fit(bits, x + c0 + c, x_stride, n_tokens, &sh, &mh, qc);
      store_u16(meta + 4 * (c0 + c), sh);
      store_u16(meta + 4 * (c0 + c) + 2, mh);
      for (int t = 0; t < n_tokens; ++t) q[t][c] = qc[t];
    }
    for (int t = 0; t < n_tokens; ++t) {
      kivi_pack_codes(bits, q[t], nc, codes + t * code_stride + c0 * bits / 8);
    }
  }
}

void kivi_decode_key_row(int bits, const uint8_t* codes, const uint8_t* meta, int d, float* out) {
  uint8_t q[512];
  for (int c0 = 0; c0 < d; c0 += 512) {
    const int nc = d - c0 < 512 ? d - c0 : 512;
    kivi_unpack_codes(bits, codes + c0 * bits / 8, nc, q);
    for (int c = 0; c < nc; ++c) {
      const float s = f16_to_f32(load_u16(meta + 4 * (c0 + c)));
      const float m = f16_to_f32(load_u16(meta + 4 * (c0 + c) + 2));
      out[c0 + c] = std::fma(s, static_cast<float>(q[c]), m);
    }
  }
}

void kivi_encode_value_row(int bits, const float* x, int d, uint8_t* codes, uint8_t* meta) {
  uint8_t q[kKiviValueGroup];
  for (int g = 0; g < d / kKiviValueGroup; ++g) {
    uint16_t sh, mh;
    asym_quant_fit(bits, x + kKiviValueGroup * g, 1, kKiviValueGroup, &sh, &mh, q);
    store_u16(meta + 4 * g, sh);
    store_u16(meta + 4 * g + 2, mh);
    kivi_pack_codes(bits, q, kKiviValueGroup, codes + g * 4 * bits);
  }
}

void kivi_decode_value_row(int bits, const uint8_t* codes, const uint8_t* meta, int d, float* out) {
  uint8_t q[32];
  for (int g = 0; g < d / kKiviValueGroup; ++g) {
    kivi_unpack_codes(bits, codes + g * 4 * bits, 32, q);
    const float s = f16_to_f32(load_u16(meta + 4 * g));
    const float m = f16_to_f32(load_u16(meta + 4 * g + 2));
    for (int j = 0; j < 32; ++j) out[32 * g + j] = std::fma(s, static_cast<float>(q[j]), m);
  }
}

}  // namespace kvstack

// Scalar reference dequantization. Each format computes in float32 with the
// same operations, in the same order, as the `gguf` Python package
// (gguf.quants), so results match it bit for bit: scales are converted from
// f16 first, products like d * sc are rounded to float before use, and there
// is no fused multiply-add (this file is built with -ffp-contract=off).
#include "model/dequant.h"

#include <cstring>
#include <string>

#include "core/half.h"
#include "model/gguf.h"

namespace kvstack {
namespace {

// Blocks may sit at any address (in-memory images, odd offsets), so each one
// is copied into an aligned local before its fields are read.
template <class Block>
Block load_block(const uint8_t* src, int64_t index) {
  Block b;
  std::memcpy(&b, src + static_cast<size_t>(index) * sizeof(Block), sizeof(Block));
  return b;
}

template <class T>
void convert_plain(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    T v;
    std::memcpy(&v, src + static_cast<size_t>(k) * sizeof(T), sizeof(T));
    dst[k] = static_cast<float>(v);
  }
}

void dequant_f16(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    uint16_t h;
    std::memcpy(&h, src + 2 * k, 2);
    dst[k] = f16_to_f32(h);
  }
}

void dequant_bf16(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    uint16_t h;
    std::memcpy(&h, src + 2 * k, 2);
    dst[k] = bf16_to_f32(h);
  }
}

// y = d * (q - 8); q is a nibble: low nibbles are elements 0..15, high 16..31.
void dequant_q4_0(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK) {
    const auto blk = load_block<BlockQ4_0>(src, b);
    const float d = f16_to_f32(blk.d);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (blk.qs[j] & 0x0f) - 8;
      const int hi = (blk.qs[j] >> 4) - 8;
      dst[j] = d * static_cast<float>(lo);
      dst[j + kQK / 2] = d * static_cast<float>(hi);
    }
  }
}

// y = d * q + m, q an unsigned nibble.
void dequant_q4_1(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK) {
    const auto blk = load_block<BlockQ4_1>(src, b);
    const float d = f16_to_f32(blk.d);
    const float m = f16_to_f32(blk.m);
    for (int j = 0; j < kQK / 2; ++j) {
      dst[j] = d * static_cast<float>(blk.qs[j] & 0x0f) + m;
      dst[j + kQK / 2] = d * static_cast<float>(blk.qs[j] >> 4) + m;
    }
  }
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 5-bit quants: nibble plus bit j of qh for element j. Q5_0: y = d * (q - 16).
void dequant_q5_0(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK) {
    const auto blk = load_block<BlockQ5_0>(src, b);
    const float d = f16_to_f32(blk.d);
    const uint32_t qh = load_u32(blk.qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = static_cast<int>((blk.qs[j] & 0x0f) | (((qh >> j) & 1u) << 4)) - 16;
      const int hi = static_cast<int>((blk.qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
      dst[j] = d * static_cast<float>(lo);
      dst[j + kQK / 2] = d * static_cast<float>(hi);
    }
  }
}

// Q5_1: y = d * q + m.
void dequant_q5_1(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK) {
    const auto blk = load_block<BlockQ5_1>(src, b);
    const float d = f16_to_f32(blk.d);
    const float m = f16_to_f32(blk.m);
    const uint32_t qh = load_u32(blk.qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const uint32_t lo = (blk.qs[j] & 0x0fu) | (((qh >> j) & 1u) << 4);
      const uint32_t hi = (blk.qs[j] >> 4u) | (((qh >> (j + 16)) & 1u) << 4);
      dst[j] = d * static_cast<float>(lo) + m;
      dst[j + kQK / 2] = d * static_cast<float>(hi) + m;
    }
  }
}

void dequant_q8_0(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK) {
    const auto blk = load_block<BlockQ8_0>(src, b);
    const float d = f16_to_f32(blk.d);
    for (int j = 0; j < kQK; ++j) dst[j] = d * static_cast<float>(blk.qs[j]);
  }
}

// Q8_1's s field (d * sum) is only used by dot products.
void dequant_q8_1(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK) {
    const auto blk = load_block<BlockQ8_1>(src, b);
    const float d = f16_to_f32(blk.d);
    for (int j = 0; j < kQK; ++j) dst[j] = d * static_cast<float>(blk.qs[j]);
  }
}

// Q2_K: 16 sub-blocks of 16; scales[i] = scale (low nibble) | min (high).
// Element e = 128 * h + 32 * s + l takes bits 2s..2s+1 of qs[32 * h + l];
// y = (d * scale) * q - (dmin * min).
void dequant_q2_k(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const auto blk = load_block<BlockQ2_K>(src, b);
    const float d = f16_to_f32(blk.d);
    const float dmin = f16_to_f32(blk.dmin);
    for (int e = 0; e < kQK_K; ++e) {
      const int h = e / 128;
      const int s = (e / 32) % 4;
      const int l = e % 32;
      const int sub = e / 16;
      const float dl = d * static_cast<float>(blk.scales[sub] & 0x0f);
      const float ml = dmin * static_cast<float>(blk.scales[sub] >> 4);
      const int q = (blk.qs[32 * h + l] >> (2 * s)) & 3;
      dst[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

// Q3_K: 16 signed 6-bit scales (offset 32): low 4 bits from scales[0..7]
// (low nibbles for sub-blocks 0..7, high for 8..15), high 2 bits from
// scales[8 + j % 4] at bit 2 * (j / 4). q = low2 - (hmask bit ? 0 : 4).
void dequant_q3_k(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const auto blk = load_block<BlockQ3_K>(src, b);
    const float d = f16_to_f32(blk.d);
    float dl[16];
    for (int j = 0; j < 16; ++j) {
      const int low = j < 8 ? (blk.scales[j] & 0x0f) : (blk.scales[j - 8] >> 4);
      const int high = (blk.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
      dl[j] = d * static_cast<float>((low | (high << 4)) - 32);
    }
    for (int e = 0; e < kQK_K; ++e) {
      const int h = e / 128;
      const int s = (e / 32) % 4;
      const int l = e % 32;
      const int low2 = (blk.qs[32 * h + l] >> (2 * s)) & 3;
      const int hbit = (blk.hmask[l] >> (e / 32)) & 1;
      const int q = low2 - (hbit != 0 ? 0 : 4);
      dst[e] = dl[e / 16] * static_cast<float>(q);
    }
  }
}

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scale and min packed in 12 bytes.
void unpack_scale_min_k4(const uint8_t* scales, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
    *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// Sub-block 2g uses low nibbles of qs[32g .. 32g+31], 2g+1 the high nibbles;
// y = (d * sc) * q - (dmin * m).
void dequant_q4_k(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const auto blk = load_block<BlockQ4_K>(src, b);
    const float d = f16_to_f32(blk.d);
    const float dmin = f16_to_f32(blk.dmin);
    for (int sub = 0; sub < 8; ++sub) {
      int sc = 0;
      int m = 0;
      unpack_scale_min_k4(blk.scales, sub, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* qs = blk.qs + 32 * (sub / 2);
      const int shift = 4 * (sub % 2);
      for (int l = 0; l < 32; ++l) {
        dst[32 * sub + l] = dl * static_cast<float>((qs[l] >> shift) & 0x0f) - ml;
      }
    }
  }
}

// As Q4_K with a 5th bit: bit `sub` of qh[l] for element l of sub-block sub.
void dequant_q5_k(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const auto blk = load_block<BlockQ5_K>(src, b);
    const float d = f16_to_f32(blk.d);
    const float dmin = f16_to_f32(blk.dmin);
    for (int sub = 0; sub < 8; ++sub) {
      int sc = 0;
      int m = 0;
      unpack_scale_min_k4(blk.scales, sub, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* qs = blk.qs + 32 * (sub / 2);
      const int shift = 4 * (sub % 2);
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[l] >> shift) & 0x0f) | (((blk.qh[l] >> sub) & 1) << 4);
        dst[32 * sub + l] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

// Q6_K: group g (0..7) of 32 elements in half h = g / 4: low 4 bits from
// ql[64h + 32(g % 2) + l] (high nibble when (g / 2) % 2), high 2 bits from
// qh[32h + l] at bit 2 * (g % 4); y = (d * scales[e / 16]) * (q - 32).
void dequant_q6_k(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const auto blk = load_block<BlockQ6_K>(src, b);
    const float d = f16_to_f32(blk.d);
    float dl[16];
    for (int j = 0; j < 16; ++j) dl[j] = d * static_cast<float>(blk.scales[j]);
    for (int g = 0; g < 8; ++g) {
      const int h = g / 4;
      const uint8_t* ql = blk.ql + 64 * h + 32 * (g % 2);
      const uint8_t* qh = blk.qh + 32 * h;
      const int lshift = 4 * ((g / 2) % 2);
      const int hshift = 2 * (g % 4);
      for (int l = 0; l < 32; ++l) {
        const int q = (((ql[l] >> lshift) & 0x0f) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        const int e = 32 * g + l;
        dst[e] = dl[e / 16] * static_cast<float>(q);
      }
    }
  }
}

void dequant_q8_k(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const auto blk = load_block<BlockQ8_K>(src, b);
    for (int j = 0; j < kQK_K; ++j) dst[j] = blk.d * static_cast<float>(blk.qs[j]);
  }
}

}  // namespace

void dequantize_row(GgmlType type, const void* src_v, float* dst, int64_t n) {
  const GgmlTypeTraits* traits = ggml_type_traits(static_cast<uint32_t>(type));
  KV_CHECK(traits != nullptr && traits->supported, "dequantize_row: unsupported type");
  KV_CHECK(n >= 0 && n % traits->block_elems == 0, "dequantize_row: n not a multiple of block");
  const auto* src = static_cast<const uint8_t*>(src_v);
  const int64_t n_blocks = n / traits->block_elems;
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::kF16:
      dequant_f16(src, dst, n);
      return;
    case GgmlType::kBF16:
      dequant_bf16(src, dst, n);
      return;
    case GgmlType::kF64:
      convert_plain<double>(src, dst, n);
      return;
    case GgmlType::kI8:
      convert_plain<int8_t>(src, dst, n);
      return;
    case GgmlType::kI16:
      convert_plain<int16_t>(src, dst, n);
      return;
    case GgmlType::kI32:
      convert_plain<int32_t>(src, dst, n);
      return;
    case GgmlType::kI64:
      convert_plain<int64_t>(src, dst, n);
      return;
    case GgmlType::kQ4_0:
      dequant_q4_0(src, dst, n_blocks);
      return;
    case GgmlType::kQ4_1:
      dequant_q4_1(src, dst, n_blocks);
      return;
    case GgmlType::kQ5_0:
      dequant_q5_0(src, dst, n_blocks);
      return;
    case GgmlType::kQ5_1:
      dequant_q5_1(src, dst, n_blocks);
      return;
    case GgmlType::kQ8_0:
      dequant_q8_0(src, dst, n_blocks);
      return;
    case GgmlType::kQ8_1:
      dequant_q8_1(src, dst, n_blocks);
      return;
    case GgmlType::kQ2_K:
      dequant_q2_k(src, dst, n_blocks);
      return;
    case GgmlType::kQ3_K:
      dequant_q3_k(src, dst, n_blocks);
      return;
    case GgmlType::kQ4_K:
      dequant_q4_k(src, dst, n_blocks);
      return;
    case GgmlType::kQ5_K:
      dequant_q5_k(src, dst, n_blocks);
      return;
    case GgmlType::kQ6_K:
      dequant_q6_k(src, dst, n_blocks);
      return;
    case GgmlType::kQ8_K:
      dequant_q8_k(src, dst, n_blocks);
      return;
  }
  KV_CHECK(false, "dequantize_row: type marked supported but not implemented");
}

Status dequantize_tensor(const GgufTensor& tensor, float* dst) {
  const GgmlTypeTraits* traits = ggml_type_traits(static_cast<uint32_t>(tensor.type));
  if (traits == nullptr || !traits->supported) {
    return make_error(Errc::kUnsupported,
                      "tensor '" + tensor.name + "': dequantization of type " +
                          (traits != nullptr ? traits->name
                                             : std::to_string(static_cast<uint32_t>(tensor.type))) +
                          " is not supported");
  }
  if (tensor.dims.empty() || tensor.data == nullptr) {
    return make_error(Errc::kInvalidArgument, "tensor '" + tensor.name + "' has no data");
  }
  const int64_t ne0 = tensor.dims[0];
  if (ne0 <= 0 || ne0 % traits->block_elems != 0) {
    return make_error(Errc::kInvalidArgument, "tensor '" + tensor.name + "': row length " +
                                                  std::to_string(ne0) +
                                                  " is not a multiple of the block size");
  }
  const int64_t n_rows = tensor.n_elements() / ne0;
  const size_t row_bytes = ggml_row_bytes(tensor.type, ne0);
  if (row_bytes * static_cast<uint64_t>(n_rows) != tensor.n_bytes) {
    return make_error(Errc::kInvalidArgument,
                      "tensor '" + tensor.name + "': byte size does not match its shape");
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    dequantize_row(tensor.type, tensor.data + static_cast<size_t>(r) * row_bytes, dst + r * ne0,
                   ne0);
  }
  return {};
}

}  // namespace kvstack

// Scalar reference dequantization. Each format computes in float32 with the
// same operations, in the same order, as the `gguf` Python package
// (gguf.quants), so results match it bit for bit: scales are converted from
// f16 first, products like d * sc are rounded to float before use, and there
// is no fused multiply-add (this file is built with -ffp-contract=off).
#include "model/dequant.h"

#include <cstring>
#include <string>
#include <type_traits>

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

template <float (*kToF32)(uint16_t)>
void convert_half(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    uint16_t h;
    std::memcpy(&h, src + 2 * k, 2);
    dst[k] = kToF32(h);
  }
}

// Every quantized format below is "unpack the block's integer quants in
// element order, then scale them"; the scaling helpers keep the reference's
// rounding: each product is a float before the min/offset is applied.

// Calls kDecode(block, y) for each of n_blocks blocks; y: [kElems] floats.
// (A template argument, not a parameter, so each format's loop is compiled
// with its decoder inlined.)
template <class Block, int kElems, void (*kDecode)(const Block&, float*)>
void for_each_block(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) kDecode(load_block<Block>(src, b), dst + b * kElems);
}

// y = d * q.
template <int kN, class Q>
void scale(const Q* q, float d, float* y) {
  for (int j = 0; j < kN; ++j) y[j] = d * static_cast<float>(q[j]);
}

// y = d * q + m.
template <int kN, class Q>
void scale_add(const Q* q, float d, float m, float* y) {
  for (int j = 0; j < kN; ++j) y[j] = d * static_cast<float>(q[j]) + m;
}

// y = dl[sub] * q - ml[sub] over sub-blocks of kSub elements.
template <int kN, int kSub>
void scale_sub_min(const int8_t* q, const float* dl, const float* ml, float* y) {
  for (int sub = 0; sub < kN / kSub; ++sub) {
    for (int l = 0; l < kSub; ++l) {
      y[kSub * sub + l] = dl[sub] * static_cast<float>(q[kSub * sub + l]) - ml[sub];
    }
  }
}

// y = dl[sub] * q over sub-blocks of kSub elements.
template <int kN, int kSub>
void scale_sub(const int8_t* q, const float* dl, float* y) {
  for (int sub = 0; sub < kN / kSub; ++sub) scale<kSub>(q + kSub * sub, dl[sub], y + kSub * sub);
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_0..Q5_1 quants, minus `offset`: the low nibble of qs[j] is element j,
// the high nibble element j + 16; bit j of qh (0 for the 4-bit formats) is
// element j's fifth bit.
void unpack_nibbles_32(const uint8_t* qs, uint32_t qh, int offset, int8_t* q) {
  for (int j = 0; j < kQK / 2; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 0x0f) | (((qh >> j) & 1u) << 4)) - offset);
    q[j + kQK / 2] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - offset);
  }
}

// Q4_0: y = d * (q - 8); Q5_0: y = d * (q - 16).
void dequant_q4_0(const BlockQ4_0& blk, float* y) {
  int8_t q[kQK];
  unpack_nibbles_32(blk.qs, 0, 8, q);
  scale<kQK>(q, f16_to_f32(blk.d), y);
}

void dequant_q5_0(const BlockQ5_0& blk, float* y) {
  int8_t q[kQK];
  unpack_nibbles_32(blk.qs, load_u32(blk.qh), 16, q);
  scale<kQK>(q, f16_to_f32(blk.d), y);
}

// Q4_1, Q5_1: y = d * q + m.
void dequant_q4_1(const BlockQ4_1& blk, float* y) {
  int8_t q[kQK];
  unpack_nibbles_32(blk.qs, 0, 0, q);
  scale_add<kQK>(q, f16_to_f32(blk.d), f16_to_f32(blk.m), y);
}

void dequant_q5_1(const BlockQ5_1& blk, float* y) {
  int8_t q[kQK];
  unpack_nibbles_32(blk.qs, load_u32(blk.qh), 0, q);
  scale_add<kQK>(q, f16_to_f32(blk.d), f16_to_f32(blk.m), y);
}

// Q8_0, Q8_1 (its s field, d * sum, only serves dot products), Q8_K.
template <class Block>
void dequant_q8(const Block& blk, float* y) {
  constexpr int kN = sizeof(Block::qs);
  if constexpr (std::is_same_v<decltype(Block::d), float>) {
    scale<kN>(blk.qs, blk.d, y);
  } else {
    scale<kN>(blk.qs, f16_to_f32(blk.d), y);
  }
}

// Q2_K and Q3_K low bits: element e = 128 * h + 32 * s + l is bits 2s..2s+1
// of qs[32 * h + l].
void unpack_2bit_256(const uint8_t* qs, int8_t* q) {
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int l = 0; l < 32; ++l) {
        q[128 * h + 32 * s + l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * s)) & 3);
      }
    }
  }
}

// Q2_K: 16 sub-blocks of 16; scales[i] = scale (low nibble) | min (high);
// y = (d * scale) * q - (dmin * min).
void dequant_q2_k(const BlockQ2_K& blk, float* y) {
  const float d = f16_to_f32(blk.d);
  const float dmin = f16_to_f32(blk.dmin);
  float dl[16];
  float ml[16];
  for (int j = 0; j < 16; ++j) {
    dl[j] = d * static_cast<float>(blk.scales[j] & 0x0f);
    ml[j] = dmin * static_cast<float>(blk.scales[j] >> 4);
  }
  int8_t q[kQK_K];
  unpack_2bit_256(blk.qs, q);
  scale_sub_min<kQK_K, 16>(q, dl, ml, y);
}

// Q3_K: 16 signed 6-bit scales (offset 32): low 4 bits from scales[0..7]
// (low nibbles for sub-blocks 0..7, high for 8..15), high 2 bits from
// scales[8 + j % 4] at bit 2 * (j / 4). q = low2 - (hmask bit ? 0 : 4), the
// hmask bit of element e being bit e / 32 of hmask[e % 32].
void dequant_q3_k(const BlockQ3_K& blk, float* y) {
  const float d = f16_to_f32(blk.d);
  float dl[16];
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? (blk.scales[j] & 0x0f) : (blk.scales[j - 8] >> 4);
    const int high = (blk.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    dl[j] = d * static_cast<float>((low | (high << 4)) - 32);
  }
  int8_t q[kQK_K];
  unpack_2bit_256(blk.qs, q);
  for (int e = 0; e < kQK_K; ++e) {
    const int hbit = (blk.hmask[e % 32] >> (e / 32)) & 1;
    q[e] = static_cast<int8_t>(q[e] - (hbit != 0 ? 0 : 4));
  }
  scale_sub<kQK_K, 16>(q, dl, y);
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

// Sub-block 2g uses the low nibbles of qs[32g .. 32g+31], 2g+1 the high
// nibbles; Q5_K adds bit `sub` of qh[l] as element l's fifth bit.
// y = (d * sc) * q - (dmin * m).
template <class Block>
void dequant_q4_q5_k(const Block& blk, float* y) {
  const float d = f16_to_f32(blk.d);
  const float dmin = f16_to_f32(blk.dmin);
  float dl[8];
  float ml[8];
  int8_t q[kQK_K];
  for (int sub = 0; sub < 8; ++sub) {
    int sc = 0;
    int m = 0;
    unpack_scale_min_k4(blk.scales, sub, &sc, &m);
    dl[sub] = d * static_cast<float>(sc);
    ml[sub] = dmin * static_cast<float>(m);
    const uint8_t* qs = blk.qs + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) {
      int v = (qs[l] >> shift) & 0x0f;
      if constexpr (std::is_same_v<Block, BlockQ5_K>) v |= ((blk.qh[l] >> sub) & 1) << 4;
      q[32 * sub + l] = static_cast<int8_t>(v);
    }
  }
  scale_sub_min<kQK_K, 32>(q, dl, ml, y);
}

// Q6_K: group g (0..7) of 32 elements in half h = g / 4: low 4 bits from
// ql[64h + 32(g % 2) + l] (high nibble when (g / 2) % 2), high 2 bits from
// qh[32h + l] at bit 2 * (g % 4); y = (d * scales[e / 16]) * (q - 32).
void dequant_q6_k(const BlockQ6_K& blk, float* y) {
  const float d = f16_to_f32(blk.d);
  float dl[16];
  for (int j = 0; j < 16; ++j) dl[j] = d * static_cast<float>(blk.scales[j]);
  int8_t q[kQK_K];
  for (int g = 0; g < 8; ++g) {
    const int h = g / 4;
    const uint8_t* ql = blk.ql + 64 * h + 32 * (g % 2);
    const uint8_t* qh = blk.qh + 32 * h;
    const int lshift = 4 * ((g / 2) % 2);
    const int hshift = 2 * (g % 4);
    for (int l = 0; l < 32; ++l) {
      const int v = ((ql[l] >> lshift) & 0x0f) | (((qh[l] >> hshift) & 3) << 4);
      q[32 * g + l] = static_cast<int8_t>(v - 32);
    }
  }
  scale_sub<kQK_K, 16>(q, dl, y);
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
      convert_half<f16_to_f32>(src, dst, n);
      return;
    case GgmlType::kBF16:
      convert_half<bf16_to_f32>(src, dst, n);
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
      for_each_block<BlockQ4_0, kQK, dequant_q4_0>(src, dst, n_blocks);
      return;
    case GgmlType::kQ4_1:
      for_each_block<BlockQ4_1, kQK, dequant_q4_1>(src, dst, n_blocks);
      return;
    case GgmlType::kQ5_0:
      for_each_block<BlockQ5_0, kQK, dequant_q5_0>(src, dst, n_blocks);
      return;
    case GgmlType::kQ5_1:
      for_each_block<BlockQ5_1, kQK, dequant_q5_1>(src, dst, n_blocks);
      return;
    case GgmlType::kQ8_0:
      for_each_block<BlockQ8_0, kQK, dequant_q8<BlockQ8_0>>(src, dst, n_blocks);
      return;
    case GgmlType::kQ8_1:
      for_each_block<BlockQ8_1, kQK, dequant_q8<BlockQ8_1>>(src, dst, n_blocks);
      return;
    case GgmlType::kQ2_K:
      for_each_block<BlockQ2_K, kQK_K, dequant_q2_k>(src, dst, n_blocks);
      return;
    case GgmlType::kQ3_K:
      for_each_block<BlockQ3_K, kQK_K, dequant_q3_k>(src, dst, n_blocks);
      return;
    case GgmlType::kQ4_K:
      for_each_block<BlockQ4_K, kQK_K, dequant_q4_q5_k<BlockQ4_K>>(src, dst, n_blocks);
      return;
    case GgmlType::kQ5_K:
      for_each_block<BlockQ5_K, kQK_K, dequant_q4_q5_k<BlockQ5_K>>(src, dst, n_blocks);
      return;
    case GgmlType::kQ6_K:
      for_each_block<BlockQ6_K, kQK_K, dequant_q6_k>(src, dst, n_blocks);
      return;
    case GgmlType::kQ8_K:
      for_each_block<BlockQ8_K, kQK_K, dequant_q8<BlockQ8_K>>(src, dst, n_blocks);
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

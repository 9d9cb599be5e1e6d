// GGML tensor element types as stored in GGUF files, with their block
// layouts. Values of GgmlType are the on-disk type ids.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvstack {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kBF16 = 30,
  // Other ids (IQ*, TQ*, MXFP4) are known to ggml_type_traits() for sizes but
  // have no enumerator: they cannot be dequantized by this build.
};

constexpr int kQK = 32;     // elements per legacy block (Q4_0 .. Q8_1)
constexpr int kQK_K = 256;  // elements per k-quant super-block

// Legacy blocks. d/m are IEEE f16 bit patterns.
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQK / 2];  // nibbles: low = element j, high = element j + 16
};
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];  // 5th bits, little-endian uint32
  uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQK];
};
struct BlockQ8_1 {
  uint16_t d;  // scale
  uint16_t s;  // d * sum(qs)
  int8_t qs[kQK];
};

// k-quants (super-blocks of 256).
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];  // low nibble: scale, high nibble: min (4 bits each)
  uint8_t qs[kQK_K / 4];       // 2-bit quants
  uint16_t d;
  uint16_t dmin;
};
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];  // 3rd bits (set bit = no -4 offset)
  uint8_t qs[kQK_K / 4];     // low 2 bits
  uint8_t scales[12];        // 16 x 6-bit signed scales (offset 32), packed
  uint16_t d;
};
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];  // 8 x (6-bit scale, 6-bit min), packed
  uint8_t qs[kQK_K / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  uint16_t d;
};
struct BlockQ8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

struct GgmlTypeTraits {
  const char* name;
  int block_elems;     // elements per block (1 for plain float types)
  size_t block_bytes;  // bytes per block
  bool supported;      // this build can dequantize it
};

// Traits for a type id; nullptr for ids this build does not know.
const GgmlTypeTraits* ggml_type_traits(uint32_t type_id);

// Bytes of a row of n elements; n must be a multiple of block_elems.
size_t ggml_row_bytes(GgmlType type, int64_t n);

// "Q4_K" etc.; "unknown" for ids ggml_type_traits() does not know.
const char* ggml_type_name(GgmlType type);

// Name of an id GGML once assigned and has since removed (e.g. 4 -> "Q4_2"),
// else nullptr. Files using these are rejected as unsupported.
const char* ggml_removed_type_name(uint32_t type_id);

}  // namespace kvstack

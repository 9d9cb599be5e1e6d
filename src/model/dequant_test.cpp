#include "model/dequant.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/half.h"
#include "model/gguf.h"
#include "model/tools/gguf_builder.h"

namespace kvstack {
namespace {

// f16 bit patterns of exactly representable scales.
constexpr uint16_t kHalf1 = 0x3c00;       // 1.0
constexpr uint16_t kHalf2 = 0x4000;       // 2.0
constexpr uint16_t kHalf4 = 0x4400;       // 4.0
constexpr uint16_t kHalf0_5 = 0x3800;     // 0.5
constexpr uint16_t kHalf0_25 = 0x3400;    // 0.25
constexpr uint16_t kHalf0_125 = 0x3000;   // 0.125
constexpr uint16_t kHalfMinus1 = 0xbc00;  // -1.0

// Bit patterns of n floats: compares -0.0 and NaN payloads exactly, which
// == on floats would not.
std::vector<uint32_t> float_bits(const float* p, size_t n) {
  std::vector<uint32_t> out(n);
  for (size_t k = 0; k < n; ++k) out[k] = std::bit_cast<uint32_t>(p[k]);
  return out;
}

template <class Block>
std::vector<float> dequant_block(GgmlType type, const Block& blk) {
  const GgmlTypeTraits* t = ggml_type_traits(static_cast<uint32_t>(type));
  EXPECT_NE(t, nullptr);
  EXPECT_EQ(t->block_bytes, sizeof(Block));
  std::vector<float> out(static_cast<size_t>(t->block_elems));
  dequantize_row(type, &blk, out.data(), t->block_elems);
  return out;
}

TEST(Dequant, TypeTraits) {
  EXPECT_STREQ(ggml_type_traits(12)->name, "Q4_K");
  EXPECT_EQ(ggml_type_traits(12)->block_elems, 256);
  EXPECT_EQ(ggml_type_traits(12)->block_bytes, 144u);
  EXPECT_EQ(ggml_type_traits(4), nullptr);  // removed Q4_2
  EXPECT_STREQ(ggml_removed_type_name(4), "Q4_2");
  EXPECT_EQ(ggml_type_traits(1000), nullptr);
  EXPECT_FALSE(ggml_type_traits(16)->supported);  // IQ2_XXS: sizes only
  EXPECT_EQ(ggml_row_bytes(GgmlType::kQ4_0, 64), 36u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::kF16, 7), 14u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::kQ6_K, 512), 420u);
}

TEST(Dequant, PlainFloatTypes) {
  const float f32[3] = {1.5f, -0.0f, 3e38f};
  float out[3];
  dequantize_row(GgmlType::kF32, f32, out, 3);
  EXPECT_EQ(float_bits(out, 3), float_bits(f32, 3));

  const uint16_t f16[6] = {0x3c00, 0xc000, 0x0001, 0x7c00, 0x7bff, 0x8000};
  float o16[6];
  dequantize_row(GgmlType::kF16, f16, o16, 6);
  EXPECT_EQ(o16[0], 1.0f);
  EXPECT_EQ(o16[1], -2.0f);
  EXPECT_EQ(o16[2], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(o16[3], std::numeric_limits<float>::infinity());
  EXPECT_EQ(o16[4], 65504.0f);
  EXPECT_TRUE(std::signbit(o16[5]));

  const uint16_t bf16[2] = {0x3f80, 0xc040};
  float ob[2];
  dequantize_row(GgmlType::kBF16, bf16, ob, 2);
  EXPECT_EQ(ob[0], 1.0f);
  EXPECT_EQ(ob[1], -3.0f);

  const int8_t i8[2] = {-128, 127};
  float oi[2];
  dequantize_row(GgmlType::kI8, i8, oi, 2);
  EXPECT_EQ(oi[0], -128.0f);
  EXPECT_EQ(oi[1], 127.0f);
}

TEST(Dequant, Q4_0) {
  BlockQ4_0 b{};
  b.d = kHalf0_5;
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const auto y = dequant_block(GgmlType::kQ4_0, b);
  EXPECT_EQ(y[0], -4.0f);   // 0.5 * (0 - 8)
  EXPECT_EQ(y[8], 0.0f);    // 0.5 * (8 - 8)
  EXPECT_EQ(y[15], 3.5f);   // 0.5 * (15 - 8)
  EXPECT_EQ(y[16], 3.5f);   // high nibble of qs[0] = 15
  EXPECT_EQ(y[31], -4.0f);  // high nibble of qs[15] = 0
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * static_cast<float>(j - 8));
    EXPECT_EQ(y[j + 16], 0.5f * static_cast<float>(7 - j));
  }
}

TEST(Dequant, Q4_1) {
  BlockQ4_1 b{};
  b.d = kHalf0_25;
  b.m = kHalfMinus1;
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const auto y = dequant_block(GgmlType::kQ4_1, b);
  EXPECT_EQ(y[0], -1.0f);   // 0.25 * 0 - 1
  EXPECT_EQ(y[4], 0.0f);    // 0.25 * 4 - 1
  EXPECT_EQ(y[15], 2.75f);  // 0.25 * 15 - 1
  EXPECT_EQ(y[16], 2.75f);
  EXPECT_EQ(y[31], -1.0f);
}

TEST(Dequant, Q5_0) {
  BlockQ5_0 b{};
  b.d = kHalf1;
  b.qs[0] = 0xf5;
  const uint32_t qh = 0x80000001u;  // 5th bit for elements 0 and 31
  std::memcpy(b.qh, &qh, 4);
  const auto y = dequant_block(GgmlType::kQ5_0, b);
  EXPECT_EQ(y[0], 5.0f);    // (5 | 16) - 16
  EXPECT_EQ(y[16], -1.0f);  // 15 - 16
  EXPECT_EQ(y[1], -16.0f);  // 0 - 16
  EXPECT_EQ(y[31], 0.0f);   // (0 | 16) - 16
}

TEST(Dequant, Q5_1) {
  BlockQ5_1 b{};
  b.d = kHalf2;
  b.m = kHalf0_5;
  b.qs[3] = 0x21;
  const uint32_t qh = (1u << 3) | (1u << 19);
  std::memcpy(b.qh, &qh, 4);
  const auto y = dequant_block(GgmlType::kQ5_1, b);
  EXPECT_EQ(y[3], 34.5f);   // 2 * (1 | 16) + 0.5
  EXPECT_EQ(y[19], 36.5f);  // 2 * (2 | 16) + 0.5
  EXPECT_EQ(y[0], 0.5f);
}

TEST(Dequant, Q8_0AndQ8_1) {
  BlockQ8_0 b{};
  b.d = kHalf0_125;
  b.qs[0] = -128;
  b.qs[1] = 127;
  b.qs[3] = 5;
  const auto y = dequant_block(GgmlType::kQ8_0, b);
  EXPECT_EQ(y[0], -16.0f);
  EXPECT_EQ(y[1], 15.875f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 0.625f);

  BlockQ8_1 c{};
  c.d = kHalf4;
  c.s = 0x7c00;  // ignored by dequantization
  c.qs[0] = -3;
  const auto z = dequant_block(GgmlType::kQ8_1, c);
  EXPECT_EQ(z[0], -12.0f);
  EXPECT_EQ(z[1], 0.0f);
}

TEST(Dequant, Q2_K) {
  BlockQ2_K b{};
  b.d = kHalf1;
  b.dmin = kHalf0_5;
  b.scales[0] = 0x23;  // scale 3, min 2 -> y = 3q - 1
  b.scales[2] = 0x11;  // scale 1, min 1 -> y = q - 0.5
  b.scales[9] = 0x5a;  // scale 10, min 5 -> y = 10q - 2.5
  b.qs[0] = 0xe4;      // 2-bit fields 0, 1, 2, 3 for elements 0, 32, 64, 96
  b.qs[48] = 0x03;     // element 128 + 16 = 144 (sub-block 9), q = 3
  const auto y = dequant_block(GgmlType::kQ2_K, b);
  EXPECT_EQ(y[0], -1.0f);
  EXPECT_EQ(y[32], 0.5f);    // sub-block 2, q = 1
  EXPECT_EQ(y[144], 27.5f);  // 10 * 3 - 2.5
  EXPECT_EQ(y[1], -1.0f);    // q = 0 in sub-block 0
}

TEST(Dequant, Q3_K) {
  BlockQ3_K b{};
  b.d = kHalf1;
  b.scales[0] = 0x05;  // sub-block 0: low 4 bits 5
  b.scales[8] = 0x02;  //   high 2 bits 2 -> 37 - 32 = 5
  b.scales[5] = 0x90;  // sub-block 13: low 4 bits 9 (high nibble of scales[5])
  b.scales[9] = 0x40;  //   high 2 bits 1 (bits 6..7 of scales[9]) -> 25 - 32 = -7
  b.qs[0] = 0x02;      // element 0: low2 = 2
  b.hmask[0] = 0x01;   //   hmask set: no -4 -> q = 2
  b.qs[48] = 0x30;     // element 208 (h 1, shift 4, l 16): low2 = 3
  // hmask[16] bit 6 clear -> q = 3 - 4 = -1
  const auto y = dequant_block(GgmlType::kQ3_K, b);
  EXPECT_EQ(y[0], 10.0f);    // 5 * 2
  EXPECT_EQ(y[1], -20.0f);   // 5 * (0 - 4)
  EXPECT_EQ(y[16], 128.0f);  // sub-block 1 scale 0 - 32 = -32, q = -4
  EXPECT_EQ(y[208], 7.0f);   // -7 * -1
}

// Scales for sub-blocks 0 (sc 3, m 1), 1 (0, 0), 4 (0, 0), 5 (sc 37, m 19).
void set_k4_scales(uint8_t* s) {
  s[0] = 3;
  s[4] = 1;
  s[1] = 0x80;  // sub 1 sc = 0; top bits 2 -> high bits of sub 5's scale
  s[5] = 0x40;  // sub 1 m = 0; top bits 1 -> high bits of sub 5's min
  s[9] = 0x35;  // sub 5: sc low 5, m low 3
}

TEST(Dequant, Q4_K) {
  BlockQ4_K b{};
  b.d = kHalf1;
  b.dmin = kHalf1;
  set_k4_scales(b.scales);
  b.qs[0] = 0x97;       // element 0: q 7 (sub 0); element 32: q 9 (sub 1)
  b.qs[64 + 3] = 0xa0;  // element 128 + 3: q 0 (sub 4); element 160 + 3: q 10 (sub 5)
  const auto y = dequant_block(GgmlType::kQ4_K, b);
  EXPECT_EQ(y[0], 20.0f);  // 3 * 7 - 1
  EXPECT_EQ(y[1], -1.0f);  // 3 * 0 - 1
  EXPECT_EQ(y[32], 0.0f);  // 0 * 9 - 0
  EXPECT_EQ(y[131], 0.0f);
  EXPECT_EQ(y[163], 351.0f);  // 37 * 10 - 19
}

TEST(Dequant, Q5_K) {
  BlockQ5_K b{};
  b.d = kHalf1;
  b.dmin = kHalf1;
  set_k4_scales(b.scales);
  b.qs[0] = 0x07;
  b.qs[64 + 3] = 0xa0;
  b.qh[0] = 0x01;     // 5th bit for element 0 (sub-block 0)
  b.qh[3] = 1u << 5;  // 5th bit for element 163 (sub-block 5)
  const auto y = dequant_block(GgmlType::kQ5_K, b);
  EXPECT_EQ(y[0], 68.0f);     // 3 * (7 | 16) - 1
  EXPECT_EQ(y[163], 943.0f);  // 37 * (10 | 16) - 19
  EXPECT_EQ(y[3], -1.0f);     // bit for sub 0 only on element 0
}

TEST(Dequant, Q6_K) {
  BlockQ6_K b{};
  b.d = kHalf0_5;
  b.scales[0] = 2;
  b.scales[15] = -4;
  b.ql[0] = 0x0f;    // element 0: low 4 bits 15
  b.qh[0] = 0x02;    //   high 2 bits 2 -> 47 - 32 = 15
  b.ql[127] = 0x30;  // element 255 (group 7): high nibble 3
  // qh[63] bits 6..7 = 0 -> 3 - 32 = -29
  const auto y = dequant_block(GgmlType::kQ6_K, b);
  EXPECT_EQ(y[0], 15.0f);    // (0.5 * 2) * 15
  EXPECT_EQ(y[1], -32.0f);   // (0.5 * 2) * (0 - 32)
  EXPECT_EQ(y[255], 58.0f);  // (0.5 * -4) * -29
}

TEST(Dequant, Q8_K) {
  BlockQ8_K b{};
  b.d = 0.5f;
  b.qs[0] = -2;
  b.qs[255] = 100;
  const auto y = dequant_block(GgmlType::kQ8_K, b);
  EXPECT_EQ(y[0], -1.0f);
  EXPECT_EQ(y[255], 50.0f);
}

TEST(Dequant, UnalignedSourceAndManyBlocks) {
  // Three Q4_K blocks with varied bytes, at an odd address.
  std::vector<uint8_t> raw(3 * sizeof(BlockQ4_K));
  for (size_t k = 0; k < raw.size(); ++k) raw[k] = static_cast<uint8_t>(k * 131 + 7);
  for (int b = 0; b < 3; ++b) {
    const uint16_t d = f32_to_f16(0.01f * static_cast<float>(b + 1));
    std::memcpy(raw.data() + b * sizeof(BlockQ4_K), &d, 2);
    std::memcpy(raw.data() + b * sizeof(BlockQ4_K) + 2, &d, 2);
  }
  std::vector<uint8_t> shifted(raw.size() + 1);
  std::memcpy(shifted.data() + 1, raw.data(), raw.size());
  std::vector<float> a(768);
  std::vector<float> b(768);
  dequantize_row(GgmlType::kQ4_K, raw.data(), a.data(), 768);
  dequantize_row(GgmlType::kQ4_K, shifted.data() + 1, b.data(), 768);
  EXPECT_EQ(float_bits(a.data(), a.size()), float_bits(b.data(), b.size()));
  // Row of three blocks == three single-block rows.
  for (int blk = 0; blk < 3; ++blk) {
    std::vector<float> one(256);
    dequantize_row(GgmlType::kQ4_K, raw.data() + blk * sizeof(BlockQ4_K), one.data(), 256);
    EXPECT_EQ(float_bits(one.data(), 256), float_bits(a.data() + blk * 256, 256));
  }
}

TEST(Dequant, TensorFromGguf) {
  using testing::Bytes;
  testing::GgufBuilder builder;
  // Q8_0 tensor [32, 2]: row r has d = r + 1, qs[j] = j - 16.
  Bytes q8(2 * sizeof(BlockQ8_0));
  for (int r = 0; r < 2; ++r) {
    BlockQ8_0 blk{};
    blk.d = f32_to_f16(static_cast<float>(r + 1));
    for (int j = 0; j < 32; ++j) blk.qs[j] = static_cast<int8_t>(j - 16);
    std::memcpy(q8.data() + r * sizeof(BlockQ8_0), &blk, sizeof(blk));
  }
  builder.add_tensor("q8", {32, 2}, 8, q8);
  builder.add_tensor("iq", {256}, 16, Bytes(66, 0));  // IQ2_XXS: known size, no dequant
  const Bytes img = builder.build();
  auto f = GgufFile::parse(img.data(), img.size(), "t.gguf");
  ASSERT_TRUE(f.ok()) << f.error().message;
  std::vector<float> out(64);
  ASSERT_TRUE(dequantize_tensor(*f->find_tensor("q8"), out.data()).ok());
  EXPECT_EQ(out[0], -16.0f);
  EXPECT_EQ(out[31], 15.0f);
  EXPECT_EQ(out[32], -32.0f);
  EXPECT_EQ(out[63], 30.0f);
  std::vector<float> iq(256);
  Status s = dequantize_tensor(*f->find_tensor("iq"), iq.data());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, Errc::kUnsupported);
  EXPECT_NE(s.error().message.find("IQ2_XXS"), std::string::npos);
}

}  // namespace
}  // namespace kvstack

// Colder host format (host_format.h): the int8 round trip error stays within
// its bound, the SIMD path equals the scalar reference bit for bit, and odd
// values (zeros, subnormals, the f16 extremes, inf, NaN) are handled.
#include "kv/host_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"

namespace kvstack {
namespace {

std::vector<uint8_t> random_block(int64_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint8_t> b(static_cast<size_t>(bytes));
  const int64_t n = bytes / 2;
  for (int64_t i = 0; i < n; ++i) {
    // Groups of different magnitudes, like K/V rows of different heads.
    const float scale = std::ldexp(1.0f, static_cast<int>((i / 32) % 24) - 12);
    const uint16_t h = f32_to_f16(nd(rng) * scale);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return b;
}

void set(std::vector<uint8_t>& b, int64_t i, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(b.data() + 2 * i, &h, 2);
}
float get(const std::vector<uint8_t>& b, int64_t i) {
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * i, 2);
  return f16_to_f32(h);
}

TEST(HostFormat, Int8RoundTripIsBoundedAndSimdEqualsScalar) {
  constexpr int64_t kBytes = 368640;  // one SmolLM2-135M f16 block
  std::vector<uint8_t> in = random_block(kBytes, 1);
  // Odd groups: all zero; subnormals; the f16 maximum; inf and NaN.
  for (int64_t i = 0; i < 32; ++i) set(in, i, 0.0f);
  for (int64_t i = 32; i < 64; ++i) set(in, i, static_cast<float>(i - 48) * 6e-8f);
  set(in, 64, 65504.0f);
  set(in, 65, -65504.0f);
  set(in, 96, std::numeric_limits<float>::infinity());
  set(in, 97, std::nanf(""));
  set(in, 98, 3.0f);
  ASSERT_EQ(int8_block_bytes(kBytes), kBytes / 2 + kBytes / 32);
  std::vector<uint8_t> enc(static_cast<size_t>(int8_block_bytes(kBytes)));
  std::vector<uint8_t> enc_ref(enc.size());
  encode_int8_block(in.data(), kBytes, enc.data());
  encode_int8_block_scalar(in.data(), kBytes, enc_ref.data());
  EXPECT_EQ(enc, enc_ref);
  std::vector<uint8_t> out(static_cast<size_t>(kBytes)), out_ref(out.size());
  decode_int8_block(enc.data(), kBytes, out.data());
  decode_int8_block_scalar(enc.data(), kBytes, out_ref.data());
  EXPECT_EQ(out, out_ref);
  const int64_t n = kBytes / 2;
  double worst = 0;  // error / bound
  for (int64_t g = 0; g < n / 32; ++g) {
    float amax = 0;
    for (int64_t i = 32 * g; i < 32 * g + 32; ++i) {
      const float x = get(in, i);
      if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
    }
    uint16_t s16 = f32_to_f16(amax / 127.0f);
    if (f16_to_f32(s16) < amax / 127.0f) ++s16;
    const float s = f16_to_f32(s16);
    for (int64_t i = 32 * g; i < 32 * g + 32; ++i) {
      const float x = get(in, i);
      const float y = get(out, i);
      if (!std::isfinite(x)) {
        EXPECT_EQ(y, 0.0f) << i;
        continue;
      }
      const double e = std::fabs(static_cast<double>(y) - x);
      const double bound = 0.5 * s + std::fabs(x) / 1024.0 + 1e-12;
      ASSERT_LE(e, bound) << "value " << i << " x " << x << " y " << y;
      worst = std::max(worst, e / bound);
    }
  }
  EXPECT_EQ(get(out, 0), 0.0f);
  EXPECT_EQ(get(out, 64), 65504.0f);
  EXPECT_EQ(get(out, 65), -65504.0f);
  EXPECT_GT(worst, 0.1);  // the bound is not vacuous
}

TEST(HostFormat, ParseNamesTheFlag) {
  EXPECT_EQ(*parse_host_format("int8"), HostFormat::kInt8);
  EXPECT_EQ(*parse_host_format("pool"), HostFormat::kPool);
  auto bad = parse_host_format("int4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("--kv-host-format"), std::string::npos);
}

}  // namespace
}  // namespace kvstack

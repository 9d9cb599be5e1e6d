#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/half.h"
#include "core/proc_stats.h"
#include "core/thread_pool.h"
#include "core/units.h"

namespace kvstack {
namespace {

TEST(Half, F16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    if ((bits & 0x7c00) == 0x7c00) continue;  // inf/nan handled below
    EXPECT_EQ(f32_to_f16(f16_to_f32(bits)), bits) << h;
  }
}

TEST(Half, F16RoundsToNearestEven) {
  // 1 + 2^-11 is exactly between 1 and the next f16 (1 + 2^-10): ties to even -> 1.
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3*2^-11 is between 1+2^-10 (odd mantissa) and 1+2^-9: ties to even -> up.
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(70000.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -26)), 0x0000);  // rounds to zero
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
}

TEST(Half, Bf16) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even -> 1.
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Units, ParseBytes) {
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(*parse_bytes("2GiB"), 2ull << 30);
  EXPECT_EQ(*parse_bytes("1.5GB"), 1500000000ull);
  EXPECT_EQ(*parse_bytes("8k"), 8000ull);
  EXPECT_FALSE(parse_bytes("").ok());
  EXPECT_FALSE(parse_bytes("-1GiB").ok());
  EXPECT_FALSE(parse_bytes("12 parsecs").ok());
  EXPECT_FALSE(parse_bytes("1e30").ok());
  EXPECT_NE(parse_bytes("3XB").error().message.find("XB"), std::string::npos);
}

TEST(Units, ParseRate) {
  EXPECT_DOUBLE_EQ(*parse_rate("25GiB/s"), 25.0 * (1ull << 30));
  EXPECT_DOUBLE_EQ(*parse_rate("1TB/s"), 1e12);
  EXPECT_DOUBLE_EQ(*parse_rate("200Gbit/s"), 25e9);
  EXPECT_FALSE(parse_rate("200Gbit").ok());
  EXPECT_FALSE(parse_rate("fast/s").ok());
}

TEST(Units, FormatBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3.0 * (1ull << 30)), "3.00 GiB");
}

TEST(ProcStats, RssCountsTouchedPages) {
  const int64_t before = process_rss_bytes();
  ASSERT_GT(before, 0);
  // 32 MiB written page by page must become resident (the process is not
  // under memory pressure in tests; allow a quarter for noise).
  constexpr size_t kBytes = size_t{32} << 20;
  auto buf = std::make_unique<char[]>(kBytes);
  std::memset(buf.get(), 1, kBytes);
  const int64_t after = process_rss_bytes();
  EXPECT_GE(after - before, static_cast<int64_t>(kBytes / 4 * 3));
  EXPECT_EQ(buf[kBytes - 1], 1);
}

TEST(ThreadPool, ParallelForCoversRangeOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 7, 64, 1000}) {
      for (int64_t grain : {1, 4, 16}) {
        std::vector<std::atomic<int>> hits(n);
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
          EXPECT_EQ(b % grain, 0);
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n;
      }
    }
  }
}

TEST(ThreadPool, ManySmallJobs) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  for (int j = 0; j < 20000; ++j) pool.run([&](int t) { sum.fetch_add(t + 1); });
  EXPECT_EQ(sum.load(), 20000 * 3);
}

}  // namespace
}  // namespace kvstack

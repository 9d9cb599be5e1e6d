#include "ops/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "core/half.h"
#include "ops/quantize_act.h"

namespace kvstack {
namespace {

// Index of the first element whose bit pattern differs, or -1 when all n
// floats are bit-identical (exact bits, like memcmp: -0 != +0, a NaN equals
// the same NaN).
int64_t first_bit_mismatch(const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return i;
  }
  return -1;
}

// ---- Test weights: random valid blocks and an independent dequantizer. ----

uint16_t rand_scale(std::mt19937& rng, float lo, float hi) {
  return f32_to_f16(std::uniform_real_distribution<float>(lo, hi)(rng));
}

// A random weight matrix [n_out, n_in] of `type`: quant bytes uniform, block
// scales in ranges typical of real models.
std::vector<uint8_t> random_weights(GgmlType type, int64_t n_in, int64_t n_out, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t row = ggml_row_bytes(type, n_in);
  std::vector<uint8_t> buf(row * n_out);
  std::uniform_int_distribution<int> byte(0, 255);
  if (type == GgmlType::kF32) {
    std::normal_distribution<float> nd(0.f, 0.05f);
    auto* f = reinterpret_cast<float*>(buf.data());
    for (int64_t i = 0; i < n_in * n_out; ++i) f[i] = nd(rng);
    return buf;
  }
  if (type == GgmlType::kF16) {
    std::normal_distribution<float> nd(0.f, 0.05f);
    auto* h = reinterpret_cast<uint16_t*>(buf.data());
    for (int64_t i = 0; i < n_in * n_out; ++i) h[i] = f32_to_f16(nd(rng));
    return buf;
  }
  for (auto& b : buf) b = static_cast<uint8_t>(byte(rng));
  const int64_t n_blocks =
      n_in * n_out / ggml_type_traits(static_cast<uint32_t>(type))->block_elems;
  for (int64_t i = 0; i < n_blocks; ++i) {
    switch (type) {
      case GgmlType::kQ4_0:
        reinterpret_cast<BlockQ4_0*>(buf.data())[i].d = rand_scale(rng, -0.02f, 0.02f);
        break;
      case GgmlType::kQ5_0:
        reinterpret_cast<BlockQ5_0*>(buf.data())[i].d = rand_scale(rng, -0.01f, 0.01f);
        break;
      case GgmlType::kQ8_0: {
        auto& b = reinterpret_cast<BlockQ8_0*>(buf.data())[i];
        b.d = rand_scale(rng, 0.f, 0.001f);
        for (auto& q : b.qs) q = static_cast<int8_t>(std::max(-127, static_cast<int>(q)));
        break;
      }
      case GgmlType::kQ4_1: {
        auto& b = reinterpret_cast<BlockQ4_1*>(buf.data())[i];
        b.d = rand_scale(rng, 0.f, 0.02f);
        b.m = rand_scale(rng, -0.15f, 0.f);
        break;
      }
      case GgmlType::kQ5_1: {
        auto& b = reinterpret_cast<BlockQ5_1*>(buf.data())[i];
        b.d = rand_scale(rng, 0.f, 0.01f);
        b.m = rand_scale(rng, -0.15f, 0.f);
        break;
      }
      case GgmlType::kQ4_K: {
        auto& b = reinterpret_cast<BlockQ4_K*>(buf.data())[i];
        b.d = rand_scale(rng, 0.f, 0.001f);
        b.dmin = rand_scale(rng, 0.f, 0.002f);
        break;
      }
      case GgmlType::kQ5_K: {
        auto& b = reinterpret_cast<BlockQ5_K*>(buf.data())[i];
        b.d = rand_scale(rng, 0.f, 0.0005f);
        b.dmin = rand_scale(rng, 0.f, 0.002f);
        break;
      }
      case GgmlType::kQ6_K: {
        auto& b = reinterpret_cast<BlockQ6_K*>(buf.data())[i];
        b.d = rand_scale(rng, 0.f, 0.0005f);
        break;
      }
      default:
        ADD_FAILURE() << "no generator for type";
        break;
    }
  }
  return buf;
}

uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void k4_scale_min(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Row of `type` -> doubles, written from the format description.
std::vector<double> dequant(GgmlType type, const uint8_t* p, int64_t n) {
  std::vector<double> out(n);
  switch (type) {
    case GgmlType::kF32:
      for (int64_t i = 0; i < n; ++i) out[i] = reinterpret_cast<const float*>(p)[i];
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
      break;
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
      for (int64_t b = 0; b < n / 32; ++b) {
        double d, m = 0;
        const uint8_t* qs;
        uint32_t qh = 0;
        int offset = 0;
        if (type == GgmlType::kQ4_0) {
          const auto& k = reinterpret_cast<const BlockQ4_0*>(p)[b];
          d = f16_to_f32(k.d), qs = k.qs, offset = -8;
        } else if (type == GgmlType::kQ4_1) {
          const auto& k = reinterpret_cast<const BlockQ4_1*>(p)[b];
          d = f16_to_f32(k.d), m = f16_to_f32(k.m), qs = k.qs;
        } else if (type == GgmlType::kQ5_0) {
          const auto& k = reinterpret_cast<const BlockQ5_0*>(p)[b];
          d = f16_to_f32(k.d), qs = k.qs, qh = u32(k.qh), offset = -16;
        } else {
          const auto& k = reinterpret_cast<const BlockQ5_1*>(p)[b];
          d = f16_to_f32(k.d), m = f16_to_f32(k.m), qs = k.qs, qh = u32(k.qh);
        }
        for (int j = 0; j < 16; ++j) {
          const int lo = (qs[j] & 15) + static_cast<int>(((qh >> j) & 1) << 4);
          const int hi = (qs[j] >> 4) + static_cast<int>(((qh >> (j + 16)) & 1) << 4);
          out[b * 32 + j] = d * (lo + offset) + m;
          out[b * 32 + j + 16] = d * (hi + offset) + m;
        }
      }
      break;
    case GgmlType::kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b) {
        const auto& k = reinterpret_cast<const BlockQ8_0*>(p)[b];
        for (int j = 0; j < 32; ++j)
          out[b * 32 + j] = f16_to_f32(k.d) * static_cast<double>(k.qs[j]);
      }
      break;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      for (int64_t b = 0; b < n / 256; ++b) {
        const bool five = type == GgmlType::kQ5_K;
        const auto* k4 = reinterpret_cast<const BlockQ4_K*>(p) + b;
        const auto* k5 = reinterpret_cast<const BlockQ5_K*>(p) + b;
        const double d = f16_to_f32(five ? k5->d : k4->d);
        const double dmin = f16_to_f32(five ? k5->dmin : k4->dmin);
        const uint8_t* sc = five ? k5->scales : k4->scales;
        const uint8_t* qs = five ? k5->qs : k4->qs;
        for (int e = 0; e < 256; ++e) {
          const int sub = e / 32, chunk = e / 64, l = e % 32;
          int s, m;
          k4_scale_min(sub, sc, &s, &m);
          int q = (sub % 2 == 0) ? (qs[chunk * 32 + l] & 15) : (qs[chunk * 32 + l] >> 4);
          if (five) q += ((k5->qh[l] >> sub) & 1) << 4;
          out[b * 256 + e] = d * s * q - dmin * m;
        }
      }
      break;
    case GgmlType::kQ6_K:
      for (int64_t b = 0; b < n / 256; ++b) {
        const auto& k = reinterpret_cast<const BlockQ6_K*>(p)[b];
        for (int e = 0; e < 256; ++e) {
          const int half = e / 128, i = e % 128, quarter = i / 32, l = i % 32;
          const uint8_t lbyte = k.ql[half * 64 + (quarter % 2) * 32 + l];
          const int low = quarter < 2 ? (lbyte & 15) : (lbyte >> 4);
          const int high = (k.qh[half * 32 + l] >> (2 * quarter)) & 3;
          const int sub = e / 16;  // 16-element sub-block, one scale each
          out[b * 256 + e] = f16_to_f32(k.d) * k.scales[sub] * ((low | (high << 4)) - 32);
        }
      }
      break;
    default:
      ADD_FAILURE() << "no dequant for type";
      break;
  }
  return out;
}

std::vector<float> random_acts(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  // A few outliers per row, as real activations have.
  for (int64_t i = 0; i < n; i += 97) x[i] *= 8.f;
  return x;
}

GgmlType kAllTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kQ4_0, GgmlType::kQ4_1,
                        GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0, GgmlType::kQ4_K,
                        GgmlType::kQ5_K, GgmlType::kQ6_K};

struct IsaGuard {
  explicit IsaGuard(Isa isa) { set_isa_override(isa); }
  ~IsaGuard() { set_isa_override(Isa::kAvx512); }
};

std::vector<float> run_matmul(GgmlType type, const std::vector<uint8_t>& w, int64_t n_in,
                              int64_t n_out, const std::vector<float>& x, int64_t m, Isa isa,
                              int n_threads) {
  IsaGuard guard(isa);
  std::unique_ptr<ThreadPool> pool;
  if (n_threads > 0) pool = std::make_unique<ThreadPool>(n_threads);
  std::vector<float> y(m * n_out, std::nanf(""));
  matmul(WeightView{type, w.data(), n_in, n_out}, x.data(), m, y.data(), pool.get());
  return y;
}

// ---- Activation quantization on hand-computed cases. ----

TEST(QuantizeAct, Q8_0HandComputed) {
  float x[32] = {};
  x[0] = 127.f;    // amax -> d = 1, id = 1
  x[1] = -63.5f;   // half -> even: -64
  x[2] = 0.5f;     // -> 0
  x[3] = 1.5f;     // -> 2
  x[4] = 2.5f;     // -> 2
  x[5] = -0.49f;   // -> 0
  x[31] = 100.7f;  // -> 101
  BlockQ8_0 b;
  quantize_row_q8_0(x, &b, 32);
  EXPECT_EQ(f16_to_f32(b.d), 1.f);
  const int expect[] = {127, -64, 0, 2, 2, 0};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(b.qs[j], expect[j]) << j;
  EXPECT_EQ(b.qs[31], 101);
  for (int j = 6; j < 31; ++j) EXPECT_EQ(b.qs[j], 0);

  // All-zero block: d = 0, q = 0.
  float z[32] = {};
  quantize_row_q8_0(z, &b, 32);
  EXPECT_EQ(b.d, 0);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(b.qs[j], 0);
}

TEST(QuantizeAct, Q8_1SumField) {
  float x[64];
  for (int j = 0; j < 64; ++j) x[j] = (j % 2 ? -1.f : 1.f) * (j + 1) / 64.f;
  // Block 0: amax = 32/64 = 0.5 at j = 31 (negative); d = 0.5/127.
  BlockQ8_1 b[2];
  quantize_row_q8_1(x, b, 64);
  EXPECT_EQ(b[0].d, f32_to_f16(0.5f / 127.f));
  EXPECT_EQ(b[0].qs[31], -127);
  EXPECT_EQ(b[0].qs[0], 4);  // (1/64) * 254 = 3.97 -> 4
  int sum = 0;
  for (int j = 0; j < 32; ++j) sum += b[0].qs[j];
  // Pairs (+a, -(a + 1/64)) -> each pair's q sum is about -4; the block's is -64 +- rounding.
  EXPECT_EQ(b[0].s, f32_to_f16(0.5f / 127.f * static_cast<float>(sum)));
  EXPECT_NEAR(sum, -64, 2);
  // Block 1: amax = 1 at j = 63: q[63] = -127.
  EXPECT_EQ(b[1].qs[31], -127);
}

TEST(QuantizeAct, Q8_KHandComputed) {
  std::vector<float> x(256, 0.f);
  x[3] = 2.f;     // first element of largest |x| -> max = 2, iscale = -63.5
  x[5] = -2.f;    // same |x|, later: does not change max
  x[0] = 1.f;     // -63.5 -> -64 (half to even)
  x[17] = -0.5f;  // 31.75 -> 32
  BlockQ8_K b;
  quantize_row_q8_K(x.data(), &b, 256);
  EXPECT_FLOAT_EQ(b.d, 1.f / -63.5f);
  EXPECT_EQ(b.qs[3], -127);
  EXPECT_EQ(b.qs[5], 127);
  EXPECT_EQ(b.qs[0], -64);
  EXPECT_EQ(b.qs[17], 32);
  EXPECT_EQ(b.bsums[0], -127 + 127 - 64);
  EXPECT_EQ(b.bsums[1], 32);
  for (int g = 2; g < 16; ++g) EXPECT_EQ(b.bsums[g], 0);
  // A negative max gives a positive iscale; the first max still maps to -127.
  std::vector<float> y(256, 0.f);
  y[10] = -4.f;
  y[11] = 4.f;                  // later tie: maps to +127
  y[12] = 1.f / 31.75f * 0.5f;  // exactly 0.5 after scaling -> 0
  quantize_row_q8_K(y.data(), &b, 256);
  EXPECT_FLOAT_EQ(b.d, 1.f / 31.75f);
  EXPECT_EQ(b.qs[10], -127);
  EXPECT_EQ(b.qs[11], 127);
  EXPECT_EQ(b.qs[12], 0);
}

// quantize_act_q8 of x on one ISA level (s and qsum kept unless `bare`).
struct QuantizedAct {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};
QuantizedAct quantize_on(Isa isa, const std::vector<float>& x, bool bare = false) {
  const auto n = static_cast<int64_t>(x.size());
  QuantizedAct r{std::vector<int8_t>(n), std::vector<float>(n / 32), std::vector<float>(n / 32),
                 std::vector<int32_t>(n / 32, -1)};
  IsaGuard g(isa);
  quantize_act_q8(x.data(), r.q.data(), r.d.data(), bare ? nullptr : r.s.data(), n,
                  bare ? nullptr : r.sum.data());
  return r;
}

bool avx512_quantizer_runs() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
}

TEST(QuantizeAct, SplitLayoutScalarAndAvx2Identical) {
  if (!cpu_features().avx2) GTEST_SKIP() << "no AVX2";
  const int64_t n = 32 * 40;
  auto x = random_acts(n, 7);
  x[64] = 0.f;  // keep one all-zero block
  for (int j = 64; j < 96; ++j) x[j] = 0.f;
  // Scales at the ends of f16's range: subnormal d (amax < 127 * 2^-14),
  // d below f16's smallest subnormal, d that overflows to infinity (amax > 127 * 65504), and blocks
  // whose d * sum(q) over- or underflows.
  const float amax_of_block[] = {1e-3f, 1e-6f, 3e-8f, 8.4e6f, 1e9f, 3e5f, 2e-5f};
  for (int k = 0; k < 7; ++k) {
    for (int j = 0; j < 32; ++j) {
      x[(4 + k) * 32 + j] = amax_of_block[k] * (j % 3 == 0 ? 1.f : 0.3f + 0.01f * j);
    }
  }
  const QuantizedAct a = quantize_on(Isa::kScalar, x), b = quantize_on(Isa::kAvx2, x);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.d, b.d);
  EXPECT_EQ(a.s, b.s);
  EXPECT_EQ(a.sum, b.sum);
  // The AVX-512 path (16 blocks at a time: blocks 0-31 here, 32-39 on the
  // AVX2 code) gives the same bits.
  if (avx512_quantizer_runs()) {
    const QuantizedAct c = quantize_on(Isa::kAvx512, x);
    EXPECT_EQ(a.q, c.q);
    EXPECT_EQ(a.d, c.d);
    EXPECT_EQ(a.s, c.s);
    EXPECT_EQ(a.sum, c.sum);
    std::printf("[ paths    ] activation quantization: avx512 matched scalar bit for bit\n");
  } else {
    std::printf("[ skipped  ] activation quantization avx512: CPU lacks AVX-512 F/BW/VL/DQ\n");
  }
  const std::vector<int8_t>& q0 = a.q;
  const std::vector<float>& d0 = a.d;
  const std::vector<float>& s0 = a.s;
  const std::vector<int32_t>& sum0 = a.sum;
  EXPECT_TRUE(std::isinf(d0[4 + 4])) << "block 8's d overflows f16";
  EXPECT_GT(d0[4], 0.f);
  EXPECT_LT(d0[4], 6.2e-5f) << "block 4's d is an f16 subnormal";
  EXPECT_EQ(d0[4 + 1], 0.f) << "block 5's d underflows f16";
  for (int64_t b = 0; b < n / 32; ++b) {
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += q0[b * 32 + j];
    ASSERT_EQ(sum0[b], sum) << "block " << b;
  }
  // And the split layout agrees with the ggml block layout.
  std::vector<BlockQ8_1> blocks(n / 32);
  quantize_row_q8_1(x.data(), blocks.data(), n);
  for (int64_t b = 0; b < n / 32; ++b) {
    EXPECT_EQ(d0[b], f16_to_f32(blocks[b].d));
    EXPECT_EQ(s0[b], f16_to_f32(blocks[b].s));
    EXPECT_EQ(0, std::memcmp(blocks[b].qs, q0.data() + b * 32, 32));
  }
}

// The AVX-512 activation quantizer against the AVX2 one on many random rows
// (groups of 16 blocks and remainders) and on a group holding a NaN (which
// falls back to the AVX2 code, so that the bits stay the AVX2 code's).
TEST(QuantizeAct, Avx512SixteenBlocksMatchAvx2) {
  if (!avx512_quantizer_runs()) {
    GTEST_SKIP() << "CPU lacks AVX-512 F/BW/VL/DQ: the AVX-512 activation quantizer does not run";
  }
  for (int64_t blocks : {1, 15, 16, 17, 18, 48, 83}) {
    auto x = random_acts(32 * blocks, static_cast<uint32_t>(blocks));
    if (blocks == 48) x[32 * 20 + 5] = std::nanf("");  // the second group holds a NaN
    if (blocks == 83) x[32 * 3 + 7] = std::numeric_limits<float>::infinity();
    const QuantizedAct a = quantize_on(Isa::kAvx2, x), b = quantize_on(Isa::kAvx512, x);
    const size_t fb = sizeof(float) * static_cast<size_t>(blocks);
    EXPECT_EQ(a.q, b.q) << blocks << " blocks";
    EXPECT_EQ(0, std::memcmp(a.d.data(), b.d.data(), fb)) << blocks;
    EXPECT_EQ(0, std::memcmp(a.s.data(), b.s.data(), fb)) << blocks;
    EXPECT_EQ(a.sum, b.sum) << blocks << " blocks";
    // Without s and qsum (Q8_0 activations).
    const QuantizedAct c = quantize_on(Isa::kAvx512, x, /*bare=*/true);
    EXPECT_EQ(0, std::memcmp(a.d.data(), c.d.data(), fb)) << blocks;
    EXPECT_EQ(a.q, c.q) << blocks << " blocks";
  }
}

// quantize_row_q8_K's AVX2 path against the scalar reference, bit for bit
// (d, every q and every bsum), on random rows with outliers, a zero block,
// blocks whose largest |x| repeats with either sign (the first one wins), a
// block holding NaNs and one holding an infinity (both handled like the
// scalar code: NaNs are skipped, a non-finite max goes to the scalar code).
TEST(QuantizeAct, Q8_KScalarAndAvx2Identical) {
  if (!cpu_features().avx2) GTEST_SKIP() << "no AVX2";
  for (int64_t nb : {1, 2, 3, 7}) {
    const int64_t n = 256 * nb;
    auto x = random_acts(n, static_cast<uint32_t>(40 + nb));
    if (nb >= 2) std::fill(x.begin() + 256, x.begin() + 512, 0.f);
    if (nb >= 3) {
      x[512 + 9] = 5.f;  // tie of |x| = 5: the first one (negative here) wins
      x[512 + 3] = -5.f;
      x[512 + 200] = 5.f;
    }
    if (nb >= 7) {
      x[768 + 17] = std::nanf("");
      x[768 + 100] = -std::nanf("");
      x[1024 + 50] = std::numeric_limits<float>::infinity();
      for (int j = 0; j < 256; ++j) x[1280 + j] = 1e-42f * static_cast<float>(j - 128);
    }
    std::vector<BlockQ8_K> a(nb), b(nb);
    {
      IsaGuard g(Isa::kScalar);
      quantize_row_q8_K(x.data(), a.data(), n);
    }
    {
      IsaGuard g(Isa::kAvx2);
      quantize_row_q8_K(x.data(), b.data(), n);
    }
    for (int64_t k = 0; k < nb; ++k) {
      SCOPED_TRACE(testing::Message() << "nb " << nb << " block " << k);
      EXPECT_EQ(std::bit_cast<uint32_t>(a[k].d), std::bit_cast<uint32_t>(b[k].d));
      EXPECT_EQ(0, std::memcmp(a[k].qs, b[k].qs, sizeof(a[k].qs)));
      EXPECT_EQ(0, std::memcmp(a[k].bsums, b[k].bsums, sizeof(a[k].bsums)));
    }
  }
}

// ---- Quantized path vs a float64 reference. ----

// Reference: dequantize the weights and the activations (quantized as the
// kernel does), dot in double. The kernel is exact per block in integers, so
// its error is float rounding of the per-block scale products and of the
// running sum (<= (n_blocks + 3) * 2^-24 relative to sum |term|), plus, for
// Q4_1/Q5_1, the f16 rounding of the q8_1 `s` field (<= 2^-11 * |m * d_y *
// sum(q_y)| per block). The bound below is twice that.
TEST(Matmul, QuantizedMatchesFloat64Reference) {
  const int64_t n_in = 512, n_out = 7, m = 3;
  for (GgmlType type : kAllTypes) {
    SCOPED_TRACE(ggml_type_traits(static_cast<uint32_t>(type))->name);
    const auto w = random_weights(type, n_in, n_out, 11);
    const auto x = random_acts(m * n_in, 12);
    const size_t row = ggml_row_bytes(type, n_in);
    for (Isa isa : {Isa::kScalar, Isa::kAvx2}) {
      const auto y = run_matmul(type, w, n_in, n_out, x, m, isa, 0);
      for (int64_t r = 0; r < m; ++r) {
        // Activation as the kernel sees it.
        std::vector<double> xa(n_in);
        std::vector<double> s_err(n_in / 32, 0.0);  // per 32-block q8_1 s rounding
        const float* xr = x.data() + r * n_in;
        if (type == GgmlType::kF32) {
          for (int64_t i = 0; i < n_in; ++i) xa[i] = xr[i];
        } else if (type == GgmlType::kF16) {
          for (int64_t i = 0; i < n_in; ++i) xa[i] = f16_to_f32(f32_to_f16(xr[i]));
        } else if (type == GgmlType::kQ4_K || type == GgmlType::kQ5_K || type == GgmlType::kQ6_K) {
          std::vector<BlockQ8_K> q(n_in / 256);
          quantize_row_q8_K(xr, q.data(), n_in);
          for (int64_t i = 0; i < n_in; ++i) {
            const BlockQ8_K& qb = q[i / 256];
            xa[i] = static_cast<double>(qb.d) * qb.qs[i % 256];
          }
        } else {
          std::vector<BlockQ8_1> q(n_in / 32);
          quantize_row_q8_1(xr, q.data(), n_in);
          for (int64_t i = 0; i < n_in; ++i) {
            const BlockQ8_1& qb = q[i / 32];
            xa[i] = f16_to_f32(qb.d) * static_cast<double>(qb.qs[i % 32]);
          }
          for (int64_t b = 0; b < n_in / 32; ++b) {
            double sum_q = 0;
            for (int j = 0; j < 32; ++j) sum_q += q[b].qs[j];
            s_err[b] = std::fabs(f16_to_f32(q[b].d) * sum_q) * std::ldexp(1.0, -11);
          }
        }
        for (int64_t c = 0; c < n_out; ++c) {
          const auto wd = dequant(type, w.data() + c * row, n_in);
          double ref = 0, mag = 0, extra = 0;
          for (int64_t i = 0; i < n_in; ++i) {
            ref += wd[i] * xa[i];
            mag += std::fabs(wd[i] * xa[i]);
          }
          if (type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1) {
            for (int64_t b = 0; b < n_in / 32; ++b) {
              const auto* blk = w.data() + c * row + b * (row / (n_in / 32));
              uint16_t mh;
              std::memcpy(&mh, blk + 2, 2);  // m follows d in both block types
              extra += std::fabs(f16_to_f32(mh)) * s_err[b] * 1.01;
            }
            mag *= 4;  // m * s is a separate, possibly cancelling, term
          }
          const int64_t n_blocks = n_in / 32;
          const double tol = 2 * ((n_blocks + 3) * std::ldexp(mag, -24) + extra) + 1e-30;
          EXPECT_NEAR(y[r * n_out + c], ref, tol)
              << "isa " << isa_name(isa) << " r " << r << " c " << c;
        }
      }
    }
  }
}

// ---- Every SIMD path against the scalar reference, odd shapes, threads. ----

TEST(Matmul, Avx2MatchesScalarAndThreadsAreDeterministic) {
  if (!cpu_features().avx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(3);
  const int64_t ms[] = {1, 2, 3, 4, 5, 7, 8, 13, 37};
  for (GgmlType type : kAllTypes) {
    const int block = ggml_type_traits(static_cast<uint32_t>(type))->block_elems;
    const bool k_quant = block == 256;
    for (int64_t m : ms) {
      const int64_t n_in =
          k_quant ? 256 * (1 + rng() % 3)
                  : (block == 1 ? 8 * (1 + rng() % 40) + rng() % 8 : 32 * (1 + rng() % 20));
      const int64_t n_out = 1 + rng() % 45;  // often not a multiple of the tile
      SCOPED_TRACE(std::string(ggml_type_traits(static_cast<uint32_t>(type))->name) +
                   " m=" + std::to_string(m) + " n_in=" + std::to_string(n_in) +
                   " n_out=" + std::to_string(n_out));
      const auto w = random_weights(type, n_in, n_out, static_cast<uint32_t>(rng()));
      const auto x = random_acts(m * n_in, static_cast<uint32_t>(rng()));
      const auto ref = run_matmul(type, w, n_in, n_out, x, m, Isa::kScalar, 0);
      const auto simd = run_matmul(type, w, n_in, n_out, x, m, Isa::kAvx2, 0);
      const size_t row = ggml_row_bytes(type, n_in);
      for (int64_t c = 0; c < n_out; ++c) {
        const auto wd = dequant(type, w.data() + c * row, n_in);
        for (int64_t r = 0; r < m; ++r) {
          // Same integer block sums; only the float summation order differs.
          double mag = 0;
          for (int64_t i = 0; i < n_in; ++i) mag += std::fabs(wd[i] * x[r * n_in + i]);
          const int64_t n_blocks = n_in / block;
          const double tol = 8 * (n_blocks + 8) * std::ldexp(mag, -24);
          ASSERT_NEAR(simd[r * n_out + c], ref[r * n_out + c], tol) << "r " << r << " c " << c;
        }
      }
      if (m != 1 && m != 5 && m != 37) continue;  // thread sweeps on a few shapes only
      for (int threads : {1, 2, 3, 8}) {
        const Isa isa = threads % 2 ? Isa::kAvx2 : Isa::kScalar;
        const auto y = run_matmul(type, w, n_in, n_out, x, m, isa, threads);
        const auto& single = isa == Isa::kAvx2 ? simd : ref;
        ASSERT_EQ(first_bit_mismatch(y.data(), single.data(), std::ssize(y)), -1)
            << "threads " << threads << " isa " << isa_name(isa);
      }
    }
  }
}

// Kernels that promise the scalar reference's exact bits (integer block sums,
// then the scalar float update in the same order): every shape, row count and
// thread count gives memcmp-equal output. `isa` names the path under test.
void expect_bits_equal_scalar(GgmlType type, Isa isa, uint32_t seed) {
  std::mt19937 rng(seed);
  const int block = ggml_type_traits(static_cast<uint32_t>(type))->block_elems;
  for (int64_t m : {1, 2, 3, 4, 5, 7, 13, 16, 17, 37, 64, 70}) {
    const int64_t n_in = block * (block == 256 ? 1 + rng() % 4 : 1 + rng() % 30);
    const int64_t n_out = 1 + rng() % 53;
    SCOPED_TRACE(std::string(ggml_type_traits(static_cast<uint32_t>(type))->name) + " isa " +
                 isa_name(isa) + " m=" + std::to_string(m) + " n_in=" + std::to_string(n_in) +
                 " n_out=" + std::to_string(n_out));
    const auto w = random_weights(type, n_in, n_out, static_cast<uint32_t>(rng()));
    const auto x = random_acts(m * n_in, static_cast<uint32_t>(rng()));
    const auto ref = run_matmul(type, w, n_in, n_out, x, m, Isa::kScalar, 0);
    for (int threads : {0, 3}) {
      const auto y = run_matmul(type, w, n_in, n_out, x, m, isa, threads);
      const int64_t bad = first_bit_mismatch(y.data(), ref.data(), std::ssize(y));
      ASSERT_EQ(bad, -1) << "threads " << threads << " row " << bad / n_out << " col "
                         << bad % n_out << ": " << y[std::max<int64_t>(bad, 0)] << " vs "
                         << ref[std::max<int64_t>(bad, 0)];
    }
  }
}

// True when matmul() can run at `isa` here (the CPU has it and KVSTACK_ISA
// does not cap it lower).
bool isa_reachable(Isa isa) {
  IsaGuard guard(isa);
  return best_isa() == isa;
}

// The path a test exercises must be the one matmul() runs (no silent fallback
// to another kernel): checked through the dispatcher's own report, and logged.
void expect_path(GgmlType type, Isa isa, const char* want) {
  IsaGuard guard(isa);
  const char* got = matmul_kernel_name(type);
  ASSERT_NE(got, nullptr);
  ASSERT_STREQ(got, want) << ggml_type_name(type) << " under " << isa_name(isa);
  std::printf("[ path     ] %s: %s\n", ggml_type_name(type), got);
}

TEST(Matmul, KQuantAvx2BitIdenticalToScalar) {
  if (!isa_reachable(Isa::kAvx2)) GTEST_SKIP() << "no AVX2/FMA (or KVSTACK_ISA=scalar)";
  for (GgmlType type : {GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    expect_path(type, Isa::kAvx2, "avx2");
    expect_bits_equal_scalar(type, Isa::kAvx2, 90 + static_cast<uint32_t>(type));
  }
}

// Which AVX-512 feature this CPU lacks for the VNNI kernels (or that
// KVSTACK_ISA caps them off), or nullptr.
const char* missing_avx512_vnni() {
  if (!isa_reachable(Isa::kAvx512)) return "AVX-512 F/BW/VL, or KVSTACK_ISA caps below avx512";
  const CpuFeatures& f = cpu_features();
  if (!f.avx512f) return "AVX-512F";
  if (!f.avx512bw) return "AVX-512BW";
  if (!f.avx512vl) return "AVX-512VL";
  if (!f.avx512dq) return "AVX-512DQ";
  if (!f.avx512vnni) return "AVX-512 VNNI";
  return nullptr;
}

GgmlType kAvx512Types[] = {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                           GgmlType::kQ8_0, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

// Every AVX-512 type runs VNNI kernels for decode rows (1..3) and prefill.
const char* avx512_path(GgmlType) {
  return "avx512-vnni";
}

TEST(Matmul, Avx512BitIdenticalToScalar) {
  if (const char* miss = missing_avx512_vnni()) GTEST_SKIP() << "CPU lacks " << miss;
  for (GgmlType type : kAvx512Types) {
    expect_path(type, Isa::kAvx512, avx512_path(type));
    expect_bits_equal_scalar(type, Isa::kAvx512, 120 + static_cast<uint32_t>(type));
  }
}

// One random case of `type` (n_in, n_out, m rows, seeds from *seed): the
// output of run(w, x, threads) for 0 and 3 threads must equal the scalar
// reference's bit for bit. run is the path under test (row-major AVX-512,
// packed panels).
template <class Run>
void expect_case_bits_scalar(GgmlType type, int64_t n_in, int64_t n_out, int64_t m, uint32_t* seed,
                             const Run& run) {
  SCOPED_TRACE(std::string(ggml_type_traits(static_cast<uint32_t>(type))->name) +
               " m=" + std::to_string(m) + " n_out=" + std::to_string(n_out) +
               " n_in=" + std::to_string(n_in));
  const auto w = random_weights(type, n_in, n_out, ++*seed);
  const auto x = random_acts(m * n_in, ++*seed);
  const auto ref = run_matmul(type, w, n_in, n_out, x, m, Isa::kScalar, 0);
  for (int threads : {0, 3}) {
    const std::vector<float> y = run(w, x, threads);
    ASSERT_EQ(first_bit_mismatch(y.data(), ref.data(), std::ssize(y)), -1) << "threads " << threads;
  }
}

// The row-major AVX-512 path of expect_case_bits_scalar.
auto avx512_rows(GgmlType type, int64_t n_in, int64_t n_out, int64_t m) {
  return [=](const std::vector<uint8_t>& w, const std::vector<float>& x, int threads) {
    return run_matmul(type, w, n_in, n_out, x, m, Isa::kAvx512, threads);
  };
}

// The one-row (decode, m < 4) AVX-512 kernels compile full 16-column groups
// apart from a range's partial last group: n_out = 16, 47 (two full groups
// and a tail of 15) and 64, each split over 0 and 3 threads, rows 1..3.
TEST(Matmul, Avx512DecodeFullAndPartialGroupsBitIdentical) {
  if (const char* miss = missing_avx512_vnni()) GTEST_SKIP() << "CPU lacks " << miss;
  uint32_t seed = 300;
  for (GgmlType type :
       {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0}) {
    for (int64_t m : {1, 2, 3}) {
      for (int64_t n_out : {16, 47, 64}) {
        const int64_t n_in = 32 * 7;
        expect_case_bits_scalar(type, n_in, n_out, m, &seed, avx512_rows(type, n_in, n_out, m));
      }
    }
  }
}

// The panel path (4 or more rows) builds full 16-column groups apart from
// a partial one (headers from scalar loads, Q4_1 four blocks at a time with
// the rest one by one) and runs two or three panels at once where the range
// has them: n_out = 16 (one panel), 48 (three at once), 64 (two pairs) and
// 71 (a pair, then three with a partial group last), n_in of 4, 7 and 18
// blocks, rows 4, 16 and 21, split over 0 and 3 threads, and 300 rows (two
// row blocks); every output bit equals the scalar reference's.
TEST(Matmul, Avx512PanelFullAndPartialGroupsBitIdentical) {
  if (const char* miss = missing_avx512_vnni()) GTEST_SKIP() << "CPU lacks " << miss;
  uint32_t seed = 700;
  for (GgmlType type :
       {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0}) {
    for (int64_t m : {4, 16, 21}) {
      for (int64_t n_out : {16, 48, 64, 71}) {
        for (int64_t n_in : {32 * 4, 32 * 7, 32 * 18}) {
          expect_case_bits_scalar(type, n_in, n_out, m, &seed, avx512_rows(type, n_in, n_out, m));
        }
      }
    }
    // 300 rows: past the first 256-row block, whose panels are rebuilt.
    SCOPED_TRACE(std::string(ggml_type_traits(static_cast<uint32_t>(type))->name) + " m=300");
    const int64_t m = 300, n_in = 32 * 7, n_out = 48;
    const auto w = random_weights(type, n_in, n_out, ++seed);
    const auto x = random_acts(m * n_in, ++seed);
    const auto ref = run_matmul(type, w, n_in, n_out, x, m, Isa::kScalar, 0);
    const auto y = run_matmul(type, w, n_in, n_out, x, m, Isa::kAvx512, 0);
    ASSERT_EQ(first_bit_mismatch(y.data(), ref.data(), std::ssize(y)), -1);
  }
}

// ---- kPanels16: weights packed in place for the AVX-512 VNNI kernels. ----

// y = x . W^T through a kPanels16 copy of w (packed in place), with n_threads
// workers (0: the calling thread alone).
std::vector<float> run_packed(GgmlType type, const std::vector<uint8_t>& w, int64_t n_in,
                              int64_t n_out, const std::vector<float>& x, int64_t m,
                              int n_threads) {
  std::vector<uint8_t> bytes = w;
  const WeightView rows{type, bytes.data(), n_in, n_out};
  EXPECT_TRUE(weight_panels_supported(rows));
  const WeightView packed = pack_weight_panels(rows, bytes.data());
  EXPECT_EQ(packed.layout, WeightLayout::kPanels16);
  EXPECT_STREQ(matmul_kernel_name(packed), "avx512-vnni-panels");
  std::unique_ptr<ThreadPool> pool;
  if (n_threads > 0) pool = std::make_unique<ThreadPool>(n_threads);
  std::vector<float> y(m * n_out, std::nanf(""));
  matmul(packed, x.data(), m, y.data(), pool.get());
  return y;
}

// Packing keeps a matrix's size and moves every byte: the packed bytes differ
// from the rows' yet hold the same multiset of quant and scale bytes (Q8_0's
// quants offset by 128), so nothing is lost or duplicated.
TEST(Matmul, PanelsPackInPlaceKeepsEveryByte) {
  if (const char* miss = missing_avx512_vnni())
    GTEST_SKIP() << "kPanels16 not run: CPU lacks " << miss;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    SCOPED_TRACE(ggml_type_traits(static_cast<uint32_t>(type))->name);
    const int64_t n_in = 32 * 5, n_out = 32;
    const auto w = random_weights(type, n_in, n_out, 901);
    std::vector<uint8_t> bytes = w;
    pack_weight_panels(WeightView{type, bytes.data(), n_in, n_out}, bytes.data());
    ASSERT_EQ(bytes.size(), w.size());
    EXPECT_NE(bytes, w);
    std::vector<uint8_t> want = w;
    if (type == GgmlType::kQ8_0) {  // each 34-byte block: d (2 bytes), then 32 quants
      for (size_t i = 0; i < want.size(); ++i) {
        if (i % sizeof(BlockQ8_0) >= 2) want[i] ^= 0x80;
      }
    }
    // weight_row gives back every row as it was stored.
    const WeightView packed{type, bytes.data(), n_in, n_out, WeightLayout::kPanels16};
    const size_t row_bytes = ggml_row_bytes(type, n_in);
    std::vector<uint8_t> row(row_bytes);
    for (int64_t r = 0; r < n_out; ++r) {
      weight_row(packed, r, row.data());
      ASSERT_EQ(std::memcmp(row.data(), w.data() + r * row_bytes, row_bytes), 0) << "row " << r;
    }
    std::sort(want.begin(), want.end());
    std::sort(bytes.begin(), bytes.end());
    EXPECT_EQ(bytes, want);
  }
}

// Every output bit of the packed kernels equals the scalar reference's on
// the rows: decode rows 1..3 (four groups at a time, then single groups) and
// panel rows (pairs and triples of groups, 4-row and single-row tails, a
// second 256-row block), n_out of 1, 3, 4, 5 and 7 groups, n_in of 1, 7 and
// 18 blocks, 0 and 3 threads; and a packed matrix fused with row-major ones.
TEST(Matmul, PanelsBitIdenticalToScalar) {
  if (const char* miss = missing_avx512_vnni())
    GTEST_SKIP() << "kPanels16 not run: CPU lacks " << miss;
  uint32_t seed = 1100;
  int cases = 0;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    for (int64_t m : {1, 2, 3, 4, 5, 16, 23, 300}) {
      for (int64_t n_out : {16, 48, 64, 80, 112}) {
        for (int64_t n_in : {32, 32 * 7, 32 * 18}) {
          if (m == 300 && (n_in != 32 * 7 || n_out != 48)) continue;
          expect_case_bits_scalar(
              type, n_in, n_out, m, &seed,
              [&](const std::vector<uint8_t>& w, const std::vector<float>& x, int threads) {
                ++cases;
                return run_packed(type, w, n_in, n_out, x, m, threads);
              });
          if (HasFatalFailure()) return;
        }
      }
    }
  }
  std::printf(
      "[ paths    ] avx512-vnni-panels matched the scalar reference bit for bit in %d cases\n",
      cases);
  // Fused with row-major parts of the same activation format (Q4_1 packed,
  // Q5_1 rows, Q4_1 packed), as matmul_multi runs Q/K/V.
  const int64_t n_in = 576;
  std::vector<uint8_t> a = random_weights(GgmlType::kQ4_1, n_in, 64, 1200);
  std::vector<uint8_t> b = random_weights(GgmlType::kQ5_1, n_in, 43, 1201);
  std::vector<uint8_t> c = random_weights(GgmlType::kQ4_1, n_in, 192, 1202);
  const std::vector<uint8_t> a_rows = a, c_rows = c;
  const WeightView views[3] = {
      pack_weight_panels(WeightView{GgmlType::kQ4_1, a.data(), n_in, 64}, a.data()),
      WeightView{GgmlType::kQ5_1, b.data(), n_in, 43},
      pack_weight_panels(WeightView{GgmlType::kQ4_1, c.data(), n_in, 192}, c.data())};
  for (int64_t m : {1, 16}) {
    const auto x = random_acts(m * n_in, 1203 + static_cast<uint32_t>(m));
    std::vector<float> ya(m * 64), yb(m * 43), yc(m * 192);
    float* const ys[3] = {ya.data(), yb.data(), yc.data()};
    ThreadPool pool(2);
    matmul_multi(views, x.data(), m, ys, &pool);
    const auto ra = run_matmul(GgmlType::kQ4_1, a_rows, n_in, 64, x, m, Isa::kScalar, 0);
    const auto rb = run_matmul(GgmlType::kQ5_1, b, n_in, 43, x, m, Isa::kScalar, 0);
    const auto rc = run_matmul(GgmlType::kQ4_1, c_rows, n_in, 192, x, m, Isa::kScalar, 0);
    EXPECT_EQ(first_bit_mismatch(ya.data(), ra.data(), std::ssize(ra)), -1) << "m " << m;
    EXPECT_EQ(first_bit_mismatch(yb.data(), rb.data(), std::ssize(rb)), -1) << "m " << m;
    EXPECT_EQ(first_bit_mismatch(yc.data(), rc.data(), std::ssize(rc)), -1) << "m " << m;
  }
}

// What packs: Q4_0, Q4_1 and Q8_0 with whole 16-column groups, where the
// VNNI kernels run; never other types, partial groups, packed views, or
// under a cap below AVX-512 (the row kernels run then).
TEST(Matmul, PanelsSupportedOnlyWhereTheyRun) {
  uint8_t dummy = 0;
  const WeightView q41{GgmlType::kQ4_1, &dummy, 64, 32};
  EXPECT_FALSE(weight_panels_supported(WeightView{GgmlType::kQ5_1, &dummy, 64, 32}));
  EXPECT_FALSE(weight_panels_supported(WeightView{GgmlType::kQ4_K, &dummy, 256, 32}));
  EXPECT_FALSE(weight_panels_supported(WeightView{GgmlType::kQ4_1, &dummy, 64, 40}));
  {
    IsaGuard guard(Isa::kAvx2);
    EXPECT_FALSE(weight_panels_supported(q41));
  }
  if (const char* miss = missing_avx512_vnni()) {
    EXPECT_FALSE(weight_panels_supported(q41));
    GTEST_SKIP() << "kPanels16 not run: CPU lacks " << miss;
  }
  EXPECT_TRUE(weight_panels_supported(q41));
  WeightView packed = q41;
  packed.layout = WeightLayout::kPanels16;
  EXPECT_FALSE(weight_panels_supported(packed));
  // The summary names each (type, path) once: packed Q4_1 and row Q4_1 apart.
  const WeightView* views[] = {&packed, &q41, &packed};
  EXPECT_EQ(matmul_kernel_summary(std::span<const WeightView* const>(views)),
            "q4_1 avx512-vnni-panels, q4_1 avx512-vnni");
}

// KVSTACK_ISA-style caps change what runs, and the report follows them.
TEST(Matmul, KernelNameFollowsDispatch) {
  for (GgmlType t : kAllTypes) expect_path(t, Isa::kScalar, "scalar");
  if (isa_reachable(Isa::kAvx2)) {
    for (GgmlType t : kAllTypes) expect_path(t, Isa::kAvx2, "avx2");
  }
  if (missing_avx512_vnni() == nullptr) {
    for (GgmlType t : kAvx512Types) expect_path(t, Isa::kAvx512, avx512_path(t));
  }
  EXPECT_EQ(matmul_kernel_name(GgmlType::kQ2_K), nullptr);
  IsaGuard guard(Isa::kScalar);
  const GgmlType types[] = {GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kQ4_1, GgmlType::kQ2_K};
  EXPECT_EQ(matmul_kernel_summary(types), "q4_1 scalar, q8_0 scalar, q2_k none");
}

TEST(Matmul, LargeShapesThreadedMatchSingleThread) {
  // Enough rows that the work is split into many chunks across threads.
  const int64_t n_in = 576, n_out = 1000, m = 9;
  for (GgmlType type : {GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    const auto w = random_weights(type, n_in, n_out, 5);
    const auto x = random_acts(m * n_in, 6);
    const auto one = run_matmul(type, w, n_in, n_out, x, m, Isa::kAvx2, 0);
    for (int threads = 2; threads <= 8; ++threads) {
      const auto y = run_matmul(type, w, n_in, n_out, x, m, Isa::kAvx2, threads);
      ASSERT_EQ(first_bit_mismatch(y.data(), one.data(), std::ssize(y)), -1) << threads;
    }
  }
}

// matmul_multi must give each output exactly what a separate matmul() call
// gives, for decode and prefill shapes, mixed weight types sharing one
// activation format, and any thread count (the work list spans the outputs).
TEST(Matmul, MultiMatchesSeparateCalls) {
  const int64_t n_in = 576;
  const struct {
    GgmlType type;
    int64_t n_out;
  } parts[] = {{GgmlType::kQ4_1, 576}, {GgmlType::kQ5_1, 43}, {GgmlType::kQ4_1, 190}};
  std::vector<std::vector<uint8_t>> w;
  std::vector<WeightView> views;
  for (size_t i = 0; i < std::size(parts); ++i) {
    w.push_back(random_weights(parts[i].type, n_in, parts[i].n_out, 40 + i));
  }
  for (size_t i = 0; i < std::size(parts); ++i) {
    views.push_back(WeightView{parts[i].type, w[i].data(), n_in, parts[i].n_out});
  }
  for (int64_t m : {1, 3, 70}) {
    const auto x = random_acts(m * n_in, 50 + m);
    for (Isa isa : {Isa::kScalar, Isa::kAvx2}) {
      std::vector<std::vector<float>> want;
      for (size_t i = 0; i < std::size(parts); ++i) {
        want.push_back(run_matmul(parts[i].type, w[i], n_in, parts[i].n_out, x, m, isa, 0));
      }
      for (int threads : {0, 2, 3}) {
        IsaGuard guard(isa);
        std::unique_ptr<ThreadPool> pool;
        if (threads > 0) pool = std::make_unique<ThreadPool>(threads);
        std::vector<std::vector<float>> got;
        std::vector<float*> ys;
        for (const auto& p : parts) got.emplace_back(m * p.n_out, std::nanf(""));
        ys.reserve(got.size());
        for (auto& g : got) ys.push_back(g.data());
        matmul_multi(views, x.data(), m, ys, pool.get());
        for (size_t i = 0; i < std::size(parts); ++i) {
          ASSERT_EQ(first_bit_mismatch(got[i].data(), want[i].data(), std::ssize(want[i])), -1)
              << "part " << i << " m " << m << " threads " << threads << " isa " << isa_name(isa);
        }
      }
    }
  }
}

// ---- Batch invariance: a row's output bits do not depend on the batch. ----

// The server batches tokens of unrelated sequences into one call, so each
// output row must be bit-identical to computing that row alone (m = 1, the
// decode kernel), wherever it sits in a batch of any size (single-row,
// multi-row tiles and row blocks of the prefill kernel) and however the
// columns are split across threads.
TEST(Matmul, RowBitsIndependentOfBatchAndThreads) {
  std::mt19937 rng(21);
  for (GgmlType type : kAllTypes) {
    const int block = ggml_type_traits(static_cast<uint32_t>(type))->block_elems;
    const int64_t n_in = block == 256 ? 512 : (block == 1 ? 8 * 37 + 5 : 576);
    const int64_t n_out = 203;  // not a multiple of any column tile or grain
    const auto w = random_weights(type, n_in, n_out, 60 + static_cast<uint32_t>(type));
    const auto target = random_acts(n_in, 61);
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (isa == Isa::kAvx2 && !cpu_features().avx2) continue;
      if (isa == Isa::kAvx512 && missing_avx512_vnni() != nullptr) continue;
      SCOPED_TRACE(std::string(ggml_type_traits(static_cast<uint32_t>(type))->name) + " isa " +
                   isa_name(isa));
      const auto alone = run_matmul(type, w, n_in, n_out, target, 1, isa, 0);
      for (int64_t m : {2, 7, 64, 70}) {
        auto x = random_acts(m * n_in, static_cast<uint32_t>(rng()));
        for (int64_t pos : {int64_t{0}, m / 2, m - 1}) {
          std::copy(target.begin(), target.end(), x.begin() + pos * n_in);
          // Thread sweeps at one position (the column split is the same for all rows).
          for (int threads : {0, 2, 3}) {
            if ((threads == 0) == (pos == m / 2 && pos != 0)) continue;
            const auto y = run_matmul(type, w, n_in, n_out, x, m, isa, threads);
            ASSERT_EQ(first_bit_mismatch(y.data() + pos * n_out, alone.data(), n_out), -1)
                << "m " << m << " pos " << pos << " threads " << threads;
          }
        }
      }
    }
  }
}

// matmul_multi's outputs are batch invariant too (each equals a matmul()).
TEST(Matmul, MultiRowBitsIndependentOfBatch) {
  const int64_t n_in = 576;
  const auto wq = random_weights(GgmlType::kQ4_1, n_in, 64, 70);
  const auto wk = random_weights(GgmlType::kQ4_1, n_in, 24, 71);
  const WeightView views[2] = {{GgmlType::kQ4_1, wq.data(), n_in, 64},
                               {GgmlType::kQ4_1, wk.data(), n_in, 24}};
  const auto target = random_acts(n_in, 72);
  ThreadPool pool(2);
  std::vector<float> q1(64), k1(24);
  float* const ys1[2] = {q1.data(), k1.data()};
  matmul_multi(views, target.data(), 1, ys1, &pool);
  const int64_t m = 9, pos = 5;
  auto x = random_acts(m * n_in, 73);
  std::copy(target.begin(), target.end(), x.begin() + pos * n_in);
  std::vector<float> q(m * 64), k(m * 24);
  float* const ys[2] = {q.data(), k.data()};
  matmul_multi(views, x.data(), m, ys, &pool);
  EXPECT_EQ(first_bit_mismatch(q.data() + pos * 64, q1.data(), 64), -1);
  EXPECT_EQ(first_bit_mismatch(k.data() + pos * 24, k1.data(), 24), -1);
}

// ---- ThreadPool::run_shared, the dispatch matmul uses. ----

// Every unit of a shared job runs exactly once, whichever threads take part,
// with run() and run_shared() jobs interleaved (the pool tells them apart by
// generation) and more threads than cores (workers often miss jobs).
TEST(ThreadPoolRunShared, EachUnitOnceInterleavedWithRun) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    std::vector<int> hits(257);
    const int n_jobs = threads > 2 ? 300 : 3000;  // oversubscribed pools spin slowly
    for (int job = 0; job < n_jobs; ++job) {
      std::fill(hits.begin(), hits.end(), 0);
      const int n = 1 + job % 257;
      std::atomic<int> next{0};
      pool.run_shared([&](int t) {
        ASSERT_TRUE(t >= 0 && t < threads);
        for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) ++hits[i];
      });
      // Returned: every claimed unit is finished and visible here.
      for (int i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "job " << job << " unit " << i;
      if (job % 7 == 0) {
        std::atomic<int> calls{0};
        pool.run([&](int) { calls.fetch_add(1); });
        ASSERT_EQ(calls.load(), threads);
      }
    }
  }
}

// Each worker enters a shared job at most once, and only the caller is
// guaranteed to.
TEST(ThreadPoolRunShared, CallerAlwaysRunsWorkersAtMostOnce) {
  ThreadPool pool(4);
  for (int job = 0; job < 500; ++job) {
    std::array<std::atomic<int>, 4> entered{};
    pool.run_shared([&](int t) { entered[t].fetch_add(1); });
    ASSERT_EQ(entered[0].load(), 1);
    for (int t = 1; t < 4; ++t) ASSERT_LE(entered[t].load(), 1);
  }
}

TEST(Matmul, CanFuse) {
  const uint8_t* none = nullptr;
  const WeightView q41{GgmlType::kQ4_1, none, 64, 4}, q51{GgmlType::kQ5_1, none, 64, 4};
  const WeightView q80{GgmlType::kQ8_0, none, 64, 4}, q41_wide{GgmlType::kQ4_1, none, 96, 4};
  EXPECT_TRUE(matmul_can_fuse(q41, q51));
  EXPECT_FALSE(matmul_can_fuse(q41, q80));       // Q8_1 vs Q8_0 activations
  EXPECT_FALSE(matmul_can_fuse(q41, q41_wide));  // different n_in
}

TEST(Matmul, SupportedTypes) {
  for (GgmlType t : kAllTypes) EXPECT_TRUE(matmul_supported(t));
  EXPECT_FALSE(matmul_supported(GgmlType::kQ2_K));
  EXPECT_FALSE(matmul_supported(GgmlType::kBF16));
}

}  // namespace
}  // namespace kvstack

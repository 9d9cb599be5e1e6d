// Quantized KV formats: codec round-trip error bounds on random and
// adversarial data, NaN/Inf/range rejection, fp8 block-scale growth, and the
// layout's byte accounting against the capacity planner for every format.
#include "kv/kv_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/half.h"
#include "kv/capacity.h"
#include "kv/kv_codec_avx512.h"
#include "kv/kv_write.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

template <class T>
T must(Result<T> r) {
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return std::move(*r);
}

// A pool of n_blocks blocks of a layout, 64-byte aligned, filled with junk so
// that stale bytes from "previous owners" are present.
struct Arena {
  explicit Arena(const KvLayout& l, int n_blocks)
      : bytes(static_cast<size_t>(l.block_bytes()) * n_blocks),
        base(static_cast<uint8_t*>(std::aligned_alloc(64, bytes))) {
    std::mt19937 rng(99);
    for (size_t i = 0; i < bytes; ++i) base.get()[i] = static_cast<uint8_t>(rng());
  }
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  size_t bytes;
  std::unique_ptr<uint8_t, Free> base;
};

// Reads back element (pos, head, dim) of K (which = 0) or V of a layer view.
std::vector<float> read_row(const PagedKvLayerView& v, const std::vector<int32_t>& table, int pos,
                            int h, int which) {
  const int64_t b = table[pos / v.block_size];
  const int s = pos % v.block_size;
  const KvDtype t = which == 0 ? v.dtype : v.value_dtype();
  const uint8_t* row =
      which == 0 ? v.k + b * v.block_stride + h * v.head_stride + s * v.slot_stride
                 : v.v + b * v.block_stride + h * v.value_head_stride() + s * v.value_slot_stride();
  const uint8_t* meta = nullptr;
  if (which == 0 && v.k_meta != nullptr) {
    meta = v.k_meta + b * v.block_stride + h * v.k_meta_head_stride + s * v.k_meta_slot_stride;
  } else if (which == 1 && v.v_meta != nullptr) {
    meta = v.v_meta + b * v.block_stride + h * v.v_meta_head_stride + s * v.v_meta_slot_stride;
  }
  std::vector<float> out(v.head_dim);
  kv_decode_row(t, row, meta, v.head_dim, out.data());
  return out;
}

TEST(Fp8, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(static_cast<uint8_t>(c))));
      continue;
    }
    const float x = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(fp8_e4m3_from_f32(x), c) << "code " << c << " value " << x;
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  std::vector<float> finite;
  finite.reserve(0x7f);
  for (int c = 0; c < 0x7f; ++c) finite.push_back(fp8_e4m3_to_f32(static_cast<uint8_t>(c)));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> mag(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(mag(rng)) * (i % 2 ? -1.0f : 1.0f);
    const float got = fp8_e4m3_to_f32(fp8_e4m3_from_f32(x));
    float best = std::numeric_limits<float>::infinity();
    for (float t : finite) best = std::min(best, std::fabs(std::fabs(x) - t));
    EXPECT_EQ(std::fabs(std::fabs(x) - std::fabs(got)), best) << x;
    EXPECT_EQ(std::signbit(got), std::signbit(x)) << x;
  }
  // Ties go to the even mantissa: 1 + 1/16 lies between 1 (m=0) and 1.125 (m=1).
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1.0625f)), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1.1875f)), 1.25f);
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1e9f)), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(-500.0f)), -448.0f);
  EXPECT_EQ(fp8_scale_for(448.0f), 1.0f);
  EXPECT_EQ(fp8_scale_for(449.0f), 2.0f);
  EXPECT_EQ(fp8_scale_for(0.0f), 0.0f);
  EXPECT_EQ(fp8_scale_for(1.0f), std::ldexp(1.0f, -8));  // 1 / 2^-8 = 256 <= 448
}

// Data sets a KV cache meets, plus adversarial ones. Each is [n_rows, d].
struct DataSet {
  const char* name;
  std::vector<float> x;
};

std::vector<DataSet> data_sets(int n_rows, int d) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<DataSet> out;
  auto make = [&](const char* name, auto fn) {
    DataSet s{name, std::vector<float>(static_cast<size_t>(n_rows) * d)};
    for (int r = 0; r < n_rows; ++r) {
      for (int i = 0; i < d; ++i) s.x[r * d + i] = fn(r, i);
    }
    out.push_back(std::move(s));
  };
  make("normal", [&](int, int) { return nd(rng); });
  make("outlier_channels", [&](int, int i) { return (i % 17 == 3 ? 100.0f : 1.0f) * nd(rng); });
  make("constant_rows", [&](int r, int) { return 0.37f * static_cast<float>(r - 3); });
  make("zeros", [&](int, int) { return 0.0f; });
  make("tiny", [&](int, int) { return 1e-6f * nd(rng); });
  make("huge", [&](int, int) { return 1e4f * nd(rng); });  // within f16 metadata range
  make("one_spike", [&](int r, int i) { return i == r % d ? 1e3f : 1e-3f * nd(rng); });
  return out;
}

// Bound on |x - x_hat| for one row: int8 s/2, int4 s_g/2 per group (s from
// the stored metadata, itself checked against the ideal), fp8 half an E4M3
// step (2^-4 relative, or 2^-10 x scale in the subnormal range), plus one
// more subnormal half step for values re-rounded when the block's scale grew.
void check_row(KvDtype t, const float* x, const float* y, const uint8_t* meta, int d,
               const char* what) {
  if (t == KvDtype::kInt8) {
    uint16_t s16;
    std::memcpy(&s16, meta, 2);
    const float s = f16_to_f32(s16);
    float amax = 0;
    for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
    EXPECT_LE(s, amax / 127.0f * (1.0f + 1.0f / 1024.0f) + 6e-8f) << what;
    for (int i = 0; i < d; ++i) {
      EXPECT_LE(std::fabs(x[i] - y[i]), s * 0.5f * (1.0f + 1e-6f) + 1e-30f) << what << " " << i;
    }
  } else if (t == KvDtype::kInt4) {
    for (int g = 0; g < d / 32; ++g) {
      uint16_t s16, m16;
      std::memcpy(&s16, meta + 4 * g, 2);
      std::memcpy(&m16, meta + 4 * g + 2, 2);
      const float s = f16_to_f32(s16), m = f16_to_f32(m16);
      EXPECT_TRUE(std::isfinite(s) && s >= 0.0f && std::isfinite(m)) << what;
      // The encoder searches (scale, min) for the smallest squared error; it
      // must never do worse than the plain min-max fit, whose every element
      // is within half a step: sum of (s_mm / 2)^2, s_mm = (max - min) / 15
      // (plus f16 rounding of the min and scale).
      float mn = x[32 * g], mx = x[32 * g];
      for (int i = 0; i < 32; ++i) {
        mn = std::min(mn, x[32 * g + i]);
        mx = std::max(mx, x[32 * g + i]);
      }
      const double s_mm = (mx - mn + std::fabs(mn) / 1024.0) / 15.0 * (1.0 + 1.0 / 1024.0) + 6e-8;
      double sse = 0.0;
      for (int i = 32 * g; i < 32 * g + 32; ++i) {
        const double e = static_cast<double>(x[i]) - y[i];
        sse += e * e;
      }
      EXPECT_LE(sse, 32.0 * (s_mm / 2) * (s_mm / 2) * (1.0 + 1e-5) + 1e-30)
          << what << " group " << g;
    }
  } else {  // fp8: meta is the block scale
    float scale;
    std::memcpy(&scale, meta, 4);
    for (int i = 0; i < d; ++i) {
      EXPECT_LE(std::fabs(x[i] - y[i]), std::fabs(x[i]) / 16.0f + scale / 512.0f)
          << what << " " << i;
    }
  }
}

class CodecRoundTrip : public ::testing::TestWithParam<KvDtype> {};

TEST_P(CodecRoundTrip, ErrorWithinFormatBound) {
  const KvDtype t = GetParam();
  const int d = 64, h = 2, p = 16, n = 40;  // 40 tokens: 3 blocks, the last partial
  const KvLayout layout = must(KvLayout::uniform(1, h, d, t, p));
  Arena arena(layout, 6);
  const PagedKvLayerView v = layout.layer_view(0, arena.base.get());
  const std::vector<int32_t> table = {4, 1, 3};  // scattered
  for (const DataSet& ds : data_sets(n * h, d)) {
    SCOPED_TRACE(ds.name);
    // K gets the data set, V its negation; written one token at a time
    // (decode) for the first half and in bulk (prefill) for the rest.
    std::vector<float> neg(ds.x.size());
    for (size_t i = 0; i < neg.size(); ++i) neg[i] = -ds.x[i];
    for (int t0 = 0; t0 < n / 2; ++t0) {
      ASSERT_TRUE(
          try_write_kv(v, table, t0, ds.x.data() + t0 * h * d, neg.data() + t0 * h * d, 1).ok());
    }
    ASSERT_TRUE(try_write_kv(v, table, n / 2, ds.x.data() + n / 2 * h * d,
                             neg.data() + n / 2 * h * d, n - n / 2)
                    .ok());
    for (int pos = 0; pos < n; ++pos) {
      for (int hh = 0; hh < h; ++hh) {
        for (int which = 0; which < 2; ++which) {
          const std::vector<float> y = read_row(v, table, pos, hh, which);
          const float* x = (which == 0 ? ds.x.data() : neg.data()) + (pos * h + hh) * d;
          const int64_t b = table[pos / p];
          const uint8_t* meta =
              (which == 0 ? v.k_meta : v.v_meta) + b * v.block_stride +
              hh * (which == 0 ? v.k_meta_head_stride : v.v_meta_head_stride) +
              (pos % p) * (which == 0 ? v.k_meta_slot_stride : v.v_meta_slot_stride);
          check_row(t, x, y.data(), meta, d, ds.name);
          if (std::string(ds.name) == "zeros") {
            for (float e : y) EXPECT_EQ(e, 0.0f);
          }
        }
      }
    }
  }
}

TEST_P(CodecRoundTrip, RejectsNanInfAndOutOfRangeWithoutWriting) {
  const KvDtype t = GetParam();
  const int d = 64, h = 1, p = 8;
  const KvLayout layout = must(KvLayout::uniform(1, h, d, t, p));
  Arena arena(layout, 2);
  const std::vector<uint8_t> before(arena.base.get(), arena.base.get() + arena.bytes);
  const PagedKvLayerView v = layout.layer_view(0, arena.base.get());
  const std::vector<int32_t> table = {1};
  std::vector<float> k(2 * d, 0.5f), vv(2 * d, 0.25f);
  const float bad_values[] = {std::nanf(""), INFINITY, -INFINITY};
  for (float bad : bad_values) {
    for (int which = 0; which < 2; ++which) {
      std::vector<float> kk = k, vr = vv;
      (which == 0 ? kk : vr)[d + 7] = bad;  // token 1, element 7
      const Status st = try_write_kv(v, table, 3, kk.data(), vr.data(), 2);
      ASSERT_FALSE(st.ok());
      const std::string& msg = st.error().message;
      EXPECT_NE(msg.find(which == 0 ? "K of position 4" : "V of position 4"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find(std::isnan(bad) ? "nan" : "inf"), std::string::npos) << msg;
      EXPECT_NE(msg.find("element 7"), std::string::npos) << msg;
    }
  }
  // Beyond the f16 metadata range: int4 (|x| > 65504), int8 (amax / 127 > 65504).
  std::vector<float> huge = k;
  huge[3] = t == KvDtype::kInt4 ? 1e5f : 1e7f;
  const Status st = try_write_kv(v, table, 0, huge.data(), vv.data(), 1);
  if (t == KvDtype::kFp8) {
    EXPECT_TRUE(st.ok());  // f32 scale: any finite value fits
    EXPECT_NEAR(read_row(v, table, 0, 0, 0)[3], huge[3], huge[3] / 16);
  } else {
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("exceeds the range"), std::string::npos)
        << st.error().message;
    EXPECT_TRUE(std::equal(before.begin(), before.end(), arena.base.get()));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CodecRoundTrip,
                         ::testing::Values(KvDtype::kFp8, KvDtype::kInt8, KvDtype::kInt4),
                         [](const auto& info) { return std::string(kv_dtype_name(info.param)); });

// The AVX2 loops of asym_quant_fit give the scalar loops' bits: every
// group size up to kAsymQuantMaxN (vector body and scalar tail), strided
// input, Gaussian, outlier, constant and tiny-range groups.
// int8 rows: the AVX2 encoder against the scalar one (forced with the ISA
// override), codes and scale, on random rows of several sizes and scales,
// exact halves of the scale (ties), zeros, and rows with a NaN or an
// infinity (which take the scalar way).
TEST(Int8EncodeRow, Avx2MatchesScalarBitForBit) {
  if (best_isa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int d : {8, 16, 20, 64, 128, 256}) {
    for (int rep = 0; rep < 200; ++rep) {
      std::vector<float> x(static_cast<size_t>(d));
      const float sc = std::ldexp(1.0f, rep % 40 - 20);
      for (auto& e : x) e = nd(rng) * sc;
      if (rep % 7 == 1) std::fill(x.begin(), x.end(), 0.0f);
      if (rep % 7 == 2) {  // ties: multiples of half the scale the row gets
        for (int i = 0; i < d; ++i) x[i] = static_cast<float>(i % 9 - 4) * 0.5f * sc;
      }
      if (rep % 7 == 3) x[rep % d] = std::numeric_limits<float>::quiet_NaN();
      if (rep % 7 == 4) x[rep % d] = -std::numeric_limits<float>::infinity();
      if (rep % 7 == 5) x[rep % d] = -0.0f;
      std::vector<uint8_t> ca(static_cast<size_t>(d)), cb(static_cast<size_t>(d));
      uint8_t ma[2], mb[2];
      int8_encode_row(x.data(), d, ca.data(), ma);
      set_isa_override(Isa::kScalar);
      int8_encode_row(x.data(), d, cb.data(), mb);
      set_isa_override(Isa::kAvx512);  // clamped back to what the CPU has
      ASSERT_EQ(0, std::memcmp(ma, mb, 2)) << "d " << d << " rep " << rep;
      ASSERT_EQ(0, std::memcmp(ca.data(), cb.data(), ca.size())) << "d " << d << " rep " << rep;
    }
  }
}

TEST(AsymQuantFit, Avx2MatchesScalarBitForBit) {
  if (!cpu_features().avx2 || !cpu_features().fma) GTEST_SKIP() << "no AVX2/FMA";
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  int checked = 0;
  for (int bits : {2, 4, 8}) {
    for (int n = 1; n <= kAsymQuantMaxN; ++n) {
      for (int kind = 0; kind < 4; ++kind) {
        for (int stride : {1, 3}) {
          std::vector<float> x(static_cast<size_t>(n) * stride);
          for (float& e : x) e = nd(rng);
          if (kind == 1) x[0] = 40.0f;                          // outlier
          if (kind == 2) std::fill(x.begin(), x.end(), 0.75f);  // constant
          if (kind == 3)
            for (float& e : x) e = 1.0f + 1e-3f * e;  // tiny range
          uint16_t s0, m0, s1, m1;
          uint8_t q0[kAsymQuantMaxN], q1[kAsymQuantMaxN];
          asym_quant_fit_isa(Isa::kScalar, bits, x.data(), stride, n, &s0, &m0, q0);
          asym_quant_fit_isa(Isa::kAvx2, bits, x.data(), stride, n, &s1, &m1, q1);
          ASSERT_EQ(s0, s1) << bits << " bits, n " << n << ", kind " << kind;
          ASSERT_EQ(m0, m1) << bits << " bits, n " << n << ", kind " << kind;
          ASSERT_EQ(0, std::memcmp(q0, q1, static_cast<size_t>(n))) << bits << " bits, n " << n;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * kAsymQuantMaxN * 4 * 2);
}

// The AVX-512 lanes of asym_quant_fit's search give the scalar path's bits
// (scale, min and codes): bits 2, 4 and 8, every n up to kAsymQuantMaxN,
// strides 1, 3 and 7 (KIVI keys), and groups that stress the fit: Gaussian,
// one outlier, constant, tiny range, zeros with a -0, tiny magnitudes (f16
// subnormal steps), huge magnitudes near the f16 limit, few distinct values,
// heavy tails; then many random groups of 32 for int4.
TEST(AsymQuantFit, Avx512MatchesScalarBitForBit) {
  const CpuFeatures& f = cpu_features();
  if (!f.avx512f || !f.avx512vl || !f.avx2 || !f.fma || !f.f16c) {
    GTEST_SKIP() << "no AVX-512F/VL (or F16C): the AVX-512 path of asym_quant_fit is not run";
  }
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  auto same = [](int bits, const float* x, int64_t stride, int n) {
    uint16_t s0, m0, s1, m1;
    uint8_t q0[kAsymQuantMaxN], q1[kAsymQuantMaxN];
    asym_quant_fit_isa(Isa::kScalar, bits, x, stride, n, &s0, &m0, q0);
    asym_quant_fit_isa(Isa::kAvx512, bits, x, stride, n, &s1, &m1, q1);
    return s0 == s1 && m0 == m1 && std::memcmp(q0, q1, static_cast<size_t>(n)) == 0;
  };
  constexpr int kKinds = 9;
  int checked = 0;
  for (int bits : {2, 4, 8}) {
    for (int n = 1; n <= kAsymQuantMaxN; ++n) {
      for (int kind = 0; kind < kKinds; ++kind) {
        for (int stride : {1, 3, 7}) {
          std::vector<float> x(static_cast<size_t>(n) * stride);
          for (float& e : x) e = nd(rng);
          if (kind == 1) x[0] = 40.0f;                          // outlier
          if (kind == 2) std::fill(x.begin(), x.end(), 0.75f);  // constant
          if (kind == 3)
            for (float& e : x) e = 1.0f + 1e-3f * e;  // tiny range
          if (kind == 4) {                            // zeros, one -0, one value
            std::fill(x.begin(), x.end(), 0.0f);
            x[0] = -0.0f;
            x.back() = 0.5f;
          }
          if (kind == 5)
            for (float& e : x) e *= 1e-6f;  // f16 subnormal scales
          if (kind == 6)
            for (float& e : x) e = std::clamp(e * 8000.0f, -30000.0f, 30000.0f);  // huge
          if (kind == 7)
            for (float& e : x) e = std::round(e * 2.0f) * 0.25f;  // few distinct values
          if (kind == 8)
            for (float& e : x) e = e * nd(rng) * nd(rng) + 3.0f;  // heavy tails, offset
          ASSERT_TRUE(same(bits, x.data(), stride, n))
              << bits << " bits, n " << n << ", kind " << kind << ", stride " << stride;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * kAsymQuantMaxN * kKinds * 3);
  std::uniform_real_distribution<float> ud(-3.0f, 3.0f);
  std::vector<float> x(32);
  for (int g = 0; g < 20000; ++g) {
    const float amp = std::pow(10.0f, ud(rng));
    for (float& e : x) e = (g % 2 ? nd(rng) : ud(rng)) * amp;
    ASSERT_TRUE(same(4, x.data(), 1, 32)) << "random group " << g;
  }
  std::printf("asym_quant_fit: AVX-512 path checked on %d shaped and 20000 random groups\n",
              checked);
}

// The three lane kernels against their contracts (kv_codec_avx512.h) written
// out per lane in scalar code, memcmp of every lane's double sums: sharper
// than the end-to-end test above, where an operation rounded differently
// usually changes no winner (a fused err + e*e passes that one, not this).
TEST(AsymQuantFit, Avx512LanesMatchTheirScalarContracts) {
  const CpuFeatures& f = cpu_features();
  if (!f.avx512f || !f.avx512vl || !f.avx2 || !f.fma || !f.f16c) {
    GTEST_SKIP() << "no AVX-512F/VL (or F16C): the AVX-512 lanes of asym_quant_fit are not run";
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (int bits : {2, 4, 8}) {
    const float qmax = static_cast<float>((1 << bits) - 1);
    for (int n = 1; n <= kAsymQuantMaxN; ++n) {
      std::vector<float> x(static_cast<size_t>(n));
      const float amp = std::pow(10.0f, 4.0f * ud(rng) - 2.0f);
      for (float& e : x) e = nd(rng) * amp;
      if (n > 2) x[1] = 30.0f * amp;  // one outlier
      const float mn = *std::min_element(x.begin(), x.end());
      const float mx = *std::max_element(x.begin(), x.end());
      float iscale[kAsymFitLanes], s[kAsymFitLanes], m[kAsymFitLanes];
      for (int c = 0; c < kAsymFitLanes; ++c) {
        iscale[c] = (qmax + 0.1f * static_cast<float>(c - 10)) / (mx > mn ? mx - mn : 1.0f);
        s[c] = c == 3 ? 0.0f : (mx - mn + amp) / qmax * (0.8f + 0.4f * ud(rng));  // lane 3: s = 0
        m[c] = mn + amp * (ud(rng) - 0.5f);
      }
      double sl[kAsymFitLanes], sll[kAsymFitLanes], slx[kAsymFitLanes], err[kAsymFitLanes];
      asym_fit_sums_avx512(x.data(), n, mn, iscale, qmax, sl, sll, slx);
      asym_fit_errors_avx512(x.data(), n, s, m, qmax, err);
      for (int c = 0; c < kAsymFitLanes; ++c) {
        double want_l = 0, want_ll = 0, want_lx = 0, want_err = 0;
        for (int i = 0; i < n; ++i) {
          const double l = std::clamp(std::nearbyint(iscale[c] * (x[i] - mn)), 0.0f, qmax);
          want_l += l;
          want_ll += l * l;
          want_lx += l * x[i];
          const float q =
              s[c] > 0.0f ? std::clamp(std::nearbyint((x[i] - m[c]) / s[c]), 0.0f, qmax) : 0.0f;
          const double e = static_cast<double>(std::fma(s[c], q, m[c])) - x[i];
          want_err += e * e;
        }
        ASSERT_EQ(std::bit_cast<uint64_t>(want_l), std::bit_cast<uint64_t>(sl[c]))
            << "sl lane " << c << " n " << n;
        ASSERT_EQ(std::bit_cast<uint64_t>(want_ll), std::bit_cast<uint64_t>(sll[c]))
            << "sll lane " << c;
        ASSERT_EQ(std::bit_cast<uint64_t>(want_lx), std::bit_cast<uint64_t>(slx[c]))
            << "slx lane " << c;
        ASSERT_EQ(std::bit_cast<uint64_t>(want_err), std::bit_cast<uint64_t>(err[c]))
            << "err lane " << c << ", " << bits << " bits, n " << n;
      }
      // The fit of each lane's sums, as asym_solve in kv_codec.cpp.
      double sx = 0;
      for (int i = 0; i < n; ++i) sx += x[i];
      uint16_t s16[kAsymFitLanes], m16[kAsymFitLanes];
      float fs[kAsymFitLanes], fm[kAsymFitLanes];
      const uint32_t ok = asym_fit_solve_avx512(n, sx, sl, sll, slx, s16, m16, fs, fm);
      EXPECT_EQ(ok >> kAsymFitCandidates, 0u);
      for (int c = 0; c < kAsymFitCandidates; ++c) {
        const double det = n * sll[c] - sl[c] * sl[c];
        const double s_fit = (n * slx[c] - sl[c] * sx) / det;
        const double m_fit = (sll[c] * sx - sl[c] * slx[c]) / det;
        const bool want_ok =
            det > 0.0 && s_fit > 0.0 && !(s_fit > 65504.0) && !(std::fabs(m_fit) > 65504.0);
        ASSERT_EQ(want_ok, (ok >> c & 1u) != 0) << "fit lane " << c << ", n " << n;
        if (!want_ok) {
          EXPECT_EQ(fs[c], 1.0f);
          EXPECT_EQ(fm[c], 0.0f);
          continue;
        }
        ASSERT_EQ(s16[c], f32_to_f16(static_cast<float>(s_fit))) << "fit lane " << c;
        ASSERT_EQ(m16[c], f32_to_f16(static_cast<float>(m_fit))) << "fit lane " << c;
        ASSERT_EQ(fs[c], f16_to_f32(s16[c]));
        ASSERT_EQ(fm[c], f16_to_f32(m16[c]));
      }
    }
  }
}

// The (scale, min) search of int4 and KIVI (asym_quant_fit) must pay: on
// Gaussian groups (what K and V look like after --kv-rotate) its squared
// error is clearly below the min-max fit's, computed here independently.
TEST(AsymQuantFit, RangeSearchBeatsMinMaxOnGaussianGroups) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (int bits : {2, 4}) {
    const int qmax = (1 << bits) - 1;
    std::vector<float> x(32);
    uint8_t q[32];
    double sse = 0.0, sse_mm = 0.0;
    for (int r = 0; r < 1000; ++r) {
      for (float& e : x) e = nd(rng);
      uint16_t s16, m16;
      asym_quant_fit(bits, x.data(), 1, 32, &s16, &m16, q);
      const float s = f16_to_f32(s16), m = f16_to_f32(m16);
      const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
      const double s_mm = (static_cast<double>(*hi) - *lo) / qmax;
      for (int i = 0; i < 32; ++i) {
        ASSERT_LE(q[i], qmax);
        const double e = static_cast<double>(std::fma(s, static_cast<float>(q[i]), m)) - x[i];
        sse += e * e;
        const double c = std::nearbyint((x[i] - *lo) / s_mm);
        sse_mm += (c * s_mm + *lo - x[i]) * (c * s_mm + *lo - x[i]);
      }
    }
    std::printf("%d-bit squared error: search %.2f, min-max %.2f (ratio %.3f)\n", bits, sse, sse_mm,
                sse / sse_mm);
    EXPECT_LT(sse, 0.9 * sse_mm) << bits << " bits";
  }
}

TEST(Fp8, BlockScaleGrowsAndRescalesEarlierSlots) {
  const int d = 32;
  const KvLayout layout = must(KvLayout::uniform(1, 1, d, KvDtype::kFp8, 4));
  Arena arena(layout, 2);
  const PagedKvLayerView v = layout.layer_view(0, arena.base.get());
  const std::vector<int32_t> table = {1, 0};
  std::vector<float> small(d), big(d);
  for (int i = 0; i < d; ++i) {
    small[i] = 0.01f * static_cast<float>(i + 1);
    big[i] = 50.0f * static_cast<float>(i % 5 + 1);
  }
  ASSERT_TRUE(try_write_kv(v, table, 0, small.data(), small.data(), 1).ok());
  float scale0;
  std::memcpy(&scale0, v.k_meta + 1 * v.block_stride, 4);
  EXPECT_EQ(scale0, fp8_scale_for(0.32f));
  ASSERT_TRUE(try_write_kv(v, table, 1, big.data(), big.data(), 1).ok());
  float scale1;
  std::memcpy(&scale1, v.k_meta + 1 * v.block_stride, 4);
  EXPECT_EQ(scale1, fp8_scale_for(250.0f));
  const std::vector<float> y0 = read_row(v, table, 0, 0, 0);
  const std::vector<float> y1 = read_row(v, table, 1, 0, 0);
  for (int i = 0; i < d; ++i) {
    EXPECT_LE(std::fabs(y0[i] - small[i]), small[i] / 16 + scale1 / 1024) << i;
    EXPECT_LE(std::fabs(y1[i] - big[i]), big[i] / 16) << i;
  }
  // A new block (slot 0) ignores the stale scale left by a previous owner.
  ASSERT_TRUE(try_write_kv(v, table, 4, small.data(), small.data(), 1).ok());
  float scale2;
  std::memcpy(&scale2, v.k_meta, 4);
  EXPECT_EQ(scale2, scale0);
}

// kv_validate_rows covers every dtype: float caches reject NaN/Inf and
// values that would overflow to Inf, naming the tensor, position, head and
// element; in-range rows pass.
TEST(KvValidateRows, EveryDtypeRejectsNonFiniteRows) {
  const int d = 32, h = 2;
  for (KvDtype t : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kFp8, KvDtype::kInt8,
                    KvDtype::kInt4}) {
    SCOPED_TRACE(kv_dtype_name(t));
    const KvLayout layout = must(KvLayout::uniform(1, h, d, t, 8));
    Arena arena(layout, 1);
    const PagedKvLayerView v = layout.layer_view(0, arena.base.get());
    std::vector<float> k(3 * h * d, 1.5f), vv(3 * h * d, -0.5f);
    EXPECT_TRUE(kv_validate_rows(v, 10, k.data(), vv.data(), 3).ok());
    for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      std::vector<float> vb = vv;
      vb[(2 * h + 1) * d + 9] = bad;  // token 2, head 1, element 9
      const Status st = kv_validate_rows(v, 10, k.data(), vb.data(), 3);
      ASSERT_FALSE(st.ok());
      EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
      const std::string want = std::string("V of position 12, head 1: element 9 is ") +
                               (std::isnan(bad) ? "nan" : "inf");
      EXPECT_NE(st.error().message.find(want), std::string::npos) << st.error().message;
    }
  }
  // f16 stores 65504 but 1e5 would become Inf; f32/fp8 take any finite value.
  const KvLayout f16 = must(KvLayout::uniform(1, 1, d, KvDtype::kF16, 8));
  Arena arena(f16, 1);
  const PagedKvLayerView v = f16.layer_view(0, arena.base.get());
  std::vector<float> k(d, 65504.0f), vv(d, 0.0f);
  EXPECT_TRUE(kv_validate_rows(v, 0, k.data(), vv.data(), 1).ok());
  k[4] = -1e5f;
  const Status st = kv_validate_rows(v, 0, k.data(), vv.data(), 1);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("K of position 0, head 0: element 4"), std::string::npos)
      << st.error().message;
  EXPECT_NE(st.error().message.find("overflows KV dtype f16"), std::string::npos)
      << st.error().message;
  // At the rounding boundary: 65519.99 rounds to 65504, 65520 to Inf.
  k[4] = -65519.99f;
  EXPECT_TRUE(kv_validate_rows(v, 0, k.data(), vv.data(), 1).ok());
  k[4] = 65520.0f;
  EXPECT_FALSE(kv_validate_rows(v, 0, k.data(), vv.data(), 1).ok());
}

// An fp8 block's bytes do not depend on how its tokens were split into
// steps: written one token at a time, in uneven chunks or all at once, the
// block scale (max over the block's rows so far) and every code are equal.
TEST(Fp8, BlockBytesIndependentOfStepSplit) {
  const int d = 64, h = 2, p = 16, n = 16;
  const KvLayout layout = must(KvLayout::uniform(1, h, d, KvDtype::kFp8, p));
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(n * h * d), vv(n * h * d);
  for (int t = 0; t < n; ++t) {
    // Growing magnitudes force several scale increases inside the block,
    // with values of early tokens pushed into E4M3 subnormals.
    const float mag = std::ldexp(1.0f, t) * 1e-3f;
    for (int i = 0; i < h * d; ++i) {
      k[t * h * d + i] = nd(rng) * mag;
      vv[t * h * d + i] = nd(rng) * (t % 3 == 0 ? 100.0f : 0.01f);
    }
  }
  const std::vector<int32_t> table = {0};
  std::vector<std::vector<uint8_t>> results;
  for (const std::vector<int>& split :
       {std::vector<int>{16}, std::vector<int>(16, 1), std::vector<int>{3, 1, 7, 5}}) {
    Arena arena(layout, 1);
    const PagedKvLayerView v = layout.layer_view(0, arena.base.get());
    int pos = 0;
    for (int c : split) {
      ASSERT_TRUE(
          try_write_kv(v, table, pos, k.data() + pos * h * d, vv.data() + pos * h * d, c).ok());
      pos += c;
    }
    results.emplace_back(arena.base.get(), arena.base.get() + layout.block_bytes());
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(KvLayoutQuant, MixedKAndVDtypes) {
  const int d = 64, h = 3, p = 16;
  std::vector<KvLayerSpec> layers(2, KvLayerSpec{.n_kv_heads = h,
                                                 .head_dim_k = d,
                                                 .head_dim_v = d,
                                                 .dtype = KvDtype::kInt4,
                                                 .dtype_v = KvDtype::kF16});
  layers[1].dtype = KvDtype::kInt8;
  layers[1].dtype_v = KvDtype::kFp8;
  const KvLayout layout = must(KvLayout::create(layers, p));
  // Layer 0: K int4 codes 3*16*32 = 1536, V f16 3*16*128 = 6144, K meta 3*16*8 = 384.
  // Layer 1: K int8 3*16*64 = 3072, V fp8 3072, K meta 3*16*2 = 96 -> 128, V meta 12 -> 64.
  EXPECT_EQ(layout.block_bytes(), 1536 + 6144 + 384 + 3072 + 3072 + 128 + 64);
  EXPECT_EQ(layout.layer_payload_bytes_per_token(0), h * (32 + 8 + 128));
  EXPECT_EQ(layout.layer_payload_bytes_per_token(1), h * (64 + 2 + 64));
  EXPECT_EQ(layout.block_meta_bytes(), h * 4);
  EXPECT_EQ(layout.payload_bytes(17), 17 * layout.payload_bytes_per_token() + 2 * h * 4);
  Arena arena(layout, 3);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> k(20 * h * d), v(20 * h * d);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  const std::vector<int32_t> table = {2, 0};
  for (int l = 0; l < 2; ++l) {
    const PagedKvLayerView view = layout.layer_view(l, arena.base.get());
    EXPECT_TRUE(view.v_distinct);
    EXPECT_TRUE(kv_view_is_quantized(view));
    ASSERT_TRUE(try_write_kv(view, table, 0, k.data(), v.data(), 20).ok());
  }
  for (int l = 0; l < 2; ++l) {
    const PagedKvLayerView view = layout.layer_view(l, arena.base.get());
    for (int pos : {0, 15, 16, 19}) {
      for (int hh = 0; hh < h; ++hh) {
        const std::vector<float> yk = read_row(view, table, pos, hh, 0);
        const std::vector<float> yv = read_row(view, table, pos, hh, 1);
        for (int i = 0; i < d; ++i) {
          const float xk = k[(pos * h + hh) * d + i], xv = v[(pos * h + hh) * d + i];
          EXPECT_NEAR(yk[i], xk, l == 0 ? 0.5f : 0.05f);
          EXPECT_NEAR(yv[i], xv, l == 0 ? 0.002f : std::fabs(xv) / 16 + 1e-3f);
        }
      }
    }
  }
}

TEST(KvLayoutQuant, RejectsUnsupportedShapes) {
  EXPECT_FALSE(KvLayout::uniform(1, 2, 48, KvDtype::kInt4, 16).ok());  // 48 % 32 != 0
  EXPECT_TRUE(KvLayout::uniform(1, 2, 48, KvDtype::kInt8, 16).ok());
  // MLA latents: int8 (per-row f16 scale) yes, fp8 no.
  auto mla = KvLayout::create({KvLayerSpec{.kind = KvLayerKind::kMlaLatent,
                                           .latent_dim = 64,
                                           .rope_dim = 16,
                                           .dtype = KvDtype::kFp8}},
                              16);
  ASSERT_FALSE(mla.ok());
  EXPECT_EQ(mla.error().code, Errc::kUnsupported);
  EXPECT_TRUE(KvLayout::create({KvLayerSpec{.kind = KvLayerKind::kMlaLatent,
                                            .latent_dim = 64,
                                            .rope_dim = 16,
                                            .dtype = KvDtype::kInt8}},
                               16)
                  .ok());
  EXPECT_EQ(parse_kv_dtype("int8").value(), KvDtype::kInt8);
  EXPECT_EQ(parse_kv_dtype("int3").error().code, Errc::kInvalidArgument);
}

// The planner's per-format numbers are the layout's: block bytes (padding
// included) and the exact payload of a sequence.
TEST(KvLayoutQuant, PlannerUsesTheSameBytes) {
  struct Case {
    int n_layers, n_kv_heads, head_dim, block_size;
  };
  for (const char* name : {"f32", "f16", "bf16", "fp8", "int8", "int4"}) {
    const KvDtype t = parse_kv_dtype(name).value();
    const capacity::KvFormat fmt = capacity::find_kv_format(name).value();
    for (const Case c :
         {Case{30, 3, 64, 16}, Case{2, 1, 32, 1}, Case{3, 5, 96, 4}, Case{4, 8, 128, 256}}) {
      SCOPED_TRACE(std::string(name) + " layers " + std::to_string(c.n_layers));
      const KvLayout layout =
          must(KvLayout::uniform(c.n_layers, c.n_kv_heads, c.head_dim, t, c.block_size));
      const capacity::ModelArch a = capacity::make_uniform_arch("x", c.n_layers, c.n_kv_heads,
                                                                c.n_kv_heads, c.head_dim, 64, 1);
      EXPECT_EQ(capacity::block_bytes(a, fmt, c.block_size),
                static_cast<uint64_t>(layout.block_bytes()));
      for (int64_t tokens : {1, 15, 16, 17, 1000}) {
        capacity::Workload w;
        w.seq_tokens = {tokens};
        w.block_size = c.block_size;
        EXPECT_EQ(capacity::kv_payload_bytes(a, fmt, w),
                  static_cast<uint64_t>(layout.payload_bytes(tokens)))
            << tokens;
      }
    }
  }
}

}  // namespace
}  // namespace kvstack

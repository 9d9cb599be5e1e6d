#include "ops/elementwise.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "core/half.h"

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

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

TEST(Elementwise, RmsNormMatchesFormula) {
  const int64_t n_rows = 3, n = 37;
  const auto x = randn(n_rows * n, 1);
  const auto w = randn(n, 2);
  std::vector<float> out(n_rows * n);
  rms_norm(x.data(), w.data(), n_rows, n, 1e-5f, out.data());
  for (int64_t r = 0; r < n_rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double s = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(out[r * n + i], x[r * n + i] * s * w[i],
                  1e-5 * std::fabs(x[r * n + i] * s * w[i]) + 1e-7);
    }
  }
  // In place, no weight: the row's mean square becomes ~1.
  auto y = x;
  rms_norm(y.data(), nullptr, n_rows, n, 0.f, y.data());
  double ms = 0;
  for (int64_t i = 0; i < n; ++i) ms += double(y[i]) * y[i];
  EXPECT_NEAR(ms / n, 1.0, 1e-5);
  // Single-row overload.
  std::vector<float> one(n);
  rms_norm(x.data(), w.data(), n, 1e-5f, one.data());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(one[i], out[i]);
}

// Distance in units in the last place between two finite floats of the same sign.
int64_t ulp_distance(float a, float b) {
  return std::llabs(static_cast<int64_t>(std::bit_cast<int32_t>(a)) -
                    static_cast<int64_t>(std::bit_cast<int32_t>(b)));
}

// Forces an ISA level for its scope, then restores the level in use before.
class IsaOverride {
 public:
  explicit IsaOverride(Isa isa) : saved_(best_isa()) { set_isa_override(isa); }
  ~IsaOverride() { set_isa_override(saved_); }

 private:
  Isa saved_;
};

// The AVX2 path sums the squares (in double) in a different order than the
// sequential scalar reference: the sums differ by ~n * 2^-53 relative, which
// moves the float mean only when it lies that close to a rounding boundary
// (~n * 2^-29 of rows; none of 4e5 random rows of widths 64-4096 in a trial
// run). Then 1/sqrt(mean + eps) moves by <= 1 ulp and each output by <= 2.
// Every width class of the 16/4/1 blocking is covered, with and without a
// weight, in place and not.
TEST(Elementwise, RmsNormAvx2MatchesScalarReference) {
  if (best_isa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2 on this CPU";
  const int64_t n_rows = 5;
  int64_t n_rows_moved = 0;
  for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 19, 20, 31, 33, 37, 64, 100, 576, 1537}) {
    auto x = randn(n_rows * n, static_cast<uint32_t>(n));
    for (int64_t i = 0; i < n_rows * n; i += 3) x[i] *= 1000.f;  // wide dynamic range
    const auto w = randn(n, static_cast<uint32_t>(n + 1));
    for (const float* weight : {w.data(), static_cast<const float*>(nullptr)}) {
      std::vector<float> ref(n_rows * n), got(n_rows * n), in_place = x;
      {
        IsaOverride scalar(Isa::kScalar);
        rms_norm(x.data(), weight, n_rows, n, 1e-5f, ref.data());
      }
      rms_norm(x.data(), weight, n_rows, n, 1e-5f, got.data());
      rms_norm(in_place.data(), weight, n_rows, n, 1e-5f, in_place.data());
      ASSERT_EQ(first_bit_mismatch(in_place.data(), got.data(), n_rows * n), -1) << "n " << n;
      for (int64_t r = 0; r < n_rows; ++r) {
        bool moved = false;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t u = ulp_distance(got[r * n + i], ref[r * n + i]);
          ASSERT_LE(u, 2) << "n " << n << " row " << r << " i " << i;
          moved |= u != 0;
        }
        n_rows_moved += moved;
      }
    }
  }
  // A bound of 2 ulp would also pass a subtly wrong sum that is merely
  // close; in practice the two paths agree bit for bit on these rows.
  EXPECT_EQ(n_rows_moved, 0);
}

// Reference rotation in double: pair (a, b) rotated by pos * base^(-2i/n_rot) * scale.
void rope_ref(std::vector<double>& v, int pos, int head_dim, const RopeParams& p) {
  const int half = p.n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const double theta = pos * p.freq_scale * std::pow(double(p.freq_base), -2.0 * i / p.n_rot);
    const int ia = p.style == RopeStyle::kNormal ? 2 * i : i;
    const int ib = p.style == RopeStyle::kNormal ? 2 * i + 1 : i + half;
    const double a = v[ia], b = v[ib];
    v[ia] = a * std::cos(theta) - b * std::sin(theta);
    v[ib] = a * std::sin(theta) + b * std::cos(theta);
  }
  (void)head_dim;
}

TEST(Elementwise, RopeBothStylesMatchReference) {
  const int n_tokens = 4, n_heads = 3, head_dim = 16;
  const int32_t pos[n_tokens] = {0, 1, 7, 300};
  for (RopeStyle style : {RopeStyle::kNormal, RopeStyle::kNeox}) {
    for (int n_rot : {16, 8}) {
      const RopeParams p{.style = style, .n_rot = n_rot, .freq_base = 10000.f, .freq_scale = 0.5f};
      auto x = randn(n_tokens * n_heads * head_dim, 3);
      const auto orig = x;
      rope(x.data(), pos, n_tokens, n_heads, head_dim, p);
      for (int t = 0; t < n_tokens; ++t) {
        for (int h = 0; h < n_heads; ++h) {
          const size_t off = (size_t(t) * n_heads + h) * head_dim;
          std::vector<double> ref(orig.begin() + off, orig.begin() + off + head_dim);
          rope_ref(ref, pos[t], head_dim, p);
          for (int d = 0; d < head_dim; ++d) {
            // theta is a running float product (as in ggml): ~1e-7 relative per
            // step, times pos for the angle.
            EXPECT_NEAR(x[off + d], ref[d], 2e-4) << "t " << t << " h " << h << " d " << d;
            if (d >= n_rot) {
              EXPECT_EQ(x[off + d], orig[off + d]);
            }
          }
        }
      }
    }
  }
}

// rope reuses its (cos, sin) table while the positions and parameters stay
// the same (the forward pass ropes Q and K of every layer at one step's
// positions): a call gives the same bits as a first call with those inputs,
// whatever came before, including positions changed in the same buffer and
// parameters that change but positions that do not.
TEST(Elementwise, RopeTableReuseIsInvisible) {
  const int64_t n_heads = 3, head_dim = 16;
  std::vector<int32_t> pos = {5, 6, 700};
  const auto n_tokens = std::ssize(pos);
  const auto x = randn(n_tokens * n_heads * head_dim, 11);
  const RopeParams base{.style = RopeStyle::kNormal, .n_rot = 16, .freq_base = 10000.f};
  const std::vector<int32_t> other = {1, 2, 3};
  auto first_call = [&](const std::vector<int32_t>& p, const RopeParams& rp) {
    auto y = x;
    auto flush = x;
    rope(flush.data(), other.data(), std::ssize(other), n_heads, head_dim, rp);
    rope(flush.data(), other.data(), std::ssize(other), n_heads, head_dim, RopeParams{.n_rot = 4});
    rope(y.data(), p.data(), n_tokens, n_heads, head_dim, rp);
    return y;
  };
  const auto want = first_call(pos, base);
  auto again = x;
  rope(again.data(), pos.data(), n_tokens, n_heads, head_dim, base);  // table reused
  ASSERT_EQ(first_bit_mismatch(again.data(), want.data(), std::ssize(x)), -1);
  // Same buffer, one position changed: must not reuse the table.
  pos[1] = 7;
  auto moved = x;
  rope(moved.data(), pos.data(), n_tokens, n_heads, head_dim, base);
  ASSERT_EQ(first_bit_mismatch(moved.data(), first_call(pos, base).data(), std::ssize(x)), -1);
  EXPECT_NE(first_bit_mismatch(moved.data(), want.data(), std::ssize(x)), -1);
  // Same positions, each parameter changed in turn.
  for (const RopeParams& rp : {RopeParams{.n_rot = 8, .freq_base = 10000.f},
                               RopeParams{.n_rot = 16, .freq_base = 500000.f},
                               RopeParams{.n_rot = 16, .freq_base = 10000.f, .freq_scale = 0.25f},
                               RopeParams{.style = RopeStyle::kNeox, .n_rot = 16}}) {
    rope(again.data(), pos.data(), n_tokens, n_heads, head_dim, base);  // table for `base`
    auto y = x;
    rope(y.data(), pos.data(), n_tokens, n_heads, head_dim, rp);
    ASSERT_EQ(first_bit_mismatch(y.data(), first_call(pos, rp).data(), std::ssize(x)), -1)
        << "n_rot " << rp.n_rot << " base " << rp.freq_base << " scale " << rp.freq_scale;
  }
  // Fewer tokens with the same leading positions: a different table size.
  auto head = x;
  rope(head.data(), pos.data(), 1, n_heads, head_dim, base);
  ASSERT_EQ(first_bit_mismatch(head.data(), moved.data(), n_heads * head_dim), -1);
}

TEST(Elementwise, RopeNormalRotatesAdjacentPairsNeoxHalves) {
  // head_dim 4, n_rot 4, pos 1, base 1 -> every angle is 1 rad.
  float v[4] = {1, 0, 0, 0};
  const int32_t pos = 1;
  rope(v, &pos, 1, 1, 4, RopeParams{.style = RopeStyle::kNormal, .n_rot = 4, .freq_base = 1.f});
  EXPECT_NEAR(v[0], std::cos(1.0), 1e-6);
  EXPECT_NEAR(v[1], std::sin(1.0), 1e-6);  // partner of element 0 is element 1
  EXPECT_EQ(v[2], 0.f);
  float u[4] = {1, 0, 0, 0};
  rope(u, &pos, 1, 1, 4, RopeParams{.style = RopeStyle::kNeox, .n_rot = 4, .freq_base = 1.f});
  EXPECT_NEAR(u[0], std::cos(1.0), 1e-6);
  EXPECT_EQ(u[1], 0.f);
  EXPECT_NEAR(u[2], std::sin(1.0), 1e-6);  // partner of element 0 is element n_rot/2
}

TEST(Elementwise, SwigluAddMulScale) {
  const int64_t n = 19;
  const auto g = randn(n, 4), u = randn(n, 5);
  std::vector<float> out(n);
  swiglu(g.data(), u.data(), out.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double ref = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    EXPECT_NEAR(out[i], ref, 1e-6 * std::fabs(ref) + 1e-7);
  }
  add(g.data(), u.data(), out.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], g[i] + u[i]);
  mul(g.data(), u.data(), out.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], g[i] * u[i]);
  scale(out.data(), 2.f, n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], 2.f * (g[i] * u[i]));
  // Large negative gate: silu -> 0 without NaN.
  const float big[1] = {-1000.f}, one[1] = {1.f};
  swiglu(big, one, out.data(), 1);
  EXPECT_EQ(out[0], -0.f);
}

// The AVX2 path's own exp: relative error against double over the whole
// range silu meets (including overflow of exp(-g) for very negative g and the
// k = 128 corner just below it), and the same bits at any position (the tail
// is computed 8-wide too).
TEST(Elementwise, SwigluWideRangeAndPositionIndependent) {
  std::vector<float> g;
  for (float v = -100.f; v <= 100.f; v += 0.0137f) g.push_back(v);
  for (float v : {-88.72f, -88.71f, -88.5f, -88.38f, -88.3f, 87.3f, 87.4f, 0.f, -0.f, 1e-20f}) {
    g.push_back(v);
  }
  const auto n = static_cast<int64_t>(g.size());
  const auto u = randn(g.size(), 9);
  std::vector<float> out(g.size());
  swiglu(g.data(), u.data(), out.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double ref = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    ASSERT_NEAR(out[i], ref, 1e-6 * std::fabs(ref) + 1e-30) << "g " << g[i];
  }
  for (int64_t off : {1, 3, 7}) {
    std::vector<float> o2(g.size() - off);
    swiglu(g.data() + off, u.data() + off, o2.data(), n - off);
    ASSERT_EQ(first_bit_mismatch(o2.data(), out.data() + off, std::ssize(o2)), -1) << off;
  }
}

// The AVX-512 SwiGLU against the AVX2 one (ISA override): the same bits for
// every element, over the whole range, the exp overflow/underflow corners,
// NaN and infinities, at lengths with and without a tail.
TEST(Elementwise, SwigluAvx512MatchesAvx2BitForBit) {
  if (!cpu_features().avx512f || best_isa() < Isa::kAvx512) {
    GTEST_SKIP() << "no AVX-512F on this CPU";
  }
  std::vector<float> g;
  for (float v = -100.f; v <= 100.f; v += 0.0137f) g.push_back(v);
  for (float v : {-88.72f, -88.71f, -88.5f, -88.38f, -88.3f, -87.33f, -87.34f, 87.3f, 87.4f, 88.72f,
                  88.73f, 0.f, -0.f, 1e-20f, -1e-40f, INFINITY, -INFINITY, NAN}) {
    g.push_back(v);
  }
  const auto u = randn(g.size(), 11);
  for (int64_t n : {std::ssize(g), std::ssize(g) - 5, int64_t{15}, int64_t{16}, int64_t{1}}) {
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    const int64_t off = std::ssize(g) - n;  // the corner values sit at the end
    swiglu(g.data() + off, u.data() + off, a.data(), n);
    {
      IsaOverride avx2(Isa::kAvx2);
      swiglu(g.data() + off, u.data() + off, b.data(), n);
    }
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "n " << n;
  }
}

// Batch invariance: a token's row gives the same bits alone or inside a batch
// of any size at any position (rms_norm, rope and the element-wise ops have no
// reduction across rows).
TEST(Elementwise, RowBitsIndependentOfBatch) {
  const int64_t n = 576, n_heads = 9, head_dim = 64;
  const auto w = randn(n, 5);
  const auto target = randn(n, 6);
  std::vector<float> alone(n), rot_alone(target);
  rms_norm(target.data(), w.data(), 1, n, 1e-5f, alone.data());
  const RopeParams rp{.style = RopeStyle::kNormal, .n_rot = 64, .freq_base = 10000.f};
  const int32_t pos1 = 77;
  rope(rot_alone.data(), &pos1, 1, n_heads, head_dim, rp);
  for (int64_t m : {2, 7, 64}) {
    for (int64_t at : {int64_t{0}, m / 2, m - 1}) {
      auto x = randn(m * n, static_cast<uint32_t>(m + at));
      std::copy(target.begin(), target.end(), x.begin() + at * n);
      std::vector<float> out(m * n);
      rms_norm(x.data(), w.data(), m, n, 1e-5f, out.data());
      ASSERT_EQ(first_bit_mismatch(out.data() + at * n, alone.data(), n), -1);
      std::vector<int32_t> pos(m, 3);
      pos[at] = pos1;
      rope(x.data(), pos.data(), m, n_heads, head_dim, rp);
      ASSERT_EQ(first_bit_mismatch(x.data() + at * n, rot_alone.data(), n), -1);
    }
  }
}

// tanh GELU in float64, the formula ggml's gelu_f32 evaluates in float.
double gelu_tanh_f64(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * x * (1.0 + 0.044715 * x * x)));
}

TEST(Elementwise, GeluTanhMatchesFloat64) {
  // The float formula against float64 on a wide grid: a few float ulps.
  for (double x = -12.0; x <= 12.0; x += 1.0 / 64) {
    const auto xf = static_cast<float>(x);
    const double want = gelu_tanh_f64(xf);
    EXPECT_NEAR(gelu_tanh(xf), want, 4e-7 * (1.0 + std::fabs(want))) << "x = " << x;
  }
  EXPECT_EQ(gelu_tanh(0.0f), 0.0f);
}

// geglu reads GELU from an f16 table, as llama.cpp does: on every f16 input
// in (-10, 10) the result is f16(gelu(x)), i.e. within half an f16 ulp of the
// float64 value (plus the float formula's own error); inputs between f16
// values are rounded to f16 first (|x - f16(x)| <= 2^-11 |x|, and
// |gelu'| < 1.13); outside [-10, 10] it is 0 or x, exactly.
TEST(Elementwise, GegluMatchesFloat64GeluWithinF16Rounding) {
  std::vector<float> gate, up;
  for (uint32_t h = 0; h < (1u << 16); ++h) {
    const float x = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isfinite(x)) gate.push_back(x);
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-14.0f, 14.0f);
  const size_t n_table = gate.size();
  for (int i = 0; i < 20000; ++i) gate.push_back(u(rng));
  up.resize(gate.size());
  for (size_t i = 0; i < up.size(); ++i) up[i] = i % 3 == 0 ? 1.0f : 0.5f + 0.001f * (i % 1000);
  std::vector<float> out(gate.size());
  geglu(gate.data(), up.data(), out.data(), static_cast<int64_t>(gate.size()));
  for (size_t i = 0; i < gate.size(); ++i) {
    const float x = gate[i];
    if (x <= -10.0f) {
      ASSERT_EQ(out[i], 0.0f) << "x = " << x;
      continue;
    }
    if (x >= 10.0f) {
      ASSERT_EQ(out[i], x * up[i]) << "x = " << x;
      continue;
    }
    const double want = gelu_tanh_f64(x) * up[i];
    const double input_err = i < n_table ? 0.0 : 1.13 * std::ldexp(std::fabs(x), -11);
    const double tol =
        (std::ldexp(std::fabs(gelu_tanh_f64(x)), -11) + input_err + 1e-7 + 0x1p-24) * up[i] +
        1e-7 * std::fabs(want);
    ASSERT_NEAR(out[i], want, tol) << "x = " << x << " up = " << up[i];
    // The table value is exactly f16(gelu(f16(x))).
    const float table = f16_to_f32(f32_to_f16(gelu_tanh(f16_to_f32(f32_to_f16(x)))));
    ASSERT_EQ(out[i], table * up[i]) << "x = " << x;
  }
  // In place (out aliases gate).
  std::vector<float> g2 = gate;
  geglu(g2.data(), up.data(), g2.data(), static_cast<int64_t>(g2.size()));
  EXPECT_EQ(first_bit_mismatch(g2.data(), out.data(), static_cast<int64_t>(out.size())), -1);
}

// The AVX2 geglu (F16C rounding, gathered table) against the scalar code, bit
// for bit: every f16 bit pattern as a gate (NaN and inf included), random
// gates over a wide range, the boundaries +-10 and the float values around
// them, float subnormals, and up values of every sign including 0, -0, inf and
// NaN; every length 0..40 (tails) and in place. Where the result is NaN only
// NaN-ness is compared (which input NaN's payload a product carries depends
// on the operand order the compiler picks, in the scalar code too).
int64_t first_mismatch_nan_any(const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return i;
  }
  return -1;
}

TEST(Elementwise, GegluAvx2MatchesScalarBitForBit) {
  if (best_isa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2 on this CPU";
  std::vector<float> gate;
  for (uint32_t h = 0; h < (1u << 16); ++h) gate.push_back(f16_to_f32(static_cast<uint16_t>(h)));
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> wide(-30.0f, 30.0f);
  for (int i = 0; i < 30000; ++i) gate.push_back(wide(rng));
  for (float b : {10.0f, -10.0f, 9.99f, -9.99f}) {
    gate.push_back(b);
    gate.push_back(std::nextafter(b, 0.0f));
    gate.push_back(std::nextafter(b, b * 2));
  }
  for (float v : {1e-40f, -1e-40f, 1e-45f, 0.0f, -0.0f, 6e-5f, 6.1e-5f, 65504.f, 70000.f}) {
    gate.push_back(v);
  }
  gate.push_back(std::numeric_limits<float>::quiet_NaN());
  gate.push_back(-std::numeric_limits<float>::infinity());
  const float specials[] = {0.0f,
                            -0.0f,
                            -1.5f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            1e30f};
  std::vector<float> up(gate.size());
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < up.size(); ++i) up[i] = i % 7 == 3 ? specials[(i / 7) % 6] : nd(rng);
  const auto n = static_cast<int64_t>(gate.size());
  std::vector<float> ref(gate.size()), got(gate.size());
  {
    IsaOverride scalar(Isa::kScalar);
    geglu(gate.data(), up.data(), ref.data(), n);
  }
  geglu(gate.data(), up.data(), got.data(), n);
  ASSERT_EQ(first_mismatch_nan_any(got.data(), ref.data(), n), -1);
  for (int64_t len = 0; len <= 40; ++len) {
    for (int64_t off : {0, 1, 5, 65530}) {
      std::vector<float> g(gate.begin() + off, gate.begin() + off + len);
      geglu(g.data(), up.data() + off, g.data(), len);  // in place
      ASSERT_EQ(first_mismatch_nan_any(g.data(), ref.data() + off, len), -1)
          << "len " << len << " off " << off;
    }
  }
}

// argmax is std::max_element's index on every path: random rows of odd
// lengths, ties (first one wins), the maximum in the tail and in the first
// vector, all -inf, -0/+0 ties, and a Gemma-sized row.
TEST(Elementwise, ArgmaxIsFirstLargestOnEveryPath) {
  std::mt19937 rng(21);
  std::vector<std::vector<float>> rows;
  for (int64_t n : {1, 2, 7, 15, 16, 17, 31, 33, 100, 1001, 262144}) {
    rows.push_back(randn(static_cast<size_t>(n), static_cast<uint32_t>(rng())));
    std::vector<float> tie(static_cast<size_t>(n), 0.5f);  // every element equal
    rows.push_back(tie);
    auto coarse = randn(static_cast<size_t>(n), static_cast<uint32_t>(rng()));
    for (auto& v : coarse) v = std::round(v * 2);  // many ties on the maximum
    rows.push_back(coarse);
    auto tail = randn(static_cast<size_t>(n), static_cast<uint32_t>(rng()));
    tail.back() = 100.f;
    rows.push_back(tail);
    rows.push_back(
        std::vector<float>(static_cast<size_t>(n), -std::numeric_limits<float>::infinity()));
  }
  std::vector<float> zeros(40, -0.0f);
  zeros[9] = 0.0f;
  zeros[3] = -0.0f;
  rows.push_back(zeros);
  int n_paths = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2}) {
    if (best_isa() < isa) {
      std::printf("[ skip     ] argmax %s: CPU lacks it\n", isa == Isa::kAvx2 ? "avx2" : "scalar");
      continue;
    }
    IsaOverride cap(isa);
    ++n_paths;
    for (const auto& r : rows) {
      const int64_t want = std::max_element(r.begin(), r.end()) - r.begin();
      ASSERT_EQ(argmax(r.data(), std::ssize(r)), want) << "n " << r.size();
      // The same row at an unaligned start.
      if (r.size() > 1) {
        const int64_t want1 = std::max_element(r.begin() + 1, r.end()) - (r.begin() + 1);
        ASSERT_EQ(argmax(r.data() + 1, std::ssize(r) - 1), want1) << "n " << r.size() - 1;
      }
    }
  }
  EXPECT_GE(n_paths, 1);
}

}  // namespace
}  // namespace kvstack

// deepseek2 layer math (deepseek2.h) against float64 references written from
// the definitions (ModelConfig::Moe, HF/YaRN paper formulas), not from the
// code under test:
//  - moe_route: every gating function, normalisation on and off, a scale, the
//    selection-only bias, exact ties (lower expert index wins);
//  - moe_forward: routed experts plus shared experts for a batch of tokens,
//    with and without shared experts, against a per-token float64 sum;
//  - rope_yarn_rows: the YaRN rotation (interpolated/extrapolated frequency
//    mix over the correction ramp, magnitude factor) and plain RoPE.
#include "engine/deepseek2.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

namespace kvstack {
namespace {

using Gating = ModelConfig::MoeGating;

// Float64 routing from the definition; ties broken toward the lower index.
void route_ref(const std::vector<float>& logits, const MoeRouteParams& p, std::vector<int>& ids,
               std::vector<double>& w) {
  const int n = p.n_expert;
  std::vector<double> probs(n);
  double mx = -1e300, sum = 0;
  for (int e = 0; e < n; ++e) mx = std::max(mx, static_cast<double>(logits[e]));
  for (int e = 0; e < n; ++e) {
    const double l = logits[e];
    probs[e] = p.gating == Gating::kSoftmax   ? std::exp(l - mx)
               : p.gating == Gating::kSigmoid ? 1.0 / (1.0 + std::exp(-l))
                                              : l;
    sum += probs[e];
  }
  if (p.gating == Gating::kSoftmax) {
    for (double& v : probs) v /= sum;
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const double sa = probs[a] + (p.bias ? p.bias[a] : 0.0);
    const double sb = probs[b] + (p.bias ? p.bias[b] : 0.0);
    return sa > sb;
  });
  ids.assign(order.begin(), order.begin() + p.n_used);
  w.clear();
  for (int id : ids) w.push_back(probs[id]);
  if (p.gating == Gating::kSoftmaxWeight) {
    double m = -1e300, s = 0;
    for (double v : w) m = std::max(m, v);
    for (double& v : w) s += (v = std::exp(v - m));
    for (double& v : w) v /= s;
  }
  if (p.norm) {
    double s = 0;
    for (double v : w) s += v;
    for (double& v : w) v /= std::max(s, 6.103515625e-5);
  }
  for (double& v : w) v *= p.scale;
}

TEST(MoeRoute, MatchesFloat64ReferenceForEveryGatingAndOption) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> bias(16);
  for (float& b : bias) b = 0.1f * nd(rng);
  int cases = 0;
  for (Gating g : {Gating::kSoftmax, Gating::kSigmoid, Gating::kSoftmaxWeight}) {
    for (bool norm : {false, true}) {
      for (float scale : {1.0f, 2.5f}) {
        for (const float* b : std::vector<const float*>{nullptr, bias.data()}) {
          const MoeRouteParams p{
              .gating = g, .n_expert = 16, .n_used = 4, .norm = norm, .scale = scale, .bias = b};
          for (int trial = 0; trial < 20; ++trial) {
            std::vector<float> logits(16);
            for (float& l : logits) l = nd(rng);
            std::vector<int32_t> ids(4);
            std::vector<float> w(4);
            moe_route(logits.data(), p, ids.data(), w.data());
            std::vector<int> rid;
            std::vector<double> rw;
            route_ref(logits, p, rid, rw);
            for (int k = 0; k < 4; ++k) {
              ASSERT_EQ(ids[k], rid[k]) << "gating " << static_cast<int>(g) << " k " << k;
              EXPECT_NEAR(w[k], rw[k], 1e-6 * std::max(1.0, std::abs(rw[k])));
            }
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 2 * 2 * 2 * 20);
}

TEST(MoeRoute, ExactTiesGoToTheLowerExpertAndBiasOnlySelects) {
  // Experts 1, 3 and 6 tie for the top score; top-2 takes 1 then 3.
  const std::vector<float> logits = {0.0f, 2.0f, -1.0f, 2.0f, 0.5f, 1.0f, 2.0f, -3.0f};
  MoeRouteParams p{.gating = Gating::kSoftmax, .n_expert = 8, .n_used = 2};
  int32_t ids[2];
  float w[2];
  moe_route(logits.data(), p, ids, w);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_FLOAT_EQ(w[0], w[1]);
  // A bias moving expert 7 to the top selects it, but its weight stays its
  // own (unbiased) probability; normalised weights then sum to 1.
  std::vector<float> bias(8, 0.0f);
  bias[7] = 10.0f;
  p.bias = bias.data();
  p.norm = true;
  moe_route(logits.data(), p, ids, w);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], 1);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  const double p7 = std::exp(-3.0) / z, p1 = std::exp(2.0) / z;
  EXPECT_NEAR(w[0], p7 / (p7 + p1), 1e-6);
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);
}

struct F32Mat {
  std::vector<float> a;
  WeightView view(int64_t n_in, int64_t n_out) const {
    return WeightView{GgmlType::kF32, reinterpret_cast<const uint8_t*>(a.data()), n_in, n_out};
  }
};

F32Mat random_mat(std::mt19937& rng, int64_t n_in, int64_t n_out) {
  std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(n_in)));
  F32Mat m;
  m.a.resize(static_cast<size_t>(n_in * n_out));
  for (float& v : m.a) v = nd(rng);
  return m;
}

// y = W x in float64, W [n_out][n_in].
std::vector<double> mv(const F32Mat& w, const std::vector<double>& x, int64_t n_out) {
  const auto n_in = static_cast<int64_t>(x.size());
  std::vector<double> y(n_out, 0.0);
  for (int64_t o = 0; o < n_out; ++o) {
    for (int64_t i = 0; i < n_in; ++i) y[o] += static_cast<double>(w.a[o * n_in + i]) * x[i];
  }
  return y;
}

std::vector<double> swiglu_ref(const F32Mat& g, const F32Mat& u, const F32Mat& dn,
                               const std::vector<double>& x, int64_t ff) {
  std::vector<double> a = mv(g, x, ff), b = mv(u, x, ff);
  for (int64_t i = 0; i < ff; ++i) a[i] = a[i] / (1.0 + std::exp(-a[i])) * b[i];
  return mv(dn, a, static_cast<int64_t>(dn.a.size()) / ff);
}

TEST(MoeForward, RoutedPlusSharedExpertsMatchFloat64) {
  constexpr int64_t d = 32, E = 6, K = 2, F = 16, S = 2, n_tok = 9;
  for (bool shared : {false, true}) {
    std::mt19937 rng(shared ? 11 : 12);
    F32Mat router = random_mat(rng, d, E);
    std::vector<F32Mat> g, u, dn;
    MoeWeights w;
    w.router = router.view(d, E);
    for (int e = 0; e < E; ++e) {
      g.push_back(random_mat(rng, d, F));
      u.push_back(random_mat(rng, d, F));
      dn.push_back(random_mat(rng, F, d));
    }
    for (int e = 0; e < E; ++e) {
      w.gate.push_back(g[e].view(d, F));
      w.up.push_back(u[e].view(d, F));
      w.down.push_back(dn[e].view(F, d));
    }
    F32Mat sg = random_mat(rng, d, F * S), su = random_mat(rng, d, F * S);
    F32Mat sd = random_mat(rng, F * S, d);
    if (shared) {
      w.sh_gate = sg.view(d, F * S);
      w.sh_up = su.view(d, F * S);
      w.sh_down = sd.view(F * S, d);
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> h(n_tok * d), out(n_tok * d, 123.0f);
    for (float& v : h) v = nd(rng);
    const MoeRouteParams p{
        .gating = Gating::kSigmoid, .n_expert = E, .n_used = K, .norm = true, .scale = 1.5f};
    MoeScratch scratch;
    moe_forward(w, p, h.data(), n_tok, out.data(), scratch, nullptr);
    std::vector<bool> used(E, false);
    for (int64_t t = 0; t < n_tok; ++t) {
      std::vector<double> x(h.begin() + t * d, h.begin() + (t + 1) * d);
      std::vector<double> lg = mv(router, x, E);
      std::vector<float> lf(lg.begin(), lg.end());
      std::vector<int> ids;
      std::vector<double> wt;
      route_ref(lf, p, ids, wt);
      std::vector<double> ref(d, 0.0);
      if (shared) ref = swiglu_ref(sg, su, sd, x, F * S);
      for (int k = 0; k < K; ++k) {
        used[ids[k]] = true;
        const std::vector<double> y = swiglu_ref(g[ids[k]], u[ids[k]], dn[ids[k]], x, F);
        for (int64_t i = 0; i < d; ++i) ref[i] += wt[k] * y[i];
      }
      for (int64_t i = 0; i < d; ++i) {
        EXPECT_NEAR(out[t * d + i], ref[i], 1e-4) << "token " << t << " dim " << i;
      }
    }
    EXPECT_GE(std::count(used.begin(), used.end(), true), 3);  // several experts ran
  }
}

ModelConfig rope_config(bool yarn) {
  ModelConfig c;
  c.n_rot = 16;
  c.rope_freq_base = 10000.0f;
  c.rope_freq_scale = yarn ? 0.25f : 1.0f;
  if (yarn) {
    c.yarn.enabled = true;
    c.yarn.n_ctx_orig = 256;
    // corr dims as the YaRN definition: dim where the wavelength fits beta times
    // in the original context, floor/ceil, clamped to [0, n_rot - 1].
    auto dim = [&](double beta) {
      return c.n_rot * std::log(256.0 / (beta * 2 * M_PI)) / (2 * std::log(10000.0));
    };
    c.yarn.corr_lo = static_cast<float>(std::max(0.0, std::floor(dim(32))));
    c.yarn.corr_hi = static_cast<float>(std::min(15.0, std::ceil(dim(1))));
    c.yarn.rope_mscale = 1.2f;
  }
  return c;
}

TEST(RopeYarn, MatchesFloat64Definition) {
  for (bool yarn : {false, true}) {
    const ModelConfig c = rope_config(yarn);
    const int64_t stride = 24, n_tok = 5, per = 3;  // 3 heads per position, rope in dims 0..15
    const std::vector<int32_t> pos = {0, 1, 7, 300, 1000};
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(n_tok * per * stride);
    for (float& v : x) v = nd(rng);
    std::vector<float> y = x;
    rope_yarn_rows(y.data(), n_tok * per, stride, per, pos.data(), c);
    for (int64_t r = 0; r < n_tok * per; ++r) {
      const double p = pos[r / per];
      for (int i = 0; i < c.n_rot / 2; ++i) {
        const double theta_e = p * std::pow(10000.0, -2.0 * i / c.n_rot);
        double theta = theta_e * c.rope_freq_scale, mag = 1.0;
        if (yarn) {
          // ramp 1 below corr_lo (extrapolate: original frequency), 0 above corr_hi.
          const double t =
              (i - c.yarn.corr_lo) / std::max(0.001, double{c.yarn.corr_hi} - c.yarn.corr_lo);
          const double mix = 1.0 - std::clamp(t, 0.0, 1.0);
          theta = theta * (1 - mix) + theta_e * mix;
          mag = c.yarn.rope_mscale;
        }
        const double a = x[r * stride + 2 * i], b = x[r * stride + 2 * i + 1];
        const double tol = 2e-6 * std::max(1.0, p);  // float theta at large positions
        EXPECT_NEAR(y[r * stride + 2 * i], mag * (a * std::cos(theta) - b * std::sin(theta)), tol);
        EXPECT_NEAR(y[r * stride + 2 * i + 1], mag * (a * std::sin(theta) + b * std::cos(theta)),
                    tol);
      }
      for (int64_t j = c.n_rot; j < stride; ++j) EXPECT_EQ(y[r * stride + j], x[r * stride + j]);
    }
  }
}

}  // namespace
}  // namespace kvstack

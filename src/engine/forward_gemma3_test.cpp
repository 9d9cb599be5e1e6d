// gemma3 layer math against a float64 recomputation: a small random-weight
// gemma3 GGUF (7 layers, so the default pattern gives window layers 0-4 and 6
// and a full layer 5; window 5 tokens, shorter than the prompt) runs through
// the paged cache (prefill splits, decode, several block sizes) and every
// logits row is compared with a float64 forward that applies, independently
// written here: the sqrt(n_embd) embedding scale, per-head RMSNorm of q and
// k, RoPE (NeoX pairing) with base 1e4 on window layers and the file's base
// on full ones, the 1/sqrt(head_dim) query scale, the per-layer window mask,
// post-attention and post-FFN RMSNorm, GeGLU with exact tanh GELU and tied
// output. The one deliberate difference is llama.cpp's f16 GELU table
// (elementwise.h), a relative error of ~5e-4 per activation: hence
// kGemmaLogitTol. The test also shows it can fail: the same reference
// without windows, or with one RoPE base everywhere, is far outside it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include <unistd.h>

#include "engine/forward.h"
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/layout.h"
#include "model/config.h"
#include "ops/elementwise.h"

namespace kvstack {
namespace {

using testing::Bytes;
using testing::f32_tensor;
using testing::GgufBuilder;
using testing::kv_round;
using testing::kVF32;
using testing::logits_rel_err;
using testing::random_vec;

constexpr int kLayers = 7, kEmbd = 64, kHeads = 4, kKvHeads = 1, kHeadDim = 32, kFf = 96;
constexpr int kVocab = 50, kWindow = 5;
constexpr double kGlobalBase = 1e6, kLocalBase = 1e4, kEps = 1e-6;
// f16 GELU table (relative 2^-11 per activation, through 7 layers) against
// exact GELU; measured max 6.9e-4 on these weights.
constexpr double kGemmaLogitTol = 2e-3;

struct GemmaWeights {
  std::vector<double> embd, out_norm;  // [n_vocab, n_embd], [n_embd]
  struct Layer {
    std::vector<double> attn_norm, wq, wk, wv, wo, q_norm, k_norm, post_attn;
    std::vector<double> ffn_norm, gate, up, down, post_ffn;
  };
  std::vector<Layer> layers;
};

// Writes the gemma3 file; returns its path and fills `w`.
std::string write_gemma3(GemmaWeights& w, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t q_dim = static_cast<size_t>(kHeads) * kHeadDim;
  const size_t kv_dim = static_cast<size_t>(kKvHeads) * kHeadDim;
  const double ws = 1.0 / std::sqrt(static_cast<double>(kEmbd));
  // Small embeddings: the model scales them by sqrt(n_embd) = 8.
  w.embd = random_vec(rng, static_cast<size_t>(kVocab) * kEmbd, 0.125);
  w.out_norm = random_vec(rng, kEmbd, 0.1, 1.0);
  GgufBuilder b;
  const std::string a = "gemma3.";
  b.add_string("general.architecture", "gemma3");
  b.add_u32(a + "block_count", kLayers);
  b.add_u32(a + "embedding_length", kEmbd);
  b.add_u32(a + "attention.head_count", kHeads);
  b.add_u32(a + "attention.head_count_kv", kKvHeads);
  b.add_u32(a + "attention.key_length", kHeadDim);
  b.add_u32(a + "attention.value_length", kHeadDim);
  b.add_u32(a + "feed_forward_length", kFf);
  b.add_u32(a + "context_length", 512);
  b.add_u32(a + "vocab_size", kVocab);
  b.add_u32(a + "attention.sliding_window", kWindow);
  b.add_scalar<float>(a + "rope.freq_base", kVF32, static_cast<float>(kGlobalBase));
  b.add_scalar<float>(a + "attention.layer_norm_rms_epsilon", kVF32, static_cast<float>(kEps));
  b.add_tensor("token_embd.weight", {kEmbd, kVocab}, 0, f32_tensor(w.embd));
  b.add_tensor("output_norm.weight", {kEmbd}, 0, f32_tensor(w.out_norm));
  auto mat = [&](const std::string& name, size_t n_in, size_t n_out, double scale) {
    auto v = random_vec(rng, n_in * n_out, scale);
    b.add_tensor(name, {n_in, n_out}, 0, f32_tensor(v));
    return v;
  };
  auto vec = [&](const std::string& name, size_t n, double scale, double offset) {
    auto v = random_vec(rng, n, scale, offset);
    b.add_tensor(name, {n}, 0, f32_tensor(v));
    return v;
  };
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    GemmaWeights::Layer L;
    L.attn_norm = vec(p + "attn_norm.weight", kEmbd, 0.1, 1.0);
    L.wq = mat(p + "attn_q.weight", kEmbd, q_dim, ws);
    L.wk = mat(p + "attn_k.weight", kEmbd, kv_dim, ws);
    L.wv = mat(p + "attn_v.weight", kEmbd, kv_dim, ws);
    L.q_norm = vec(p + "attn_q_norm.weight", kHeadDim, 0.3, 1.0);
    L.k_norm = vec(p + "attn_k_norm.weight", kHeadDim, 0.3, 1.0);
    L.wo = mat(p + "attn_output.weight", q_dim, kEmbd, ws);
    L.post_attn = vec(p + "post_attention_norm.weight", kEmbd, 0.1, 0.5);
    L.ffn_norm = vec(p + "ffn_norm.weight", kEmbd, 0.1, 1.0);
    L.gate = mat(p + "ffn_gate.weight", kEmbd, kFf, 2 * ws);
    L.up = mat(p + "ffn_up.weight", kEmbd, kFf, ws);
    L.down = mat(p + "ffn_down.weight", kFf, kEmbd, 1.0 / std::sqrt(static_cast<double>(kFf)));
    L.post_ffn = vec(p + "post_ffw_norm.weight", kEmbd, 0.1, 0.5);
    w.layers.push_back(std::move(L));
  }
  const Bytes img = b.build();
  char tmpl[] = "/tmp/kvstack_gemma3_XXXXXX";
  const int fd = mkstemp(tmpl);
  EXPECT_GE(fd, 0);
  if (fd >= 0) {
    EXPECT_EQ(::write(fd, img.data(), img.size()), static_cast<ssize_t>(img.size()));
    ::close(fd);
  }
  return tmpl;
}

bool is_window_layer(int l) {
  return l % 6 < 5;
}

struct RefOptions {
  bool windows = true;     // false: every layer attends to the whole prefix
  bool local_base = true;  // false: the file's RoPE base on every layer
  KvDtype kv = KvDtype::kF32;
};

// Float64 logits [n_vocab] of the last of tokens[0, n).
std::vector<double> reference(const GemmaWeights& w, const std::vector<int32_t>& tokens, int n,
                              const RefOptions& o) {
  const int q_dim = kHeads * kHeadDim, kv_dim = kKvHeads * kHeadDim;
  auto norm = [](const double* v, size_t len, const double* g, double* out) {
    double ss = 0;
    for (size_t i = 0; i < len; ++i) ss += v[i] * v[i];
    const double sc = 1.0 / std::sqrt(ss / static_cast<double>(len) + kEps);
    for (size_t i = 0; i < len; ++i) out[i] = v[i] * sc * g[i];
  };
  auto matvec = [](const std::vector<double>& W, const std::vector<double>& v, size_t n_out) {
    std::vector<double> out(n_out, 0.0);
    for (size_t r = 0; r < n_out; ++r) {
      double acc = 0;
      for (size_t i = 0; i < v.size(); ++i) acc += W[r * v.size() + i] * v[i];
      out[r] = acc;
    }
    return out;
  };
  auto gelu = [](double x) {
    return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * x * (1.0 + 0.044715 * x * x)));
  };
  std::vector<std::vector<double>> x(n, std::vector<double>(kEmbd));
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < kEmbd; ++i) {
      x[t][i] = w.embd[static_cast<size_t>(tokens[t]) * kEmbd + i] * std::sqrt(double{kEmbd});
    }
  }
  for (int l = 0; l < kLayers; ++l) {
    const auto& L = w.layers[l];
    const bool windowed = o.windows && is_window_layer(l);
    const double base = o.local_base && is_window_layer(l) ? kLocalBase : kGlobalBase;
    auto rope = [&](std::vector<double>& v, int n_h, int pos) {
      for (int h = 0; h < n_h; ++h) {
        for (int i = 0; i < kHeadDim / 2; ++i) {
          const double theta = pos * std::pow(base, -2.0 * i / kHeadDim);
          double& x0 = v[h * kHeadDim + i];
          double& x1 = v[h * kHeadDim + i + kHeadDim / 2];
          const double a0 = x0, a1 = x1;
          x0 = a0 * std::cos(theta) - a1 * std::sin(theta);
          x1 = a0 * std::sin(theta) + a1 * std::cos(theta);
        }
      }
    };
    std::vector<std::vector<double>> q(n), k(n), v(n);
    std::vector<double> h(kEmbd);
    for (int t = 0; t < n; ++t) {
      norm(x[t].data(), kEmbd, L.attn_norm.data(), h.data());
      q[t] = matvec(L.wq, h, q_dim);
      k[t] = matvec(L.wk, h, kv_dim);
      v[t] = matvec(L.wv, h, kv_dim);
      for (int hh = 0; hh < kHeads; ++hh) {
        double* r = q[t].data() + hh * kHeadDim;
        norm(r, kHeadDim, L.q_norm.data(), r);
      }
      for (int hh = 0; hh < kKvHeads; ++hh) {
        double* r = k[t].data() + hh * kHeadDim;
        norm(r, kHeadDim, L.k_norm.data(), r);
      }
      rope(q[t], kHeads, t);
      rope(k[t], kKvHeads, t);
      for (double& e : k[t]) e = kv_round(e, o.kv);
      for (double& e : v[t]) e = kv_round(e, o.kv);
    }
    for (int t = 0; t < n; ++t) {
      std::vector<double> att(q_dim, 0.0);
      const int first = windowed ? std::max(0, t - kWindow + 1) : 0;
      for (int hh = 0; hh < kHeads; ++hh) {
        const int kvh = hh / (kHeads / kKvHeads);
        std::vector<double> sc(t + 1 - first);
        double mx = -1e300;
        for (int j = first; j <= t; ++j) {
          double d = 0;
          for (int i = 0; i < kHeadDim; ++i) {
            d += q[t][hh * kHeadDim + i] * k[j][kvh * kHeadDim + i];
          }
          sc[j - first] = d / std::sqrt(double{kHeadDim});
          mx = std::max(mx, sc[j - first]);
        }
        double sum = 0;
        for (double& e : sc) sum += (e = std::exp(e - mx));
        for (int j = first; j <= t; ++j) {
          for (int i = 0; i < kHeadDim; ++i) {
            att[hh * kHeadDim + i] += sc[j - first] / sum * v[j][kvh * kHeadDim + i];
          }
        }
      }
      auto o_proj = matvec(L.wo, att, kEmbd);
      norm(o_proj.data(), kEmbd, L.post_attn.data(), o_proj.data());
      for (int i = 0; i < kEmbd; ++i) x[t][i] += o_proj[i];
      norm(x[t].data(), kEmbd, L.ffn_norm.data(), h.data());
      const auto g = matvec(L.gate, h, kFf);
      const auto u = matvec(L.up, h, kFf);
      std::vector<double> act(kFf);
      for (int i = 0; i < kFf; ++i) act[i] = gelu(g[i]) * u[i];
      auto d = matvec(L.down, act, kEmbd);
      norm(d.data(), kEmbd, L.post_ffn.data(), d.data());
      for (int i = 0; i < kEmbd; ++i) x[t][i] += d[i];
    }
  }
  std::vector<double> hn(kEmbd);
  norm(x[n - 1].data(), kEmbd, w.out_norm.data(), hn.data());
  return matvec(w.embd, hn, kVocab);
}

class Gemma3Forward : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = write_gemma3(w_, 11);
    auto m = Model::load(path);
    std::remove(path.c_str());
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(*m);
  }
  GemmaWeights w_;
  std::unique_ptr<Model> model_;
  ThreadPool threads_{2};
};

TEST_F(Gemma3Forward, ConfigFollowsLlamaCppGemma3Defaults) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.arch, "gemma3");
  EXPECT_TRUE(c.rope_neox);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.post_norms);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.ffn_act, ModelConfig::FfnAct::kGeluTanh);
  EXPECT_EQ(c.embd_scale, std::sqrt(static_cast<float>(kEmbd)));
  EXPECT_EQ(c.attn_scale, 1.0f / std::sqrt(static_cast<float>(kHeadDim)));
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(c.window(l), is_window_layer(l) ? kWindow : 0) << "layer " << l;
    EXPECT_EQ(c.rope_base(l), is_window_layer(l) ? 1e4f : 1e6f) << "layer " << l;
    EXPECT_EQ(c.rope_scale(l), 1.0f);
    const LayerWeights& lw = model_->layers()[l];
    EXPECT_NE(lw.attn_q_norm, nullptr);
    EXPECT_NE(lw.attn_k_norm, nullptr);
    EXPECT_NE(lw.attn_post_norm, nullptr);
    EXPECT_NE(lw.ffn_post_norm, nullptr);
  }
}

TEST_F(Gemma3Forward, EmbeddingIsScaledBySqrtEmbd) {
  std::vector<float> row(kEmbd);
  const int32_t tok = 17;
  model_->embed(&tok, 1, row.data());
  const float s = std::sqrt(static_cast<float>(kEmbd));
  for (int i = 0; i < kEmbd; ++i) {
    // f32 weights: exact float product, and within 1 ulp of the float64 one.
    EXPECT_EQ(row[i], static_cast<float>(w_.embd[tok * kEmbd + i]) * s);
    EXPECT_NEAR(row[i], w_.embd[tok * kEmbd + i] * std::sqrt(double{kEmbd}),
                1e-6 * std::fabs(row[i]) + 1e-30);
  }
}

TEST_F(Gemma3Forward, PrefillSplitsAndDecodeMatchFloat64) {
  Forward fwd(*model_, threads_);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
  const int n_prompt = 19, n_decode = 5;
  std::vector<int32_t> prompt(n_prompt + n_decode);
  for (auto& t : prompt) t = tok(rng);
  double worst = 0;
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16}) {
    std::vector<std::vector<double>> ref(prompt.size());
    for (size_t j = 0; j < prompt.size(); ++j) {
      ref[j] = reference(w_, prompt, static_cast<int>(j) + 1, {.kv = dtype});
    }
    for (int block_size : {1, 4, 16}) {
      auto layout = KvLayout::uniform(kLayers, kKvHeads, kHeadDim, dtype, block_size);
      ASSERT_TRUE(layout.ok());
      auto pool = BlockPool::create(*layout, {.n_tokens = 2048});
      ASSERT_TRUE(pool.ok());
      for (int chunk : {1, 4, n_prompt}) {
        BlockTable junk(**pool), seq(**pool);
        ASSERT_TRUE(junk.reserve(2 * block_size).ok());
        std::vector<float> logits;
        for (int b = 0; b < n_prompt; b += chunk) {
          const int e = std::min(n_prompt, b + chunk);
          const StepSeq s{.table = &seq,
                          .tokens = std::span<const int32_t>(prompt.data() + b, e - b),
                          .logits = LogitsMode::kAll};
          ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
          if (b == 0) junk.release();
          for (int j = b; j < e; ++j) {
            const double err = logits_rel_err(logits.data() + (j - b) * kVocab, ref[j]);
            worst = std::max(worst, err);
            ASSERT_LT(err, kGemmaLogitTol) << kv_dtype_name(dtype) << " block " << block_size
                                           << " chunk " << chunk << " position " << j;
          }
        }
        for (int d = 0; d < n_decode; ++d) {
          const StepSeq s{.table = &seq,
                          .tokens = std::span<const int32_t>(&prompt[n_prompt + d], 1)};
          ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
          const double err = logits_rel_err(logits.data(), ref[n_prompt + d]);
          worst = std::max(worst, err);
          ASSERT_LT(err, kGemmaLogitTol) << "decode " << d << " block " << block_size;
        }
        (*pool)->check_invariants();
      }
    }
  }
  std::printf("gemma3 synthetic: worst logits error %.3g (tolerance %.3g)\n", worst,
              kGemmaLogitTol);
}

// The comparison has teeth: the last position (19 tokens, window 5) against
// references that drop the window mask or use one RoPE base lands far
// outside the tolerance.
TEST_F(Gemma3Forward, WindowAndLocalRopeBaseChangeTheResult) {
  Forward fwd(*model_, threads_);
  std::vector<int32_t> prompt(19);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7 + 3) % kVocab);
  auto layout = KvLayout::uniform(kLayers, kKvHeads, kHeadDim, KvDtype::kF32, 16);
  ASSERT_TRUE(layout.ok());
  auto pool = BlockPool::create(*layout, {.n_tokens = 256});
  ASSERT_TRUE(pool.ok());
  BlockTable seq(**pool);
  std::vector<float> logits;
  const StepSeq s{.table = &seq, .tokens = prompt, .logits = LogitsMode::kLast};
  ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
  const int n = static_cast<int>(prompt.size());
  EXPECT_LT(logits_rel_err(logits.data(), reference(w_, prompt, n, {})), kGemmaLogitTol);
  EXPECT_GT(logits_rel_err(logits.data(), reference(w_, prompt, n, {.windows = false})),
            10 * kGemmaLogitTol);
  EXPECT_GT(logits_rel_err(logits.data(), reference(w_, prompt, n, {.local_base = false})),
            10 * kGemmaLogitTol);
}

}  // namespace
}  // namespace kvstack

// --kv-center (key_center.h): a per-layer, per-channel key mean mu is
// subtracted from every key after RoPE, before rotation and storage.
//  - f32 cache: logits equal the uncentered forward's to float error (softmax
//    removes the common shift q.mu), the stored keys are k - mu and the
//    values are untouched; with --kv-rotate the stored keys are R (k - mu);
//  - calibration: mu is the mean of the post-RoPE keys of the calibration
//    tokens (checked against the keys an uncentered f32 cache stores),
//    rounded to 1/256, and the same for one and for two threads;
//  - quantized caches (int8, int4): chunked prefill, decode and a fork give
//    the logits of a float64 recomputation whose keys are the stored rows
//    plus mu, and the stored rows are the format's quantization of k - mu;
//  - the identity key changes with mu.
#include "engine/key_center.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/forward.h"
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/layout.h"
#include "kv/rotation.h"

namespace kvstack {
namespace {

using testing::expect_same_logits_by_chunks;
using testing::kInt4MaxErr;
using testing::load_synthetic_model;
using testing::reference_last_logits;
using testing::run_prefill_decode_fork;
using testing::stored_row;
using testing::SyntheticSpec;

// A center with large offsets (|mu| up to 4, multiples of the step), so that
// a forward that ignored it, or failed to subtract it everywhere, would show.
KeyCenter big_center(const SyntheticSpec& spec, uint32_t seed) {
  KeyCenter kc;
  kc.n_layers = spec.n_layers;
  kc.kv_dim = spec.n_kv_heads * spec.head_dim();
  kc.n_tokens = 1;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> steps(-1024, 1024);
  kc.mean.resize(static_cast<size_t>(kc.n_layers) * kc.kv_dim);
  for (float& m : kc.mean) m = static_cast<float>(steps(rng)) * kKeyCenterStep;
  return kc;
}

std::vector<int32_t> random_tokens(const SyntheticSpec& spec, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = tok(rng);
  return out;
}

TEST(KeyCenter, F32LogitsUnchangedAndCacheHoldsCenteredKeys) {
  SyntheticSpec spec;
  spec.seed = 21;
  spec.n_embd = 128;  // 4 q heads, 2 kv heads, head_dim 32
  auto loaded = load_synthetic_model(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  const std::unique_ptr<Model>& model = loaded->model;
  const KeyCenter kc = big_center(spec, 5);
  const int d = spec.head_dim();
  for (const KvRotation rot : {KvRotation::kNone, KvRotation::kHadamard}) {
    SCOPED_TRACE(kv_rotation_name(rot));
    ThreadPool threads(2);
    Forward plain(*model, threads), centered(*model, threads, rot);
    centered.set_key_center(&kc);
    auto layout =
        KvLayout::uniform(spec.n_layers, spec.n_kv_heads, spec.head_dim(), KvDtype::kF32, 4);
    ASSERT_TRUE(layout.ok());
    auto pool = BlockPool::create(*layout, {.n_tokens = 256});
    ASSERT_TRUE(pool.ok());
    const std::vector<int32_t> prompt = random_tokens(spec, 13, 3);
    BlockTable tp(**pool), tc(**pool);
    expect_same_logits_by_chunks(plain, tp, centered, tc, prompt, {{0, 9}, {9, 12}, {12, 13}},
                                 1e-5);
    if (HasFatalFailure()) return;
    // Stored K = R (k - mu), stored V = R v (R = I without rotation).
    double moved = 0;
    for (int l = 0; l < spec.n_layers; ++l) {
      const PagedKvLayerView v = (*pool)->layer_view(l);
      for (int pos : {0, 6, 12}) {
        for (int h = 0; h < spec.n_kv_heads; ++h) {
          for (int which = 0; which < 2; ++which) {
            std::vector<float> p = stored_row(v, tp, pos, h, which);
            const std::vector<float> c = stored_row(v, tc, pos, h, which);
            if (which == 0) {
              for (int i = 0; i < d; ++i) p[i] -= kc.layer(l)[h * d + i];
            }
            kv_rotate(rot, p.data(), 1, d);
            double amax = 0, diff = 0;
            for (int i = 0; i < d; ++i) {
              amax = std::max(amax, static_cast<double>(std::fabs(p[i])));
              diff = std::max(diff, static_cast<double>(std::fabs(p[i] - c[i])));
            }
            EXPECT_LE(diff, 1e-5 * amax)
                << "layer " << l << " pos " << pos << " head " << h << (which == 0 ? " K" : " V");
            if (which == 0) {
              const std::vector<float> raw = stored_row(v, tp, pos, h, 0);
              for (int i = 0; i < d; ++i) moved = std::max(moved, std::fabs(double(raw[i]) - c[i]));
            }
          }
        }
      }
    }
    EXPECT_GT(moved, 0.5) << "centered keys equal the plain ones: mu not applied?";
  }
}

TEST(KeyCenter, CalibrationIsTheRoundedMeanOfPostRopeKeysForAnyThreadCount) {
  SyntheticSpec spec;
  spec.seed = 8;
  spec.n_embd = 128;
  auto loaded = load_synthetic_model(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  const std::unique_ptr<Model>& model = loaded->model;
  const std::vector<int32_t> tokens = random_tokens(spec, 37, 11);
  ThreadPool one(1), two(2);
  // Chunks of 16: the calibration runs several prefill steps.
  auto c1 = calibrate_key_center(*model, one, tokens, 16);
  auto c2 = calibrate_key_center(*model, two, tokens, 16);
  ASSERT_TRUE(c1.ok()) << c1.error().message;
  ASSERT_TRUE(c2.ok()) << c2.error().message;
  EXPECT_EQ(c1->key(), c2->key());
  EXPECT_EQ(c1->mean, c2->mean);
  EXPECT_EQ(c1->n_tokens, 37);
  ASSERT_EQ(c1->mean.size(),
            static_cast<size_t>(spec.n_layers * spec.n_kv_heads * spec.head_dim()));

  // The mean of the keys an uncentered f32 cache stores for the same tokens.
  auto layout =
      KvLayout::uniform(spec.n_layers, spec.n_kv_heads, spec.head_dim(), KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool = BlockPool::create(*layout, {.n_tokens = 64});
  ASSERT_TRUE(pool.ok());
  Forward plain(*model, two);
  BlockTable t(**pool);
  const StepSeq s{.table = &t, .tokens = tokens, .logits = LogitsMode::kNone};
  ASSERT_TRUE(plain.step(std::span<const StepSeq>(&s, 1), nullptr).ok());
  const int d = spec.head_dim();
  double largest = 0;
  for (int l = 0; l < spec.n_layers; ++l) {
    const PagedKvLayerView v = (*pool)->layer_view(l);
    for (int h = 0; h < spec.n_kv_heads; ++h) {
      std::vector<double> sum(static_cast<size_t>(d), 0.0);
      for (int pos = 0; pos < static_cast<int>(tokens.size()); ++pos) {
        const std::vector<float> k = stored_row(v, t, pos, h, 0);
        for (int i = 0; i < d; ++i) sum[i] += k[i];
      }
      for (int i = 0; i < d; ++i) {
        const double mean = sum[i] / static_cast<double>(tokens.size());
        const float got = c1->layer(l)[h * d + i];
        EXPECT_LE(std::fabs(got - mean), 0.5 * kKeyCenterStep + 1e-5)
            << "layer " << l << " head " << h << " channel " << i;
        EXPECT_EQ(got, std::round(got / kKeyCenterStep) * kKeyCenterStep) << "not on the grid";
        largest = std::max(largest, std::fabs(mean));
      }
    }
  }
  EXPECT_GT(largest, 2 * kKeyCenterStep) << "all means round to zero: the test shows nothing";

  EXPECT_FALSE(calibrate_key_center(*model, two, {}).ok());
  std::vector<int32_t> too_long(static_cast<size_t>(spec.n_ctx) + 1, 1);
  auto err = calibrate_key_center(*model, two, too_long);
  ASSERT_FALSE(err.ok());
  EXPECT_NE(err.error().message.find("context"), std::string::npos) << err.error().message;
}

TEST(KeyCenter, IdentityKeyFollowsTheMeans) {
  SyntheticSpec spec;
  const KeyCenter a = big_center(spec, 1);
  KeyCenter b = a;
  EXPECT_EQ(a.key(), b.key());
  b.mean[3] += kKeyCenterStep;
  EXPECT_NE(a.key(), b.key());
  KeyCenter c = a;
  c.kv_dim /= 2;
  c.n_layers *= 2;
  EXPECT_NE(a.key(), c.key()) << "the shape is part of the key";
  EXPECT_EQ(a.key().rfind("kcenter;", 0), 0U) << a.key();
}

// Quantized caches: the forward's logits are those of a float64 model whose
// keys are the stored rows + mu (softmax makes "+ mu" irrelevant, which is
// the claim under test), and the stored rows quantize k - mu.
TEST(KeyCenter, QuantizedCacheMatchesReferenceOverStoredCenteredKeys) {
  SyntheticSpec spec;
  spec.seed = 7;
  spec.n_embd = 128;
  auto loaded = load_synthetic_model(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  const testing::SyntheticWeights& w = loaded->weights;
  const std::unique_ptr<Model>& model = loaded->model;
  const KeyCenter kc = big_center(spec, 9);
  ThreadPool threads(2);
  Forward fwd(*model, threads);
  fwd.set_key_center(&kc);
  const int n_prompt = 11, n_decode = 3, block_size = 4;
  const std::vector<int32_t> prompt = random_tokens(spec, n_prompt + n_decode, 41);
  const std::vector<int32_t> fork_tail = random_tokens(spec, 3, 42);
  const int d = spec.head_dim();
  const struct {
    const char* name;
    KvDtype dtype;
    double max_err;  // worst |(k - mu) - stored| / amax(k - mu)
  } formats[] = {{"int8", KvDtype::kInt8, 0.5 / 127 * 1.01}, {"int4", KvDtype::kInt4, kInt4MaxErr}};
  for (const auto& f : formats) {
    SCOPED_TRACE(f.name);
    auto layout = KvLayout::uniform(spec.n_layers, spec.n_kv_heads, d, f.dtype, block_size);
    ASSERT_TRUE(layout.ok()) << layout.error().message;
    auto pool_r = BlockPool::create(*layout, {.n_tokens = 256});
    ASSERT_TRUE(pool_r.ok());
    BlockPool& pool = **pool_r;
    double worst = 0;
    run_prefill_decode_fork(
        fwd, pool, spec.n_vocab, prompt, n_prompt, 2, fork_tail,
        [&](const std::vector<int32_t>& tokens, int n, const BlockTable& table) {
          return reference_last_logits(
              w, std::vector<int32_t>(tokens.begin(), tokens.begin() + n),
              [&](int layer, int pos, std::vector<double>& k, std::vector<double>& v) {
                const PagedKvLayerView view = pool.layer_view(layer);
                for (int h = 0; h < spec.n_kv_heads; ++h) {
                  const float* mu = kc.layer(layer) + h * d;
                  const std::vector<float> sk = stored_row(view, table, pos, h, 0);
                  const std::vector<float> sv = stored_row(view, table, pos, h, 1);
                  double amax = 1e-30;
                  for (int i = 0; i < d; ++i)
                    amax = std::max(amax, std::fabs(k[h * d + i] - mu[i]));
                  for (int i = 0; i < d; ++i) {
                    const double x = k[h * d + i] - mu[i];
                    worst = std::max(worst, std::fabs(x - sk[i]) / amax);
                    k[h * d + i] = static_cast<double>(sk[i]) + mu[i];
                    v[h * d + i] = sv[i];
                  }
                }
              });
        },
        testing::decode_row_tol(*layout));
    if (HasFatalFailure()) return;
    EXPECT_LE(worst, f.max_err) << "stored keys are not the quantized k - mu";
    EXPECT_GT(worst, 0.0) << "no quantization error at all: K not quantized?";
    pool.check_invariants();
  }
}

}  // namespace
}  // namespace kvstack

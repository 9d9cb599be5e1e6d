// Cross-layer KV sharing (YOCO / Gemma 3n; config.h, kv-cache-spec.md
// section 12): synthetic models whose last N layers are declared
// (<arch>.attention.shared_kv_layers) to read the K/V of the last storing
// layer with their window. Such a layer computes no K/V and the pool holds
// nothing for it: the KV layout has n_layers - N layers. Logits of chunked
// prefill, decode and a fork through the paged cache equal a float64
// recomputation in which each shared layer attends over its source layer's
// K/V (synthetic_model.h), for several block sizes; the reference without
// sharing differs (the declaration changes the model), and the engine's
// layout and pool are smaller by exactly the shared layers.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

using testing::reference_last_logits;
using testing::SyntheticCase;
using testing::SyntheticSpec;

// The layout the engine builds: the storing layers only (the first
// n_layers - shared_kv_layers), each with its window.
KvLayout storing_layout(const SyntheticSpec& spec, int block_size) {
  SyntheticSpec s = spec;
  s.n_layers = spec.n_layers - spec.shared_kv_layers;
  if (!s.layer_window.empty()) s.layer_window.resize(static_cast<size_t>(s.n_layers));
  return testing::window_layout(s, KvDtype::kF32, block_size);
}

class SharedKv : public testing::SyntheticForwardTest {};

TEST_P(SharedKv, SharedLayersReadTheirSourceAndStoreNothing) {
  const SyntheticSpec& spec = GetParam().spec;
  const ModelConfig& c = model_->config();
  ASSERT_EQ(c.shared_kv_layers, spec.shared_kv_layers);
  ASSERT_EQ(c.n_kv_layers(), spec.n_layers - spec.shared_kv_layers);
  for (int l = 0; l < spec.n_layers; ++l) {
    EXPECT_EQ(c.kv_source(l), spec.kv_source(l)) << "layer " << l;
    EXPECT_EQ(c.stores_kv(l), l < c.n_kv_layers()) << "layer " << l;
  }
  // The engine's layout: one layer per storing layer, nothing for the others.
  EngineConfig ec;
  ec.kv_dtype = KvDtype::kF32;
  auto layout = engine_kv_layout(c, ec);
  ASSERT_TRUE(layout.ok()) << layout.error().message;
  EXPECT_EQ(layout->n_layers(), c.n_kv_layers());
  EXPECT_EQ(layout->payload_bytes_per_token(),
            int64_t{2} * c.n_kv_layers() * spec.n_kv_heads * spec.head_dim() * 4);

  std::mt19937 rng(spec.seed + 300);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  std::vector<int32_t> prompt(29), tail(5);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : tail) t = tok(rng);
  // Declaring the sharing changes the model: the unshared reference differs.
  SyntheticSpec unshared_spec = spec;
  unshared_spec.shared_kv_layers = 0;
  testing::SyntheticWeights unshared = w_;
  unshared.spec = unshared_spec;
  const std::vector<double> a = reference_last_logits(w_, prompt, KvDtype::kF32);
  const std::vector<double> b = reference_last_logits(unshared, prompt, KvDtype::kF32);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(a[i]));
  }
  EXPECT_GT(diff, 1e-2 * scale) << "the shared layers' own K/V would give the same logits";

  // Batched with another sequence, in several chunkings (multi-group pools
  // for the window pattern), then, for single-group pools, a fork too.
  std::vector<int32_t> full(prompt), other(24);
  full.insert(full.end(), tail.begin(), tail.end());
  for (auto& t : other) t = tok(rng);
  std::vector<std::vector<double>> ref(full.size());
  for (size_t j = 0; j < full.size(); ++j) {
    ref[j] = reference_last_logits(
        w_, std::vector<int32_t>(full.begin(), full.begin() + static_cast<long>(j) + 1),
        KvDtype::kF32);
  }
  for (int block_size : {1, 4, 16}) {
    auto pool = BlockPool::create(storing_layout(spec, block_size), {.n_tokens = 2048});
    ASSERT_TRUE(pool.ok()) << pool.error().message;
    for (int chunk : {1, 7, 24}) {
      const std::string where =
          "block " + std::to_string(block_size) + " chunk " + std::to_string(chunk);
      BlockTable seq(**pool), side(**pool);
      ASSERT_NO_FATAL_FAILURE(testing::run_interleaved_prefill_decode(
          *fwd_, seq, side, full, other, 24, chunk, spec.n_vocab, ref, where));
    }
    if ((*pool)->groups().n_groups() == 1) {
      auto reference = [&](const std::vector<int32_t>& tokens, int n, const BlockTable&) {
        return reference_last_logits(w_, std::vector<int32_t>(tokens.begin(), tokens.begin() + n),
                                     KvDtype::kF32);
      };
      ASSERT_NO_FATAL_FAILURE(testing::run_prefill_decode_fork(*fwd_, **pool, spec.n_vocab, prompt,
                                                               24, 5, tail, reference));
    }
    (*pool)->check_invariants();
  }
}

// Full attention (the last two of four layers read layer 1), and a hybrid
// window pattern whose shared layers pick the last storing layer of their
// window (layer 4, w 6, reads layer 2; layer 5, full, reads layer 3).
INSTANTIATE_TEST_SUITE_P(Patterns, SharedKv,
                         ::testing::Values(SyntheticCase{"full_last2_share",
                                                         {.n_layers = 4,
                                                          .n_embd = 32,
                                                          .n_heads = 4,
                                                          .n_kv_heads = 2,
                                                          .n_ff = 48,
                                                          .seed = 31,
                                                          .shared_kv_layers = 2}},
                                           SyntheticCase{"hybrid_w6_last2_share",
                                                         {.n_layers = 6,
                                                          .n_embd = 32,
                                                          .n_heads = 2,
                                                          .n_kv_heads = 1,
                                                          .n_ff = 48,
                                                          .seed = 32,
                                                          .layer_window = {6, 0, 6, 0, 6, 0},
                                                          .shared_kv_layers = 2}}),
                         testing::synthetic_case_name);

TEST(SharedKvConfig, RejectsASharedLayerWithoutASourceOfItsWindow) {
  // Layer 3 (window 5) is shared, but no storing layer has window 5.
  auto loaded = testing::load_synthetic_model({.n_layers = 4,
                                               .n_embd = 32,
                                               .n_heads = 2,
                                               .n_kv_heads = 1,
                                               .n_ff = 48,
                                               .shared_kv_layers = 1});
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  const Status st = loaded->model->set_layer_windows({0, 0, 0, 5});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("layer 3"), std::string::npos) << st.error().message;
  // The model keeps its previous windows and sources.
  EXPECT_EQ(loaded->model->config().window(3), 0);
  EXPECT_EQ(loaded->model->config().kv_source(3), 2);
}

}  // namespace
}  // namespace kvstack

// Cache equivalence (kv-cache-spec.md section 1): logits from prefill +
// incremental decode through the paged cache equal a float64 recomputation
// of the whole prefix at every step, for MHA/GQA/MQA and several head dims,
// every prefill split tried, several block sizes, and physical blocks
// deliberately scattered by interleaving sequences and leaving holes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "engine/forward.h"
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

using testing::load_synthetic_model;
using testing::reference_last_logits;
using testing::SyntheticCase;
using testing::SyntheticSpec;

class CacheEquivalence : public testing::SyntheticForwardTest {};

TEST_P(CacheEquivalence, PrefillSplitsAndDecodeMatchRecomputation) {
  const SyntheticSpec& spec = GetParam().spec;
  const testing::SyntheticWeights& w = w_;
  Forward& fwd = *fwd_;

  std::mt19937 rng(spec.seed + 100);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 23, n_decode = 6;
  std::vector<int32_t> prompt(n_prompt + n_decode), other(n_prompt);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : other) t = tok(rng);

  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16}) {
    // Reference logits of every prefix, recomputed from scratch each time.
    std::vector<std::vector<double>> ref(prompt.size());
    for (size_t j = 0; j < prompt.size(); ++j) {
      ref[j] = reference_last_logits(
          w, std::vector<int32_t>(prompt.begin(), prompt.begin() + static_cast<long>(j) + 1),
          dtype);
    }
    for (int block_size : {1, 4, 16, 256}) {
      auto layout =
          KvLayout::uniform(spec.n_layers, spec.n_kv_heads, spec.head_dim(), dtype, block_size);
      ASSERT_TRUE(layout.ok());
      auto pool = BlockPool::create(*layout, {.n_tokens = 8 * 1024});
      ASSERT_TRUE(pool.ok());
      for (int chunk : {1, 5, n_prompt}) {
        // Holes: a junk table released after the first step, and two
        // sequences grown interleaved, so the sequence under test gets
        // scattered blocks.
        BlockTable seq(**pool), side(**pool);
        ASSERT_NO_FATAL_FAILURE(testing::run_interleaved_prefill_decode(
            fwd, seq, side, prompt, other, n_prompt, chunk, spec.n_vocab, ref,
            std::string("dtype ") + kv_dtype_name(dtype) + " block " + std::to_string(block_size) +
                " chunk " + std::to_string(chunk)));
        EXPECT_EQ(seq.length(), n_prompt + n_decode);
        (*pool)->check_invariants();
      }
      // Every sequence released: the pool is whole again.
      (*pool)->check_invariants();
      EXPECT_EQ((*pool)->stats().n_blocks_free, (*pool)->stats().n_blocks_total);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CacheEquivalence,
    ::testing::Values(
        SyntheticCase{"mha_d16", {.n_embd = 64, .n_heads = 4, .n_kv_heads = 4, .seed = 1}},
        SyntheticCase{"gqa_d32", {.n_embd = 96, .n_heads = 3, .n_kv_heads = 1, .seed = 2}},
        SyntheticCase{"gqa_6_2_d16", {.n_embd = 96, .n_heads = 6, .n_kv_heads = 2, .seed = 3}},
        SyntheticCase{"mqa_d64", {.n_embd = 128, .n_heads = 2, .n_kv_heads = 1, .seed = 4}},
        SyntheticCase{"qwen2_bias_neox",
                      {.n_embd = 64, .n_heads = 4, .n_kv_heads = 2, .neox = true, .seed = 5}}),
    testing::synthetic_case_name);

TEST(Forward, RejectsBadInputWithoutSideEffects) {
  auto loaded = load_synthetic_model({});
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  ThreadPool threads(1);
  Forward fwd(*loaded->model, threads);
  auto layout = KvLayout::uniform(2, 2, 16, KvDtype::kF32, 4);
  ASSERT_TRUE(layout.ok());
  auto pool = BlockPool::create(*layout, {.n_tokens = 16});
  ASSERT_TRUE(pool.ok());
  BlockTable t(**pool);
  std::vector<float> logits;
  const int32_t bad = 1000;
  StepSeq s{.table = &t, .tokens = std::span<const int32_t>(&bad, 1)};
  auto st = fwd.step(std::span<const StepSeq>(&s, 1), &logits);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
  EXPECT_EQ(t.length(), 0);
  // Out of blocks: 17 tokens into a 16-token pool, nothing allocated after.
  std::vector<int32_t> many(17, 1);
  s.tokens = many;
  st = fwd.step(std::span<const StepSeq>(&s, 1), &logits);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::kOutOfBlocks);
  EXPECT_EQ(t.length(), 0);
  EXPECT_EQ((*pool)->stats().n_blocks_free, (*pool)->stats().n_blocks_total);
  (*pool)->check_invariants();
}

}  // namespace
}  // namespace kvstack

// Hybrid sliding-window models through KV groups (kv-cache-spec.md sections
// 1 and 12): synthetic models whose layers mix full attention and windows
// w < P, w = P and w > P, in several patterns. Logits from prefill (every
// chunking tried) + decode through the grouped, window-dropping cache equal
// a float64 recomputation with the same windowed visibility, for several
// block sizes and with scattered physical blocks; per-group residency
// equals the formula at every step (full groups ceil(T / P), window groups
// the blocks the coming chunk can see), and after the sequences end every
// block is free.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "engine/forward.h"
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

using testing::load_synthetic_model;
using testing::reference_last_logits;
using testing::SyntheticCase;
using testing::SyntheticSpec;
using testing::window_layout;

// Per group, the table holds exactly the blocks the step starting at
// `start` with `chunk` tokens could see, and never more than the bound.
void expect_resident_formula(const BlockTable& t, int64_t start, int64_t chunk,
                             const std::string& where) {
  const KvGroups& groups = t.pool().groups();
  const int64_t p = t.pool().block_size();
  for (int g = 0; g < groups.n_groups(); ++g) {
    const KvGroup& gr = groups.group(g);
    const int64_t resident = t.group(g).n_resident_blocks();
    EXPECT_EQ(resident, groups.blocks_for(g, start, chunk)) << where << " group " << g;
    if (gr.drops_blocks) {
      EXPECT_LE(resident, (gr.window - 1 + chunk + p - 1) / p + 1) << where << " group " << g;
    } else {
      EXPECT_EQ(resident, (start + chunk + p - 1) / p) << where << " group " << g;
    }
  }
}

class WindowEquivalence : public testing::SyntheticForwardTest {};

TEST_P(WindowEquivalence, GroupedWindowCacheMatchesWindowedRecomputation) {
  const SyntheticSpec& spec = GetParam().spec;
  Forward& fwd = *fwd_;
  std::mt19937 rng(spec.seed + 200);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 37, n_decode = 5;
  std::vector<int32_t> prompt(n_prompt + n_decode), other(n_prompt);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : other) t = tok(rng);
  const KvDtype dtype = KvDtype::kF32;
  std::vector<std::vector<double>> ref(prompt.size());
  for (size_t j = 0; j < prompt.size(); ++j) {
    ref[j] = reference_last_logits(
        w_, std::vector<int32_t>(prompt.begin(), prompt.begin() + static_cast<long>(j) + 1), dtype);
  }
  bool dropped_any = false;
  for (int block_size : {1, 4, 8}) {
    auto pool = BlockPool::create(window_layout(spec, dtype, block_size), {.n_tokens = 4096});
    ASSERT_TRUE(pool.ok());
    for (int chunk : {1, 6, n_prompt}) {
      const std::string where =
          "block " + std::to_string(block_size) + " chunk " + std::to_string(chunk);
      BlockTable seq(**pool), side(**pool);
      ASSERT_NO_FATAL_FAILURE(testing::run_interleaved_prefill_decode(
          fwd, seq, side, prompt, other, n_prompt, chunk, spec.n_vocab, ref, where,
          [&](int64_t start, int64_t n, const std::string& label) {
            expect_resident_formula(seq, start, n, where + label);
          }));
      for (int g = 0; g < seq.n_groups(); ++g) dropped_any |= seq.group(g).n_dropped() > 0;
      // A fork shares the window groups' null entries and decodes the same.
      BlockTable fork = seq.fork();
      (*pool)->check_invariants();
      fork.release();
      (*pool)->check_invariants();
    }
    (*pool)->check_invariants();
    EXPECT_EQ((*pool)->stats().n_blocks_free, (*pool)->stats().n_blocks_total);
  }
  // The hybrid cases really dropped blocks (the single-class one keeps all).
  EXPECT_EQ(dropped_any, GetParam().spec.layer_window.size() > 2) << "pattern's drop expectation";
}

// Windows against P in {1, 4, 8}: w = 3 (< P for P = 4, 8), 4 (= P for 4),
// 5, 9 and 11 (> P); patterns interleaved, Gemma-like (one full layer in
// six) and window-first.
INSTANTIATE_TEST_SUITE_P(Patterns, WindowEquivalence,
                         ::testing::Values(SyntheticCase{"full_then_w3",
                                                         {.n_layers = 4,
                                                          .n_embd = 32,
                                                          .n_heads = 2,
                                                          .n_kv_heads = 1,
                                                          .n_ff = 48,
                                                          .seed = 11,
                                                          .layer_window = {0, 3, 3, 3}}},
                                           SyntheticCase{"w4_w9_full_pairs",
                                                         {.n_layers = 6,
                                                          .n_embd = 32,
                                                          .n_heads = 2,
                                                          .n_kv_heads = 2,
                                                          .n_ff = 48,
                                                          .seed = 12,
                                                          .layer_window = {4, 0, 9, 4, 0, 9}}},
                                           SyntheticCase{"gemma_like_w5",
                                                         {.n_layers = 6,
                                                          .n_embd = 32,
                                                          .n_heads = 4,
                                                          .n_kv_heads = 1,
                                                          .n_ff = 48,
                                                          .seed = 13,
                                                          .layer_window = {5, 5, 5, 5, 5, 0}}},
                                           SyntheticCase{"w11_w8_no_full",
                                                         {.n_layers = 4,
                                                          .n_embd = 32,
                                                          .n_heads = 2,
                                                          .n_kv_heads = 1,
                                                          .n_ff = 48,
                                                          .seed = 14,
                                                          .layer_window = {11, 8, 8, 11}}},
                                           SyntheticCase{"one_class_w6",
                                                         {.n_layers = 2,
                                                          .n_embd = 32,
                                                          .n_heads = 2,
                                                          .n_kv_heads = 1,
                                                          .n_ff = 48,
                                                          .seed = 15,
                                                          .layer_window = {6, 6}}}),
                         testing::synthetic_case_name);

// A long sequence on a hybrid model: resident blocks per group stay at the
// formula for every chunk and decode step, the window groups far below the
// full ones; after the sequence ends every block is free.
TEST(WindowMemory, LongSequenceKeepsTheFormula) {
  const SyntheticSpec spec{.n_layers = 6,
                           .n_embd = 32,
                           .n_heads = 2,
                           .n_kv_heads = 1,
                           .n_ff = 48,
                           .n_vocab = 50,
                           .n_ctx = 2048,
                           .seed = 21,
                           .layer_window = {24, 24, 24, 24, 24, 0}};
  auto loaded = load_synthetic_model(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  ThreadPool threads(2);
  Forward fwd(*loaded->model, threads);
  const int p = 8, chunk = 64, n_prompt = 1000, n_decode = 40;
  auto pool = BlockPool::create(window_layout(spec, KvDtype::kF16, p), {.n_tokens = 2048});
  ASSERT_TRUE(pool.ok());
  ASSERT_EQ((*pool)->n_groups(), 6);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  std::vector<int32_t> tokens(n_prompt + n_decode);
  for (auto& t : tokens) t = tok(rng);
  {
    BlockTable seq(**pool);
    std::vector<float> logits;
    for (int64_t b = 0; b < static_cast<int64_t>(tokens.size());) {
      const int64_t n = b < n_prompt ? std::min<int64_t>(chunk, n_prompt - b) : 1;
      const StepSeq s{.table = &seq,
                      .tokens = std::span<const int32_t>(tokens.data() + b, n),
                      .logits = LogitsMode::kLast};
      ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
      expect_resident_formula(seq, b, n, "at " + std::to_string(b));
      b += n;
    }
    const int64_t t = seq.length();
    const BlockPoolStats st = (*pool)->stats();
    ASSERT_EQ(st.groups.size(), 6u);
    // The full group (group 0, layer 5) holds all T tokens; each window group
    // holds the window plus the last step (one decode token) in blocks.
    EXPECT_EQ(st.groups[0].window, 0);
    EXPECT_EQ(st.groups[0].n_blocks_used, (t + p - 1) / p);
    EXPECT_EQ(st.groups[0].n_tokens_resident, t);
    for (size_t g = 1; g < 6; ++g) {
      EXPECT_EQ(st.groups[g].window, 24);
      EXPECT_LE(st.groups[g].n_blocks_used, (24 - 1 + 1 + p - 1) / p + 1);
      EXPECT_EQ(st.groups[g].payload_bytes,
                24 * (*pool)->group(1).layout.payload_bytes_per_token());
    }
    // Total blocks in use: one full group's T / P plus five bounded groups,
    // instead of six groups of T / P.
    EXPECT_LT(st.n_blocks_used, 2 * ((t + p - 1) / p));
    (*pool)->check_invariants();
  }
  (*pool)->check_invariants();
  EXPECT_EQ((*pool)->stats().n_blocks_free, (*pool)->stats().n_blocks_total);
}

}  // namespace
}  // namespace kvstack

// Prefix reuse on hybrid sliding-window models (kv-cache-spec.md section
// 12): window groups drop old blocks, yet a continued conversation or a
// shared prefix hits, because published blocks keep the window groups'
// blocks as checkpoints (PrefixIndex companions). Logits after a hit equal
// a float64 windowed recomputation; a second turn prefills only its new
// tokens; evicted checkpoints shorten a hit but never make it wrong; random
// operations (start, extend, fork, cancel, preempt, evict, prefix hit) keep
// the pool's and index's invariants.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "engine/forward.h"
#include "engine/sequence.h"
// GCC 12 misreads gguf_builder.h's put_bytes (resize + memcpy) once it is
// inlined into this file's fixture (false -Wstringop-overflow / -Wrestrict,
// the family gguf_builder.h already works around for insert()).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#pragma GCC diagnostic ignored "-Wrestrict"
#endif
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

using testing::kLogitTol;
using testing::load_synthetic_model;
using testing::logits_rel_err;
using testing::reference_last_logits;
using testing::SyntheticSpec;
using testing::window_layout;

CacheIdentity test_identity() {
  CacheIdentity id;
  id.weights_digest = Hash128{3, 4};
  id.arch_revision = "hybrid-test";
  id.kv_format = "test";
  return id;
}

const SyntheticSpec kSpec{.n_layers = 6,
                          .n_embd = 32,
                          .n_heads = 2,
                          .n_kv_heads = 1,
                          .n_ff = 48,
                          .n_vocab = 40,
                          .n_ctx = 512,
                          .seed = 31,
                          .layer_window = {6, 6, 0, 6, 6, 11}};  // full, w6 (x4), w11: g = 1

class HybridPrefix : public ::testing::Test {
 protected:
  void SetUp() override {
    auto loaded = load_synthetic_model(kSpec);
    ASSERT_TRUE(loaded.ok()) << loaded.error().message;
    w_ = std::move(loaded->weights);
    model_ = std::move(loaded->model);
    fwd_ = std::make_unique<Forward>(*model_, threads_);
  }

  // Forwards tokens[seq.length() ..) in chunks, publishing after each step;
  // checks every position's logits against the windowed recomputation.
  void run(Sequence& seq, const std::vector<int32_t>& tokens, int chunk, const std::string& where) {
    std::vector<float> logits;
    while (seq.length() < static_cast<int64_t>(tokens.size())) {
      const int64_t b = seq.length();
      const int64_t e = std::min<int64_t>(static_cast<int64_t>(tokens.size()), b + chunk);
      const StepSeq s{.table = &seq.table(),
                      .tokens = std::span<const int32_t>(tokens.data() + b, e - b),
                      .logits = LogitsMode::kAll};
      ASSERT_TRUE(fwd_->step(std::span<const StepSeq>(&s, 1), &logits).ok()) << where;
      seq.on_committed(std::span<const int32_t>(tokens.data() + b, e - b));
      for (int64_t j = b; j < e; ++j) {
        const auto ref = reference_last_logits(
            w_, std::vector<int32_t>(tokens.begin(), tokens.begin() + j + 1), KvDtype::kF32);
        ASSERT_LT(logits_rel_err(logits.data() + (j - b) * kSpec.n_vocab, ref), kLogitTol)
            << where << " position " << j;
      }
    }
  }

  testing::SyntheticWeights w_;
  std::unique_ptr<Model> model_;
  ThreadPool threads_{2};
  std::unique_ptr<Forward> fwd_;
};

std::vector<int32_t> random_tokens(std::mt19937& rng, int n) {
  std::uniform_int_distribution<int32_t> tok(0, kSpec.n_vocab - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = tok(rng);
  return v;
}

TEST_F(HybridPrefix, SecondTurnPrefillsOnlyItsNewTokens) {
  for (int p : {4, 8}) {
    auto pool = BlockPool::create(window_layout(kSpec, KvDtype::kF32, p), {.n_tokens = 512});
    ASSERT_TRUE(pool.ok());
    ASSERT_EQ((*pool)->n_groups(), 6);
    KvManager kv(**pool, test_identity(), {});
    const NamespaceId ns = kv.namespace_for("");
    Sequence ns_anchor = kv.new_sequence(ns);  // keeps ns alive (unused namespaces expire)
    std::mt19937 rng(static_cast<uint32_t>(p));
    std::vector<int32_t> conv = random_tokens(rng, 45);
    for (int turn = 0; turn < 3; ++turn) {
      const std::string where = "P " + std::to_string(p) + " turn " + std::to_string(turn);
      Sequence seq = kv.new_sequence(ns);
      const int64_t hit = seq.adopt_cached_prefix(conv);
      if (turn > 0) {
        // Everything but the tail block of the previous turn's committed tokens.
        const int64_t previous = static_cast<int64_t>(conv.size()) - 17;
        EXPECT_GE(hit, previous - p) << where;
        EXPECT_EQ(hit % p, 0) << where;
      }
      for (int g = 1; g < seq.table().n_groups(); ++g) {
        if ((*pool)->group(g).drops_blocks && hit > 0) {
          EXPECT_GT(seq.table().group(g).n_dropped(), 0) << where << " group " << g;
        }
      }
      run(seq, conv, 5, where);  // only conv[hit ..) is forwarded
      (*pool)->check_invariants();
      // The window groups dropped old blocks; they stay cached as checkpoints.
      EXPECT_GT((*pool)->stats().n_blocks_cached, 0) << where;
      const std::vector<int32_t> more = random_tokens(rng, 17);  // reply + next user message
      conv.insert(conv.end(), more.begin(), more.end());
    }
  }
}

TEST_F(HybridPrefix, EvictedCheckpointsShortenTheHitNeverCorruptIt) {
  const int p = 4;
  // A tight pool: the second prompt's allocations evict cached checkpoints.
  const int64_t block_bytes =
      KvGroups::create(window_layout(kSpec, KvDtype::kF32, p))->block_bytes();
  auto pool =
      BlockPool::create(window_layout(kSpec, KvDtype::kF32, p), {.mem_bytes = 80 * block_bytes});
  ASSERT_TRUE(pool.ok());
  KvManager kv(**pool, test_identity(), {});
  const NamespaceId ns = kv.namespace_for("");
  Sequence ns_anchor = kv.new_sequence(ns);  // keeps ns alive (unused namespaces expire)
  std::mt19937 rng(9);
  const std::vector<int32_t> a = random_tokens(rng, 60);
  {
    Sequence s = kv.new_sequence(ns);
    run(s, a, 7, "first");
  }
  {
    Sequence other = kv.new_sequence(ns);
    run(other, random_tokens(rng, 150), 16, "pressure");
  }
  (*pool)->check_invariants();
  EXPECT_GT((*pool)->stats().n_evictions, 0);
  Sequence s = kv.new_sequence(ns);
  const int64_t hit = s.adopt_cached_prefix(a);
  EXPECT_LT(hit, 56);  // something was lost
  std::vector<int32_t> longer = a;
  const auto tail = random_tokens(rng, 6);
  longer.insert(longer.end(), tail.begin(), tail.end());
  run(s, longer, 3, "after eviction, hit " + std::to_string(hit));
  (*pool)->check_invariants();
}

TEST_F(HybridPrefix, RandomOperationsKeepInvariantsAndLogits) {
  const int p = 4;
  const int64_t block_bytes =
      KvGroups::create(window_layout(kSpec, KvDtype::kF32, p))->block_bytes();
  auto pool =
      BlockPool::create(window_layout(kSpec, KvDtype::kF32, p), {.mem_bytes = 160 * block_bytes});
  ASSERT_TRUE(pool.ok());
  KvManager kv(**pool, test_identity(), {});
  const NamespaceId ns = kv.namespace_for("");
  Sequence ns_anchor = kv.new_sequence(ns);  // keeps ns alive (unused namespaces expire)
  std::mt19937 rng(77);
  // A few shared stems so that lookups hit at various depths.
  std::vector<std::vector<int32_t>> stems;
  stems.reserve(3);
  for (int i = 0; i < 3; ++i) stems.push_back(random_tokens(rng, 30));
  std::vector<std::pair<Sequence, std::vector<int32_t>>> live;
  for (int step = 0; step < 60; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 5)(rng);
    const std::string where = "step " + std::to_string(step) + " op " + std::to_string(op);
    if (live.empty() || op <= 1) {  // start with a prefix hit
      std::vector<int32_t> prompt = stems[std::uniform_int_distribution<size_t>(0, 2)(rng)];
      prompt.resize(std::uniform_int_distribution<size_t>(5, prompt.size())(rng));
      const auto tail = random_tokens(rng, std::uniform_int_distribution<int>(1, 8)(rng));
      prompt.insert(prompt.end(), tail.begin(), tail.end());
      Sequence s = kv.new_sequence(ns);
      (void)s.adopt_cached_prefix(prompt);
      const size_t free_before = static_cast<size_t>((*pool)->n_available());
      if (free_before < 40) {
        live.clear();  // preempt everything rather than run out mid-test
        continue;
      }
      run(s, prompt, std::uniform_int_distribution<int>(1, 9)(rng), where);
      live.emplace_back(std::move(s), std::move(prompt));
    } else {
      auto& [s, toks] = live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng)];
      if (op == 2) {  // extend
        const auto tail = random_tokens(rng, std::uniform_int_distribution<int>(1, 6)(rng));
        toks.insert(toks.end(), tail.begin(), tail.end());
        if ((*pool)->n_available() < 20) continue;
        run(s, toks, 4, where);
      } else if (op == 3) {  // fork
        Sequence f = s.fork();
        std::vector<int32_t> t = toks;
        live.emplace_back(std::move(f), std::move(t));
      } else if (op == 4) {  // cancelled step: reserve then roll back
        if (s.table().reserve(3).ok()) {
          EXPECT_GT(s.table().capacity(), s.length());
        }
        s.rollback();
        EXPECT_EQ(s.table().capacity(), (s.length() + p - 1) / p * p);
      } else {  // finish / preempt
        const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
        live.erase(live.begin() + static_cast<long>(i));
      }
    }
    (*pool)->check_invariants();
  }
  live.clear();
  (*pool)->check_invariants();
  const BlockPoolStats st = (*pool)->stats();
  EXPECT_EQ(st.n_blocks_used, 0);
  EXPECT_EQ(st.n_blocks_free + st.n_blocks_cached, st.n_blocks_total);
}

}  // namespace
}  // namespace kvstack

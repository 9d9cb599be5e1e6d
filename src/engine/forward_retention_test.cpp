// Retention through the forward pass (kv-cache-spec.md sections 8 and 12):
// a StreamingLLM table compacts before steps, yet every logits row equals a
// float64 recomputation of the whole sequence that keeps every token at its
// original position and only MASKS the tokens the cache had dropped when
// that row ran. A model that re-rotated survivors by their slot index would
// disagree with that reference (shown below); a budget larger than the
// sequence gives bit-identical logits to the exact cache; a compacted
// sequence never publishes blocks, so an exact request can only hit blocks
// computed before the first compaction; a step refused after a compaction
// leaks nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>

#include "engine/forward.h"
#include "engine/sequence.h"
// GCC 12 misreads gguf_builder.h's put_bytes once inlined (see
// sequence_hybrid_test.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#pragma GCC diagnostic ignored "-Wrestrict"
#endif
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/retention.h"

namespace kvstack {
namespace {

using testing::kLogitTol;
using testing::logits_rel_err;
using testing::reference_last_logits;
using testing::SyntheticCase;
using testing::SyntheticSpec;

// What each query position saw, per layer: the resident positions of the
// layer's group after its step (= kept at the step's start plus the step's
// own tokens), up to itself.
struct Visibility {
  std::vector<std::vector<std::set<int>>> seen;  // [layer][position] visible key positions
  std::vector<int> slot_at_write;                // [position] its slot in group 0 when written
  bool visible(int l, int t, int j) const {
    return seen[static_cast<size_t>(l)][static_cast<size_t>(t)].count(j) > 0;
  }
};

void record_step(const BlockTable& t, int64_t start, int64_t n, int64_t slots_before,
                 Visibility& vis) {
  const KvGroups& groups = t.pool().groups();
  vis.seen.resize(static_cast<size_t>(groups.n_layers()));
  for (int l = 0; l < groups.n_layers(); ++l) {
    const GroupTable& g = t.group(groups.slot(l).group);
    std::set<int> resident;
    for (int64_t s = 0; s < g.length(); ++s) resident.insert(static_cast<int>(g.position(s)));
    for (int64_t r = 0; r < n; ++r) {
      const int pos = static_cast<int>(start + r);
      std::set<int> mine;
      for (int j : resident) {
        if (j <= pos) mine.insert(j);
      }
      vis.seen[static_cast<size_t>(l)].push_back(std::move(mine));
    }
  }
  for (int64_t r = 0; r < n; ++r) vis.slot_at_write.push_back(static_cast<int>(slots_before + r));
}

KvDtype dtype_of(int block_size) {
  return block_size == 4 ? KvDtype::kF16 : KvDtype::kF32;
}

std::vector<double> masked_reference(const testing::SyntheticWeights& w,
                                     const std::vector<int32_t>& tokens, int n, KvDtype dtype,
                                     const Visibility& vis, bool rotate_by_slot) {
  const std::vector<int32_t> prefix(tokens.begin(), tokens.begin() + n);
  return reference_last_logits(
      w, prefix,
      [dtype](int, int, std::vector<double>& k, std::vector<double>& v) {
        for (double& x : k) x = testing::kv_round(x, dtype);
        for (double& x : v) x = testing::kv_round(x, dtype);
      },
      [&vis](int l, int t, int j) { return vis.visible(l, t, j); },
      rotate_by_slot ? testing::RopePosition(
                           [&vis](int t) { return vis.slot_at_write[static_cast<size_t>(t)]; })
                     : testing::RopePosition{});
}

class Retention : public testing::SyntheticForwardTest {
 protected:
  // The scenario every policy test runs: `tokens` through `seq` (the policy)
  // and `exact` (no retention) side by side, prompt chunks of at most
  // `chunk` tokens up to n_prompt, then one token per step. After each step
  // it checks the pool's invariants, notes whether seq's logits equal
  // exact's bits, lets `record(b, n, vis)` note what rows [b, b + n) saw
  // (default: record_step, the resident positions), checks every row of
  // seq against the masked float64 reference of that visibility (f32 KV,
  // original positions), then runs `after(b, n)` for the test's own checks.
  // Returns whether every step's logits matched exact's bits.
  using Record = std::function<void(int b, int n, Visibility& vis)>;
  bool run_against_masked_reference(BlockPool& pool, BlockTable& seq, BlockTable& exact,
                                    const std::vector<int32_t>& tokens, int n_prompt, int chunk,
                                    const std::string& where, const Record& record = nullptr,
                                    const std::function<void(int b, int n)>& after = nullptr) {
    const int n_vocab = GetParam().spec.n_vocab;
    Visibility vis;
    std::vector<float> logits, exact_logits;
    bool all_equal = true;
    for (int b = 0; b < static_cast<int>(tokens.size());) {
      const int n = b < n_prompt ? std::min(chunk, n_prompt - b) : 1;
      const std::span<const int32_t> c(tokens.data() + b, n);
      const StepSeq s{.table = &seq, .tokens = c, .logits = LogitsMode::kAll};
      const StepSeq se{.table = &exact, .tokens = c, .logits = LogitsMode::kAll};
      EXPECT_TRUE(fwd_->step(std::span<const StepSeq>(&s, 1), &logits).ok()) << where;
      EXPECT_TRUE(fwd_->step(std::span<const StepSeq>(&se, 1), &exact_logits).ok()) << where;
      if (::testing::Test::HasFailure()) return false;
      pool.check_invariants();
      all_equal &=
          std::memcmp(logits.data(), exact_logits.data(), logits.size() * sizeof(float)) == 0;
      if (record) {
        record(b, n, vis);
      } else {
        record_step(seq, b, n, seq.group(0).length() - n, vis);
      }
      for (int r = 0; r < n; ++r) {
        const int pos = b + r;
        const double err = logits_rel_err(
            logits.data() + static_cast<size_t>(r) * n_vocab,
            masked_reference(w_, tokens, pos + 1, KvDtype::kF32, vis, /*rotate_by_slot=*/false));
        EXPECT_LT(err, kLogitTol) << where << " position " << pos;
        if (err >= kLogitTol) return false;
      }
      if (after) after(b, n);
      b += n;
    }
    return all_equal;
  }
};

TEST_P(Retention, StreamingLlmEqualsMaskedRecomputationWithOriginalPositions) {
  const SyntheticSpec& spec = GetParam().spec;
  std::mt19937 rng(spec.seed + 7);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 23, n_decode = 33;
  std::vector<int32_t> tokens(n_prompt + n_decode);
  for (auto& t : tokens) t = tok(rng);
  bool checked_slot_bug = false;
  for (int block_size : {1, 4, 8}) {
    for (int64_t slack : {int64_t{1}, int64_t{3}, int64_t{0}}) {
      const KvDtype dtype = dtype_of(block_size);
      const std::string where =
          "block " + std::to_string(block_size) + " slack " + std::to_string(slack);
      auto pool =
          BlockPool::create(testing::window_layout(spec, dtype, block_size), {.n_tokens = 1024});
      ASSERT_TRUE(pool.ok());
      BlockTable junk(**pool), seq(**pool);
      ASSERT_TRUE(junk.reserve(3 * block_size).ok());  // scattered blocks
      const RetentionConfig rc{
          .policy = RetentionPolicy::kStreamingLlm, .sinks = 2, .window = 9, .slack = slack};
      ASSERT_TRUE(seq.set_retention(rc).ok());
      Visibility vis;
      std::vector<float> logits;
      // Prefill in chunks of 7 (compaction happens between chunks too), then decode.
      for (int b = 0; b < n_prompt + n_decode;) {
        const int n = b < n_prompt ? std::min(7, n_prompt - b) : 1;
        const StepSeq s{.table = &seq,
                        .tokens = std::span<const int32_t>(tokens.data() + b, n),
                        .logits = LogitsMode::kAll};
        ASSERT_TRUE(fwd_->step(std::span<const StepSeq>(&s, 1), &logits).ok()) << where;
        if (b == 0) junk.release();
        (*pool)->check_invariants();
        // The step's tokens took the slots after those kept by its compaction.
        record_step(seq, b, n, seq.group(0).length() - n, vis);
        for (int r = 0; r < n; ++r) {
          const int pos = b + r;
          const std::vector<double> ref =
              masked_reference(w_, tokens, pos + 1, dtype, vis, /*rotate_by_slot=*/false);
          ASSERT_LT(logits_rel_err(logits.data() + static_cast<size_t>(r) * spec.n_vocab, ref),
                    kLogitTol)
              << where << " position " << pos;
        }
        b += n;
      }
      const GroupTable& g = seq.group(0);
      EXPECT_TRUE(seq.compacted()) << where;
      EXPECT_EQ(seq.length(), n_prompt + n_decode);
      const int64_t slack_eff = slack > 0 ? slack : block_size;
      EXPECT_LE(g.length(), rc.sinks + rc.window - 1 + slack_eff) << where;
      EXPECT_GT(seq.retention_stats().n_blocks_freed, 0) << where;
      // Re-rotating by slot index is a bug this comparison catches: the last
      // row under that rule differs from the engine by far more than the
      // tolerance (and the engine matched the original-position reference).
      const std::vector<double> bug =
          masked_reference(w_, tokens, n_prompt + n_decode, dtype, vis, /*rotate_by_slot=*/true);
      EXPECT_GT(logits_rel_err(logits.data(), bug), 100 * kLogitTol)
          << where << ": re-rotation by slot index went unnoticed";
      checked_slot_bug = true;
      seq.release();
      EXPECT_EQ((*pool)->n_free(), (*pool)->n_blocks()) << where;
    }
  }
  EXPECT_TRUE(checked_slot_bug);
}

// A window covering the whole sequence: retention is on but never drops a
// token, and the logits are bit-identical to the exact cache's.
TEST_P(Retention, BudgetLargerThanSequenceIsExact) {
  const SyntheticSpec& spec = GetParam().spec;
  std::mt19937 rng(spec.seed + 9);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  std::vector<int32_t> tokens(40);
  for (auto& t : tokens) t = tok(rng);
  auto pool = BlockPool::create(testing::window_layout(spec, KvDtype::kF16, 4), {.n_tokens = 512});
  ASSERT_TRUE(pool.ok());
  BlockTable exact(**pool), ret(**pool);
  ASSERT_TRUE(ret.set_retention({.policy = RetentionPolicy::kStreamingLlm,
                                 .sinks = 0,
                                 .window = static_cast<int64_t>(tokens.size()),
                                 .slack = 1})
                  .ok());
  std::vector<float> la, lb;
  for (int b = 0; b < static_cast<int>(tokens.size());) {
    const int n = b < 20 ? 10 : 1;
    const std::span<const int32_t> chunk(tokens.data() + b, n);
    const StepSeq sa{.table = &exact, .tokens = chunk, .logits = LogitsMode::kAll};
    const StepSeq sb{.table = &ret, .tokens = chunk, .logits = LogitsMode::kAll};
    ASSERT_TRUE(fwd_->step(std::span<const StepSeq>(&sa, 1), &la).ok());
    ASSERT_TRUE(fwd_->step(std::span<const StepSeq>(&sb, 1), &lb).ok());
    ASSERT_EQ(la.size(), lb.size());
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << "at " << b;
    b += n;
  }
  EXPECT_FALSE(ret.compacted());
  EXPECT_EQ(ret.retention_stats().n_compactions, 0);
}

// SnapKV and PyramidKV: the prompt's last `window` queries vote at the end
// of prefill (the first one-token step); the dropped prompt tokens are gone
// for every later row, which still matches the masked float64
// recomputation (per layer: PyramidKV keeps different tokens in each
// layer's group); each group keeps the observation window plus, per KV
// head, its layer's budget (union: up to budget per query head) of prompt
// tokens; decoded tokens all stay. A budget covering the prompt gives the
// exact cache's bits. SnapKV runs on one group of all layers (the union
// over layers) and PyramidKV on one group per layer (as the engine builds).
TEST_P(Retention, PrefillEndSelectionEqualsMaskedRecomputationAndFreesBlocks) {
  const SyntheticSpec& spec = GetParam().spec;
  std::mt19937 rng(spec.seed + 13);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 35, n_decode = 8, p = 4;
  std::vector<int32_t> tokens(n_prompt + n_decode);
  for (auto& t : tokens) t = tok(rng);
  for (RetentionPolicy policy : {RetentionPolicy::kSnapKv, RetentionPolicy::kPyramidKv}) {
    for (GqaRule rule : {GqaRule::kUnion, GqaRule::kMean}) {
      for (int64_t budget : {int64_t{5}, int64_t{40}}) {
        const bool pyramid = policy == RetentionPolicy::kPyramidKv;
        const std::string where = std::string(pyramid ? "pyramidkv " : "snapkv ") +
                                  (rule == GqaRule::kMean ? "mean" : "union") + " budget " +
                                  std::to_string(budget);
        auto pool = BlockPool::create(testing::window_layout(spec, KvDtype::kF32, p),
                                      {.n_tokens = 512, .one_layer_per_group = pyramid});
        ASSERT_TRUE(pool.ok());
        ASSERT_EQ((*pool)->n_groups(), pyramid ? spec.n_layers : 1);
        BlockTable seq(**pool), exact(**pool);
        const RetentionConfig rc{
            .policy = policy, .window = 4, .budget = budget, .kernel = 3, .gqa = rule, .beta = 2};
        ASSERT_TRUE(seq.set_retention(rc).ok());
        const auto after = [&](int b, int) {
          if (b != n_prompt) return;
          // The first decode step applied the selection to the prompt.
          for (int gi = 0; gi < seq.n_groups(); ++gi) {
            const GroupTable& g = seq.group(gi);
            const int64_t kept = g.length() - 1;
            const int64_t layer_budget =
                retention_layer_budget(rc, (*pool)->group(gi).layers.front(), spec.n_layers);
            const int64_t n_kv = spec.n_kv_heads;
            const int64_t per_kv = rule == GqaRule::kMean
                                       ? layer_budget
                                       : layer_budget * (spec.n_heads / spec.n_kv_heads);
            const int64_t n_units = static_cast<int64_t>((*pool)->group(gi).layers.size()) * n_kv;
            const std::string at = where + " group " + std::to_string(gi);
            if (layer_budget >= n_prompt - rc.window) {
              EXPECT_EQ(kept, n_prompt) << at;
            } else {
              EXPECT_GE(kept, layer_budget + rc.window) << at;
              EXPECT_LE(kept, rc.window + std::min<int64_t>(n_prompt - rc.window, n_units * per_kv))
                  << at;
              for (int64_t j = n_prompt - rc.window; j < n_prompt; ++j) {
                EXPECT_GE(g.slot_of(j), 0) << at << ": window position " << j;
              }
            }
          }
        };
        const bool all_equal = run_against_masked_reference(**pool, seq, exact, tokens, n_prompt,
                                                            12, where, nullptr, after);
        ASSERT_FALSE(HasFailure()) << where;
        const bool covers =
            retention_layer_budget(rc, 0, spec.n_layers) >= n_prompt - rc.window &&
            retention_layer_budget(rc, spec.n_layers - 1, spec.n_layers) >= n_prompt - rc.window;
        if (covers) {
          EXPECT_TRUE(all_equal) << where << ": a budget covering the prompt changed bits";
          EXPECT_FALSE(seq.compacted()) << where;
        } else if (budget == 5) {  // larger budgets may still cover it through the union
          EXPECT_TRUE(seq.compacted()) << where;
          EXPECT_GT(seq.retention_stats().n_blocks_freed, 0) << where;
        }
        if (pyramid && budget == 5) {
          // Deeper layers keep fewer prompt tokens (budgets decrease).
          EXPECT_GE(seq.group(0).length(), seq.group(spec.n_layers - 1).length()) << where;
        }
        seq.release();
        exact.release();
        EXPECT_EQ((*pool)->n_free(), (*pool)->n_blocks()) << where;
      }
    }
  }
}

// H2O through the forward pass: the decode kernels accumulate each slot's
// attention mass, every one-token step keeps each layer group's recent
// window plus its heavy hitters, and every logits row still equals the
// masked float64 recomputation with original positions; a budget covering
// the sequence gives the exact cache's bits; resident tokens stay within
// budget + window + slack per layer; blocks return to the pool.
TEST_P(Retention, H2oEqualsMaskedRecomputationAndStaysWithinBudget) {
  const SyntheticSpec& spec = GetParam().spec;
  std::mt19937 rng(spec.seed + 17);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 21, n_decode = 30, p = 4;
  std::vector<int32_t> tokens(n_prompt + n_decode);
  for (auto& t : tokens) t = tok(rng);
  for (int64_t budget : {int64_t{5}, int64_t{100}}) {
    for (int64_t slack : {int64_t{1}, int64_t{0}}) {
      for (int64_t obs : {int64_t{0}, int64_t{8}}) {
        const std::string where = "budget " + std::to_string(budget) + " slack " +
                                  std::to_string(slack) + " obs " + std::to_string(obs);
        auto pool = BlockPool::create(testing::window_layout(spec, KvDtype::kF32, p),
                                      {.n_tokens = 512, .one_layer_per_group = true});
        ASSERT_TRUE(pool.ok());
        BlockTable seq(**pool), exact(**pool);
        const RetentionConfig rc{.policy = RetentionPolicy::kH2o,
                                 .window = 6,
                                 .slack = slack,
                                 .budget = budget,
                                 .obs = obs};
        ASSERT_TRUE(seq.set_retention(rc).ok());
        const int64_t slack_eff = slack > 0 ? slack : p;
        const auto after = [&](int b, int) {
          if (b < n_prompt) return;
          for (int gi = 0; gi < seq.n_groups(); ++gi) {
            if ((*pool)->group(gi).window > 0) continue;
            EXPECT_LE(seq.group(gi).length(), budget + rc.window + slack_eff)
                << where << " group " << gi << " at " << b;
          }
        };
        const bool all_equal = run_against_masked_reference(**pool, seq, exact, tokens, n_prompt, 8,
                                                            where, nullptr, after);
        ASSERT_FALSE(HasFailure()) << where;
        if (budget >= n_prompt + n_decode) {
          EXPECT_TRUE(all_equal) << where << ": a budget covering the sequence changed bits";
          EXPECT_FALSE(seq.compacted()) << where;
        } else {
          EXPECT_TRUE(seq.compacted()) << where;
          EXPECT_GT(seq.retention_stats().n_blocks_freed, 0) << where;
        }
        seq.release();
        exact.release();
        EXPECT_EQ((*pool)->n_free(), (*pool)->n_blocks()) << where;
      }
    }
  }
}

// Per-query top-k reads (Quest): with k covering every block the logits
// are the exact cache's bits; with a small k each decode row equals the
// float64 recomputation that masks every key outside the blocks it read
// (its own block plus the chosen full blocks), nothing is dropped, and the
// counters report the blocks read.
TEST_P(Retention, TopKReadsEqualMaskedRecomputationAndCoveringIsExact) {
  const SyntheticSpec& spec = GetParam().spec;
  std::mt19937 rng(spec.seed + 19);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 18, n_decode = 24, p = 4;
  std::vector<int32_t> tokens(n_prompt + n_decode);
  for (auto& t : tokens) t = tok(rng);
  // (k, sink, recent): ranked blocks only; the sink and recent blocks
  // always read plus one ranked; k covering every block.
  struct Config {
    int64_t k, sink, recent;
  };
  const Config configs[] = {{3, 0, 0}, {4, 1, 1}, {100, 1, 1}};
  for (const Config& cf : configs) {
    const int64_t k = cf.k, sink = cf.sink, recent = cf.recent;  // captured below
    const std::string where = "k " + std::to_string(k) + " sink " + std::to_string(sink) +
                              " recent " + std::to_string(recent);
    auto pool =
        BlockPool::create(testing::window_layout(spec, KvDtype::kF32, p), {.n_tokens = 512});
    ASSERT_TRUE(pool.ok());
    BlockTable seq(**pool), exact(**pool);
    ASSERT_TRUE(seq.set_retention({.policy = RetentionPolicy::kTopK,
                                   .topk = k,
                                   .topk_sink = sink,
                                   .topk_recent = recent})
                    .ok());
    // What each row read, per layer: everything (prompt rows, window
    // layers, k covering the blocks) or the chosen full blocks + its own.
    const auto record = [&](int b, int n, Visibility& vis) {
      vis.seen.resize(static_cast<size_t>(spec.n_layers));
      for (int l = 0; l < spec.n_layers; ++l) {
        for (int r = 0; r < n; ++r) {
          const int pos = b + r;
          std::set<int> mine;
          const std::vector<int64_t>& choice = seq.topk_choice(l);
          const bool all =
              n > 1 || choice.empty() || (*pool)->group((*pool)->groups().slot(l).group).window > 0;
          if (!all) {  // the sink and recent blocks are always among the k - 1
            EXPECT_EQ(static_cast<int64_t>(choice.size()), k - 1) << where;
            if (sink > 0) {
              EXPECT_EQ(choice.front(), 0) << where;
            }
            if (recent > 0) {
              EXPECT_EQ(choice.back(), pos / p - 1) << where;
            }
          }
          for (int j = 0; j <= pos; ++j) {
            const bool own = j / p == pos / p;
            if (all || own || std::count(choice.begin(), choice.end(), j / p) > 0) mine.insert(j);
          }
          vis.seen[static_cast<size_t>(l)].push_back(std::move(mine));
        }
      }
      for (int r = 0; r < n; ++r) vis.slot_at_write.push_back(b + r);
    };
    const bool all_equal =
        run_against_masked_reference(**pool, seq, exact, tokens, n_prompt, 8, where, record);
    ASSERT_FALSE(HasFailure()) << where;
    EXPECT_FALSE(seq.compacted());
    EXPECT_EQ(seq.group(0).length(), n_prompt + n_decode);
    const RetentionStats& rs = seq.retention_stats();
    EXPECT_GT(rs.n_topk_blocks_total, 0);
    if (k >= 100) {
      EXPECT_TRUE(all_equal) << "k covering every block changed bits";
      EXPECT_EQ(rs.n_topk_blocks_read, rs.n_topk_blocks_total);
    } else {
      EXPECT_LT(rs.n_topk_blocks_read, rs.n_topk_blocks_total);
    }
    seq.release();
    exact.release();
    EXPECT_EQ((*pool)->n_free(), (*pool)->n_blocks());
  }
}

CacheIdentity test_identity() {
  CacheIdentity id;
  id.weights_digest = Hash128{7, 8};
  id.arch_revision = "retention-test";
  id.kv_format = "test";
  return id;
}

// Prefix identity: a StreamingLLM sequence publishes only what it computed
// before its first compaction; an exact request for the same tokens adopts
// at most that and its logits equal exact recomputation. A step refused for
// lack of blocks right after a compaction leaves the pool consistent and
// everything is free once the sequences end.
TEST_P(Retention, CompactedSequenceNeverServesAnExactPrefixHit) {
  const SyntheticSpec& spec = GetParam().spec;
  std::mt19937 rng(spec.seed + 11);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  std::vector<int32_t> tokens(48);
  for (auto& t : tokens) t = tok(rng);
  const int p = 4;
  auto pool = BlockPool::create(testing::window_layout(spec, KvDtype::kF32, p), {.n_tokens = 256});
  ASSERT_TRUE(pool.ok());
  KvManager kv(**pool, test_identity(), {.prefix_cache = true});
  std::vector<float> logits;
  auto run = [&](Sequence& s, int from, int to, int chunk) {
    for (int b = from; b < to; b += chunk) {
      const int n = std::min(chunk, to - b);
      const std::span<const int32_t> c(tokens.data() + b, n);
      const StepSeq st{.table = &s.table(), .tokens = c, .logits = LogitsMode::kLast};
      ASSERT_TRUE(fwd_->step(std::span<const StepSeq>(&st, 1), &logits).ok());
      s.on_committed(c);
      (*pool)->check_invariants();
    }
  };
  int64_t published_before_compaction = 0;
  {
    Sequence a = kv.new_sequence(kv.namespace_for(""));
    ASSERT_TRUE(
        a.table()
            .set_retention(
                {.policy = RetentionPolicy::kStreamingLlm, .sinks = 1, .window = 6, .slack = 1})
            .ok());
    run(a, 0, 8, 8);  // one chunk, nothing dropped yet: two blocks published
    published_before_compaction = a.n_published_blocks();
    EXPECT_EQ(published_before_compaction, 2);
    run(a, 8, 48, 1);
    EXPECT_TRUE(a.table().compacted());
    EXPECT_EQ(a.n_published_blocks(), published_before_compaction)
        << "a compacted sequence published blocks";
    // Sequence `a` ends: its published (exact) blocks stay cached.
  }
  Sequence b = kv.new_sequence(kv.namespace_for(""));
  const int64_t adopted = b.adopt_cached_prefix(tokens);
  EXPECT_EQ(adopted, published_before_compaction * p);
  ASSERT_NO_FATAL_FAILURE(run(b, static_cast<int>(adopted), 48, 5));
  const std::vector<double> ref = reference_last_logits(w_, tokens, KvDtype::kF32);
  EXPECT_LT(logits_rel_err(logits.data(), ref), kLogitTol) << "exact request after a hit";
  b.release();

  // Out of blocks right after a compaction: the step fails, the compaction
  // stands (a valid state), nothing leaks.
  BlockTable c(**pool), filler(**pool);
  ASSERT_TRUE(c.set_retention(
                   {.policy = RetentionPolicy::kStreamingLlm, .sinks = 1, .window = 4, .slack = 1})
                  .ok());
  const StepSeq first{.table = &c,
                      .tokens = std::span<const int32_t>(tokens.data(), 12),
                      .logits = LogitsMode::kNone};
  ASSERT_TRUE(fwd_->step(std::span<const StepSeq>(&first, 1), nullptr).ok());
  ASSERT_TRUE(filler.reserve((*pool)->n_available() * p).ok());
  const StepSeq big{.table = &c,
                    .tokens = std::span<const int32_t>(tokens.data() + 12, 30),
                    .logits = LogitsMode::kNone};
  const Status st = fwd_->step(std::span<const StepSeq>(&big, 1), nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::kOutOfBlocks);
  EXPECT_TRUE(c.compacted());
  EXPECT_EQ(c.length(), 12);
  (*pool)->check_invariants();
  c.release();
  filler.release();
  EXPECT_EQ((*pool)->stats().n_blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Retention,
                         ::testing::Values(SyntheticCase{"gqa", SyntheticSpec{.n_layers = 2,
                                                                              .n_embd = 32,
                                                                              .n_heads = 4,
                                                                              .n_kv_heads = 2,
                                                                              .n_ff = 48,
                                                                              .n_vocab = 40,
                                                                              .seed = 21}},
                                           SyntheticCase{"mha_neox", SyntheticSpec{.n_layers = 2,
                                                                                   .n_embd = 32,
                                                                                   .n_heads = 2,
                                                                                   .n_kv_heads = 2,
                                                                                   .n_ff = 48,
                                                                                   .n_vocab = 40,
                                                                                   .neox = true,
                                                                                   .seed = 22}}),
                         testing::synthetic_case_name);

}  // namespace
}  // namespace kvstack

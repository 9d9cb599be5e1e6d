// Memory truth on the real Gemma 3 270M file (models/gemma-3-270m-q4_k_m.gguf:
// 18 layers, window 512 with every sixth layer full, 1 KV head of 256): after
// each prefill step of a long sequence the pool's per-group figures equal the
// per-layer formula computed here from the model's shape alone (the full group
// holds all T tokens; each window group holds only the blocks overlapping
// [T - w + 1, T), i.e. at most w + P tokens between steps), and once the
// sequence ends every block is free or cached.
//
// KVSTACK_GEMMA3_MEM_TOKENS overrides T (default: 8,192 with the prefix cache
// off, 2,048 with it on, together about 35 s on 2 shared cores).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "engine/engine.h"
#include "engine/testing/model_files.h"

namespace kvstack {
namespace {

using testing::gemma3_model_path;

// The 8,192 tokens with the prefix cache off (~30 s on 2 shared
// cores); 2,048 with it on (the same per-group checks, plus cached blocks).
int64_t n_tokens_under_test(bool prefix_cache) {
  const char* env = std::getenv("KVSTACK_GEMMA3_MEM_TOKENS");
  return env ? std::atoll(env) : (prefix_cache ? 2048 : 8192);
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Prefix cache on: a window group's dropped blocks that were published
// (checkpoints) become cached (evictable), not free; off: they are freed.
class Gemma3KvMemory : public ::testing::TestWithParam<bool> {};

TEST_P(Gemma3KvMemory, PerGroupResidencyEqualsTheFormulaAndEverythingIsReturned) {
  if (!std::filesystem::exists(gemma3_model_path())) {
    GTEST_SKIP() << gemma3_model_path() << " not found (scripts/setup.sh model fetches it)";
  }
  const bool prefix_cache = GetParam();
  const int64_t T = n_tokens_under_test(prefix_cache);
  ASSERT_GE(T, 2);
  constexpr int64_t P = 16;
  constexpr int64_t kChunk = 512;
  constexpr int64_t kWindow = 512;
  EngineConfig c;
  c.model_path = gemma3_model_path();
  c.n_threads = 2;
  c.block_size = static_cast<int>(P);
  c.kv_dtype = KvDtype::kF16;
  // The full group's T tokens plus five window groups' peak within a step
  // (w - 1 + chunk tokens, one partial block on each side).
  c.kv_cache_tokens = ceil_div(T, P) * P + 5 * (kWindow + kChunk + 2 * P);
  c.prefill_chunk = static_cast<int>(kChunk);
  c.prefix_cache = prefix_cache;
  auto er = Engine::create(c);
  ASSERT_TRUE(er.ok()) << er.error().message;
  Engine& e = **er;
  const ModelConfig& mc = e.model().config();
  ASSERT_EQ(mc.n_layers, 18);

  // The model's shape, not the pool's arithmetic: f16 K and V rows.
  const int64_t layer_bytes_per_token = 2 * mc.n_kv_heads * mc.head_dim * 2;
  const int n_groups = e.pool().n_groups();
  ASSERT_EQ(n_groups, 6);  // 3 full layers, 15 window layers -> groups of 3

  std::mt19937 rng(17);
  std::uniform_int_distribution<int32_t> tok(10, mc.n_vocab - 1);
  std::vector<int32_t> tokens(static_cast<size_t>(T));
  for (auto& t : tokens) t = tok(rng);

  {
    Sequence seq = e.new_sequence();
    // One Engine::prefill per chunk so the figures can be read between steps.
    int64_t done = 0;
    while (done < T) {
      const int64_t n = std::min(kChunk, T - done);
      ASSERT_TRUE(
          e.prefill(seq,
                    std::span(tokens).subspan(static_cast<size_t>(done), static_cast<size_t>(n)),
                    LogitsMode::kNone, nullptr)
              .ok());
      done += n;
      e.pool().check_invariants();
      // Right after the step a window group still holds what the step's
      // queries saw: at most w + P + chunk tokens.
      const BlockPoolStats before = e.pool().stats();
      for (int g = 1; g < n_groups; ++g) {
        EXPECT_LE(before.groups[static_cast<size_t>(g)].n_tokens_resident, kWindow + P + kChunk)
            << "group " << g << " at T=" << done;
      }
      // What the next step releases first (BlockTable::reserve does this).
      seq.table().drop_invisible();
      e.pool().check_invariants();
      const BlockPoolStats st = e.pool().stats();
      ASSERT_EQ(static_cast<int>(st.groups.size()), n_groups);
      int64_t payload = 0, used = 0;
      for (int g = 0; g < n_groups; ++g) {
        const BlockPoolGroupStats& gs = st.groups[static_cast<size_t>(g)];
        // Window groups: the blocks overlapping [max(0, T - w + 1), T) stay,
        // the `first` ones before them are dropped.
        const int64_t first = g > 0 ? std::max<int64_t>(0, done - kWindow + 1) / P : 0;
        const int64_t blocks = ceil_div(done, P) - first;
        const int64_t resident = done - first * P;
        EXPECT_EQ(gs.n_layers, 3);
        EXPECT_EQ(gs.window, g == 0 ? 0 : kWindow) << "group " << g;
        EXPECT_EQ(gs.n_blocks_used, blocks) << "group " << g << " at T=" << done;
        EXPECT_EQ(gs.n_tokens_resident, resident) << "group " << g << " at T=" << done;
        if (g > 0) {
          EXPECT_LE(resident, kWindow + P) << "group " << g << " at T=" << done;
        }
        // Payload: the tokens a query can still attend to (min(T, w) in a
        // window group); the resident blocks hold up to P - 1 more.
        const int64_t kept = g > 0 ? std::min(done, kWindow) : done;
        EXPECT_EQ(gs.payload_bytes, kept * gs.n_layers * layer_bytes_per_token) << "group " << g;
        EXPECT_EQ(gs.allocated_bytes, (gs.n_blocks_used + gs.n_blocks_cached) * st.block_bytes)
            << "group " << g;
        if (!prefix_cache) {
          EXPECT_EQ(gs.n_blocks_cached, 0);
        }
        payload += gs.payload_bytes;
        used += gs.n_blocks_used * st.block_bytes;
      }
      EXPECT_EQ(st.n_blocks_used * st.block_bytes, used);
      if (done == T) {
        // The figures benchmarks.md records: per group, and the held total
        // against the per-layer ideal (full layers T tokens, window layers
        // min(T, w)).
        const int64_t ideal = layer_bytes_per_token * (3 * T + 15 * std::min<int64_t>(T, kWindow));
        for (int g = 0; g < n_groups; ++g) {
          const BlockPoolGroupStats& gs = st.groups[static_cast<size_t>(g)];
          std::printf(
              "prefix cache %s T=%lld group %d window %lld: %lld tokens resident, payload %lld, "
              "held %lld, allocated (held + cached) %lld bytes\n",
              prefix_cache ? "on" : "off", static_cast<long long>(T), g,
              static_cast<long long>(gs.window), static_cast<long long>(gs.n_tokens_resident),
              static_cast<long long>(gs.payload_bytes),
              static_cast<long long>(gs.n_blocks_used) * static_cast<long long>(st.block_bytes),
              static_cast<long long>(gs.allocated_bytes));
        }
        std::printf(
            "prefix cache %s T=%lld total payload %lld, held %lld, allocated %lld, per-layer "
            "ideal %lld bytes (held/ideal %.4f), pool resident (mincore) %lld bytes\n",
            prefix_cache ? "on" : "off", static_cast<long long>(T), static_cast<long long>(payload),
            static_cast<long long>(used), static_cast<long long>(st.allocated_bytes),
            static_cast<long long>(ideal), static_cast<double>(used) / static_cast<double>(ideal),
            static_cast<long long>(st.resident_bytes));
        // Held bytes within 5% of the ideal once T is well past the window.
        if (T >= 4096) {
          EXPECT_LE(static_cast<double>(used), 1.05 * static_cast<double>(ideal));
        }
      }
    }
  }
  // The sequence ended: nothing is held; its published blocks are cached.
  e.pool().check_invariants();
  const BlockPoolStats end = e.pool().stats();
  EXPECT_EQ(end.n_blocks_used, 0);
  EXPECT_EQ(end.n_tables, 0);
  EXPECT_EQ(end.n_blocks_free + end.n_blocks_cached, end.n_blocks_total);
  if (prefix_cache) {
    EXPECT_GT(end.n_blocks_cached, 0);
  } else {
    EXPECT_EQ(end.n_blocks_cached, 0);
  }
  for (const BlockPoolGroupStats& gs : end.groups) {
    EXPECT_EQ(gs.n_blocks_used, 0);
    EXPECT_EQ(gs.n_tokens_resident, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(PrefixCache, Gemma3KvMemory, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "On" : "Off"; });

}  // namespace
}  // namespace kvstack

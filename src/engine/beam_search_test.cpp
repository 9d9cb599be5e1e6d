// Beam search on forks (default model): K = 4 beams share the prompt and
// common prefixes, so they hold fewer KV blocks than 4 independent
// sequences, and give exactly the beams of the no-sharing reference (every
// fork a private copy of its parent's blocks).
#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/beam_search.h"

namespace kvstack {
namespace {

TEST(BeamSearch, SharedForksMatchPrivateCopiesWithFewerBlocks) {
  const char* model = std::getenv("KVSTACK_MODEL");
  EngineConfig cfg;
  cfg.model_path = model != nullptr ? model : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  cfg.n_threads = 2;
  cfg.kv_cache_tokens = 4096;
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.error().message;
  Engine& e = **engine;
  const std::vector<int32_t> prompt = e.tokenizer().tokenize(
      "Paris is the capital and largest city of France. With an estimated population of "
      "over two million residents, it is the centre of the Ile-de-France region. The city "
      "is known for",
      {.add_special = true});
  BeamSearchOptions opt;
  opt.n_beams = 4;
  opt.max_tokens = 12;
  opt.cache_salt = "beam-shared";
  auto shared = beam_search(e, prompt, opt);
  ASSERT_TRUE(shared.ok()) << shared.error().message;
  opt.share_kv = false;
  // Another namespace: the reference computes its prompt itself rather than
  // hitting the first run's blocks (a 1-token prefill after a cached prefix
  // rounds differently from a whole-prompt prefill on this Q4 model).
  opt.cache_salt = "beam-reference";
  auto reference = beam_search(e, prompt, opt);
  ASSERT_TRUE(reference.ok()) << reference.error().message;
  ASSERT_EQ(shared->beams.size(), 4u);
  ASSERT_EQ(reference->beams.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(shared->beams[i].tokens, reference->beams[i].tokens) << "beam " << i;
    EXPECT_EQ(shared->beams[i].logprob, reference->beams[i].logprob) << "beam " << i;
  }
  // Sharing: fewer blocks held at the peak than 4 independent sequences,
  // and fewer than the private-copy reference actually held.
  EXPECT_LT(shared->peak_blocks_used, shared->peak_blocks_independent);
  EXPECT_LT(shared->peak_blocks_used, reference->peak_blocks_used);
  EXPECT_GT(shared->n_cow_copies, 0);
  std::printf(
      "beam search K=4, %zu prompt tokens, 12 steps: peak %lld blocks shared vs %lld "
      "independent (%lld measured without sharing), %lld copy-on-write copies\n",
      prompt.size(), static_cast<long long>(shared->peak_blocks_used),
      static_cast<long long>(shared->peak_blocks_independent),
      static_cast<long long>(reference->peak_blocks_used),
      static_cast<long long>(shared->n_cow_copies));
  // Every reference returned: only cached (published) blocks remain.
  e.pool().check_invariants();
  EXPECT_EQ(e.pool().stats().n_blocks_used, 0);
}

}  // namespace
}  // namespace kvstack

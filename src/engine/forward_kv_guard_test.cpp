// Forward-level checks of what reaches the KV cache:
//  - a K/V row holding NaN/Inf (here: a poisoned token embedding or a
//    poisoned K weight of a later layer) fails the step with an error naming
//    the layer, step entry, tensor and position; no abort, no table length
//    changes, the step's reservations go back to the pool, and the committed
//    K/V of the other sequences are untouched (retrying without the bad
//    sequence gives the same logits as a run that never saw it).
// (--kv-rotate is tested in forward_rotation_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "engine/forward.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_codec.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

using testing::make_synthetic_model;
using testing::SyntheticSpec;
using testing::SyntheticWeights;

// Overwrites element `index` of the f32 tensor whose values are `src` in the
// model file with `value`, locating the tensor by the bytes of 8 consecutive
// values starting at `index` (random weights: unique in the file).
void poison(const std::string& path, const std::vector<double>& src, size_t index, float value) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<char> pat(32);
  for (size_t i = 0; i < 8; ++i) {
    const auto f = static_cast<float>(src[index + i]);
    std::memcpy(pat.data() + 4 * i, &f, 4);
  }
  const auto it = std::search(file.begin(), file.end(), pat.begin(), pat.end());
  ASSERT_NE(it, file.end()) << "tensor bytes not found in " << path;
  std::memcpy(&*it, &value, 4);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(file.data(), static_cast<std::streamsize>(file.size()));
}

std::unique_ptr<BlockPool> make_pool(const SyntheticSpec& spec, KvDtype dtype, int block_size) {
  auto layout =
      KvLayout::uniform(spec.n_layers, spec.n_kv_heads, spec.head_dim(), dtype, block_size);
  EXPECT_TRUE(layout.ok());
  auto pool = BlockPool::create(*layout, {.n_tokens = 256});
  EXPECT_TRUE(pool.ok());
  return std::move(*pool);
}

// Raw bytes of every block of `t` (all layers).
std::vector<uint8_t> block_bytes(const BlockPool& pool, const BlockTable& t) {
  std::vector<uint8_t> out;
  for (int l = 0; l < pool.layout().n_layers(); ++l) {
    const PagedKvLayerView v = pool.layer_view(l);
    for (const int32_t b : t.ids()) {
      const uint8_t* p = v.k + b * v.block_stride;
      out.insert(out.end(), p, p + v.block_stride);
    }
  }
  return out;
}

constexpr int kBadToken = 7;

class KvGuard : public ::testing::TestWithParam<KvDtype> {};

TEST_P(KvGuard, NanRowFailsTheStepAndChangesNothing) {
  const KvDtype dtype = GetParam();
  SyntheticSpec spec;
  spec.seed = 31;
  spec.n_embd = 128;  // head_dim 32, as int4 needs
  SyntheticWeights w = make_synthetic_model(spec);
  poison(w.path, w.embd, static_cast<size_t>(kBadToken) * spec.n_embd, std::nanf(""));
  auto model = Model::load(w.path);
  std::remove(w.path.c_str());
  ASSERT_TRUE(model.ok()) << model.error().message;
  ThreadPool threads(2);
  Forward fwd(**model, threads);
  auto pool = make_pool(spec, dtype, 4);

  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};  // 1.5 blocks: partial tail
  const std::vector<int32_t> next = {9};
  const std::vector<int32_t> bad = {3, kBadToken, 4};
  std::vector<float> logits;

  // The reference: prompt then one decode token, never disturbed.
  std::vector<float> want;
  {
    BlockTable ref(*pool);
    const StepSeq p{.table = &ref, .tokens = prompt, .logits = LogitsMode::kNone};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&p, 1), nullptr).ok());
    const StepSeq d{.table = &ref, .tokens = next, .logits = LogitsMode::kLast};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&d, 1), &want).ok());
  }

  BlockTable a(*pool), b(*pool);
  const StepSeq p{.table = &a, .tokens = prompt, .logits = LogitsMode::kNone};
  ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&p, 1), nullptr).ok());
  const int64_t available = pool->n_available();
  const int64_t a_blocks = a.n_blocks();
  const std::vector<uint8_t> a_before = block_bytes(*pool, a);

  const StepSeq batch[2] = {{.table = &a, .tokens = next, .logits = LogitsMode::kLast},
                            {.table = &b, .tokens = bad, .logits = LogitsMode::kLast}};
  const Status st = fwd.step(batch, &logits);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
  EXPECT_EQ(fwd.rejected_entry(), 1);
  const std::string& msg = st.error().message;
  EXPECT_NE(msg.find("layer 0, step entry 1: K of position 1, head 0: element 0 is nan"),
            std::string::npos)
      << msg;
  EXPECT_EQ(a.length(), static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(b.length(), 0);
  EXPECT_EQ(b.n_blocks(), 0);
  EXPECT_EQ(a.n_blocks(), a_blocks);
  EXPECT_EQ(pool->n_available(), available);
  EXPECT_EQ(block_bytes(*pool, a), a_before);

  // The same step without the bad sequence gives the undisturbed result.
  const StepSeq d{.table = &a, .tokens = next, .logits = LogitsMode::kLast};
  ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&d, 1), &logits).ok());
  EXPECT_EQ(fwd.rejected_entry(), -1);
  ASSERT_EQ(logits.size(), want.size());
  // The output matrix is the (poisoned) embedding: the bad token's logit is NaN in both.
  for (size_t i = 0; i < want.size(); ++i) {
    if (i == kBadToken) {
      EXPECT_TRUE(std::isnan(logits[i]) && std::isnan(want[i]));
    } else {
      ASSERT_EQ(logits[i], want[i]) << i;
    }
  }
}

TEST_P(KvGuard, NanInALaterLayerRollsBackTheReservation) {
  const KvDtype dtype = GetParam();
  SyntheticSpec spec;
  spec.seed = 32;
  spec.n_embd = 128;
  SyntheticWeights w = make_synthetic_model(spec);
  poison(w.path, w.layers[1].wk, 0, INFINITY);  // every token's K of layer 1
  auto model = Model::load(w.path);
  std::remove(w.path.c_str());
  ASSERT_TRUE(model.ok()) << model.error().message;
  ThreadPool threads(2);
  Forward fwd(**model, threads);
  auto pool = make_pool(spec, dtype, 4);
  const int64_t available = pool->n_available();
  BlockTable t(*pool);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  std::vector<float> logits;
  const StepSeq s{.table = &t, .tokens = prompt, .logits = LogitsMode::kAll};
  const Status st = fwd.step(std::span<const StepSeq>(&s, 1), &logits);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("layer 1, step entry 0: K of position 0, head 0: element"),
            std::string::npos)
      << st.error().message;
  EXPECT_EQ(t.length(), 0);
  EXPECT_EQ(t.n_blocks(), 0);
  EXPECT_EQ(pool->n_available(), available);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvGuard,
                         ::testing::Values(KvDtype::kF32, KvDtype::kF16, KvDtype::kFp8,
                                           KvDtype::kInt8, KvDtype::kInt4),
                         [](const auto& info) { return std::string(kv_dtype_name(info.param)); });

}  // namespace
}  // namespace kvstack

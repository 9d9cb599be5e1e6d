// Test helpers shared by the cache-equivalence tests (forward_test.cpp,
// forward_quant_test.cpp, forward_rotation_test.cpp): a parameterised fixture
// that loads a synthetic model with a Forward over it, the comparison of
// float32 logits rows against the float64 reference (synthetic_model.h), the
// int4 storage error bound, the decoded stored row of a position, the
// chunk-by-chunk comparison of two forwards, and the prefill / decode / fork
// driver of the quantized-cache tests, and the per-layer-window layout of a
// synthetic spec (forward_window_test.cpp, sequence_hybrid_test.cpp) with the
// interleaved prefill / decode driver of forward_test and forward_window_test.
// Header-only: src/engine
// globs only its own folder into kvstack_engine, so nothing here is linked
// into the library.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attention/paged_attention.h"
#include "core/thread_pool.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_codec.h"
#include "kv/layout.h"

namespace kvstack::testing {

// float32 compute against a float64 reference over the same K/V: each logit
// is the end of ~10 chained reductions of length <= max(n_embd, n_ff) = 128
// (matmuls, norms, softmax over <= 60 positions) whose rounding errors are
// each bounded by ~n * 2^-24 relative (1 part in 1.3e5 for n = 128) and
// mostly cancel; 1e-4 relative to the row's largest logit allows a 10x
// margin over the typical accumulated error while any real bug (wrong
// position, mask, head mapping, block addressing) changes logits by O(1).
inline constexpr double kLogitTol = 1e-4;

// Decode rows (one new token) over int4 keys attend with q^, the query
// rounded to int8 codes per 32 elements (attention_quant.h), which the
// float64 references leave exact: a float64 q cannot tell which codes the
// engine's float q rounds to (a code flips when q * 127 / amax lies within
// float error of a half), so a q^-aware reference would fail at random.
// Those rows are held to the size of that rounding's effect instead,
// measured at 0.2% to 0.9% of the largest logit on the synthetic models of
// these tests (a wrong block, position or head moves logits by O(1));
// attention_quant_test checks q^ against the kernels exactly.
inline constexpr double kInt4DecodeTol = 3e-2;

// The tolerance of decode rows over a cache of this layout: kInt4DecodeTol
// where a layer's decode rows attend with q^, i.e. over int4 keys, and over
// int8 keys where the AVX-512 VNNI decode kernel runs (attention_kernel_name;
// it rounds q as for int4, measured at 0.2% of the largest logit here).
inline double decode_row_tol(const KvLayout& layout) {
  for (int l = 0; l < layout.n_layers(); ++l) {
    const KvLayerSpec& s = layout.layer(l);
    if (s.dtype == KvDtype::kInt4) return kInt4DecodeTol;
    if (s.dtype == KvDtype::kInt8 &&
        attention_kernel_name(s.dtype, s.value_dtype(), s.head_dim_k).starts_with("avx512-vnni")) {
      return kInt4DecodeTol;
    }
  }
  return kLogitTol;
}

// Worst |x - stored| / row amax of an int4 row. The encoder picks each
// group's (scale, min) for the smallest squared error, never above the
// min-max fit's 32 x (step / 2)^2 with step <= range / 15 <= 2 amax / 15:
// one element is off by at most sqrt(32) such half steps.
inline constexpr double kInt4MaxErr = 2 * 0.5 / 15 * 1.01 * 5.6569;

// The layout the engine builds for `spec`: one standard layer per model
// layer with its window (spec.window(l); 0 is full attention).
inline KvLayout window_layout(const SyntheticSpec& spec, KvDtype dtype, int block_size) {
  std::vector<KvLayerSpec> layers;
  layers.reserve(static_cast<size_t>(spec.n_layers));
  for (int l = 0; l < spec.n_layers; ++l) {
    layers.push_back({.n_kv_heads = spec.n_kv_heads,
                      .head_dim_k = spec.head_dim(),
                      .head_dim_v = spec.head_dim(),
                      .dtype = dtype,
                      .window = spec.window(l)});
  }
  auto layout = KvLayout::create(layers, block_size);
  KV_CHECK(layout.ok(), "window_layout: bad spec");
  return std::move(*layout);
}

// Max |got[i] - ref[i]| over a logits row ([ref.size()] floats at `got`),
// relative to the row's largest |ref[i]|.
inline double logits_rel_err(const float* got, const std::vector<double>& ref) {
  double num = 0, den = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::fabs(got[i] - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return num / den;
}

// Steps forward `a` over table `ta` and forward `b` over `tb` through the
// same [from, to) chunks of `prompt` (every row's logits) and expects b's
// logits within rel_tol of a's, relative to a's largest |logit| of the
// chunk: for two forwards that differ by a transform of K/V that is exact
// in real arithmetic (--kv-rotate, --kv-center) over float caches.
inline void expect_same_logits_by_chunks(Forward& a, BlockTable& ta, Forward& b, BlockTable& tb,
                                         const std::vector<int32_t>& prompt,
                                         std::initializer_list<std::pair<int, int>> chunks,
                                         double rel_tol) {
  std::vector<float> la, lb;
  for (auto [from, to] : chunks) {
    const std::span<const int32_t> chunk(prompt.data() + from, static_cast<size_t>(to - from));
    const StepSeq sa{.table = &ta, .tokens = chunk, .logits = LogitsMode::kAll};
    const StepSeq sb{.table = &tb, .tokens = chunk, .logits = LogitsMode::kAll};
    ASSERT_TRUE(a.step(std::span<const StepSeq>(&sa, 1), &la).ok());
    ASSERT_TRUE(b.step(std::span<const StepSeq>(&sb, 1), &lb).ok());
    ASSERT_EQ(la.size(), lb.size());
    EXPECT_LT(logits_rel_err(lb.data(), std::vector<double>(la.begin(), la.end())), rel_tol)
        << "chunk from " << from;
  }
}

// A named synthetic shape, the parameter of SyntheticForwardTest suites.
struct SyntheticCase {
  const char* name;
  SyntheticSpec spec;
};

// Test names from SyntheticCase::name (INSTANTIATE_TEST_SUITE_P's last argument).
inline std::string synthetic_case_name(const ::testing::TestParamInfo<SyntheticCase>& info) {
  return info.param.name;
}

// The synthetic model of `spec`, written to a temporary file, loaded and the
// file removed; `weights` are the float64 copies the reference runs on.
struct LoadedSyntheticModel {
  SyntheticWeights weights;
  std::unique_ptr<Model> model;
};

inline Result<LoadedSyntheticModel> load_synthetic_model(const SyntheticSpec& spec) {
  LoadedSyntheticModel out{.weights = make_synthetic_model(spec), .model = nullptr};
  auto model = Model::load(out.weights.path);
  std::remove(out.weights.path.c_str());
  if (!model.ok()) return model.error();
  out.model = std::move(*model);
  if (!spec.layer_window.empty()) {
    if (Status st = out.model->set_layer_windows(spec.layer_window); !st.ok()) return st.error();
  }
  return out;
}

// Fixture: GetParam().spec's synthetic model loaded (w_, model_) and a
// Forward over it on a 2-thread pool (fwd_). A load failure fails the test
// in SetUp, before its body runs.
class SyntheticForwardTest : public ::testing::TestWithParam<SyntheticCase> {
 protected:
  void SetUp() override {
    auto loaded = load_synthetic_model(GetParam().spec);
    ASSERT_TRUE(loaded.ok()) << loaded.error().message;
    w_ = std::move(loaded->weights);
    model_ = std::move(loaded->model);
    fwd_ = std::make_unique<Forward>(*model_, threads_);
  }

  SyntheticWeights w_;
  std::unique_ptr<Model> model_;
  ThreadPool threads_{2};
  std::unique_ptr<Forward> fwd_;  // over *model_ and threads_
};

// The stored row of position `pos`, KV head `h`, K (which 0) or V of a
// per-row format, decoded with the scalar reference codec.
inline std::vector<float> stored_row(const PagedKvLayerView& v, const BlockTable& t, int pos, int h,
                                     int which) {
  const int64_t b = t.ids()[pos / v.block_size];
  const int s = pos % v.block_size;
  const bool k = which == 0;
  const uint8_t* row =
      k ? v.k + b * v.block_stride + h * v.head_stride + s * v.slot_stride
        : v.v + b * v.block_stride + h * v.value_head_stride() + s * v.value_slot_stride();
  const uint8_t* meta = k ? v.k_meta : v.v_meta;
  if (meta != nullptr) {
    meta += b * v.block_stride + h * (k ? v.k_meta_head_stride : v.v_meta_head_stride) +
            s * (k ? v.k_meta_slot_stride : v.v_meta_slot_stride);
  }
  std::vector<float> out(v.head_dim);
  kv_decode_row(k ? v.dtype : v.value_dtype(), row, meta, v.head_dim, out.data());
  return out;
}

// One sequence through `pool` the way the cache-equivalence tests drive it:
// chunked prefill of prompt[0, n_prompt) in chunks of first_chunk,
// first_chunk + 3, ... (after a junk reservation of two blocks that is then
// released, so blocks are scattered), decode of the rest of `prompt` one
// token at a time, then, when the prompt fills at least one block, a fork
// that adopts its full blocks (shared, stored once) and prefills fork_tail.
// After every step each returned logits row must be within kLogitTol of
// reference(tokens, n, table): the float64 logits of tokens[0, n) computed
// over what `table` stores; rows of one-token steps (decode rows) within
// decode_tol (decode_row_tol()).
template <class Reference>
void run_prefill_decode_fork(Forward& fwd, BlockPool& pool, int n_vocab,
                             const std::vector<int32_t>& prompt, int n_prompt, int first_chunk,
                             const std::vector<int32_t>& fork_tail, const Reference& reference,
                             double decode_tol = kLogitTol) {
  const int block_size = pool.layout().block_size();
  BlockTable junk(pool), seq(pool);
  ASSERT_TRUE(junk.reserve(2 * block_size).ok());
  std::vector<float> logits;
  for (int b = 0, chunk = first_chunk; b < n_prompt; b += chunk, chunk += 3) {
    const int e = std::min(n_prompt, b + chunk);
    const StepSeq s{.table = &seq,
                    .tokens = std::span<const int32_t>(prompt.data() + b, e - b),
                    .logits = LogitsMode::kAll};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
    if (b == 0) junk.release();
    for (int j = b; j < e; ++j) {
      const std::vector<double> ref = reference(prompt, j + 1, seq);
      ASSERT_LT(logits_rel_err(logits.data() + static_cast<size_t>(j - b) * n_vocab, ref),
                e - b == 1 ? decode_tol : kLogitTol)
          << "prefill position " << j;
    }
  }
  const int n_total = static_cast<int>(prompt.size());
  for (int pos = n_prompt; pos < n_total; ++pos) {
    const StepSeq s{.table = &seq, .tokens = std::span<const int32_t>(&prompt[pos], 1)};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
    ASSERT_LT(logits_rel_err(logits.data(), reference(prompt, pos + 1, seq)), decode_tol)
        << "decode step " << pos - n_prompt;
  }
  const int n_shared = n_prompt / block_size;
  if (n_shared == 0) return;
  std::vector<BlockRef> refs;
  refs.reserve(static_cast<size_t>(n_shared));
  for (int i = 0; i < n_shared; ++i) refs.push_back(seq.share_block(i));
  BlockTable fork(pool);
  fork.adopt_prefix(std::move(refs));
  std::vector<int32_t> fork_tokens(prompt.begin(), prompt.begin() + n_shared * block_size);
  fork_tokens.insert(fork_tokens.end(), fork_tail.begin(), fork_tail.end());
  const StepSeq s{.table = &fork,
                  .tokens = std::span<const int32_t>(fork_tail.data(), fork_tail.size()),
                  .logits = LogitsMode::kLast};
  ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
  ASSERT_LT(logits_rel_err(logits.data(),
                           reference(fork_tokens, static_cast<int>(fork_tokens.size()), fork)),
            kLogitTol)
      << "fork";
  EXPECT_EQ(seq.length(), n_total);
}

// One sequence `seq` with scattered blocks, the way forward_test and
// forward_window_test drive it: a junk table reserves three blocks, prompt's
// first n_prompt tokens go in chunks of `chunk`, each step batched with the
// same span of `other` into `side` (no logits), junk is released after the
// first step; then the rest of `prompt` is decoded one token at a time. Every
// logits row of position j must be within kLogitTol of ref[j] (the float64
// logits of prompt[0, j]); `where` labels failures. after_step(start, n,
// label), when given, runs after each step of n tokens from `start`, before
// the logits checks (label: " prefill at <start>" or " decode <d>").
inline void run_interleaved_prefill_decode(
    Forward& fwd, BlockTable& seq, BlockTable& side, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& other, int n_prompt, int chunk, int n_vocab,
    const std::vector<std::vector<double>>& ref, const std::string& where,
    const std::function<void(int64_t, int64_t, const std::string&)>& after_step = {}) {
  BlockTable junk(seq.pool());
  ASSERT_TRUE(junk.reserve(3 * seq.pool().block_size()).ok());
  std::vector<float> logits;
  for (int b = 0; b < n_prompt; b += chunk) {
    const int e = std::min(n_prompt, b + chunk);
    const StepSeq batch[2] = {
        {.table = &side,
         .tokens = std::span<const int32_t>(other.data() + b, e - b),
         .logits = LogitsMode::kNone},
        {.table = &seq,
         .tokens = std::span<const int32_t>(prompt.data() + b, e - b),
         .logits = LogitsMode::kAll},
    };
    ASSERT_TRUE(fwd.step(batch, &logits).ok()) << where;
    if (b == 0) junk.release();
    if (after_step) after_step(b, e - b, " prefill at " + std::to_string(b));
    // Every position of the chunk against recomputation of its prefix.
    for (int j = b; j < e; ++j) {
      ASSERT_LT(logits_rel_err(logits.data() + static_cast<size_t>(j - b) * n_vocab, ref[j]),
                kLogitTol)
          << where << " position " << j;
    }
  }
  const int n_decode = static_cast<int>(prompt.size()) - n_prompt;
  for (int d = 0; d < n_decode; ++d) {
    const int64_t start = seq.length();
    const StepSeq s{.table = &seq, .tokens = std::span<const int32_t>(&prompt[n_prompt + d], 1)};
    ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok()) << where;
    if (after_step) after_step(start, 1, " decode " + std::to_string(d));
    ASSERT_LT(logits_rel_err(logits.data(), ref[n_prompt + d]), kLogitTol)
        << where << " decode step " << d;
  }
}

}  // namespace kvstack::testing

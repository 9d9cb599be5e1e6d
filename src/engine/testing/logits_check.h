// Test helpers shared by the cache-equivalence tests (forward_test.cpp,
// forward_quant_test.cpp, forward_rotation_test.cpp): a parameterised fixture
// that loads a synthetic model with a Forward over it, the comparison of
// float32 logits rows against the float64 reference (synthetic_model.h) and
// the int4 storage error bound. Header-only: src/engine
// globs only its own folder into kvstack_engine, so nothing here is linked
// into the library.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/thread_pool.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "engine/testing/synthetic_model.h"

namespace kvstack::testing {

// float32 compute against a float64 reference over the same K/V: each logit
// is the end of ~10 chained reductions of length <= max(n_embd, n_ff) = 128
// (matmuls, norms, softmax over <= 60 positions) whose rounding errors are
// each bounded by ~n * 2^-24 relative (1 part in 1.3e5 for n = 128) and
// mostly cancel; 1e-4 relative to the row's largest logit allows a 10x
// margin over the typical accumulated error while any real bug (wrong
// position, mask, head mapping, block addressing) changes logits by O(1).
inline constexpr double kLogitTol = 1e-4;

// Worst |x - stored| / row amax of an int4 row. The encoder picks each
// group's (scale, min) for the smallest squared error, never above the
// min-max fit's 32 x (step / 2)^2 with step <= range / 15 <= 2 amax / 15:
// one element is off by at most sqrt(32) such half steps.
inline constexpr double kInt4MaxErr = 2 * 0.5 / 15 * 1.01 * 5.6569;

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

}  // namespace kvstack::testing

// PromText against hand-written exposition text: families, base and extra
// labels, integer and double samples, and a histogram's cumulative buckets.
#include "core/prometheus_text.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>

namespace kvstack {
namespace {

TEST(PromText, FamiliesAndSamples) {
  PromText p("model_name=\"m\"");
  p.metric("a_total", "counter", "Things.", int64_t{12345678901});
  p.metric_f("b", "gauge", "A fraction.", 0.25);
  p.family("c", "gauge", "Per tier.");
  p.sample("c", int64_t{-3}, "tier=\"host\"");
  p.sample_f("c", 1e-7, "tier=\"disk\",x=\"y\"");
  p.sample_f("c", 3.0);
  EXPECT_EQ(
      p.str(),
      "# HELP a_total Things.\n# TYPE a_total counter\na_total{model_name=\"m\"} 12345678901\n"
      "# HELP b A fraction.\n# TYPE b gauge\nb{model_name=\"m\"} 0.25\n"
      "# HELP c Per tier.\n# TYPE c gauge\n"
      "c{model_name=\"m\",tier=\"host\"} -3\n"
      "c{model_name=\"m\",tier=\"disk\",x=\"y\"} 9.9999999999999995e-08\n"
      "c{model_name=\"m\"} 3\n");
  PromText bare("");
  bare.sample("d", int64_t{1}, "k=\"v\"");
  EXPECT_EQ(bare.take(), "d{k=\"v\"} 1\n");
}

TEST(PromText, HistogramBucketsAreCumulative) {
  PromText p("l=\"1\"");
  const std::array<double, 3> bounds = {0.01, 0.5, 2.0};
  const std::array<int64_t, 4> counts = {1, 0, 2, 3};  // the last: above 2.0
  p.family("h_seconds", "histogram", "Latency.");
  p.histogram("h_seconds", std::span<const double>(bounds), std::span<const int64_t>(counts),
              12.3456789012, 6, "tier=\"x\"");
  EXPECT_EQ(p.str(),
            "# HELP h_seconds Latency.\n# TYPE h_seconds histogram\n"
            "h_seconds_bucket{l=\"1\",tier=\"x\",le=\"0.01\"} 1\n"
            "h_seconds_bucket{l=\"1\",tier=\"x\",le=\"0.5\"} 1\n"
            "h_seconds_bucket{l=\"1\",tier=\"x\",le=\"2\"} 3\n"
            "h_seconds_bucket{l=\"1\",tier=\"x\",le=\"+Inf\"} 6\n"
            "h_seconds_sum{l=\"1\",tier=\"x\"} 12.3456789\n"
            "h_seconds_count{l=\"1\",tier=\"x\"} 6\n");
}

}  // namespace
}  // namespace kvstack

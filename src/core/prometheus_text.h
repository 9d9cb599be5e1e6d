// PromText: the one writer of Prometheus text exposition (format 0.0.4)
// behind /metrics: the server's scheduler, pool and connection series
// (server/http_server.cpp), the KV events counters (server/kv_events.cpp)
// and the storage tiers' series (kv/kv_tiers_stats.cpp).
//
// A family is `# HELP name help` and `# TYPE name type`, then its samples
// `name{labels} value`. Every sample carries the writer's base labels (e.g.
// model_name="m", given without braces) followed by the sample's own (e.g.
// tier="host"). Numbers: integers in decimal; doubles with %.17g (exact on a
// round trip, and integers below 2^53 print as integers); histogram bounds
// with %g and histogram sums with %.9g.
//
// Thread-safety: none (one writer per page).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace kvstack {

class PromText {
 public:
  explicit PromText(std::string base_labels) : base_(std::move(base_labels)) {}

  // The family's HELP and TYPE lines (type: counter, gauge or histogram).
  void family(std::string_view name, std::string_view type, std::string_view help);
  // One sample of the current family; `labels` (without braces) follow the
  // base labels.
  void sample(std::string_view name, int64_t value, std::string_view labels = {});
  void sample_f(std::string_view name, double value, std::string_view labels = {});
  // A family with its one sample.
  void metric(std::string_view name, std::string_view type, std::string_view help, int64_t value) {
    family(name, type, help);
    sample(name, value);
  }
  void metric_f(std::string_view name, std::string_view type, std::string_view help, double value) {
    family(name, type, help);
    sample_f(name, value);
  }
  // One histogram's samples: name_bucket{...,le="b"} with the cumulative
  // count per upper bound, le="+Inf" with all of them, name_sum and
  // name_count. counts[i] (not cumulative) is the observations at or below
  // bounds[i] and above bounds[i - 1]; counts[bounds.size()] those above every
  // bound. REQUIRES counts.size() == bounds.size() + 1.
  template <typename Count>
  void histogram(std::string_view name, std::span<const double> bounds,
                 std::span<const Count> counts, double sum, uint64_t count,
                 std::string_view labels = {}) {
    uint64_t cum = 0;
    for (size_t i = 0; i < bounds.size(); ++i) {
      cum += static_cast<uint64_t>(counts[i]);
      bucket(name, bounds[i], false, cum, labels);
    }
    cum += static_cast<uint64_t>(counts[bounds.size()]);
    bucket(name, 0, true, cum, labels);
    sum_count(name, sum, count, labels);
  }

  const std::string& str() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void open(std::string_view name, std::string_view suffix, std::string_view labels);
  void bucket(std::string_view name, double bound, bool inf, uint64_t cum, std::string_view labels);
  void sum_count(std::string_view name, double sum, uint64_t count, std::string_view labels);

  std::string base_;
  std::string out_;
};

}  // namespace kvstack

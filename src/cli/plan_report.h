// `kvstack plan`'s output: the unit-labelled table, --json and the --svg
// chart of memory versus context length, rendered from a capacity::PlanResult.
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/units.h"
#include "kv/capacity.h"

namespace kvstack::cli::plan_report {

// What explicit dimensions left out: KV bytes need only layers, KV heads and
// the head dimension; figures built on the query heads or the weights are
// omitted from the output (with a note) when those are not given.
struct Omitted {
  bool q_heads = false;  // workspace estimate, attention FLOPs
  bool weights = false;  // weights, total, crossover, budget and decode figures
};

// Byte and time formatting of the table (--gb adds decimal gigabytes).
struct Out {
  bool gb = false;
  std::string bytes(uint64_t b) const {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "%" PRIu64 " B (%s", b,
                  format_bytes(static_cast<double>(b)).c_str());
    std::string s = buf;
    if (gb) {
      std::snprintf(buf, sizeof(buf), ", %.6g GB", static_cast<double>(b) / 1e9);
      s += buf;
    }
    return s + ")";
  }
  static std::string secs(double s) {
    char buf[64];
    if (s >= 1)
      std::snprintf(buf, sizeof(buf), "%.4g s", s);
    else if (s >= 1e-3)
      std::snprintf(buf, sizeof(buf), "%.4g ms", s * 1e3);
    else
      std::snprintf(buf, sizeof(buf), "%.4g us", s * 1e6);
    return buf;
  }
};

// The human-readable report on stdout.
void print_table(const capacity::PlanInput& in, const capacity::PlanResult& r, const Out& o,
                 const Omitted& omit);
// The report as one JSON object (stable keys; what --json prints).
std::string to_json(const capacity::PlanInput& in, const capacity::PlanResult& r,
                    const Omitted& omit);
// A standalone SVG document: memory against context length.
std::string render_svg(const capacity::PlanInput& in, const capacity::PlanResult& r);

}  // namespace kvstack::cli::plan_report

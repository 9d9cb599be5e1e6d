// Summary statistics shared by the benchmark commands (bench, kv-bench).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvstack::cli {

// Median of v (the mean of the two middle values for an even count).
// REQUIRES: !v.empty().
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace kvstack::cli

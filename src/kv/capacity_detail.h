// Small helpers shared by the capacity planner's translation units
// (capacity.cpp, capacity_formats.cpp). Not part of the planner's API.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>

#include "kv/capacity.h"

namespace kvstack::capacity::detail {

inline uint64_t ceil_div(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Tokens per KIVI key group in a pool of P-token blocks (groups never span
// blocks): min(g, P).
inline int64_t token_group(const GroupSpec& g, int64_t block_size) {
  return block_size > 0 ? std::min(g.group, block_size) : g.group;
}

// Bytes per stored element of one K or V stream: w/8 + s/g (spec section 3).
inline double per_element(const GroupSpec& g, int bits, int64_t head_dim, int64_t block_size) {
  double b = bits / 8.0;
  const double s = static_cast<double>(g.meta_bytes);
  switch (g.axis) {
    case GroupAxis::kNone:
      break;
    case GroupAxis::kHeadDim: {
      const int64_t gs = g.group > 0 ? g.group : head_dim;
      // Groups are whole: ceil(d / g) groups per head per token.
      b += s *
           static_cast<double>(
               ceil_div(static_cast<uint64_t>(head_dim), static_cast<uint64_t>(gs))) /
           static_cast<double>(head_dim);
      break;
    }
    case GroupAxis::kTokens:
      b += s / static_cast<double>(token_group(g, block_size));
      break;
    case GroupAxis::kBlockHead:
      b += s / static_cast<double>((block_size > 0 ? block_size : 16) * head_dim);
      break;
  }
  return b;
}

}  // namespace kvstack::capacity::detail

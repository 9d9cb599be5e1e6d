#include "kv/kv_groups.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

namespace kvstack {

Result<KvGroups> KvGroups::create(const KvLayout& model_layout, bool one_layer_per_group) {
  KvGroups out;
  out.block_size_ = model_layout.block_size();
  const int n = model_layout.n_layers();
  // Retention classes in a fixed order: full-attention classes first (the
  // primary group is full when the model has a full layer), then by window.
  // Classes are by retention (window) only: standard and MLA layers keep
  // the same tokens and one KvLayout lays out both, so splitting them would
  // only add tables. (Cross-layer shared layers, which store nothing, will
  // be a class of their own.)
  std::map<int, std::vector<int>> classes;  // window -> layers
  for (int l = 0; l < n; ++l) classes[model_layout.layer(l).window].push_back(l);
  if (classes.size() == 1 && (!one_layer_per_group || n == 1)) {
    // One class: the model layout itself, byte for byte.
    std::vector<int> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    KvGroup g{.window = model_layout.layer(0).window,
              .drops_blocks = false,
              .layers = std::move(all),
              .layout = model_layout};
    out.block_bytes_ = model_layout.block_bytes();
    out.groups_.push_back(std::move(g));
    out.slots_.resize(static_cast<size_t>(n));
    for (int l = 0; l < n; ++l) out.slots_[static_cast<size_t>(l)] = KvLayerSlot{0, l};
    return out;
  }
  int per_group = 0;
  for (const auto& [key, layers] : classes) {
    per_group = std::gcd(per_group, static_cast<int>(layers.size()));
  }
  if (one_layer_per_group) per_group = 1;
  const KvLayoutOptions options{.kivi_residual = model_layout.has_kivi()
                                                     ? model_layout.kivi_residual()
                                                     : KvLayoutOptions{}.kivi_residual};
  std::vector<KvGroup> groups;
  for (const auto& [key, layers] : classes) {
    for (size_t first = 0; first < layers.size(); first += static_cast<size_t>(per_group)) {
      std::vector<int> members(layers.begin() + static_cast<long>(first),
                               layers.begin() + static_cast<long>(first) + per_group);
      std::vector<KvLayerSpec> specs;
      specs.reserve(members.size());
      for (int l : members) specs.push_back(model_layout.layer(l));
      auto layout = KvLayout::create(std::move(specs), model_layout.block_size(), options);
      if (!layout) return layout.error();
      groups.push_back(KvGroup{.window = key,
                               .drops_blocks = false,
                               .layers = std::move(members),
                               .layout = std::move(*layout)});
    }
  }
  for (const KvGroup& g : groups)
    out.block_bytes_ = std::max(out.block_bytes_, g.layout.block_bytes());
  out.slots_.resize(static_cast<size_t>(n));
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    KvGroup& g = groups[gi];
    auto padded = g.layout.padded_to(out.block_bytes_);
    if (!padded) return padded.error();
    g.layout = std::move(*padded);
    g.drops_blocks = gi > 0 && g.window > 0;
    for (size_t i = 0; i < g.layers.size(); ++i) {
      out.slots_[static_cast<size_t>(g.layers[i])] =
          KvLayerSlot{static_cast<int>(gi), static_cast<int>(i)};
    }
  }
  out.groups_ = std::move(groups);
  return out;
}

int64_t KvGroups::blocks_for(int g, int64_t n_tokens, int64_t chunk) const {
  const int64_t p = block_size_;
  const int64_t end = n_tokens + chunk;
  const int64_t all = (end + p - 1) / p;
  const KvGroup& gr = group(g);
  if (!gr.drops_blocks) return all;
  const int64_t first_visible = std::max<int64_t>(0, n_tokens - gr.window + 1);
  return all - first_visible / p;
}

int64_t KvGroups::blocks_for_sequence(int64_t n_tokens, int64_t chunk) const {
  int64_t n = 0;
  for (int g = 0; g < n_groups(); ++g) n += blocks_for(g, n_tokens, chunk);
  return n;
}

int64_t KvGroups::peak_blocks(int g, int64_t n_tokens, int64_t chunk) const {
  const int64_t p = block_size_;
  const int64_t all = (n_tokens + p - 1) / p;
  const KvGroup& gr = group(g);
  if (!gr.drops_blocks) return all;
  const int64_t c = std::max<int64_t>(1, std::min(chunk, n_tokens));
  return std::min(all, (gr.window - 1 + c + p - 1) / p + 1);
}

int64_t KvGroups::peak_blocks_for_sequence(int64_t n_tokens, int64_t chunk) const {
  int64_t n = 0;
  for (int g = 0; g < n_groups(); ++g) n += peak_blocks(g, n_tokens, chunk);
  return n;
}

int64_t KvGroups::max_tokens_in(int64_t n_blocks, int64_t chunk) const {
  // peak_blocks_for_sequence is non-decreasing in T: binary search.
  int64_t lo = 0, hi = n_blocks * block_size_;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (peak_blocks_for_sequence(mid, chunk) <= n_blocks) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace kvstack

#include "kv/capacity.h"
#include "kv/capacity_detail.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <utility>

namespace kvstack::capacity {
namespace {

// Sequences compressed to (T, count) pairs so that budget searches over
// millions of identical requests stay O(layers).
using SeqHist = std::vector<std::pair<int64_t, int64_t>>;

SeqHist make_hist(const std::vector<int64_t>& seqs) {
  std::map<int64_t, int64_t> m;
  for (int64_t t : seqs) ++m[t];
  return SeqHist(m.begin(), m.end());
}

using detail::ceil_div;

// One cached tensor of a layer: K, V, or the MLA latent [heads, width] per token.
struct Stream {
  int64_t heads;
  int64_t width;
  GroupSpec group;
  int bits = 16;
};

using detail::per_element;
using detail::token_group;

int n_streams(const LayerSpec& l, const KvFormat& f, Stream out[2]) {
  if (l.kv_source >= 0) return 0;  // reads another layer's K/V, stores none
  if (l.kind == LayerKind::kMla) {
    out[0] = {1, l.mla_latent + l.mla_rope_dim, f.key, f.bits};
    return 1;
  }
  out[0] = {l.n_kv_heads, l.head_dim_k, f.key, f.bits};
  out[1] = {l.n_kv_heads, l.head_dim_v, f.value, f.value_bits > 0 ? f.value_bits : f.bits};
  return 2;
}

// Exact bytes of `quantized` tokens in the format plus `residual` tokens in
// the residual dtype, for one stream.
uint64_t stream_bytes(const Stream& s, const KvFormat& f, uint64_t quantized, uint64_t residual,
                      int64_t block_size) {
  const uint64_t heads = static_cast<uint64_t>(s.heads);
  const uint64_t width = static_cast<uint64_t>(s.width);
  uint64_t bytes = ceil_div(heads * quantized * width * static_cast<uint64_t>(s.bits), 8);
  const uint64_t meta = static_cast<uint64_t>(s.group.meta_bytes);
  switch (s.group.axis) {
    case GroupAxis::kNone:
      break;
    case GroupAxis::kHeadDim: {
      const uint64_t g = s.group.group > 0 ? static_cast<uint64_t>(s.group.group) : width;
      bytes += heads * quantized * ceil_div(width, g) * meta;
      break;
    }
    case GroupAxis::kTokens:
      if (block_size > 0) {
        // Per block: P / G groups per channel (the engine's per-block region).
        const uint64_t p = static_cast<uint64_t>(block_size);
        bytes += heads * width * ceil_div(quantized, p) *
                 (p / static_cast<uint64_t>(token_group(s.group, block_size))) * meta;
      } else {
        bytes += heads * width * ceil_div(quantized, static_cast<uint64_t>(s.group.group)) * meta;
      }
      break;
    case GroupAxis::kBlockHead: {
      const uint64_t p = block_size > 0 ? static_cast<uint64_t>(block_size) : 16;
      bytes += heads * ceil_div(quantized, p) * meta;
      break;
    }
  }
  bytes += heads * residual * width * static_cast<uint64_t>(f.residual_elem_bytes);
  return bytes;
}

KvFormat without_residual(KvFormat f) {
  f.residual_tokens = 0;
  return f;
}

// sum_{t=1..T} min(t, cap): attention key length summed over a prefill.
double attended_pairs(int64_t tokens, int64_t cap) {
  const double t = static_cast<double>(tokens);
  if (cap <= 0 || tokens <= cap) return t * (t + 1) / 2;
  const double w = static_cast<double>(cap);
  return w * (w + 1) / 2 + (t - w) * w;
}

// Per-layer payload of a workload, with prefix sharing and window caps.
// Shared positions are the first S' tokens (S' = S rounded down to full blocks
// when paging): stored once, without residual. Each sequence stores privately
// the positions its layer keeps beyond S'.
uint64_t layer_workload_bytes(const LayerSpec& l, const KvFormat& f, const SeqHist& seqs,
                              int64_t shared, int64_t block_size) {
  uint64_t total = 0;
  if (shared <= 0) {
    for (const auto& [t, n] : seqs) {
      total += static_cast<uint64_t>(n) *
               layer_sequence_bytes(l, f, layer_kept_tokens(l, t), block_size);
    }
    return total;
  }
  const bool windowed = l.kind == LayerKind::kWindow;
  int64_t min_start = std::numeric_limits<int64_t>::max();
  for (const auto& [t, n] : seqs) {
    const int64_t start = windowed ? std::max<int64_t>(0, t - l.window) : 0;
    min_start = std::min(min_start, start);
    const int64_t priv = t - std::max(start, shared);
    total += static_cast<uint64_t>(n) * layer_sequence_bytes(l, f, priv, block_size);
  }
  const int64_t shared_kept = std::max<int64_t>(0, shared - min_start);
  total += layer_sequence_bytes(l, without_residual(f), shared_kept, block_size);
  return total;
}

int64_t effective_shared(const Workload& w, const SeqHist& seqs) {
  if (w.shared_prefix <= 0 || seqs.empty()) return 0;
  int64_t s = std::min(w.shared_prefix, seqs.front().first);  // hist is sorted by T
  if (w.block_size > 0) s = (s / w.block_size) * w.block_size;
  return s;
}

uint64_t payload_hist(const ModelArch& arch, const KvFormat& f, const SeqHist& seqs,
                      int64_t shared_prefix, int64_t block_size) {
  Workload w;
  w.shared_prefix = shared_prefix;
  w.block_size = block_size;
  const int64_t s = effective_shared(w, seqs);
  uint64_t total = 0;
  for (const auto& l : arch.layers) total += layer_workload_bytes(l, f, seqs, s, block_size);
  return total;
}

// The engine's KV groups (kv_groups.h) for a model with window and full
// layers: classes by window, groups of g = gcd(class sizes) layers in layer
// order, the full group first, every group block padded to the largest.
// Only without prefix sharing and residual (the grouped pool's figures for
// those are not modelled here); leaves `pg` as is otherwise.
void kv_groups_paging(const ModelArch& arch, const KvFormat& f, const SeqHist& seqs,
                      int64_t shared_prefix, int64_t p, PagingFigures* pg) {
  std::map<int64_t, std::vector<size_t>> classes;  // window (0 = full) -> layers
  for (size_t i = 0; i < arch.layers.size(); ++i) {
    const LayerSpec& l = arch.layers[i];
    if (l.kind == LayerKind::kMla) return;
    classes[l.kind == LayerKind::kWindow ? l.window : 0].push_back(i);
  }
  if (classes.size() < 2 || shared_prefix > 0 || f.residual_tokens > 0) return;
  int64_t g = 0;
  for (const auto& [w, layers] : classes) g = std::gcd(g, static_cast<int64_t>(layers.size()));
  struct G {
    int64_t window;
    ModelArch sub;
  };
  std::vector<G> groups;
  for (const auto& [w, layers] : classes) {  // window 0 (full) sorts first
    for (size_t k = 0; k < layers.size(); k += static_cast<size_t>(g)) {
      G gr{w, arch};
      gr.sub.layers.clear();
      for (size_t j = k; j < k + static_cast<size_t>(g); ++j) {
        gr.sub.layers.push_back(arch.layers[layers[j]]);
      }
      groups.push_back(std::move(gr));
    }
  }
  uint64_t bb = 0;
  for (const G& gr : groups) bb = std::max(bb, block_bytes(gr.sub, f, p));
  pg->block_bytes = bb;
  pg->block_count = 0;
  pg->groups.clear();
  const bool has_full = classes.count(0) > 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const G& gr = groups[gi];
    // The primary group (the first) keeps every block even when windowed.
    const bool drops = gr.window > 0 && (has_full || gi > 0);
    KvGroupFigure fig;
    fig.window = gr.window;
    fig.n_layers = static_cast<int64_t>(gr.sub.layers.size());
    for (const auto& [t, n] : seqs) {
      const int64_t first = drops ? std::max<int64_t>(0, t - gr.window + 1) / p : 0;
      const int64_t blocks = (t + p - 1) / p - first;
      const int64_t resident = t - first * p;
      const int64_t kept = drops ? std::min<int64_t>(t, gr.window) : t;
      const uint64_t un = static_cast<uint64_t>(n);
      fig.block_count += un * static_cast<uint64_t>(blocks);
      for (const LayerSpec& l : gr.sub.layers) {
        LayerSpec full = l;
        full.kind = LayerKind::kFull;
        fig.payload_bytes += un * layer_sequence_bytes(full, f, kept, p);
        fig.resident_bytes += un * layer_sequence_bytes(full, f, resident, p);
      }
    }
    fig.allocated_bytes = fig.block_count * bb;
    pg->block_count += fig.block_count;
    pg->groups.push_back(fig);
  }
  pg->slots = pg->block_count * static_cast<uint64_t>(p);
  // Every group's table indexes logically (dropped window entries stay as
  // null ids): ceil(T / P) ids per group per sequence.
  pg->table_bytes = 0;
  for (const auto& [t, n] : seqs) {
    pg->table_bytes +=
        4 * static_cast<uint64_t>(n) * groups.size() * static_cast<uint64_t>((t + p - 1) / p);
  }
}

PagingFigures paging_hist(const ModelArch& arch, const KvFormat& f, const SeqHist& seqs,
                          int64_t shared_prefix, int64_t p) {
  PagingFigures pg;
  pg.block_size = p;
  pg.block_bytes = block_bytes(arch, f, p);
  const uint64_t up = static_cast<uint64_t>(p);
  const int64_t r = f.residual_tokens;
  // Tokens that live in blocks: all of them (residual_tokens_at()).
  auto in_blocks = [&](int64_t t) { return t; };
  int64_t min_in_blocks = std::numeric_limits<int64_t>::max();
  for (const auto& [t, n] : seqs) min_in_blocks = std::min(min_in_blocks, in_blocks(t));
  auto count = [&](int64_t shared_blocks, uint64_t* blocks, uint64_t* waste, uint64_t* ids) {
    *blocks = static_cast<uint64_t>(shared_blocks);
    *waste = 0;
    *ids = 0;
    for (const auto& [t, n] : seqs) {
      const uint64_t x = static_cast<uint64_t>(in_blocks(t) - shared_blocks * p);
      const uint64_t own = ceil_div(x, up);
      *blocks += static_cast<uint64_t>(n) * own;
      *waste += static_cast<uint64_t>(n) * (own * up - x);
      *ids += static_cast<uint64_t>(n) * (own + static_cast<uint64_t>(shared_blocks));
    }
  };
  const int64_t shared_blocks = shared_prefix > 0 ? std::min(shared_prefix, min_in_blocks) / p : 0;
  uint64_t ids = 0;
  count(shared_blocks, &pg.block_count, &pg.tail_waste_tokens, &ids);
  pg.slots = pg.block_count * up;
  pg.table_bytes = 4 * ids;
  if (r > 0) {
    uint64_t per_token = 0;
    for (const auto& l : arch.layers) {
      Stream st[2];
      const int k = n_streams(l, f, st);
      for (int i = 0; i < k; ++i) {
        per_token += static_cast<uint64_t>(st[i].heads * st[i].width * f.residual_elem_bytes);
      }
    }
    for (const auto& [t, n] : seqs) {
      pg.residual_buffer_bytes +=
          static_cast<uint64_t>(n) * per_token * static_cast<uint64_t>(residual_tokens_at(f, t, p));
    }
  }
  kv_groups_paging(arch, f, seqs, shared_prefix, p, &pg);
  pg.kv_allocated_bytes = pg.block_count * pg.block_bytes + pg.residual_buffer_bytes;
  pg.allocator_total_bytes = pg.kv_allocated_bytes + pg.table_bytes;
  uint64_t unshared_waste = 0;
  uint64_t unshared_ids = 0;
  count(0, &pg.block_count_unshared, &unshared_waste, &unshared_ids);
  pg.kv_allocated_bytes_unshared =
      pg.block_count_unshared * pg.block_bytes + pg.residual_buffer_bytes;
  if (!pg.groups.empty()) {  // grouped only without sharing
    pg.block_count_unshared = pg.block_count;
    pg.kv_allocated_bytes_unshared = pg.kv_allocated_bytes;
  }
  return pg;
}

int64_t max_q_heads(const ModelArch& arch) {
  int64_t h = 0;
  for (const auto& l : arch.layers) h = std::max(h, l.n_q_heads);
  return h;
}

uint64_t active_weight_bytes_total(const PlanInput& in, uint64_t weights_total) {
  const ModelArch& a = in.arch;
  if (a.active_weight_bytes) return *a.active_weight_bytes;
  if (a.n_active_params == 0 || a.n_params == 0 || a.n_active_params >= a.n_params) {
    return weights_total;
  }
  if (!a.weight_bytes) return weight_bytes_for_params(a.n_active_params, in.weight_format);
  return static_cast<uint64_t>(
      std::llround(static_cast<double>(weights_total) * static_cast<double>(a.n_active_params) /
                   static_cast<double>(a.n_params)));
}

uint64_t weights_total_bytes(const PlanInput& in) {
  if (in.arch.weight_bytes) return *in.arch.weight_bytes;
  return weight_bytes_for_params(in.arch.n_params, in.weight_format);
}

// Workspace estimate (bytes, f32): per token in one forward the hidden
// state, its norm, attention output and residual (4 x hidden), the FFN
// intermediates (2 x ffn) and one layer's attention score rows [H_q, context]
// (no flash attention), plus logits [n_seq, vocab]. The forward is the larger
// of one decode step of all sequences and one prefill chunk.
uint64_t activation_estimate(const PlanInput& in, const SeqHist& seqs) {
  int64_t n_seq = 0;
  int64_t max_t = 0;
  for (const auto& [t, n] : seqs) {
    n_seq += n;
    max_t = std::max(max_t, t);
  }
  const int64_t chunk = std::min<int64_t>(std::max<int64_t>(in.prefill_chunk, 1), max_t);
  const uint64_t n_tok = static_cast<uint64_t>(std::max(n_seq, chunk));
  const ModelArch& a = in.arch;
  const uint64_t per_tok = static_cast<uint64_t>(4 * a.hidden + 2 * a.ffn) +
                           static_cast<uint64_t>(max_q_heads(a)) * static_cast<uint64_t>(max_t);
  // Logits only for the positions that sample: one per sequence.
  return 4 * (n_tok * per_tok + static_cast<uint64_t>(n_seq) * static_cast<uint64_t>(a.vocab));
}

struct DeviceKv {
  uint64_t payload = 0;
  std::optional<PagingFigures> paging;
};

DeviceKv device_kv(const PlanInput& in, const ModelArch& rank_arch, const SeqHist& seqs) {
  DeviceKv d;
  d.payload = payload_hist(rank_arch, in.kv_format, seqs, in.workload.shared_prefix,
                           in.workload.block_size);
  if (in.workload.block_size > 0) {
    d.paging = paging_hist(rank_arch, in.kv_format, seqs, in.workload.shared_prefix,
                           in.workload.block_size);
  }
  return d;
}

MemoryFigures memory_for(const PlanInput& in, const ModelArch& rank_arch, const SeqHist& seqs) {
  MemoryFigures m;
  m.weights_bytes_total = weights_total_bytes(in);
  m.weights_bytes = ceil_div(m.weights_bytes_total, static_cast<uint64_t>(in.tp));
  m.active_weights_bytes = active_weight_bytes_total(in, m.weights_bytes_total);
  const DeviceKv kv = device_kv(in, rank_arch, seqs);
  m.kv_bytes = kv.paging ? kv.paging->allocator_total_bytes : kv.payload;
  m.activation_estimated = !in.activation_bytes.has_value();
  m.activation_bytes = in.activation_bytes ? *in.activation_bytes : activation_estimate(in, seqs);
  m.overhead_bytes = in.overhead_bytes;
  m.total_bytes = m.weights_bytes + m.kv_bytes + m.activation_bytes + m.overhead_bytes;
  return m;
}

// Largest x in [lo, cap] with fits(x), given fits(lo); fits must be monotone
// (true then false). Returns cap when fits(cap).
template <class F>
int64_t largest_fitting(int64_t lo, int64_t cap, F fits) {
  int64_t hi = std::max<int64_t>(lo, 1);
  while (hi < cap && fits(hi)) {
    lo = hi;
    hi = std::min(cap, hi * 2);
  }
  if (fits(hi)) return hi;
  // fits(lo) holds, fits(hi) does not.
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// Smallest x in [1, cap] with pred(x) (monotone false then true); nullopt if none.
template <class F>
std::optional<int64_t> smallest_true(int64_t cap, F pred) {
  if (pred(1)) return 1;
  int64_t lo = 1;  // pred(lo) false
  int64_t hi = 2;
  while (!pred(hi)) {
    if (hi >= cap) return std::nullopt;
    lo = hi;
    hi = std::min(cap, hi * 2);
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (pred(mid) ? hi : lo) = mid;
  }
  return hi;
}

constexpr int64_t kSearchCap = int64_t{1} << 40;

// Prefill compute time per layer for the workload, seconds.
std::optional<std::vector<double>> prefill_layer_times(const ModelArch& arch, const Hardware& hw,
                                                       const SeqHist& seqs) {
  const size_t n_layers = arch.layers.size();
  std::vector<double> out(n_layers, 0.0);
  if (hw.recompute_tokens_per_s > 0) {
    double tokens = 0;
    for (const auto& [t, n] : seqs) tokens += static_cast<double>(t) * static_cast<double>(n);
    const double total = tokens / hw.recompute_tokens_per_s;
    for (auto& x : out) x = total / static_cast<double>(n_layers);
    return out;
  }
  if (hw.compute_flops <= 0) return std::nullopt;
  const double params =
      static_cast<double>(arch.n_active_params ? arch.n_active_params : arch.n_params);
  const double per_layer_params = params / static_cast<double>(n_layers);
  for (size_t i = 0; i < n_layers; ++i) {
    const LayerSpec& l = arch.layers[i];
    const int64_t cap = l.kind == LayerKind::kWindow ? l.window : 0;
    double flops = 0;
    for (const auto& [t, n] : seqs) {
      const double seq = 2.0 * per_layer_params * static_cast<double>(t) +
                         2.0 * static_cast<double>(l.n_q_heads * (l.head_dim_k + l.head_dim_v)) *
                             attended_pairs(t, cap);
      flops += seq * static_cast<double>(n);
    }
    out[i] = flops / hw.compute_flops;
  }
  return out;
}

Status validate_format(const KvFormat& f, const ModelArch& arch) {
  if (f.bits < 1 || f.bits > 32) {
    return make_error(Errc::kInvalidArgument,
                      "kv format " + f.name + ": bits per element must be in [1, 32]");
  }
  for (const GroupSpec* g : {&f.key, &f.value}) {
    if (g->meta_bytes < 0) {
      return make_error(Errc::kInvalidArgument,
                        "kv format " + f.name + ": metadata bytes per group must be >= 0");
    }
    if (g->axis == GroupAxis::kTokens && g->group <= 0) {
      return make_error(Errc::kInvalidArgument, "kv format " + f.name + ": group size must be > 0");
    }
    if (g->axis == GroupAxis::kHeadDim && g->group < 0) {
      return make_error(Errc::kInvalidArgument, "kv format " + f.name + ": group size must be > 0");
    }
  }
  if (f.residual_tokens < 0) {
    return make_error(Errc::kInvalidArgument, "kv format " + f.name + ": residual must be >= 0");
  }
  for (size_t i = 0; i < arch.layers.size(); ++i) {
    Stream st[2];
    const int k = n_streams(arch.layers[i], f, st);
    for (int j = 0; j < k; ++j) {
      if ((st[j].width * st[j].bits) % 8 != 0) {
        return make_error(Errc::kInvalidArgument,
                          "kv format " + f.name + ": head width " + std::to_string(st[j].width) +
                              " x " + std::to_string(st[j].bits) +
                              " bits is not whole bytes (layer " + std::to_string(i) + ")");
      }
    }
  }
  return {};
}

}  // namespace

const char* layer_kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::kFull:
      return "full";
    case LayerKind::kWindow:
      return "window";
    case LayerKind::kMla:
      return "mla";
  }
  return "?";
}

ModelArch make_uniform_arch(std::string name, int64_t n_layers, int64_t n_q_heads,
                            int64_t n_kv_heads, int64_t head_dim, int64_t hidden,
                            uint64_t n_params) {
  ModelArch a;
  a.name = std::move(name);
  LayerSpec l;
  l.kind = LayerKind::kFull;
  l.n_q_heads = n_q_heads;
  l.n_kv_heads = n_kv_heads;
  l.head_dim_k = head_dim;
  l.head_dim_v = head_dim;
  a.layers.assign(static_cast<size_t>(std::max<int64_t>(n_layers, 0)), l);
  a.hidden = hidden;
  a.n_params = n_params;
  return a;
}

Status validate_arch(const ModelArch& a) {
  const std::string who = a.name.empty() ? "model" : a.name;
  if (a.layers.empty())
    return make_error(Errc::kInvalidArgument, who + ": layer count must be > 0");
  if (a.hidden < 0 || a.ffn < 0 || a.vocab < 0 || a.context_length < 0) {
    return make_error(Errc::kInvalidArgument, who + ": sizes must not be negative");
  }
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const LayerSpec& l = a.layers[i];
    const std::string at = who + ": layer " + std::to_string(i) + ": ";
    if (l.kv_source >= 0) {
      const auto s = static_cast<size_t>(l.kv_source);
      if (s >= i || a.layers[s].kv_source >= 0 || a.layers[s].kind != l.kind ||
          a.layers[s].window != l.window || a.layers[s].n_kv_heads != l.n_kv_heads ||
          a.layers[s].head_dim_k != l.head_dim_k || a.layers[s].head_dim_v != l.head_dim_v) {
        return make_error(Errc::kInvalidArgument,
                          at + "shares the KV of layer " + std::to_string(l.kv_source) +
                              ", which is not an earlier storing layer of the same kind, window "
                              "and shape");
      }
    }
    if (l.n_q_heads <= 0) return make_error(Errc::kInvalidArgument, at + "query heads must be > 0");
    if (l.head_dim_k <= 0 || l.head_dim_v <= 0) {
      return make_error(Errc::kInvalidArgument, at + "head dim must be > 0");
    }
    if (l.kind == LayerKind::kMla) {
      if (l.mla_latent <= 0) {
        return make_error(Errc::kInvalidArgument, at + "MLA latent width d_c must be > 0");
      }
      if (l.mla_rope_dim < 0) {
        return make_error(Errc::kInvalidArgument, at + "MLA RoPE width d_R must be >= 0");
      }
      continue;
    }
    if (l.n_kv_heads <= 0) return make_error(Errc::kInvalidArgument, at + "KV heads must be > 0");
    if (l.n_q_heads % l.n_kv_heads != 0) {
      return make_error(Errc::kInvalidArgument, at + "query heads (" + std::to_string(l.n_q_heads) +
                                                    ") are not a multiple of KV heads (" +
                                                    std::to_string(l.n_kv_heads) + ")");
    }
    if (l.kind == LayerKind::kWindow && l.window <= 0) {
      return make_error(Errc::kInvalidArgument, at + "sliding window must be > 0");
    }
  }
  return {};
}

int64_t layer_kept_tokens(const LayerSpec& l, int64_t seq_tokens) {
  if (l.kind == LayerKind::kWindow) return std::min(seq_tokens, l.window);
  return seq_tokens;
}

uint64_t layer_sequence_bytes(const LayerSpec& l, const KvFormat& f, int64_t tokens,
                              int64_t block_size) {
  if (tokens <= 0) return 0;
  const uint64_t t = static_cast<uint64_t>(tokens);
  const uint64_t res = static_cast<uint64_t>(residual_tokens_at(f, tokens, block_size));
  Stream st[2];
  const int k = n_streams(l, f, st);
  uint64_t total = 0;
  // Payload: converted tokens quantized, the residual in f16 (the blocks also
  // reserve the residual tokens' quantized slots: an allocator figure).
  for (int i = 0; i < k; ++i) total += stream_bytes(st[i], f, t - res, res, block_size);
  return total;
}

double layer_bytes_per_token(const LayerSpec& l, const KvFormat& f, int64_t block_size,
                             bool* exact) {
  Stream st[2];
  const int k = n_streams(l, f, st);
  double total = 0;
  bool is_exact = f.residual_tokens == 0;
  for (int i = 0; i < k; ++i) {
    total += static_cast<double>(st[i].heads * st[i].width) *
             per_element(st[i].group, st[i].bits, st[i].width, block_size);
    if (st[i].group.axis == GroupAxis::kTokens && st[i].group.group != 1) is_exact = false;
    if (st[i].group.axis == GroupAxis::kBlockHead) is_exact = false;
  }
  if (exact != nullptr) *exact = is_exact;
  return total;
}

uint64_t block_bytes(const ModelArch& arch, const KvFormat& f, int64_t block_size) {
  // Mirrors KvLayout: per layer, each stream's element region (and, for
  // grouped formats, its metadata region) is padded to kRegionAlign bytes.
  const uint64_t align = static_cast<uint64_t>(kRegionAlign);
  const KvFormat q = without_residual(f);
  KvFormat meta_free = q;
  meta_free.key = {};
  meta_free.value = {};
  const uint64_t p = static_cast<uint64_t>(block_size);
  uint64_t total = 0;
  for (const auto& l : arch.layers) {
    Stream st[2];
    const int k = n_streams(l, q, st);
    for (int i = 0; i < k; ++i) {
      const uint64_t all = stream_bytes(st[i], q, p, 0, block_size);
      Stream plain = st[i];
      plain.group = {};
      const uint64_t elems = stream_bytes(plain, meta_free, p, 0, block_size);
      total += ceil_div(elems, align) * align;
      if (all > elems) total += ceil_div(all - elems, align) * align;
    }
  }
  return total;
}

uint64_t kv_payload_bytes(const ModelArch& arch, const KvFormat& f, const Workload& w) {
  return payload_hist(arch, f, make_hist(w.seq_tokens), w.shared_prefix, w.block_size);
}

Result<ModelArch> arch_per_rank(const ModelArch& arch, int64_t tp, int64_t* replication) {
  if (tp <= 0) return make_error(Errc::kInvalidArgument, "--tp must be > 0");
  ModelArch out = arch;
  int64_t rep = 1;
  bool rep_set = false;
  for (size_t i = 0; i < out.layers.size(); ++i) {
    LayerSpec& l = out.layers[i];
    const std::string at = "layer " + std::to_string(i) + ": ";
    if (l.n_q_heads % tp != 0) {
      return make_error(Errc::kInvalidArgument,
                        at + "query heads (" + std::to_string(l.n_q_heads) +
                            ") do not divide across tp=" + std::to_string(tp));
    }
    l.n_q_heads /= tp;
    int64_t layer_rep = 1;
    if (l.kind == LayerKind::kMla) {
      layer_rep = tp;  // the latent is shared by all heads: every rank stores all of it
    } else if (l.n_kv_heads >= tp) {
      if (l.n_kv_heads % tp != 0) {
        return make_error(Errc::kInvalidArgument,
                          at + "KV heads (" + std::to_string(l.n_kv_heads) +
                              ") do not divide across tp=" + std::to_string(tp));
      }
      l.n_kv_heads /= tp;
    } else {
      if (tp % l.n_kv_heads != 0) {
        return make_error(Errc::kInvalidArgument,
                          at + "tp=" + std::to_string(tp) + " is not a multiple of KV heads (" +
                              std::to_string(l.n_kv_heads) + "), so heads cannot be replicated");
      }
      layer_rep = tp / l.n_kv_heads;
      l.n_kv_heads = 1;
    }
    if (!rep_set && l.kind != LayerKind::kMla) {
      rep = layer_rep;
      rep_set = true;
    }
    if (!rep_set) rep = layer_rep;  // all-MLA so far: the latent's replication
  }
  if (replication != nullptr) *replication = rep;
  return out;
}

std::optional<double> recompute_time_s(const ModelArch& arch, const Hardware& hw, int64_t tokens) {
  auto t = prefill_layer_times(arch, hw, SeqHist{{tokens, 1}});
  if (!t) return std::nullopt;
  double sum = 0;
  for (double x : *t) sum += x;
  return sum;
}

uint64_t total_bytes_for(const PlanInput& in, const std::vector<int64_t>& seq_tokens) {
  auto rank = arch_per_rank(in.arch, in.tp, nullptr);
  const ModelArch& a = rank.ok() ? *rank : in.arch;
  return memory_for(in, a, make_hist(seq_tokens)).total_bytes;
}

Result<PlanResult> plan(const PlanInput& in) {
  KV_TRY_STATUS(validate_arch(in.arch));
  KV_TRY_STATUS(validate_format(in.kv_format, in.arch));
  const Workload& w = in.workload;
  if (w.seq_tokens.empty()) {
    return make_error(Errc::kInvalidArgument, "workload: give --batch/--ctx or --lengths");
  }
  for (int64_t t : w.seq_tokens) {
    if (t <= 0) {
      return make_error(Errc::kInvalidArgument,
                        "workload: sequence length " + std::to_string(t) + " must be > 0");
    }
  }
  if (w.block_size < 0) return make_error(Errc::kInvalidArgument, "--block-size must be > 0");
  if (w.shared_prefix < 0)
    return make_error(Errc::kInvalidArgument, "--shared-prefix must be >= 0");
  const SeqHist seqs = make_hist(w.seq_tokens);
  if (w.shared_prefix > seqs.front().first) {
    return make_error(Errc::kInvalidArgument, "--shared-prefix " + std::to_string(w.shared_prefix) +
                                                  " is longer than the shortest sequence (" +
                                                  std::to_string(seqs.front().first) + " tokens)");
  }
  if (in.weight_format.block <= 0 || in.weight_format.block_bytes <= 0) {
    return make_error(Errc::kInvalidArgument, "weight format must have positive block sizes");
  }
  if (in.prefix_tokens && *in.prefix_tokens <= 0) {
    return make_error(Errc::kInvalidArgument, "--prefix-tokens must be > 0");
  }
  if (in.ref_ctx < 0 || in.ref_batch < 0) {
    return make_error(Errc::kInvalidArgument, "reference batch/context must be >= 0");
  }
  const Hardware& hw = in.hw;
  for (double x :
       {hw.mem_bw, hw.link_bw, hw.link_latency_s, hw.recompute_tokens_per_s, hw.compute_flops}) {
    if (!(x >= 0) || !std::isfinite(x)) {
      return make_error(Errc::kInvalidArgument, "rates and latencies must be finite and >= 0");
    }
  }
  int64_t replication = 1;
  auto rank = arch_per_rank(in.arch, in.tp, &replication);
  if (!rank) return rank.error();
  const ModelArch& rank_arch = *rank;
  const KvFormat& f = in.kv_format;
  const int64_t p = w.block_size;

  PlanResult r;
  r.model_name = in.arch.name;
  r.kv_format_name = f.name;
  r.n_layers = static_cast<int64_t>(in.arch.layers.size());
  int64_t max_t = 0;
  for (const auto& [t, n] : seqs) {
    r.n_sequences += n;
    r.total_tokens += static_cast<uint64_t>(t) * static_cast<uint64_t>(n);
    max_t = std::max(max_t, t);
  }
  r.ref_ctx = in.ref_ctx > 0 ? in.ref_ctx : max_t;
  r.ref_batch = in.ref_batch > 0 ? in.ref_batch : r.n_sequences;

  // Per token and per layer group.
  {
    const LayerSpec& l0 = in.arch.layers.front();
    if (l0.kind == LayerKind::kMla) {
      r.kv_bytes_per_element = key_bytes_per_element(f, l0.mla_latent + l0.mla_rope_dim, p);
    } else {
      r.kv_bytes_per_element = (key_bytes_per_element(f, l0.head_dim_k, p) * l0.head_dim_k +
                                value_bytes_per_element(f, l0.head_dim_v, p) * l0.head_dim_v) /
                               static_cast<double>(l0.head_dim_k + l0.head_dim_v);
    }
    const int64_t s = effective_shared(w, seqs);
    for (const auto& l : in.arch.layers) {
      bool exact = true;
      const double bpt = layer_bytes_per_token(l, f, p, &exact);
      r.kv_bytes_per_token += bpt;
      r.kv_bytes_per_token_exact = r.kv_bytes_per_token_exact && exact;
      const uint64_t lb = layer_workload_bytes(l, f, seqs, s, p);
      auto it = std::find_if(r.layer_groups.begin(), r.layer_groups.end(), [&](const auto& g) {
        return g.kind == l.kind && g.window == l.window && g.bytes_per_token == bpt &&
               g.shared == (l.kv_source >= 0);
      });
      if (it == r.layer_groups.end()) {
        r.layer_groups.push_back({l.kind, l.window, 1, bpt, exact, lb, l.kv_source >= 0});
      } else {
        ++it->n_layers;
        it->payload_bytes += lb;
      }
    }
    if (r.kv_bytes_per_token_exact) {
      r.kv_bytes_per_token_int = static_cast<uint64_t>(std::llround(r.kv_bytes_per_token));
    }
  }

  r.kv_payload_bytes = payload_hist(in.arch, f, seqs, w.shared_prefix, p);
  r.kv_payload_bytes_unshared = payload_hist(in.arch, f, seqs, 0, p);
  if (p > 0) r.paging = paging_hist(in.arch, f, seqs, w.shared_prefix, p);

  if (in.tp > 1) {
    TpFigures tf;
    tf.tp = in.tp;
    tf.replication = replication;
    for (const auto& l : rank_arch.layers) {
      if (l.kind != LayerKind::kMla) {
        tf.kv_heads_per_rank = l.n_kv_heads;
        break;
      }
    }
    tf.kv_payload_bytes_per_rank = payload_hist(rank_arch, f, seqs, w.shared_prefix, p);
    if (p > 0) {
      tf.kv_allocated_bytes_per_rank =
          paging_hist(rank_arch, f, seqs, w.shared_prefix, p).kv_allocated_bytes;
    }
    tf.kv_bytes_all_ranks = tf.kv_payload_bytes_per_rank * static_cast<uint64_t>(in.tp);
    tf.naive_per_rank_bytes = r.kv_payload_bytes / static_cast<uint64_t>(in.tp);
    r.tp = tf;
    if (replication > 1) {
      r.notes.push_back("tp=" + std::to_string(in.tp) +
                        " exceeds the KV heads: each KV head is "
                        "replicated on " +
                        std::to_string(replication) +
                        " ranks, so per-rank KV is larger than payload / tp");
    }
  }

  r.memory = memory_for(in, rank_arch, seqs);

  // Crossover: smallest single-sequence length whose KV reaches the weights.
  {
    const uint64_t wt = r.memory.weights_bytes_total;
    r.crossover_tokens = smallest_true(kSearchCap, [&](int64_t t) {
      return payload_hist(in.arch, f, SeqHist{{t, 1}}, 0, p) >= wt;
    });
  }

  if (hw.mem_budget > 0) {
    const uint64_t budget = hw.mem_budget;
    const int64_t ref_ctx = r.ref_ctx;
    const int64_t ref_batch = r.ref_batch;
    auto fits_batch = [&](int64_t b) {
      return memory_for(in, rank_arch, SeqHist{{ref_ctx, b}}).total_bytes <= budget;
    };
    r.max_batch_for_budget = fits_batch(1) ? largest_fitting(1, kSearchCap, fits_batch) : 0;
    auto fits_ctx = [&](int64_t t) {
      return memory_for(in, rank_arch, SeqHist{{t, ref_batch}}).total_bytes <= budget;
    };
    if (!fits_ctx(1)) {
      r.max_ctx_for_budget = 0;
    } else {
      const int64_t m = largest_fitting(1, kSearchCap, fits_ctx);
      if (m < kSearchCap)
        r.max_ctx_for_budget = m;
      else
        r.notes.push_back("memory does not bound the context length (windowed layers)");
    }
    if (r.memory.total_bytes > budget) {
      r.notes.push_back("the workload as given does not fit the --mem budget");
    }
    if (r.max_ctx_for_budget && in.arch.context_length > 0 &&
        *r.max_ctx_for_budget > in.arch.context_length) {
      r.notes.push_back("max context for the budget exceeds the model's trained context (" +
                        std::to_string(in.arch.context_length) + " tokens)");
    }
  }

  // Decode: every cached element of every sequence is read once per step, a
  // shared layer's source once more (for it).
  {
    ModelArch read_arch = rank_arch;
    for (auto& l : read_arch.layers) l.kv_source = -1;
    const uint64_t kv_read = payload_hist(read_arch, f, seqs, 0, p);
    AttentionIntensity ai;
    for (const auto& l : in.arch.layers) {
      const double per_tok =
          l.kind == LayerKind::kMla
              ? 2.0 * static_cast<double>(l.n_q_heads * (2 * l.mla_latent + l.mla_rope_dim))
              : 2.0 * static_cast<double>(l.n_q_heads * (l.head_dim_k + l.head_dim_v));
      for (const auto& [t, n] : seqs) {
        ai.flops_per_step +=
            per_tok * static_cast<double>(layer_kept_tokens(l, t)) * static_cast<double>(n);
      }
    }
    ModelArch read_all = in.arch;
    for (auto& l : read_all.layers) l.kv_source = -1;
    ai.kv_bytes_read = payload_hist(read_all, f, seqs, 0, p);
    ai.flop_per_byte =
        ai.kv_bytes_read ? ai.flops_per_step / static_cast<double>(ai.kv_bytes_read) : 0;
    r.attention = ai;
    if (hw.mem_bw > 0) {
      DecodeFigures d;
      d.bytes_per_step =
          ceil_div(r.memory.active_weights_bytes, static_cast<uint64_t>(in.tp)) + kv_read;
      d.step_lower_bound_s = static_cast<double>(d.bytes_per_step) / hw.mem_bw;
      d.tokens_per_s_upper_bound = static_cast<double>(r.n_sequences) / d.step_lower_bound_s;
      r.decode = d;
    }
  }

  if (hw.link_bw > 0) {
    FetchFigures fx;
    fx.prefix_tokens =
        in.prefix_tokens ? *in.prefix_tokens : (w.shared_prefix > 0 ? w.shared_prefix : max_t);
    auto fetch_bytes = [&](int64_t t) { return payload_hist(in.arch, f, SeqHist{{t, 1}}, 0, p); };
    auto fetch_time = [&](int64_t t) {
      return hw.link_latency_s + static_cast<double>(fetch_bytes(t)) / hw.link_bw;
    };
    fx.fetch_bytes = fetch_bytes(fx.prefix_tokens);
    fx.fetch_time_s = fetch_time(fx.prefix_tokens);
    fx.recompute_time_s = recompute_time_s(in.arch, hw, fx.prefix_tokens);
    if (fx.recompute_time_s) {
      fx.break_even_tokens = smallest_true(
          kSearchCap, [&](int64_t t) { return fetch_time(t) < *recompute_time_s(in.arch, hw, t); });
      fx.fetch_never_wins = !fx.break_even_tokens.has_value();
    }
    r.fetch = fx;

    TransferFigures tx;
    tx.bytes = r.kv_payload_bytes_unshared;
    tx.transfer_time_s = hw.link_latency_s + static_cast<double>(tx.bytes) / hw.link_bw;
    tx.in_flight_bytes = 2 * tx.bytes;
    if (auto tp_layers = prefill_layer_times(in.arch, hw, seqs)) {
      double prefill = 0;
      double computed = 0;
      double sent = 0;
      for (size_t i = 0; i < in.arch.layers.size(); ++i) {
        const double tpl = (*tp_layers)[i];
        prefill += tpl;
        computed += tpl;
        const double bytes_l =
            static_cast<double>(layer_workload_bytes(in.arch.layers[i], f, seqs, 0, p));
        sent = std::max(sent, computed) + bytes_l / hw.link_bw;
      }
      tx.prefill_time_s = prefill;
      tx.pipelined_ready_time_s = sent + hw.link_latency_s;
      tx.sequential_ready_time_s = prefill + tx.transfer_time_s;
    }
    r.transfer = tx;
  }

  bool has_window = false;
  for (const auto& l : in.arch.layers) has_window = has_window || l.kind == LayerKind::kWindow;
  if (has_window && p > 0 && r.paging && !r.paging->groups.empty()) {
    r.notes.push_back(
        "KV groups as the engine pools them: " + std::to_string(r.paging->groups.size()) +
        " groups of " + std::to_string(r.paging->groups.front().n_layers) +
        " layers, one block size; window groups counted between steps (the blocks overlapping "
        "[T - w + 1, T)); within a prefill step of C tokens a window group holds up to "
        "ceil((w - 1 + C) / P) + 1 blocks");
  } else if (has_window && p > 0) {
    r.notes.push_back(
        "window layers cap the payload at their window; the allocator figure "
        "reserves every layer in every block (KV groups are modelled only without "
        "prefix sharing and residual)");
  }
  if (f.residual_tokens > 0) {
    r.notes.push_back("residual: the newest " + std::to_string(f.residual_tokens) +
                      " tokens (up to R + G - 1 until a key group fills) of each sequence and "
                      "layer are kept in f16 outside the pool (payload 2 H_kv d ((T - res) b_q + "
                      "res b)); the blocks also reserve their quantized slots");
  }
  return r;
}

VerifyComparison compare_verify(const PlanResult& p, const VerifyReport& m) {
  VerifyComparison c;
  auto exact = [&](const char* name, uint64_t pred, uint64_t meas) {
    VerifyRow row{name, static_cast<double>(pred), static_cast<double>(meas), true, pred == meas};
    c.ok = c.ok && row.matches;
    c.rows.push_back(row);
  };
  exact("payload_bytes", p.kv_payload_bytes, m.payload_bytes);
  if (p.paging && (p.paging->residual_buffer_bytes > 0 || m.residual_bytes > 0)) {
    exact("residual_bytes", p.paging->residual_buffer_bytes, m.residual_bytes);
  }
  if (p.paging) {
    exact("allocated_bytes", p.paging->kv_allocated_bytes, m.allocated_bytes);
    exact("block_count", p.paging->block_count, m.block_count);
    exact("block_bytes", p.paging->block_bytes, m.block_bytes);
    const auto& pgs = p.paging->groups;
    if (!pgs.empty() || m.groups.size() > 1) {
      for (size_t g = 0; g < std::max(pgs.size(), m.groups.size()); ++g) {
        const KvGroupFigure pred = g < pgs.size() ? pgs[g] : KvGroupFigure{};
        const VerifyReport::Group meas = g < m.groups.size() ? m.groups[g] : VerifyReport::Group{};
        const std::string n = "group" + std::to_string(g) + "_";
        c.rows.push_back({n + "window", static_cast<double>(pred.window),
                          static_cast<double>(meas.window), true, pred.window == meas.window});
        c.ok = c.ok && pred.window == meas.window;
        exact((n + "payload_bytes").c_str(), pred.payload_bytes, meas.payload_bytes);
        exact((n + "resident_bytes").c_str(), pred.resident_bytes, meas.resident_bytes);
        exact((n + "allocated_bytes").c_str(), pred.allocated_bytes, meas.allocated_bytes);
      }
    }
  } else {
    VerifyRow row{"allocated_bytes", 0, static_cast<double>(m.allocated_bytes), true, false};
    c.ok = false;
    c.rows.push_back(row);
  }
  const double predicted_rss = p.paging ? static_cast<double>(p.paging->kv_allocated_bytes) : 0.0;
  c.rows.push_back(
      {"rss_growth_bytes", predicted_rss, static_cast<double>(m.rss_growth_bytes), false, true});
  return c;
}

}  // namespace kvstack::capacity

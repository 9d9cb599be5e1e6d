#include "kv/retention.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "core/cpu_features.h"
#include "core/half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvstack {
namespace {

Error bad(const std::string& what) {
  return make_error(Errc::kInvalidArgument, "--kv-retention: " + what);
}

}  // namespace

Status validate_retention(const RetentionConfig& c) {
  if (c.policy == RetentionPolicy::kNone) return {};
  constexpr int64_t kMax = int64_t{1} << 30;
  if (c.is_topk()) {
    if (c.topk < 1 || c.topk > kMax) {
      return bad("k=" + std::to_string(c.topk) + " must be in [1, " + std::to_string(kMax) + "]");
    }
    if (c.topk_sink < 0 || c.topk_sink > kMax || c.topk_recent < 0 || c.topk_recent > kMax) {
      return bad("sink=" + std::to_string(c.topk_sink) + " and recent=" +
                 std::to_string(c.topk_recent) + " must be in [0, " + std::to_string(kMax) + "]");
    }
    return {};
  }
  if (c.sinks > kMax || c.window > kMax || c.slack > kMax || c.budget > kMax || c.kernel > kMax) {
    return bad("parameters must be at most " + std::to_string(kMax));
  }
  if (c.window < 1) {
    return bad("window=" + std::to_string(c.window) +
               (c.selects_at_prefill_end() ? " must be >= 1 (the observation window)"
                : c.is_h2o()
                    ? " must be >= 1 (the recent tokens kept)"
                    : " must be >= 1 (the recent tokens each query sees, itself included)"));
  }
  if (c.is_h2o()) {
    if (c.budget < 1) return bad("budget=" + std::to_string(c.budget) + " must be >= 1");
    if (c.slack < 0) {
      return bad("slack=" + std::to_string(c.slack) + " must be >= 1 (or 0 for the block size)");
    }
    if (c.obs < 0 || c.obs > kMax) {
      return bad("obs=" + std::to_string(c.obs) + " must be in [0, " + std::to_string(kMax) + "]");
    }
  }
  if (c.policy == RetentionPolicy::kStreamingLlm) {
    if (c.sinks < 0) return bad("sinks=" + std::to_string(c.sinks) + " must be >= 0");
    if (c.slack < 0) {
      return bad("slack=" + std::to_string(c.slack) + " must be >= 1 (or 0 for the block size)");
    }
  }
  if (c.policy == RetentionPolicy::kPyramidKv && c.beta < 1) {
    return bad("beta=" + std::to_string(c.beta) + " must be >= 1");
  }
  if (c.selects_at_prefill_end()) {
    if (c.budget < 1) return bad("budget=" + std::to_string(c.budget) + " must be >= 1");
    if (c.kernel < 1 || c.kernel % 2 == 0) {
      return bad("kernel=" + std::to_string(c.kernel) + " must be odd and >= 1");
    }
  }
  return {};
}

Result<RetentionConfig> parse_retention(std::string_view spec) {
  RetentionConfig c;
  const size_t colon = spec.find(':');
  const std::string_view name = spec.substr(0, colon);
  const std::string_view params = colon == std::string_view::npos ? "" : spec.substr(colon + 1);
  if (name == "none") {
    if (!params.empty()) return bad("policy 'none' takes no parameters");
    return c;
  }
  const char* known = nullptr;
  if (name == "streamingllm") {
    c.policy = RetentionPolicy::kStreamingLlm;
    known = "sinks, window, slack";
  } else if (name == "snapkv") {
    c.policy = RetentionPolicy::kSnapKv;
    c.window = 32;
    known = "budget, window, kernel, gqa";
  } else if (name == "pyramidkv") {
    c.policy = RetentionPolicy::kPyramidKv;
    c.window = 32;
    known = "budget, beta, window, kernel, gqa";
  } else if (name == "topk") {
    c.policy = RetentionPolicy::kTopK;
    bool have_k = false;
    for (size_t at = 0; at < params.size();) {
      size_t end = params.find(',', at);
      if (end == std::string_view::npos) end = params.size();
      const std::string_view kv = params.substr(at, end - at);
      at = end + 1;
      const size_t eq = kv.find('=');
      const std::string_view key = kv.substr(0, eq);
      int64_t* field = key == "k"        ? &c.topk
                       : key == "sink"   ? &c.topk_sink
                       : key == "recent" ? &c.topk_recent
                                         : nullptr;
      if (eq == std::string_view::npos || field == nullptr) {
        return bad(
            "topk takes k=N (blocks each decode query reads) and optionally sink=S and "
            "recent=R (blocks always read among them), e.g. topk:k=16; not '" +
            std::string(kv) + "'");
      }
      const std::string_view val = kv.substr(eq + 1);
      const auto [p, ec] = std::from_chars(val.data(), val.data() + val.size(), *field);
      if (ec != std::errc() || p != val.data() + val.size()) {
        return bad("parameter " + std::string(key) + "='" + std::string(val) +
                   "' is not an integer");
      }
      have_k = have_k || key == "k";
    }
    if (!have_k) {
      return bad(
          "topk takes k=N (blocks each decode query reads) and optionally sink=S and "
          "recent=R, e.g. topk:k=16");
    }
    KV_TRY_STATUS(validate_retention(c));
    return c;
  } else if (name == "h2o") {
    c.policy = RetentionPolicy::kH2o;
    known = "budget, window, slack, obs";
  } else {
    return bad("unknown policy '" + std::string(name) +
               "' (known: none, streamingllm, snapkv, pyramidkv, h2o, topk)");
  }
  const bool snap = c.selects_at_prefill_end();
  const bool h2o = c.is_h2o();
  bool have_window = false, have_budget = false;
  size_t at = 0;
  while (at < params.size()) {
    size_t end = params.find(',', at);
    if (end == std::string_view::npos) end = params.size();
    const std::string_view kv = params.substr(at, end - at);
    at = end + 1;
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) {
      return bad("parameter '" + std::string(kv) + "' is not key=value");
    }
    const std::string_view key = kv.substr(0, eq);
    const std::string_view val = kv.substr(eq + 1);
    if (snap && key == "gqa") {
      if (val == "union") {
        c.gqa = GqaRule::kUnion;
      } else if (val == "mean") {
        c.gqa = GqaRule::kMean;
      } else {
        return bad("gqa='" + std::string(val) + "' must be union or mean");
      }
      continue;
    }
    int64_t x = 0;
    const auto [p, ec] = std::from_chars(val.data(), val.data() + val.size(), x);
    const bool is_int = ec == std::errc() && p == val.data() + val.size();
    int64_t* field = nullptr;
    if (key == "window") {
      field = &c.window;
      have_window = true;
    } else if (!snap && !h2o && key == "sinks") {
      field = &c.sinks;
    } else if (!snap && key == "slack") {
      field = &c.slack;
    } else if (h2o && key == "obs") {
      field = &c.obs;
    } else if ((snap || h2o) && key == "budget") {
      field = &c.budget;
      have_budget = true;
    } else if (snap && key == "kernel") {
      field = &c.kernel;
    } else if (c.policy == RetentionPolicy::kPyramidKv && key == "beta") {
      field = &c.beta;
    } else {
      return bad("unknown " + std::string(name) + " parameter '" + std::string(key) +
                 "' (known: " + known + ")");
    }
    if (!is_int) {
      return bad("parameter " + std::string(key) + "='" + std::string(val) + "' is not an integer");
    }
    if (key == "slack" && x < 1) return bad("slack=" + std::to_string(x) + " must be >= 1");
    *field = x;
  }
  if (h2o && (!have_window || !have_budget)) {
    return bad(
        "h2o needs budget=N (heavy hitters) and window=N (recent tokens), e.g. "
        "h2o:budget=512,window=512");
  }
  if (!snap && !h2o && !have_window) {
    return bad("streamingllm needs window=N (e.g. streamingllm:sinks=4,window=1024)");
  }
  if (snap && !have_budget) {
    return bad(std::string(name) + " needs budget=N (e.g. " + std::string(name) + ":budget=1024)");
  }
  KV_TRY_STATUS(validate_retention(c));
  return c;
}

std::string retention_name(const RetentionConfig& c) {
  switch (c.policy) {
    case RetentionPolicy::kNone:
      return "none";
    case RetentionPolicy::kStreamingLlm:
      return "streamingllm:sinks=" + std::to_string(c.sinks) +
             ",window=" + std::to_string(c.window) +
             (c.slack > 0 ? ",slack=" + std::to_string(c.slack) : std::string());
    case RetentionPolicy::kSnapKv:
      return "snapkv:budget=" + std::to_string(c.budget) + ",window=" + std::to_string(c.window) +
             ",kernel=" + std::to_string(c.kernel) +
             ",gqa=" + (c.gqa == GqaRule::kMean ? "mean" : "union");
    case RetentionPolicy::kH2o:
      return "h2o:budget=" + std::to_string(c.budget) + ",window=" + std::to_string(c.window) +
             (c.slack > 0 ? ",slack=" + std::to_string(c.slack) : std::string()) +
             ",obs=" + std::to_string(c.obs);
    case RetentionPolicy::kTopK:
      return "topk:k=" + std::to_string(c.topk) + ",sink=" + std::to_string(c.topk_sink) +
             ",recent=" + std::to_string(c.topk_recent);
    case RetentionPolicy::kPyramidKv:
      return "pyramidkv:budget=" + std::to_string(c.budget) + ",beta=" + std::to_string(c.beta) +
             ",window=" + std::to_string(c.window) + ",kernel=" + std::to_string(c.kernel) +
             ",gqa=" + (c.gqa == GqaRule::kMean ? "mean" : "union");
  }
  return "?";
}

Status retention_supported(const KvLayout& layout) {
  bool any_full = false;
  for (int l = 0; l < layout.n_layers(); ++l) {
    const KvLayerSpec& s = layout.layer(l);
    for (const KvDtype t : {s.dtype, s.value_dtype()}) {
      if (t == KvDtype::kFp8 || kv_dtype_is_kivi(t)) {
        return make_error(Errc::kUnsupported,
                          std::string("--kv-retention: KV format ") + kv_dtype_name(t) +
                              " cannot move single tokens (fp8 keeps one scale per block, KIVI "
                              "quantizes keys over groups of tokens); use f16, bf16, f32, int8 "
                              "or int4");
      }
    }
    any_full |= s.window == 0;
  }
  if (!any_full) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-retention: every layer is a sliding window (already bounded); "
                      "there is no full-attention layer to compact");
  }
  return {};
}

std::vector<int64_t> retention_keep_slots(const RetentionConfig& c,
                                          std::span<const int32_t> positions, int64_t length) {
  const auto n = static_cast<int64_t>(positions.size());
  std::vector<int64_t> keep;
  if (c.policy != RetentionPolicy::kStreamingLlm) {  // snapkv decides at prefill end only
    keep.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) keep[static_cast<size_t>(i)] = i;
    return keep;
  }
  // streamingllm: a query at position >= length sees [length - W + 1, ...):
  // keep the sinks and every resident position from there on.
  const int64_t recent = std::max<int64_t>(0, length - c.window + 1);
  keep.reserve(static_cast<size_t>(std::min(n, c.sinks + c.window)));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = positions[static_cast<size_t>(i)];
    if (p < c.sinks || p >= recent) keep.push_back(i);
  }
  return keep;
}

std::vector<int64_t> h2o_keep_slots(const RetentionConfig& c, std::span<const float> mass) {
  KV_CHECK(c.is_h2o(), "h2o_keep_slots: not an h2o config");
  const auto n = static_cast<int64_t>(mass.size());
  std::vector<int64_t> keep;
  if (n <= c.budget + c.window) {
    keep.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) keep[static_cast<size_t>(i)] = i;
    return keep;
  }
  const int64_t n_old = n - c.window;  // > budget
  keep.resize(static_cast<size_t>(n_old));
  for (int64_t i = 0; i < n_old; ++i) keep[static_cast<size_t>(i)] = i;
  std::nth_element(keep.begin(), keep.begin() + c.budget, keep.end(), [&](int64_t a, int64_t b) {
    const float ma = mass[static_cast<size_t>(a)];
    const float mb = mass[static_cast<size_t>(b)];
    return ma != mb ? ma > mb : a < b;
  });
  keep.resize(static_cast<size_t>(c.budget));
  std::sort(keep.begin(), keep.end());
  for (int64_t i = n_old; i < n; ++i) keep.push_back(i);
  return keep;
}

namespace {

// f16 bound bits -> f32, infinities clamped to +-FLT_MAX: a bound times a
// zero query channel must give 0, not NaN (the interval still holds every
// finite key).
void bounds_to_f32_scalar(const uint16_t* h, float* out, int n) {
  constexpr float kBig = std::numeric_limits<float>::max();
  for (int i = 0; i < n; ++i) out[i] = std::clamp(f16_to_f32(h[i]), -kBig, kBig);
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void bounds_to_f32_f16c(const uint16_t* h, float* out, int n) {
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 neg_big = _mm256_set1_ps(-std::numeric_limits<float>::max());
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_ps(out + i, _mm256_max_ps(neg_big, _mm256_min_ps(big, v)));
  }
  bounds_to_f32_scalar(h + i, out + i, n - i);
}
#endif

void bounds_to_f32(const uint16_t* h, float* out, int n) {
#if defined(__x86_64__)
  static const bool f16c = cpu_features().f16c && cpu_features().avx2;
  if (f16c) {
    bounds_to_f32_f16c(h, out, n);
    return;
  }
#endif
  bounds_to_f32_scalar(h, out, n);
}

uint16_t f16_next_up(uint16_t h) {
  if (h == 0x7c00u) return h;        // +inf
  if (h == 0x8000u) return 0x0001u;  // -0 -> smallest positive
  return (h & 0x8000u) != 0 ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}

uint16_t f16_next_down(uint16_t h) {
  if (h == 0xfc00u) return h;  // -inf
  if (h == 0x0000u) return 0x8001u;
  return (h & 0x8000u) != 0 ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

}  // namespace

uint16_t f16_bound_down(float x) {
  const uint16_t h = f32_to_f16(x);
  return f16_to_f32(h) > x ? f16_next_down(h) : h;
}

uint16_t f16_bound_up(float x) {
  const uint16_t h = f32_to_f16(x);
  return f16_to_f32(h) < x ? f16_next_up(h) : h;
}

std::vector<int64_t> topk_blocks(std::span<const float> q, int n_q_heads, int n_kv_heads,
                                 int head_dim, std::span<const uint16_t> summary, int64_t n_full,
                                 int64_t k_full, int64_t n_sink, int64_t n_recent) {
  const int d = head_dim, g = n_q_heads / n_kv_heads;
  KV_CHECK(g * n_kv_heads == n_q_heads &&
               static_cast<int64_t>(q.size()) == int64_t{n_q_heads} * d &&
               static_cast<int64_t>(summary.size()) >= n_full * n_kv_heads * 2 * d && k_full >= 0 &&
               n_sink >= 0 && n_recent >= 0,
           "topk_blocks: bad shapes");
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(n_full, 0)));
  for (int64_t b = 0; b < n_full; ++b) out[static_cast<size_t>(b)] = b;
  if (n_full <= k_full) return out;
  // Always read (k_full < n_full, so they never overlap): the first blocks,
  // then the last ones before the query's own.
  const int64_t sink = std::min(n_sink, k_full);
  const int64_t recent = std::min(n_recent, k_full - sink);
  const int64_t lo = sink, hi = n_full - recent;  // ranked candidates [lo, hi)
  const int64_t n_ranked = k_full - sink - recent;
  std::vector<int64_t> cand;
  if (n_ranked > 0) {
    std::vector<float> ub(static_cast<size_t>(n_full), -std::numeric_limits<float>::infinity());
    std::vector<float> bounds(static_cast<size_t>(2 * d));
    for (int64_t b = lo; b < hi; ++b) {
      float best = -std::numeric_limits<float>::infinity();
      for (int kh = 0; kh < n_kv_heads; ++kh) {
        bounds_to_f32(summary.data() + ((b * n_kv_heads + kh) * 2) * d, bounds.data(), 2 * d);
        const float* mn = bounds.data();
        const float* mx = mn + d;
        for (int h = kh * g; h < (kh + 1) * g; ++h) {
          const float* qh = q.data() + int64_t{h} * d;
          // Eight partial sums: lets the compiler vectorize the bound.
          float acc[8] = {};
          int c = 0;
          for (; c + 8 <= d; c += 8) {
            for (int u = 0; u < 8; ++u)
              acc[u] += std::max(qh[c + u] * mn[c + u], qh[c + u] * mx[c + u]);
          }
          float sum = 0.0f;
          for (; c < d; ++c) sum += std::max(qh[c] * mn[c], qh[c] * mx[c]);
          for (const float x : acc) sum += x;
          best = std::max(best, sum);
        }
      }
      ub[static_cast<size_t>(b)] = best;
    }
    for (int64_t b = lo; b < hi; ++b) cand.push_back(b);
    std::nth_element(cand.begin(), cand.begin() + n_ranked, cand.end(), [&](int64_t a, int64_t b) {
      const float ua = ub[static_cast<size_t>(a)], ubb = ub[static_cast<size_t>(b)];
      return ua != ubb ? ua > ubb : a < b;
    });
    cand.resize(static_cast<size_t>(n_ranked));
  }
  out.clear();
  for (int64_t b = 0; b < sink; ++b) out.push_back(b);
  for (int64_t b = hi; b < n_full; ++b) out.push_back(b);
  out.insert(out.end(), cand.begin(), cand.end());
  std::sort(out.begin(), out.end());
  return out;
}

void snapkv_mark_unit(const RetentionConfig& c, std::span<const float> attn, int group,
                      int64_t n_obs, int64_t n_keys, std::span<uint8_t> keep) {
  KV_CHECK(c.selects_at_prefill_end() && n_obs > 0 && n_obs <= n_keys && group > 0,
           "snapkv_mark_unit: bad arguments");
  KV_CHECK(static_cast<int64_t>(attn.size()) == group * n_obs * n_keys &&
               static_cast<int64_t>(keep.size()) == n_keys,
           "snapkv_mark_unit: attn or keep has the wrong size");
  const int64_t n_prefix = n_keys - n_obs;
  if (n_prefix <= c.budget) {
    std::fill(keep.begin(), keep.begin() + n_prefix, 1);
    return;
  }
  const int64_t half = c.kernel / 2;
  std::vector<double> vote(static_cast<size_t>(n_prefix)), pooled(vote.size());
  std::vector<int64_t> order(vote.size());
  // Marks the `budget` prefix keys of highest pooled vote (earlier on ties).
  auto choose = [&] {
    for (int64_t j = 0; j < n_prefix; ++j) {
      double m = vote[static_cast<size_t>(j)];
      const int64_t hi = std::min(n_prefix - 1, j + half);
      for (int64_t t = std::max<int64_t>(0, j - half); t <= hi; ++t) {
        m = std::max(m, vote[static_cast<size_t>(t)]);
      }
      pooled[static_cast<size_t>(j)] = m;
    }
    for (int64_t j = 0; j < n_prefix; ++j) order[static_cast<size_t>(j)] = j;
    std::partial_sort(order.begin(), order.begin() + c.budget, order.end(),
                      [&](int64_t a, int64_t b) {
                        const double pa = pooled[static_cast<size_t>(a)];
                        const double pb = pooled[static_cast<size_t>(b)];
                        return pa != pb ? pa > pb : a < b;
                      });
    for (int64_t i = 0; i < c.budget; ++i) keep[static_cast<size_t>(order[i])] = 1;
  };
  auto add_votes = [&](int h, double w) {
    const float* head = attn.data() + int64_t{h} * n_obs * n_keys;
    for (int64_t r = 0; r < n_obs; ++r) {
      const float* row = head + r * n_keys;
      for (int64_t j = 0; j < n_prefix; ++j) vote[static_cast<size_t>(j)] += w * row[j];
    }
  };
  if (c.gqa == GqaRule::kMean) {
    std::fill(vote.begin(), vote.end(), 0.0);
    for (int h = 0; h < group; ++h) add_votes(h, 1.0 / group);
    choose();
  } else {
    for (int h = 0; h < group; ++h) {
      std::fill(vote.begin(), vote.end(), 0.0);
      add_votes(h, 1.0);
      choose();
    }
  }
}

int64_t retention_peak_blocks(const RetentionConfig& c, int64_t exact_blocks, int64_t block_size,
                              int64_t chunk) {
  if (c.policy != RetentionPolicy::kStreamingLlm) return exact_blocks;
  const int64_t slack = c.slack > 0 ? c.slack : block_size;
  // After a compaction: < sinks + (window - 1) + slack resident; then the step's chunk.
  const int64_t tokens = c.sinks + c.window + slack - 2 + std::max<int64_t>(1, chunk);
  return std::min(exact_blocks, (tokens + block_size - 1) / block_size + 1);
}

int64_t retention_layer_budget(const RetentionConfig& c, int layer, int n_layers) {
  if (c.policy != RetentionPolicy::kPyramidKv || n_layers <= 1) return c.budget;
  const int64_t last = std::max<int64_t>(1, c.budget / c.beta);
  const int64_t first = 2 * c.budget - last;
  // The linear value rounded down: subtract the step rounded up.
  const int64_t den = n_layers - 1;
  return first - ((first - last) * layer + den - 1) / den;
}

std::vector<int64_t> snapkv_select(const RetentionConfig& c, std::span<const float> attn,
                                   int64_t n_units, int group, int64_t n_obs, int64_t n_keys) {
  KV_CHECK(static_cast<int64_t>(attn.size()) == n_units * group * n_obs * n_keys,
           "snapkv_select: attn has the wrong size");
  std::vector<uint8_t> keep(static_cast<size_t>(n_keys), 0);
  for (int64_t j = n_keys - n_obs; j < n_keys; ++j) keep[static_cast<size_t>(j)] = 1;
  const int64_t unit = int64_t{group} * n_obs * n_keys;
  for (int64_t u = 0; u < n_units; ++u) {
    snapkv_mark_unit(c, attn.subspan(static_cast<size_t>(u * unit), static_cast<size_t>(unit)),
                     group, n_obs, n_keys, keep);
  }
  std::vector<int64_t> out;
  for (int64_t j = 0; j < n_keys; ++j) {
    if (keep[static_cast<size_t>(j)] != 0) out.push_back(j);
  }
  return out;
}

}  // namespace kvstack

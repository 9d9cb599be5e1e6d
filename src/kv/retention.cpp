#include "kv/retention.h"

#include <algorithm>
#include <charconv>

namespace kvstack {
namespace {

Error bad(const std::string& what) {
  return make_error(Errc::kInvalidArgument, "--kv-retention: " + what);
}

}  // namespace

Status validate_retention(const RetentionConfig& c) {
  if (c.policy == RetentionPolicy::kNone) return {};
  if (c.sinks < 0) return bad("sinks=" + std::to_string(c.sinks) + " must be >= 0");
  if (c.window < 1) {
    return bad("window=" + std::to_string(c.window) +
               " must be >= 1 (the recent tokens each query sees, itself included)");
  }
  if (c.slack < 0) {
    return bad("slack=" + std::to_string(c.slack) + " must be >= 1 (or 0 for the block size)");
  }
  constexpr int64_t kMax = int64_t{1} << 30;
  if (c.sinks > kMax || c.window > kMax || c.slack > kMax) {
    return bad("sinks, window and slack must be at most " + std::to_string(kMax));
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
  if (name != "streamingllm") {
    return bad("unknown policy '" + std::string(name) + "' (known: none, streamingllm)");
  }
  c.policy = RetentionPolicy::kStreamingLlm;
  bool have_window = false;
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
    int64_t x = 0;
    const auto [p, ec] = std::from_chars(val.data(), val.data() + val.size(), x);
    if (ec != std::errc() || p != val.data() + val.size()) {
      return bad("parameter " + std::string(key) + "='" + std::string(val) + "' is not an integer");
    }
    if (key == "sinks") {
      c.sinks = x;
    } else if (key == "window") {
      c.window = x;
      have_window = true;
    } else if (key == "slack") {
      if (x < 1) return bad("slack=" + std::to_string(x) + " must be >= 1");
      c.slack = x;
    } else {
      return bad("unknown streamingllm parameter '" + std::string(key) +
                 "' (known: sinks, window, slack)");
    }
  }
  if (!have_window)
    return bad("streamingllm needs window=N (e.g. streamingllm:sinks=4,window=1024)");
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
  if (c.policy == RetentionPolicy::kNone) {
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

}  // namespace kvstack

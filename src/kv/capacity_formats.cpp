// KV and weight format tables of the capacity planner: what each format
// stores per element (codes plus group metadata), and how formats are looked
// up, customised and combined. The formulas live in capacity.cpp.
#include <algorithm>
#include <cctype>

#include "kv/capacity.h"
#include "kv/capacity_detail.h"

namespace kvstack::capacity {
using detail::ceil_div;
using detail::lower;
using detail::per_element;
using detail::token_group;

const std::vector<KvFormat>& kv_format_table() {
  // Defaults follow the quantized-KV issue; every number here is what the
  // engine's codecs must store. s = metadata bytes per group.
  static const std::vector<KvFormat> kTable = {
      {"f32", 32, {}, {}, 0, 2, "IEEE f32"},
      {"f16", 16, {}, {}, 0, 2, "IEEE f16"},
      {"bf16", 16, {}, {}, 0, 2, "bfloat16"},
      {"fp8",
       8,
       {GroupAxis::kBlockHead, 0, 4},
       {GroupAxis::kBlockHead, 0, 4},
       0,
       2,
       "E4M3, one f32 scale per KV block per head"},
      {"int8",
       8,
       {GroupAxis::kHeadDim, 0, 2},
       {GroupAxis::kHeadDim, 0, 2},
       0,
       2,
       "int8, one f16 scale per token per head (g = head_dim)"},
      {"int4",
       4,
       {GroupAxis::kHeadDim, 32, 4},
       {GroupAxis::kHeadDim, 32, 4},
       0,
       2,
       "int4, groups of 32 along head dim, f16 scale + f16 min"},
      {"kivi2",
       2,
       {GroupAxis::kTokens, 32, 4},
       {GroupAxis::kHeadDim, 32, 4},
       128,
       2,
       "KIVI 2-bit: keys per channel in groups of 32 tokens, values per token in groups of 32, "
       "f16 scale + min, newest 128 tokens in f16"},
      {"kivi4",
       4,
       {GroupAxis::kTokens, 32, 4},
       {GroupAxis::kHeadDim, 32, 4},
       128,
       2,
       "KIVI 4-bit: as kivi2 with 4-bit codes"},
  };
  return kTable;
}

namespace {
// The table entry named `name` (case-insensitive), or an error listing the
// known names; `what` names the table in the message ("KV dtype").
template <typename Format>
Result<Format> find_by_name(const std::vector<Format>& table, std::string_view name,
                            const char* what) {
  const std::string n = lower(name);
  std::string known;
  for (const auto& f : table) {
    if (f.name == n) return f;
    known += (known.empty() ? "" : ", ") + f.name;
  }
  return make_error(Errc::kInvalidArgument, std::string("unknown ") + what + " '" +
                                                std::string(name) + "' (known: " + known + ")");
}
}  // namespace

Result<KvFormat> find_kv_format(std::string_view name) {
  return find_by_name(kv_format_table(), name, "KV dtype");
}

Result<KvFormat> customize_kv_format(KvFormat f, std::optional<int64_t> group,
                                     std::optional<int64_t> meta_bytes,
                                     std::optional<int64_t> residual) {
  if (!group && !meta_bytes && !residual) return f;
  if (f.key.axis == GroupAxis::kNone) {
    return make_error(Errc::kInvalidArgument,
                      "KV dtype " + f.name +
                          " is not a grouped format; group/metadata/residual options need fp8, "
                          "int8, int4, kivi2 or kivi4");
  }
  if (group && *group <= 0) {
    return make_error(Errc::kInvalidArgument, "quant group size must be > 0");
  }
  if (meta_bytes && *meta_bytes < 0) {
    return make_error(Errc::kInvalidArgument, "quant metadata bytes must be >= 0");
  }
  if (residual && *residual < 0) {
    return make_error(Errc::kInvalidArgument, "residual tokens must be >= 0");
  }
  for (GroupSpec* g : {&f.key, &f.value}) {
    if (group && g->axis != GroupAxis::kBlockHead) g->group = *group;
    if (meta_bytes) g->meta_bytes = *meta_bytes;
  }
  if (residual) f.residual_tokens = *residual;
  f.name += "(custom)";
  return f;
}

double key_bytes_per_element(const KvFormat& f, int64_t head_dim, int64_t block_size) {
  return per_element(f.key, f.bits, head_dim, block_size);
}
double value_bytes_per_element(const KvFormat& f, int64_t head_dim, int64_t block_size) {
  return per_element(f.value, f.value_bits > 0 ? f.value_bits : f.bits, head_dim, block_size);
}

KvFormat combine_kv_formats(const KvFormat& key, const KvFormat& value) {
  if (key.name == value.name) return key;
  KvFormat f = key;
  f.name = key.name + "/" + value.name;
  f.value = value.value;
  f.value_bits = value.bits;
  f.residual_tokens = std::max(key.residual_tokens, value.residual_tokens);
  f.description = "K: " + key.description + "; V: " + value.description;
  return f;
}

int64_t residual_tokens_at(const KvFormat& f, int64_t tokens, int64_t block_size) {
  const int64_t r = f.residual_tokens;
  if (r <= 0 || tokens <= 0) return 0;
  if (tokens < r) return tokens;
  GroupSpec g = f.key.axis == GroupAxis::kTokens ? f.key : f.value;
  if (g.axis != GroupAxis::kTokens) g = GroupSpec{GroupAxis::kTokens, 32, 4};
  const int64_t gs = std::max<int64_t>(1, token_group(g, block_size));
  return r + (tokens - r) % gs;
}

const std::vector<WeightFormat>& weight_format_table() {
  // GGML block sizes (core/ggml_types.h facts): block of `block` weights in
  // `block_bytes` bytes.
  static const std::vector<WeightFormat> kTable = {
      {"f32", 1, 4},      {"f16", 1, 2},      {"bf16", 1, 2},     {"fp8", 1, 1},
      {"int8", 1, 1},     {"q8_0", 32, 34},   {"q5_0", 32, 22},   {"q5_1", 32, 24},
      {"q4_0", 32, 18},   {"q4_1", 32, 20},   {"q2_k", 256, 84},  {"q3_k", 256, 110},
      {"q4_k", 256, 144}, {"q5_k", 256, 176}, {"q6_k", 256, 210}, {"int4", 2, 1},
  };
  return kTable;
}

Result<WeightFormat> find_weight_format(std::string_view name) {
  return find_by_name(weight_format_table(), name, "weight dtype");
}

uint64_t weight_bytes_for_params(uint64_t n_params, const WeightFormat& f) {
  return ceil_div(n_params, static_cast<uint64_t>(f.block)) * static_cast<uint64_t>(f.block_bytes);
}

}  // namespace kvstack::capacity

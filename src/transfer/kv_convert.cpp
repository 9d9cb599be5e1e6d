#include "transfer/kv_convert.h"

#include <charconv>
#include <cstring>
#include <string_view>
#include <vector>

#include "kv/cache_identity.h"
#include "kv/kv_write.h"

namespace kvstack::transfer {

namespace {

bool parse_int(std::string_view s, int* out) {
  const auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

bool is_float(KvDtype t) {
  return t == KvDtype::kF32 || t == KvDtype::kF16 || t == KvDtype::kBF16;
}

// Empty when src converts to dst (the pairs of kv_convert.h), else why not.
std::string pair_refusal(KvDtype src, KvDtype dst) {
  if (!is_float(src) || !is_float(dst)) {
    return "quantized formats are not converted (their scales are per block or token group)";
  }
  if (src == dst || dst == KvDtype::kF32 || src == KvDtype::kF32) return "";
  return "f16 and bf16 do not hold each other's values";
}

}  // namespace

Result<KvLayout> producer_layout(const KvLayout& local, const std::string& kv_format) {
  auto bad = [&](const std::string& why) {
    return make_error(Errc::kUnsupported, "the prefill worker's KV layout '" +
                                              kv_format.substr(0, 80) +
                                              (kv_format.size() > 80 ? "...'" : "'") + ": " + why);
  };
  int block_size = 0;
  int kivi_residual = local.kivi_residual();
  std::vector<std::pair<int, int>> dtypes;  // (K, V) per layer
  std::string_view rest(kv_format);
  while (!rest.empty()) {
    const size_t semi = rest.find(';');
    std::string_view item = rest.substr(0, semi);
    rest = semi == std::string_view::npos ? std::string_view() : rest.substr(semi + 1);
    if (item.starts_with("P=")) {
      if (!parse_int(item.substr(2), &block_size)) return bad("unreadable block size");
    } else if (item.starts_with("kiviR=")) {
      if (!parse_int(item.substr(6), &kivi_residual)) return bad("unreadable KIVI residual");
    } else if (item.starts_with("[")) {
      const size_t at = item.find(",dt");
      const size_t slash = item.find('/', at);
      const size_t end = item.find(',', slash);
      int k = -1;
      int v = -1;
      if (at == std::string_view::npos || slash == std::string_view::npos ||
          end == std::string_view::npos || !parse_int(item.substr(at + 3, slash - at - 3), &k) ||
          !parse_int(item.substr(slash + 1, end - slash - 1), &v) || k < 0 || v < 0 ||
          k > static_cast<int>(KvDtype::kKivi4) || v > static_cast<int>(KvDtype::kKivi4)) {
        return bad("unreadable layer dtype");
      }
      dtypes.emplace_back(k, v);
    }
  }
  if (static_cast<int>(dtypes.size()) != local.n_layers()) {
    return bad(std::to_string(dtypes.size()) + " layers, " + std::to_string(local.n_layers()) +
               " here");
  }
  std::vector<KvLayerSpec> specs;
  for (int l = 0; l < local.n_layers(); ++l) {
    KvLayerSpec s = local.layer(l);
    s.dtype = static_cast<KvDtype>(dtypes[static_cast<size_t>(l)].first);
    const auto v = static_cast<KvDtype>(dtypes[static_cast<size_t>(l)].second);
    s.dtype_v = v == s.dtype ? std::nullopt : std::optional<KvDtype>(v);
    specs.push_back(s);
  }
  KvLayoutOptions opt;
  opt.kivi_residual = kivi_residual;
  auto layout = KvLayout::create(std::move(specs), block_size, opt);
  if (!layout) return bad(layout.error().message);
  if (kv_format_key(*layout) != kv_format) {
    return bad("another layer geometry (heads, dims, windows or placement) than this worker's");
  }
  return layout;
}

Status check_convertible(const KvLayout& src, const KvLayout& dst) {
  if (src.n_layers() != dst.n_layers()) {
    return make_error(Errc::kUnsupported, "layer counts differ (" + std::to_string(src.n_layers()) +
                                              " vs " + std::to_string(dst.n_layers()) + ")");
  }
  for (int l = 0; l < src.n_layers(); ++l) {
    const KvLayerSpec& a = src.layer(l);
    const KvLayerSpec& b = dst.layer(l);
    if (a.kind != b.kind || a.n_kv_heads != b.n_kv_heads || a.head_dim_k != b.head_dim_k ||
        a.head_dim_v != b.head_dim_v || a.latent_dim != b.latent_dim || a.rope_dim != b.rope_dim ||
        a.window != b.window) {
      return make_error(Errc::kUnsupported, "layer " + std::to_string(l) +
                                                ": another geometry (kind, heads, dims "
                                                "or window)");
    }
    const std::pair<KvDtype, KvDtype> kv[2] = {{a.dtype, b.dtype},
                                               {a.value_dtype(), b.value_dtype()}};
    for (int w = 0; w < 2; ++w) {
      if (w == 1 && a.kind == KvLayerKind::kMlaLatent) break;
      const std::string why = pair_refusal(kv[w].first, kv[w].second);
      if (!why.empty()) {
        return make_error(Errc::kUnsupported,
                          "layer " + std::to_string(l) + (w == 0 ? " K " : " V ") +
                              kv_dtype_name(kv[w].first) + " -> " + kv_dtype_name(kv[w].second) +
                              " is not converted: " + why);
      }
    }
  }
  return {};
}

void convert_kv_blocks(const KvLayout& src, uint8_t* src_base, std::span<const int32_t> src_table,
                       const KvLayout& dst, uint8_t* dst_base, std::span<const int32_t> dst_table,
                       int64_t pos, int64_t n_tokens) {
  std::vector<float> k;
  std::vector<float> v;
  for (int l = 0; l < src.n_layers(); ++l) {
    const PagedKvLayerView sv = src.layer_view(l, src_base);
    const PagedKvLayerView dv = dst.layer_view(l, dst_base);
    const size_t n = static_cast<size_t>(n_tokens) * static_cast<size_t>(sv.n_kv_heads) *
                     static_cast<size_t>(sv.head_dim);
    k.resize(n);
    v.resize(sv.v != nullptr ? n : 0);
    read_kv(sv, src_table, pos, n_tokens, k.data(), sv.v != nullptr ? v.data() : nullptr);
    write_kv(dv, dst_table, pos, k.data(), dv.v != nullptr ? v.data() : nullptr, n_tokens);
  }
}

Hash128 block_chain_hash(const Hash128& parent, const Hash128& ns_digest,
                         std::span<const int32_t> tokens) {
  // PrefixIndex::child_key without extra keys: parent (16) | ns digest (16)
  // | tokens (4 P).
  std::vector<uint8_t> buf(32 + 4 * tokens.size());
  std::memcpy(buf.data(), &parent, 16);
  std::memcpy(buf.data() + 16, &ns_digest, 16);
  std::memcpy(buf.data() + 32, tokens.data(), 4 * tokens.size());
  return hash128(buf.data(), buf.size());
}

}  // namespace kvstack::transfer

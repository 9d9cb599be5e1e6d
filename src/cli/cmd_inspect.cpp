// `kvstack inspect`: describe a GGUF model (config, tensors, KV bytes/token).
#include <cinttypes>
#include <cstdio>
#include <map>

#include "cli/args.h"
#include "core/units.h"
#include "engine/deepseek2.h"
#include "model/config.h"
#include "model/gguf.h"

namespace kvstack::cli {
namespace {

int run_inspect(const std::vector<std::string>& argv) {
  const std::vector<OptionSpec> specs = {
      model_option(),
      {"tensors", 0, "", "print every tensor (default: a summary by type and the first layer)"},
      {"metadata", 0, "", "print every metadata key (arrays abbreviated)"},
      help_option(),
  };
  auto args = Args::parse(argv, specs);
  if (!args) return fail("inspect", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack inspect [-m MODEL] [--tensors] [--metadata]",
                           "Print a GGUF model's architecture, tensor table and the KV cache "
                           "bytes per token for each supported KV dtype.",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  const std::string path = resolve_model_path(*args);
  auto file = GgufFile::open(path);
  if (!file) return fail("inspect", file.error().message);
  auto cfg = load_model_config(*file);
  if (!cfg) return fail("inspect", cfg.error().message);
  const ModelConfig& c = *cfg;

  std::printf("model            %s\n", path.c_str());
  std::printf("name             %s\n", c.name.c_str());
  std::printf("file size        %zu bytes (%s), GGUF v%u, %zu tensors, %zu metadata keys\n",
              file->file_size(), format_bytes(static_cast<double>(file->file_size())).c_str(),
              file->version(), file->tensors().size(), file->metadata().size());
  std::printf("architecture     %s\n", c.arch.c_str());
  std::printf("layers           %d\n", c.n_layers);
  std::printf("hidden size      %d\n", c.n_embd);
  std::printf("heads            %d query, %d key/value (%s, group %d)\n", c.n_heads, c.n_kv_heads,
              c.n_kv_heads == c.n_heads ? "MHA" : (c.n_kv_heads == 1 ? "MQA" : "GQA"), c.n_gqa());
  std::printf("head dim         %d\n", c.head_dim);
  std::printf("ffn size         %d\n", c.n_ff);
  std::printf("vocabulary       %d tokens\n", c.n_vocab);
  std::printf("context length   %d tokens (trained)\n", c.n_ctx_train);
  std::printf("rope             %s, %d dims, base %g, scaling %s (freq scale %g)\n",
              c.rope_neox ? "neox" : "normal", c.n_rot, c.rope_freq_base,
              c.rope_scaling_type.c_str(), c.rope_freq_scale);
  std::printf("norm epsilon     %g\n", c.norm_eps);
  std::printf("embeddings       %s\n",
              c.tied_embeddings ? "tied (output = token_embd)" : "separate");
  std::printf("qkv bias         %s\n", c.qkv_bias ? "yes" : "no");
  std::printf("sliding window   %s\n",
              c.sliding_window ? std::to_string(c.sliding_window).c_str() : "none");
  // Per-layer attention: the window each layer's mask applies (the KV cache
  // still stores every token of every layer) and its RoPE base.
  std::string windows, bases;
  int n_window_layers = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    windows +=
        (l ? " " : "") + (c.window(l) > 0 ? std::to_string(c.window(l)) : std::string("full"));
    char b[32];
    std::snprintf(b, sizeof b, "%s%g", l ? " " : "", c.rope_base(l));
    bases += b;
    n_window_layers += c.window(l) > 0 ? 1 : 0;
  }
  std::printf("layer windows    %s\n", windows.c_str());
  std::printf("                 (%d window layers, %d full; tokens each layer attends to)\n",
              n_window_layers, c.n_layers - n_window_layers);
  std::printf("layer rope base  %s\n", bases.c_str());
  std::printf("layer math       %s FFN, %s%s, query scale %g, embedding scale %g\n",
              c.ffn_act == ModelConfig::FfnAct::kGeluTanh ? "GeGLU (tanh GELU)" : "SwiGLU",
              c.post_norms ? "pre and post norms" : "pre norms",
              c.qk_norm ? ", q/k head norms" : "", c.attn_scale, c.embd_scale);
  if (c.arch == "deepseek2") {
    // The cache below is the expanded one kvstack runs; the latent it could
    // hold instead is (kv_lora_rank + qk_rope) elements per layer and token.
    std::printf("deepseek2        %s\n", deepseek2_kernel_summary(c).c_str());
    std::printf("MLA latent       %d + %d elements per layer and token (--kv-mla latent)\n",
                c.mla.kv_lora_rank, c.mla.qk_rope);
  }

  // KV bytes per token: 2 (K and V) * layers * kv heads * head dim * bytes.
  std::printf("\nKV cache bytes per token (2 x %d layers x %d kv heads x %d dims x b):\n",
              c.n_layers, c.n_kv_heads, c.head_dim);
  const struct {
    const char* name;
    double bytes;
  } dtypes[] = {{"f32", 4}, {"f16", 2}, {"bf16", 2}};
  for (const auto& d : dtypes) {
    const double per_token = 2.0 * c.n_layers * c.n_kv_heads * c.head_dim * d.bytes;
    const double ctx_bytes = per_token * c.n_ctx_train;
    std::printf("  %-5s %10.0f bytes/token (%s), %s for one %d-token context\n", d.name, per_token,
                format_bytes(per_token).c_str(), format_bytes(ctx_bytes).c_str(), c.n_ctx_train);
  }

  // Tensor table.
  std::map<std::string, std::pair<int64_t, uint64_t>> by_type;  // type -> (count, bytes)
  uint64_t total = 0;
  for (const auto& t : file->tensors()) {
    const auto* tr = ggml_type_traits(static_cast<uint32_t>(t.type));
    auto& e = by_type[tr ? tr->name : "?"];
    e.first++;
    e.second += t.n_bytes;
    total += t.n_bytes;
  }
  std::printf("\ntensors by type:\n");
  for (const auto& [name, e] : by_type) {
    std::printf("  %-6s %5" PRId64 " tensors %12" PRIu64 " bytes (%s)\n", name.c_str(), e.first,
                e.second, format_bytes(static_cast<double>(e.second)).c_str());
  }
  std::printf("  total  %5zu tensors %12" PRIu64 " bytes (%s)\n", file->tensors().size(), total,
              format_bytes(static_cast<double>(total)).c_str());

  const bool all = args->flag("tensors");
  std::printf("\n%s:\n", all ? "tensors" : "tensors (non-layer and layer 0; --tensors for all)");
  std::printf("  %-28s %-6s %-20s %12s\n", "name", "type", "shape (ne0 first)", "bytes");
  for (const auto& t : file->tensors()) {
    if (!all && t.name.rfind("blk.", 0) == 0 && t.name.rfind("blk.0.", 0) != 0) continue;
    std::string shape;
    for (size_t i = 0; i < t.dims.size(); ++i) {
      shape += (i ? " x " : "") + std::to_string(t.dims[i]);
    }
    const auto* tr = ggml_type_traits(static_cast<uint32_t>(t.type));
    std::printf("  %-28s %-6s %-20s %12" PRIu64 "\n", t.name.c_str(), tr ? tr->name : "?",
                shape.c_str(), t.n_bytes);
  }

  if (args->flag("metadata")) {
    std::printf("\nmetadata:\n");
    for (const auto& [key, v] : file->metadata()) {
      std::string val;
      switch (v.type) {
        case GgufType::kString:
          val = v.str.size() > 80 ? v.str.substr(0, 77) + "..." : v.str;
          break;
        case GgufType::kArray:
          val = "[array of " + std::to_string(v.array.size()) + "]";
          break;
        case GgufType::kF32:
        case GgufType::kF64:
          val = std::to_string(v.f);
          break;
        case GgufType::kBool:
          val = v.u ? "true" : "false";
          break;
        default:
          val = std::to_string(v.i);
          break;
      }
      for (char& ch : val) {
        if (ch == '\n') ch = ' ';
      }
      std::printf("  %-40s %s\n", key.c_str(), val.c_str());
    }
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_inspect, "inspect", "describe a GGUF model: config, tensors, KV bytes per token",
                run_inspect);

}  // namespace kvstack::cli

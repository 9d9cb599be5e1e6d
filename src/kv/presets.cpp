#include "kv/presets.h"

#include <cctype>
#include <functional>

namespace kvstack::capacity {
namespace {

struct Preset {
  const char* id;
  const char* summary;
  std::function<ModelArch()> build;
};

struct Dims {
  int64_t n_layers;
  int64_t n_q_heads;
  int64_t n_kv_heads;
  int64_t head_dim;
  int64_t hidden;
  int64_t ffn;
  int64_t vocab;
  int64_t context_length;
  uint64_t n_params;
  uint64_t n_active_params;  // 0 = dense
};

ModelArch dense(const char* name, const Dims& d, const char* source) {
  ModelArch a = make_uniform_arch(name, d.n_layers, d.n_q_heads, d.n_kv_heads, d.head_dim, d.hidden,
                                  d.n_params);
  a.ffn = d.ffn;
  a.vocab = d.vocab;
  a.context_length = d.context_length;
  a.n_active_params = d.n_active_params;
  a.source = source;
  return a;
}

// DeepSeek's MLA models share d_c 512, d_R 64, nope 128 and v 128 per head;
// they differ in depth, heads and body. ffn is the activated experts' width
// (shared + routed per token, times the expert width).
struct MlaDims {
  int64_t n_layers;
  int64_t n_q_heads;
  int64_t hidden;
  int64_t ffn;
  int64_t vocab;
  int64_t context_length;
  uint64_t n_params;
  uint64_t n_active_params;
};

ModelArch mla(const char* name, const MlaDims& d, const char* source) {
  ModelArch a;
  a.name = name;
  LayerSpec l;
  l.kind = LayerKind::kMla;
  l.n_q_heads = d.n_q_heads;
  l.head_dim_k = 128 + 64;
  l.head_dim_v = 128;
  l.mla_latent = 512;
  l.mla_rope_dim = 64;
  a.layers.assign(static_cast<size_t>(d.n_layers), l);
  a.hidden = d.hidden;
  a.ffn = d.ffn;
  a.vocab = d.vocab;
  a.context_length = d.context_length;
  a.n_params = d.n_params;
  a.n_active_params = d.n_active_params;
  a.source = source;
  return a;
}

// Parameter counts marked "derived" are summed from the config's tensor
// shapes (embeddings + per-layer attention, MLP and norms); the others are the
// publisher's exact or stated figure.
const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = {
      {"llama-2-7b", "MHA 32 layers, 32/32 heads x 128",
       [] {
         // meta-llama/Llama-2-7b-hf config.json: hidden 4096, 32 layers, 32 heads,
         // num_key_value_heads 32, intermediate 11008, vocab 32000,
         // max_position_embeddings 4096. Params 6,738,415,616 (derived; paper: 7B).
         return dense("Llama-2-7B", {32, 32, 32, 128, 4096, 11008, 32000, 4096, 6738415616ULL, 0},
                      "meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023 (Llama 2)");
       }},
      {"llama-2-70b", "GQA 80 layers, 64/8 heads x 128",
       [] {
         // meta-llama/Llama-2-70b-hf config.json: hidden 8192, 80 layers, 64 heads,
         // 8 KV heads, intermediate 28672, vocab 32000, context 4096.
         // Params 68,976,648,192 (derived).
         return dense("Llama-2-70B", {80, 64, 8, 128, 8192, 28672, 32000, 4096, 68976648192ULL, 0},
                      "meta-llama/Llama-2-70b-hf config.json; Touvron et al. 2023 (Llama 2)");
       }},
      {"llama-3-8b", "GQA 32 layers, 32/8 heads x 128",
       [] {
         // meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads,
         // 8 KV heads, intermediate 14336, vocab 128256, context 8192.
         // Params 8,030,261,248 (derived).
         return dense("Llama-3-8B", {32, 32, 8, 128, 4096, 14336, 128256, 8192, 8030261248ULL, 0},
                      "meta-llama/Meta-Llama-3-8B config.json");
       }},
      {"llama-3-70b", "GQA 80 layers, 64/8 heads x 128",
       [] {
         // meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 80 layers, 64 heads,
         // 8 KV heads, intermediate 28672, vocab 128256, context 8192.
         // Params 70,553,706,496 (derived).
         return dense("Llama-3-70B", {80, 64, 8, 128, 8192, 28672, 128256, 8192, 70553706496ULL, 0},
                      "meta-llama/Meta-Llama-3-70B config.json");
       }},
      {"mistral-7b", "GQA 32 layers, 32/8 heads x 128, sliding window 4096 (v0.1)",
       [] {
         // mistralai/Mistral-7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads,
         // 8 KV heads, intermediate 14336, vocab 32000, sliding_window 4096 on every
         // layer, max_position_embeddings 32768. Params 7,241,732,096 (derived).
         // Jiang et al. 2023 (Mistral 7B) describe the window.
         ModelArch a =
             dense("Mistral-7B-v0.1", {32, 32, 8, 128, 4096, 14336, 32000, 32768, 7241732096ULL, 0},
                   "mistralai/Mistral-7B-v0.1 config.json; Jiang et al. 2023");
         for (auto& l : a.layers) {
           l.kind = LayerKind::kWindow;
           l.window = 4096;
         }
         return a;
       }},
      {"mistral-7b-v0.3", "GQA 32 layers, 32/8 heads x 128, no window",
       [] {
         // mistralai/Mistral-7B-v0.3 config.json: as v0.1 but vocab 32768 and
         // sliding_window null. Params 7,248,023,552 (derived).
         return dense("Mistral-7B-v0.3",
                      {32, 32, 8, 128, 4096, 14336, 32768, 32768, 7248023552ULL, 0},
                      "mistralai/Mistral-7B-v0.3 config.json");
       }},
      {"mixtral-8x7b", "GQA MoE 32 layers, 32/8 heads x 128, 8 experts (2 active)",
       [] {
         // mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads,
         // 8 KV heads, intermediate 14336 per expert, 8 local experts, 2 per token,
         // vocab 32000, context 32768, sliding_window null. Params 46,702,792,704
         // total, 12,879,925,248 active (derived; paper: 47B / 13B).
         ModelArch a =
             dense("Mixtral-8x7B",
                   {32, 32, 8, 128, 4096, 2 * 14336, 32000, 32768, 46702792704ULL, 12879925248ULL},
                   "mistralai/Mixtral-8x7B-v0.1 config.json; Jiang et al. 2024");
         return a;
       }},
      {"qwen2.5-7b", "GQA 28 layers, 28/4 heads x 128",
       [] {
         // Qwen/Qwen2.5-7B config.json: hidden 3584, 28 layers, 28 heads, 4 KV heads,
         // intermediate 18944, vocab 152064, max_position_embeddings 131072
         // (sliding window off). Params 7,615,616,512 (derived; card: 7.61B).
         return dense("Qwen2.5-7B", {28, 28, 4, 128, 3584, 18944, 152064, 131072, 7615616512ULL, 0},
                      "Qwen/Qwen2.5-7B config.json and model card");
       }},
      {"gemma-3-27b", "GQA 62 layers, 32/16 heads x 128, 5:1 local(1024):global",
       [] {
         // google/gemma-3-27b-it config.json (text_config): hidden 5376, 62 layers,
         // 32 heads, 16 KV heads, head_dim 128, intermediate 21504, vocab 262208,
         // sliding_window 1024, sliding_window_pattern 6 (five local layers then
         // one global), context 131072. Text-model params 27,009,346,304 (derived;
         // the 27B card counts the vision encoder too). Gemma 3 technical report.
         ModelArch a =
             dense("Gemma-3-27B", {62, 32, 16, 128, 5376, 21504, 262208, 131072, 27009346304ULL, 0},
                   "google/gemma-3-27b-it config.json; Gemma 3 Technical Report 2025");
         for (size_t i = 0; i < a.layers.size(); ++i) {
           if ((i + 1) % 6 != 0) {
             a.layers[i].kind = LayerKind::kWindow;
             a.layers[i].window = 1024;
           }
         }
         return a;
       }},
      {"deepseek-v2", "MLA 60 layers, 128 heads, d_c 512 + d_R 64, MoE",
       [] {
         // deepseek-ai/DeepSeek-V2 config.json: hidden 5120, 60 layers, 128 heads,
         // kv_lora_rank 512 (d_c), qk_rope_head_dim 64 (d_R), qk_nope_head_dim 128,
         // v_head_dim 128, vocab 102400; MoE with 2 shared + 6 of 160 routed experts
         // of width 1536. DeepSeek-V2 paper (2024): 236B total, 21B activated
         // parameters, 128K context.
         return mla("DeepSeek-V2",
                    {60, 128, 5120, 8 * 1536, 102400, 131072, 236000000000ULL, 21000000000ULL},
                    "deepseek-ai/DeepSeek-V2 config.json; DeepSeek-AI 2024 (DeepSeek-V2 paper)");
       }},
      {"deepseek-v2-lite", "MLA 27 layers, 16 heads, d_c 512 + d_R 64, MoE",
       [] {
         // deepseek-ai/DeepSeek-V2-Lite config.json (and deepseek-ai/DeepSeek-V3
         // inference/configs/config_16B.json): hidden 2048, 27 layers (1 dense), 16
         // heads, q_lora_rank none (plain q projection), kv_lora_rank 512,
         // qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, vocab 102400;
         // MoE with 2 shared + 6 of 64 routed experts of width 1408. Model card:
         // 15.7B total, 2.4B activated parameters, 32K context.
         return mla("DeepSeek-V2-Lite",
                    {27, 16, 2048, 8 * 1408, 102400, 32768, 15700000000ULL, 2400000000ULL},
                    "deepseek-ai/DeepSeek-V2-Lite config.json and model card");
       }},
      {"deepseek-v3", "MLA 61 layers, 128 heads, d_c 512 + d_R 64, MoE",
       [] {
         // deepseek-ai/DeepSeek-V3 config.json (and inference/configs/config_671B.json):
         // hidden 7168, 61 layers (3 dense), 128 heads, q_lora_rank 1536,
         // kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim
         // 128, vocab 129280; MoE with 1 shared + 8 of 256 routed experts of width
         // 2048. DeepSeek-V3 technical report (2024): 671B total, 37B activated
         // parameters (the MTP module not counted), 128K context.
         return mla("DeepSeek-V3",
                    {61, 128, 7168, 9 * 2048, 129280, 131072, 671000000000ULL, 37000000000ULL},
                    "deepseek-ai/DeepSeek-V3 config.json; DeepSeek-AI 2024 (DeepSeek-V3 "
                    "technical report)");
       }},
      {"smollm2-135m", "GQA 30 layers, 9/3 heads x 64",
       [] {
         // HuggingFaceTB/SmolLM2-135M config.json: hidden 576, 30 layers, 9 heads,
         // 3 KV heads, intermediate 1536, vocab 49152, max_position_embeddings 8192,
         // tied embeddings. Params 134,515,008 (derived).
         return dense("SmolLM2-135M", {30, 9, 3, 64, 576, 1536, 49152, 8192, 134515008ULL, 0},
                      "HuggingFaceTB/SmolLM2-135M config.json");
       }},
      {"gpt2-small", "MHA 12 layers, 12/12 heads x 64",
       [] {
         // openai-community/gpt2 config.json: n_embd 768, n_layer 12, n_head 12
         // (multi-head: K/V heads = query heads), n_inner 3072, vocab 50257,
         // n_positions 1024. Params 124,439,808 (derived, tied embeddings).
         return dense("GPT-2-small", {12, 12, 12, 64, 768, 3072, 50257, 1024, 124439808ULL, 0},
                      "openai-community/gpt2 config.json; Radford et al. 2019");
       }},
  };
  return kPresets;
}

std::string normalise(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  return out;
}

}  // namespace

std::vector<PresetInfo> list_presets() {
  std::vector<PresetInfo> out;
  for (const auto& p : presets()) out.push_back({p.id, p.summary});
  return out;
}

Result<ModelArch> find_preset(std::string_view name) {
  const std::string key = normalise(name);
  std::string known;
  for (const auto& p : presets()) {
    if (!key.empty() && normalise(p.id) == key) return p.build();
    known += (known.empty() ? "" : ", ") + std::string(p.id);
  }
  return make_error(Errc::kNotFound,
                    "unknown preset '" + std::string(name) + "' (known: " + known + ")");
}

}  // namespace kvstack::capacity

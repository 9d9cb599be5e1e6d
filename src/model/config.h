// Architecture hyper-parameters of a decoder-only model, read from GGUF
// metadata into one struct. Supported architectures: `llama` (SmolLM2,
// Llama 2/3, Mistral-style), `qwen2` (QKV bias, NeoX RoPE) and `gemma3`
// (hybrid window/full layers, per-layer RoPE base, pre/post norms, q/k head
// norms, GeGLU, scaled embeddings; facts as llama.cpp's gemma3 loader) and
// `deepseek2` (MLA attention with a decoupled RoPE key and YaRN, leading dense
// layers then MoE layers; facts as llama.cpp's deepseek2 loader and graph).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"

namespace kvstack {

class GgufFile;

struct ModelConfig {
  std::string arch;  // "llama" | "qwen2" | "gemma3" | "deepseek2"
  std::string name;  // general.name, may be empty
  int n_layers = 0;
  int n_embd = 0;      // hidden size
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA when < n_heads)
  int head_dim = 0;    // per-head dimension of q/k/v
  int n_ff = 0;        // feed-forward inner size
  int n_vocab = 0;
  int n_ctx_train = 0;  // context length the model was trained for
  int n_rot = 0;        // rotary dimensions (<= head_dim)
  // RoPE pairing: false = adjacent pairs (x[2i], x[2i+1]), the llama GGUF
  // convention; true = halves (x[i], x[i + n_rot/2]) as qwen2/gpt-neox.
  bool rope_neox = false;
  float rope_freq_base = 10000.0f;
  float rope_freq_scale = 1.0f;   // 1 / linear scaling factor
  std::string rope_scaling_type;  // "none" | "linear" (others rejected)
  float norm_eps = 1e-5f;
  bool tied_embeddings = false;  // output.weight absent: reuse token_embd
  bool qkv_bias = false;         // qwen2
  int sliding_window = 0;        // model-wide window (metadata); 0 = none
  // Per-layer attention window in tokens, [n_layers]; 0 = full attention.
  // Hybrid models (gemma3) mix window and full layers; for llama/qwen2 every
  // entry is sliding_window. Kernels, KV groups and the planner read this,
  // never sliding_window directly.
  std::vector<int> layer_window;
  // Per-layer RoPE frequency base and linear scale, [n_layers]. llama/qwen2:
  // every entry is rope_freq_base / rope_freq_scale. gemma3: window layers use
  // 10000 and scale 1 (llama.cpp's rope_freq_base_train_swa), full layers the
  // file's rope.freq_base and scaling.
  std::vector<float> layer_rope_base;
  std::vector<float> layer_rope_scale;

  // Layer-math switches (all off for llama/qwen2, on for gemma3).
  enum class FfnAct : uint8_t { kSilu, kGeluTanh };
  FfnAct ffn_act = FfnAct::kSilu;  // gate activation: SwiGLU or GeGLU (tanh GELU)
  bool qk_norm = false;            // per-head RMSNorm of q and k before RoPE ([head_dim] weights)
  bool post_norms = false;         // RMSNorm of the attention and FFN outputs before the residual
  // Token embeddings are multiplied by this (gemma3: sqrtf(n_embd) in float).
  // 1 = no scaling (the multiply is skipped, not performed).
  float embd_scale = 1.0f;
  // Softmax scale of q.k: 1/sqrt(head_dim) (gemma3 27B: 1/sqrt(n_embd/n_heads)).
  float attn_scale = 0.0f;

  // deepseek2: multi-head latent attention (MLA). The KV cache holds the
  // latent expanded to per-head K and V: n_kv_heads = n_heads and head_dim =
  // max(qk_nope + qk_rope, v_head_dim), each K/V row zero-padded to head_dim
  // (q too, so q.k is unchanged and the padded V dims give zero outputs).
  struct Mla {
    int q_lora_rank = 0;      // 0: q = attn_q x; else attn_q_b(rmsnorm(attn_q_a x))
    int kv_lora_rank = 0;     // d_c: latent size
    int qk_nope = 0;          // per-head q/k dims without RoPE
    int qk_rope = 0;          // d_R: per-head RoPE dims (= n_rot), the key's shared by all heads
    int v_head_dim = 0;       // per-head V dims
    bool split_kv_b = false;  // attn_k_b + attn_v_b (key_length_mla set) vs one attn_kv_b
    int qk_dim() const { return qk_nope + qk_rope; }
  };
  Mla mla;  // all zero unless arch == "deepseek2"
  // YaRN RoPE (deepseek2; rope_scaling_type "yarn"), as ggml's rope_yarn:
  // theta = fs*theta_e*(1-r) + theta_e*r with ramp r(i) over the corr dims,
  // cos/sin times rope_mscale.
  struct Yarn {
    bool enabled = false;
    float corr_lo = 0, corr_hi = 0;  // ggml_rope_yarn_corr_dims(n_rot, n_ctx_orig, base, 32, 1)
    float rope_mscale = 1.0f;        // magnitude factor of q_pe/k_pe
    int n_ctx_orig = 0;              // rope.scaling.original_context_length
  };
  Yarn yarn;
  // Mixture of experts (deepseek2 layers >= n_dense_lead), as llama.cpp's
  // build_moe_ffn: probs = gating(router x); top-k of probs (+ probs_bias when
  // the file has exp_probs_b); weights = probs of the chosen (softmax over them
  // for kSoftmaxWeight), divided by their sum when weights_norm, times
  // weights_scale; out = sum_k w_k SwiGLU_k(x) + shared experts' SwiGLU(x).
  enum class MoeGating : uint8_t { kSoftmax = 1, kSigmoid = 2, kSoftmaxWeight = 3 };
  struct Moe {
    int n_dense_lead = 0;  // layers [0, n_dense_lead) have a dense FFN (n_ff)
    int n_expert = 0;
    int n_expert_used = 0;
    int n_expert_shared = 0;
    int n_ff_exp = 0;  // inner size of each expert (shared experts: n_ff_exp * n_expert_shared)
    MoeGating gating = MoeGating::kSoftmax;
    bool weights_norm = false;
    float weights_scale = 1.0f;
  };
  Moe moe;
  bool is_moe_layer(int layer) const { return moe.n_expert > 0 && layer >= moe.n_dense_lead; }

  // Cross-layer KV sharing (YOCO / Gemma 3n; GGUF <arch>.attention.
  // shared_kv_layers = N, the key llama.cpp's gemma3n reads): the last N
  // layers compute no K/V and store none; each attends over the K/V of the
  // last storing layer (index < n_layers - N) with the same window.
  // layer_kv_source[l]: that layer, or l for a storing layer; layer_kv_index[l]:
  // the KV layout's layer holding l's K/V (storing layers in order, a shared
  // layer its source's). Both [n_layers]; assign_kv_sharing() fills them (a
  // config built by hand, with both empty, shares nothing).
  int shared_kv_layers = 0;
  std::vector<int> layer_kv_source;
  std::vector<int> layer_kv_index;
  int kv_source(int layer) const {
    return layer_kv_source.empty() ? layer : layer_kv_source[static_cast<size_t>(layer)];
  }
  bool stores_kv(int layer) const { return kv_source(layer) == layer; }
  int kv_index(int layer) const {
    return layer_kv_index.empty() ? layer : layer_kv_index[static_cast<size_t>(layer)];
  }
  int n_kv_layers() const { return n_layers - shared_kv_layers; }

  int n_gqa() const { return n_heads / n_kv_heads; }
  int window(int layer) const { return layer_window[static_cast<size_t>(layer)]; }
  float rope_base(int layer) const { return layer_rope_base[static_cast<size_t>(layer)]; }
  float rope_scale(int layer) const { return layer_rope_scale[static_cast<size_t>(layer)]; }
};

// Reads and validates the config; errors name the file and the key at fault.
Result<ModelConfig> load_model_config(const GgufFile& file);

// Fills layer_kv_source / layer_kv_index from shared_kv_layers and the
// layers' windows (again after the windows change). kInvalidArgument when a
// shared layer has no storing layer of its window before it.
Status assign_kv_sharing(ModelConfig& c);

}  // namespace kvstack

// Architecture hyper-parameters of a decoder-only model, read from GGUF
// metadata into one struct. Supported architectures: `llama` (SmolLM2,
// Llama 2/3, Mistral-style), `qwen2` (QKV bias, NeoX RoPE) and `gemma3`
// (hybrid window/full layers, per-layer RoPE base, pre/post norms, q/k head
// norms, GeGLU, scaled embeddings; facts as llama.cpp's gemma3 loader).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"

namespace kvstack {

class GgufFile;

struct ModelConfig {
  std::string arch;  // "llama" | "qwen2" | "gemma3"
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

  int n_gqa() const { return n_heads / n_kv_heads; }
  int window(int layer) const { return layer_window[static_cast<size_t>(layer)]; }
  float rope_base(int layer) const { return layer_rope_base[static_cast<size_t>(layer)]; }
  float rope_scale(int layer) const { return layer_rope_scale[static_cast<size_t>(layer)]; }
};

// Reads and validates the config; errors name the file and the key at fault.
Result<ModelConfig> load_model_config(const GgufFile& file);

}  // namespace kvstack

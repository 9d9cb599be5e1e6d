// A loaded model: GGUF mapping, config, and per-layer weight views bound for
// the forward pass. Weights stay in the mmapped file in their GGUF format;
// only tensors whose type has no matmul kernel are dequantized to f32 at load.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/result.h"
#include "model/config.h"
#include "model/gguf.h"
#include "ops/matmul.h"

namespace kvstack {

// deepseek2 attention (ModelConfig::Mla; H heads, nope/rope/v per-head dims).
struct MlaWeights {
  WeightView wq_a{};                 // [q_lora, n_embd] (q_lora_rank > 0; else LayerWeights::wq)
  const float* q_a_norm = nullptr;   // [q_lora]
  WeightView wq_b{};                 // [H * (nope + rope), q_lora]
  WeightView wkv_a{};                // [kv_lora + rope, n_embd]: latent c_t, then the RoPE key
  const float* kv_a_norm = nullptr;  // [kv_lora]
  // [H * (nope + v), kv_lora]: per head nope rows of K, then v rows of V. The
  // split layout (attn_k_b [H][kv_lora][nope], attn_v_b [H][v][kv_lora]) is
  // rearranged into this at load (f32).
  WeightView wkv_b{};
};

// deepseek2 MoE FFN (ModelConfig::Moe), layers >= n_dense_lead.
struct MoeWeights {
  WeightView router{};                // [n_expert, n_embd] (ffn_gate_inp)
  const float* probs_bias = nullptr;  // [n_expert] exp_probs_b, selection only; may be null
  std::vector<WeightView> gate, up;   // [n_expert] of [n_ff_exp, n_embd]
  std::vector<WeightView> down;       // [n_expert] of [n_embd, n_ff_exp]
  WeightView sh_gate{}, sh_up{};      // [n_ff_exp * n_shared, n_embd]; data null if none
  WeightView sh_down{};               // [n_embd, n_ff_exp * n_shared]
};

struct LayerWeights {
  const float* attn_norm = nullptr;   // [n_embd]
  WeightView wq{}, wk{}, wv{}, wo{};  // q: [n_heads*head_dim, n_embd], k/v: [n_kv*hd, n_embd]
  const float* bq = nullptr;          // qwen2 biases, else nullptr
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* ffn_norm = nullptr;        // [n_embd]
  WeightView w_gate{}, w_up{}, w_down{};  // gate/up: [n_ff, n_embd], down: [n_embd, n_ff]
  // gemma3 (config qk_norm / post_norms), else nullptr.
  const float* attn_q_norm = nullptr;     // [head_dim], shared by every q head
  const float* attn_k_norm = nullptr;     // [head_dim], shared by every k head
  const float* attn_post_norm = nullptr;  // [n_embd] post_attention_norm
  const float* ffn_post_norm = nullptr;   // [n_embd] post_ffw_norm
  // deepseek2: wq (no q low-rank path), wo ([n_embd, H * v]), the norms and
  // the dense FFN of the leading layers use the fields above.
  MlaWeights mla;
  MoeWeights moe;
};

class Model {
 public:
  // Opens, validates and binds every tensor the architecture needs; errors
  // name the file and the missing or mis-shaped tensor.
  static Result<std::unique_ptr<Model>> load(const std::string& path,
                                             LoadMode mode = LoadMode::kMmap);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  // Replaces the per-layer attention windows (ModelConfig::layer_window):
  // tests and experiments that run a model as a hybrid sliding-window one.
  // kInvalidArgument unless windows has n_layers entries, each >= 0.
  Status set_layer_windows(std::vector<int> windows);
  const GgufFile& file() const { return file_; }
  const std::vector<LayerWeights>& layers() const { return layers_; }
  const WeightView& token_embd() const { return token_embd_; }  // [n_vocab, n_embd]
  const WeightView& output() const { return output_; }          // [n_vocab, n_embd]
  const float* output_norm() const { return output_norm_; }
  // Bytes of weights as stored (sum of tensor sizes) and bytes dequantized at load.
  uint64_t weight_bytes() const { return weight_bytes_; }
  uint64_t dequantized_bytes() const { return dequantized_bytes_; }
  // Bytes of weight matrices packed in place into 16-column panels at load
  // (WeightLayout::kPanels16; the matrices keep their size). Only with
  // LoadMode::kCopy, where the AVX-512 VNNI kernels run, for Q4_0 / Q4_1 /
  // Q8_0 matrices (a tied token embedding too: embed() reads its rows back
  // through weight_row), unless KVSTACK_WEIGHT_PANELS=0.
  uint64_t packed_bytes() const { return packed_bytes_; }
  // Names of tensor types that had no matmul kernel and were dequantized.
  const std::vector<std::string>& dequantized_types() const { return dequantized_types_; }

  // Dequantizes embedding rows for `tokens` into out [n, n_embd], each then
  // multiplied by config().embd_scale when that is not 1 (gemma3).
  // REQUIRES: every token in [0, n_vocab).
  void embed(const int32_t* tokens, int64_t n, float* out) const;

 private:
  explicit Model(GgufFile file) : file_(std::move(file)) {}
  Status bind();
  Status bind_deepseek2();  // model_deepseek2.cpp
  Result<std::vector<WeightView>> experts(const std::string& name, int64_t n_in, int64_t n_out,
                                          int64_t n_expert);
  Result<WeightView> mla_kv_b(const std::string& prefix);
  // pack: the matrix is read by matmul alone, so it may be packed (see
  // packed_bytes()) when bind() made the copy writable.
  Result<WeightView> matrix(const std::string& name, int64_t n_in, int64_t n_out,
                            bool pack = false);
  Result<const float*> vector_f32(const std::string& name, int64_t n, bool required = true);

  GgufFile file_;
  ModelConfig config_;
  std::vector<LayerWeights> layers_;
  WeightView token_embd_{}, output_{};
  const float* output_norm_ = nullptr;
  uint64_t weight_bytes_ = 0;
  uint64_t dequantized_bytes_ = 0;
  uint64_t packed_bytes_ = 0;
  uint8_t* writable_ = nullptr;  // the file's copy while bind() may pack into it, else null
  std::vector<std::string> dequantized_types_;
  std::vector<std::unique_ptr<float[]>> owned_;  // dequantized tensors
};

}  // namespace kvstack

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
};

class Model {
 public:
  // Opens, validates and binds every tensor the architecture needs; errors
  // name the file and the missing or mis-shaped tensor.
  static Result<std::unique_ptr<Model>> load(const std::string& path);
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
  // Names of tensor types that had no matmul kernel and were dequantized.
  const std::vector<std::string>& dequantized_types() const { return dequantized_types_; }

  // Dequantizes embedding rows for `tokens` into out [n, n_embd], each then
  // multiplied by config().embd_scale when that is not 1 (gemma3).
  // REQUIRES: every token in [0, n_vocab).
  void embed(const int32_t* tokens, int64_t n, float* out) const;

 private:
  explicit Model(GgufFile file) : file_(std::move(file)) {}
  Status bind();
  Result<WeightView> matrix(const std::string& name, int64_t n_in, int64_t n_out);
  Result<const float*> vector_f32(const std::string& name, int64_t n, bool required = true);

  GgufFile file_;
  ModelConfig config_;
  std::vector<LayerWeights> layers_;
  WeightView token_embd_{}, output_{};
  const float* output_norm_ = nullptr;
  uint64_t weight_bytes_ = 0;
  uint64_t dequantized_bytes_ = 0;
  std::vector<std::string> dequantized_types_;
  std::vector<std::unique_ptr<float[]>> owned_;  // dequantized tensors
};

}  // namespace kvstack

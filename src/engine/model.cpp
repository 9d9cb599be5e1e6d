#include "engine/model.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/dequant.h"
#include "ops/elementwise.h"

namespace kvstack {

Result<std::unique_ptr<Model>> Model::load(const std::string& path, LoadMode mode) {
  auto file = GgufFile::open(path, mode);
  if (!file) return file.error();
  std::unique_ptr<Model> m(new Model(std::move(*file)));
  auto cfg = load_model_config(m->file_);
  if (!cfg) return cfg.error();
  m->config_ = std::move(*cfg);
  KV_TRY_STATUS(m->bind());
  return m;
}

Result<WeightView> Model::matrix(const std::string& name, int64_t n_in, int64_t n_out, bool pack) {
  const GgufTensor* t = file_.find_tensor(name);
  if (t == nullptr) {
    return make_error(Errc::kCorruptFile, file_.path() + ": missing tensor '" + name + "'");
  }
  if (t->dims.size() != 2 || t->dims[0] != n_in || t->dims[1] != n_out) {
    std::string shape;
    for (auto d : t->dims) shape += (shape.empty() ? "" : " x ") + std::to_string(d);
    return make_error(Errc::kCorruptFile, file_.path() + ": tensor '" + name + "' has shape [" +
                                              shape + "], expected [" + std::to_string(n_in) +
                                              " x " + std::to_string(n_out) + "]");
  }
  WeightView w{t->type, t->data, n_in, n_out};
  if (!matmul_supported(t->type)) {
    // No kernel for this format yet: dequantize once to f32.
    auto buf = std::make_unique<float[]>(static_cast<size_t>(n_in * n_out));
    KV_TRY_STATUS(dequantize_tensor(*t, buf.get()));
    const auto* tr = ggml_type_traits(static_cast<uint32_t>(t->type));
    const std::string tn = tr ? tr->name : "?";
    if (std::find(dequantized_types_.begin(), dequantized_types_.end(), tn) ==
        dequantized_types_.end()) {
      dequantized_types_.push_back(tn);
    }
    dequantized_bytes_ += static_cast<uint64_t>(n_in * n_out) * sizeof(float);
    w = WeightView{GgmlType::kF32, reinterpret_cast<const uint8_t*>(buf.get()), n_in, n_out};
    owned_.push_back(std::move(buf));
  } else if (pack && writable_ != nullptr && weight_panels_supported(w)) {
    w = pack_weight_panels(w, writable_ + (t->data - file_.mapping().data()));
    packed_bytes_ += t->n_bytes;
  }
  return w;
}

namespace {

// KVSTACK_WEIGHT_PANELS=0 keeps every matrix in GGUF's row layout (for A/B
// measurements of the packed kernels); anything else, or unset, packs.
bool panels_wanted() {
  const char* e = std::getenv("KVSTACK_WEIGHT_PANELS");
  return e == nullptr || std::string(e) != "0";
}

// Makes the copy read-only again when bind() returns, however it returns.
struct Reseal {
  MappedFile& map;
  uint8_t*& writable;
  ~Reseal() {
    writable = nullptr;
    map.seal();
  }
};

}  // namespace

Result<const float*> Model::vector_f32(const std::string& name, int64_t n, bool required) {
  const GgufTensor* t = file_.find_tensor(name);
  if (t == nullptr) {
    if (!required) return static_cast<const float*>(nullptr);
    return make_error(Errc::kCorruptFile, file_.path() + ": missing tensor '" + name + "'");
  }
  if (t->n_elements() != n) {
    return make_error(Errc::kCorruptFile, file_.path() + ": tensor '" + name + "' has " +
                                              std::to_string(t->n_elements()) +
                                              " elements, expected " + std::to_string(n));
  }
  if (t->type == GgmlType::kF32) return reinterpret_cast<const float*>(t->data);
  auto buf = std::make_unique<float[]>(static_cast<size_t>(n));
  KV_TRY_STATUS(dequantize_tensor(*t, buf.get()));
  owned_.push_back(std::move(buf));
  return static_cast<const float*>(owned_.back().get());
}

Status Model::bind() {
  const ModelConfig& c = config_;
  // kCopy: the matmul-only matrices may be packed in place (matrix()).
  writable_ = panels_wanted() ? file_.mapping().unseal() : nullptr;
  Reseal reseal{file_.mapping(), writable_};
  for (const auto& t : file_.tensors()) weight_bytes_ += t.n_bytes;
  const int64_t q_dim = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;

#define KV_BIND(dst, expr)      \
  do {                          \
    auto r_ = (expr);           \
    if (!r_) return r_.error(); \
    (dst) = *r_;                \
  } while (0)

  // token_embd is only ever read a row at a time (embed()), so it is not
  // dequantized even when the matmul has no kernel for its type.
  const GgufTensor* emb = file_.find_tensor("token_embd.weight");
  if (emb == nullptr || emb->dims.size() != 2 || emb->dims[0] != c.n_embd ||
      emb->dims[1] != c.n_vocab) {
    return make_error(Errc::kCorruptFile,
                      file_.path() + ": tensor 'token_embd.weight' is missing or not [" +
                          std::to_string(c.n_embd) + " x " + std::to_string(c.n_vocab) + "]");
  }
  token_embd_ = WeightView{emb->type, emb->data, c.n_embd, c.n_vocab};
  KV_BIND(output_norm_, vector_f32("output_norm.weight", c.n_embd));
  if (c.tied_embeddings) {
    // embed() reads rows of either layout (weight_row), so the tied matrix
    // packs too; token_embd_ follows the layout of the same bytes.
    KV_BIND(output_, matrix("token_embd.weight", c.n_embd, c.n_vocab, true));
    if (output_.data == token_embd_.data) token_embd_.layout = output_.layout;
  } else {
    KV_BIND(output_, matrix("output.weight", c.n_embd, c.n_vocab, true));
  }
  layers_.resize(c.n_layers);
  if (c.arch == "deepseek2") return bind_deepseek2();
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights& l = layers_[i];
    KV_BIND(l.attn_norm, vector_f32(p + "attn_norm.weight", c.n_embd));
    KV_BIND(l.wq, matrix(p + "attn_q.weight", c.n_embd, q_dim, true));
    KV_BIND(l.wk, matrix(p + "attn_k.weight", c.n_embd, kv_dim, true));
    KV_BIND(l.wv, matrix(p + "attn_v.weight", c.n_embd, kv_dim, true));
    KV_BIND(l.wo, matrix(p + "attn_output.weight", q_dim, c.n_embd, true));
    KV_BIND(l.bq, vector_f32(p + "attn_q.bias", q_dim, c.qkv_bias));
    KV_BIND(l.bk, vector_f32(p + "attn_k.bias", kv_dim, c.qkv_bias));
    KV_BIND(l.bv, vector_f32(p + "attn_v.bias", kv_dim, c.qkv_bias));
    KV_BIND(l.ffn_norm, vector_f32(p + "ffn_norm.weight", c.n_embd));
    KV_BIND(l.w_gate, matrix(p + "ffn_gate.weight", c.n_embd, c.n_ff, true));
    KV_BIND(l.w_up, matrix(p + "ffn_up.weight", c.n_embd, c.n_ff, true));
    KV_BIND(l.w_down, matrix(p + "ffn_down.weight", c.n_ff, c.n_embd, true));
    if (c.qk_norm) {
      KV_BIND(l.attn_q_norm, vector_f32(p + "attn_q_norm.weight", c.head_dim));
      KV_BIND(l.attn_k_norm, vector_f32(p + "attn_k_norm.weight", c.head_dim));
    }
    if (c.post_norms) {
      KV_BIND(l.attn_post_norm, vector_f32(p + "post_attention_norm.weight", c.n_embd));
      KV_BIND(l.ffn_post_norm, vector_f32(p + "post_ffw_norm.weight", c.n_embd));
    }
  }
#undef KV_BIND
  return {};
}

void Model::embed(const int32_t* tokens, int64_t n, float* out) const {
  const size_t row_bytes = ggml_row_bytes(token_embd_.type, token_embd_.n_in);
  // A packed (tied) row, back in GGUF's layout (per thread: embed() may run
  // on several engines' threads; it grows once, then steps do not allocate).
  static thread_local std::vector<uint8_t> row;
  const bool packed = token_embd_.layout != WeightLayout::kRows;
  if (packed && row.size() < row_bytes) row.resize(row_bytes);
  for (int64_t i = 0; i < n; ++i) {
    KV_DCHECK(tokens[i] >= 0 && tokens[i] < token_embd_.n_out, "token id out of range");
    const uint8_t* src = token_embd_.data + static_cast<size_t>(tokens[i]) * row_bytes;
    if (packed) {
      weight_row(token_embd_, tokens[i], row.data());
      src = row.data();
    }
    dequantize_row(token_embd_.type, src, out + i * token_embd_.n_in, token_embd_.n_in);
  }
  if (config_.embd_scale != 1.0f) scale(out, config_.embd_scale, n * token_embd_.n_in);
}

Status Model::set_layer_windows(std::vector<int> windows) {
  if (static_cast<int>(windows.size()) != config_.n_layers) {
    return make_error(Errc::kInvalidArgument, "layer windows: " + std::to_string(windows.size()) +
                                                  " given for " + std::to_string(config_.n_layers) +
                                                  " layers");
  }
  for (size_t l = 0; l < windows.size(); ++l) {
    if (windows[l] < 0) {
      return make_error(Errc::kInvalidArgument,
                        "layer windows: layer " + std::to_string(l) + " has a negative window");
    }
  }
  ModelConfig c = config_;
  c.layer_window = std::move(windows);
  KV_TRY_STATUS(assign_kv_sharing(c));  // shared layers read a layer of their window
  config_ = std::move(c);
  return {};
}

}  // namespace kvstack

#include "model/config.h"

#include <cmath>

#include "model/gguf.h"

namespace kvstack {
namespace {

Error bad(const GgufFile& f, const std::string& what) {
  return make_error(Errc::kCorruptFile, f.path() + ": " + what);
}

// Reads an integer hyper-parameter in [lo, hi]; `def` < 0 means required.
Result<int> read_int(const GgufFile& f, const std::string& key, int64_t def, int64_t lo,
                     int64_t hi) {
  if (f.find(key) == nullptr) {
    if (def >= 0) return static_cast<int>(def);
    return bad(f, "missing required metadata key '" + key + "'");
  }
  auto v = f.get_i64(key);
  if (!v) return v.error();
  if (*v < lo || *v > hi) {
    return bad(f, "metadata '" + key + "' = " + std::to_string(*v) + " is out of range [" +
                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return static_cast<int>(*v);
}

Result<float> read_float(const GgufFile& f, const std::string& key, double def) {
  if (f.find(key) == nullptr) return static_cast<float>(def);
  auto v = f.get_f64(key);
  if (!v) return v.error();
  if (!std::isfinite(*v)) return bad(f, "metadata '" + key + "' is not finite");
  return static_cast<float>(*v);
}

// gemma3, as llama.cpp's loader sets it (llama-model.cpp, load_hparams for
// LLM_ARCH_GEMMA3; the graph in models/gemma3.cpp):
//  * the file carries no layer-pattern key: set_swa_pattern(6), i.e. layer l
//    is a window layer when l % 6 < 5 (layers 5, 11, 17, ... are full); with
//    no attention.sliding_window (or 0) every layer is full;
//  * window layers use RoPE base 10000 and scale 1 (rope_freq_base_train_swa),
//    full layers the file's rope.freq_base and scaling;
//  * q.k scale 1/sqrt(head_dim), except the 62-layer 27B model:
//    1/sqrt(n_embd / n_heads) (f_attention_scale);
//  * embeddings times sqrtf(n_embd), a float;
//  * per-head q/k RMSNorm, post-attention and post-FFN RMSNorm, GeGLU with
//    tanh GELU; norm weights are used as stored (the converter already added
//    Gemma's +1).
// A final or attention logit soft-capping value in the file is rejected:
// llama.cpp's windowed gemma3 graph applies none, so a file asking for it is
// not one this loader understands.
Status apply_gemma3(const GgufFile& f, ModelConfig& c) {
  for (const char* key : {"gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"}) {
    if (f.find(key) == nullptr) continue;
    auto v = f.get_f64(key);
    if (!v) return v.error();
    if (*v != 0.0) {
      return make_error(Errc::kUnsupported, f.path() + ": metadata '" + key +
                                                "' = " + std::to_string(*v) +
                                                " (logit soft-capping) is not supported");
    }
  }
  constexpr int kPattern = 6;
  constexpr float kWindowRopeBase = 10000.0f;
  for (int l = 0; l < c.n_layers; ++l) {
    const bool window_layer = c.sliding_window > 0 && l % kPattern < kPattern - 1;
    const auto i = static_cast<size_t>(l);
    c.layer_window[i] = window_layer ? c.sliding_window : 0;
    if (window_layer) {
      c.layer_rope_base[i] = kWindowRopeBase;
      c.layer_rope_scale[i] = 1.0f;
    }
  }
  if (c.n_layers == 62) {
    const int embd_per_head = c.n_embd / c.n_heads;  // integer division, as llama.cpp
    c.attn_scale = 1.0f / std::sqrt(static_cast<float>(embd_per_head));
  }
  c.embd_scale = std::sqrt(static_cast<float>(c.n_embd));
  c.qk_norm = true;
  c.post_norms = true;
  c.ffn_act = ModelConfig::FfnAct::kGeluTanh;
  return {};
}

}  // namespace

Result<ModelConfig> load_model_config(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) return arch.error();
  c.arch = *arch;
  if (c.arch != "llama" && c.arch != "qwen2" && c.arch != "gemma3") {
    return make_error(Errc::kUnsupported,
                      f.path() + ": architecture '" + c.arch +
                          "' is not supported (supported: llama, qwen2, gemma3)");
  }
  if (f.find("general.name") != nullptr) {
    auto n = f.get_string("general.name");
    if (n) c.name = *n;
  }
  const std::string a = c.arch + ".";
#define KV_READ_INT(field, key, def, lo, hi)       \
  do {                                             \
    auto r_ = read_int(f, a + (key), def, lo, hi); \
    if (!r_) return r_.error();                    \
    c.field = *r_;                                 \
  } while (0)
  KV_READ_INT(n_layers, "block_count", -1, 1, 4096);
  KV_READ_INT(n_embd, "embedding_length", -1, 1, 1 << 20);
  KV_READ_INT(n_heads, "attention.head_count", -1, 1, 4096);
  KV_READ_INT(n_kv_heads, "attention.head_count_kv", c.n_heads, 1, 4096);
  KV_READ_INT(n_ff, "feed_forward_length", -1, 1, 1 << 22);
  KV_READ_INT(n_ctx_train, "context_length", 2048, 1, 1 << 24);
  KV_READ_INT(sliding_window, "attention.sliding_window", 0, 0, 1 << 24);
  if (c.n_embd % c.n_heads != 0 && f.find(a + "attention.key_length") == nullptr) {
    return bad(f, "embedding_length " + std::to_string(c.n_embd) +
                      " is not divisible by head_count " + std::to_string(c.n_heads));
  }
  KV_READ_INT(head_dim, "attention.key_length", c.n_embd / c.n_heads, 1, 4096);
  int value_length = 0;
  {
    auto r = read_int(f, a + "attention.value_length", c.head_dim, 1, 4096);
    if (!r) return r.error();
    value_length = *r;
  }
  if (value_length != c.head_dim) {
    return make_error(Errc::kUnsupported,
                      f.path() + ": key_length != value_length is not supported");
  }
  KV_READ_INT(n_rot, "rope.dimension_count", c.head_dim, 1, c.head_dim);
#undef KV_READ_INT
  if (c.n_heads % c.n_kv_heads != 0) {
    return bad(f, "head_count " + std::to_string(c.n_heads) +
                      " is not a multiple of head_count_kv " + std::to_string(c.n_kv_heads));
  }
  if (c.n_rot % 2 != 0) return bad(f, "rope.dimension_count must be even");

  // Vocabulary: <arch>.vocab_size, else the tokenizer's token list length.
  if (f.find(a + "vocab_size") != nullptr) {
    auto r = read_int(f, a + "vocab_size", -1, 1, 1 << 24);
    if (!r) return r.error();
    c.n_vocab = *r;
  } else if (const GgufValue* toks = f.find("tokenizer.ggml.tokens")) {
    c.n_vocab = static_cast<int>(toks->array.size());
  } else if (const GgufTensor* emb = f.find_tensor("token_embd.weight");
             emb && emb->dims.size() == 2) {
    c.n_vocab = static_cast<int>(emb->dims[1]);
  } else {
    return bad(f, "cannot determine the vocabulary size");
  }

  auto base = read_float(f, a + "rope.freq_base", 10000.0);
  if (!base) return base.error();
  c.rope_freq_base = *base;
  if (c.rope_freq_base <= 0) return bad(f, "rope.freq_base must be positive");
  c.rope_scaling_type = "none";
  if (f.find(a + "rope.scaling.type") != nullptr) {
    auto t = f.get_string(a + "rope.scaling.type");
    if (!t) return t.error();
    c.rope_scaling_type = *t;
  }
  if (c.rope_scaling_type == "linear") {
    auto factor = read_float(f, a + "rope.scaling.factor", 1.0);
    if (!factor) return factor.error();
    if (*factor <= 0) return bad(f, "rope.scaling.factor must be positive");
    c.rope_freq_scale = 1.0f / *factor;
  } else if (c.rope_scaling_type != "none") {
    return make_error(Errc::kUnsupported, f.path() + ": rope scaling type '" + c.rope_scaling_type +
                                              "' is not supported");
  }
  auto eps = read_float(f, a + "attention.layer_norm_rms_epsilon", 1e-5);
  if (!eps) return eps.error();
  c.norm_eps = *eps;
  if (!(c.norm_eps > 0)) return bad(f, "attention.layer_norm_rms_epsilon must be positive");

  c.rope_neox = c.arch == "qwen2" || c.arch == "gemma3";
  c.qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const auto n_layers = static_cast<size_t>(c.n_layers);
  c.layer_window.assign(n_layers, c.sliding_window);
  c.layer_rope_base.assign(n_layers, c.rope_freq_base);
  c.layer_rope_scale.assign(n_layers, c.rope_freq_scale);
  if (c.arch == "gemma3") KV_TRY_STATUS(apply_gemma3(f, c));
  return c;
}

}  // namespace kvstack

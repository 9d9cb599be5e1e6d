#include "model/config.h"

#include <algorithm>
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

// deepseek2, as llama.cpp reads it (models/deepseek2.cpp load_arch_hparams
// and graph; llama-context.cpp for the YaRN attention factor):
//  * per-head sizes: with attention.key_length_mla / value_length_mla (the
//    split attn_k_b / attn_v_b layout) those are qk_nope + qk_rope and v, and
//    key_length / value_length describe the latent (kv_lora + rope, kv_lora);
//    without them key_length = qk_nope + qk_rope and value_length = v;
//    qk_rope = rope.dimension_count; RoPE pairs adjacent dims (llama style);
//  * attention.q_lora_rank (0 or absent: attn_q), attention.kv_lora_rank;
//  * MoE: leading_dense_block_count, expert_count, expert_used_count,
//    expert_shared_count, expert_feed_forward_length, expert_weights_scale,
//    expert_weights_norm, expert_gating_func (absent: softmax);
//  * YaRN (rope.scaling.type "yarn"): freq_scale = 1/factor, ext_factor 1,
//    beta_fast 32, beta_slow 1, n_ctx_orig = original_context_length; the
//    rope magnitude is attn_factor * (1 + 0.1 ln(1/fs)) with llama.cpp's
//    attn_factor = rope.scaling.attn_factor / (1 + 0.1 ln factor) (its
//    mscale / mscale_all_dim ratio is 1 for deepseek2); the q.k scale is
//    mscale^2 / sqrt(qk_nope + qk_rope) with mscale = attn_factor (1 + 0.1
//    ln(1/fs)) (1 + 0.1 L ln(1/fs)), L = rope.scaling.yarn_log_multiplier / 0.1.
#define DS_ASSIGN(dst, expr)    \
  do {                          \
    auto r_ = (expr);           \
    if (!r_) return r_.error(); \
    (dst) = *r_;                \
  } while (0)
Status apply_deepseek2(const GgufFile& f, ModelConfig& c, int value_length) {
  const std::string a = "deepseek2.";
  auto geti = [&](const std::string& key, int64_t def, int64_t lo, int64_t hi) {
    return read_int(f, a + key, def, lo, hi);
  };
  ModelConfig::Mla& m = c.mla;
  DS_ASSIGN(m.q_lora_rank, geti("attention.q_lora_rank", 0, 0, 1 << 20));
  DS_ASSIGN(m.kv_lora_rank, geti("attention.kv_lora_rank", -1, 1, 1 << 20));
  m.qk_rope = c.n_rot;
  m.split_kv_b = f.find(a + "attention.key_length_mla") != nullptr;
  if (m.split_kv_b) {
    int k_mla = 0;
    DS_ASSIGN(k_mla, geti("attention.key_length_mla", -1, 2, 4096));
    DS_ASSIGN(m.v_head_dim, geti("attention.value_length_mla", -1, 1, 4096));
    if (c.head_dim != m.kv_lora_rank + m.qk_rope || value_length != m.kv_lora_rank) {
      return bad(f, "MLA key_length/value_length must be kv_lora_rank + rope dims / kv_lora_rank");
    }
    m.qk_nope = k_mla - m.qk_rope;
  } else {
    m.qk_nope = c.head_dim - m.qk_rope;
    m.v_head_dim = value_length;
  }
  if (m.qk_nope < 1) return bad(f, "deepseek2: key length must exceed rope.dimension_count");
  c.head_dim = std::max(m.qk_dim(), m.v_head_dim);
  c.n_kv_heads = c.n_heads;  // the expanded cache is MHA
  c.rope_neox = false;

  ModelConfig::Moe& e = c.moe;
  DS_ASSIGN(e.n_dense_lead, geti("leading_dense_block_count", 0, 0, c.n_layers));
  if (e.n_dense_lead < c.n_layers) {
    DS_ASSIGN(e.n_expert, geti("expert_count", -1, 1, 1 << 16));
    DS_ASSIGN(e.n_expert_used, geti("expert_used_count", -1, 1, e.n_expert));
    DS_ASSIGN(e.n_expert_shared, geti("expert_shared_count", -1, 0, 1 << 10));
    DS_ASSIGN(e.n_ff_exp, geti("expert_feed_forward_length", -1, 1, 1 << 22));
    int groups = 0;
    DS_ASSIGN(groups, geti("expert_group_count", 0, 0, 1 << 16));
    if (groups > 1) {
      return make_error(Errc::kUnsupported,
                        f.path() + ": expert groups (expert_group_count > 1) are not supported");
    }
    int gating = 0;
    DS_ASSIGN(gating, geti("expert_gating_func", 0, 0, 16));
    if (gating == 0) gating = 1;  // llama.cpp: absent means softmax (DeepSeek V2 files)
    if (gating > 3) {
      return make_error(Errc::kUnsupported, f.path() + ": expert_gating_func " +
                                                std::to_string(gating) + " is not supported");
    }
    e.gating = static_cast<ModelConfig::MoeGating>(gating);
    if (f.find(a + "expert_weights_norm") != nullptr) {
      auto v = f.get_bool(a + "expert_weights_norm");
      if (!v) return v.error();
      e.weights_norm = *v;
    }
    DS_ASSIGN(e.weights_scale, read_float(f, a + "expert_weights_scale", 0.0));
    if (e.weights_scale == 0.0f) e.weights_scale = 1.0f;  // llama.cpp: 0 or 1 = no scaling
  }

  // Attention factors (llama.cpp: cparams.yarn_attn_factor, graph kq_scale).
  float rope_attn = 1.0f;
  DS_ASSIGN(rope_attn, read_float(f, a + "rope.scaling.attn_factor", 1.0));
  float log_mul = 0.0f;
  DS_ASSIGN(log_mul, read_float(f, a + "rope.scaling.yarn_log_multiplier", 0.0));
  log_mul /= 0.1f;  // the converter stores 0.1 * mscale_all_dim
  const float fs = c.rope_freq_scale;
  float attn_factor = 1.0f;
  if (c.rope_scaling_type == "yarn") {
    const float factor = 1.0f / fs;
    const float get_mscale1 = factor <= 1.0f ? 1.0f : 0.1f * std::log(factor) + 1.0f;
    // log_mul != 0: get_mscale(f, m) / get_mscale(f, m_all) with m = m_all: 1.
    attn_factor = log_mul != 0.0f ? 1.0f : get_mscale1;
    attn_factor *= 1.0f / (1.0f + 0.1f * std::log(factor));
    c.yarn.enabled = true;
    DS_ASSIGN(c.yarn.n_ctx_orig,
              geti("rope.scaling.original_context_length", c.n_ctx_train, 1, 1 << 24));
    auto corr_dim = [&](float n_rot_beta) {
      return static_cast<float>(c.n_rot) *
             std::log(static_cast<float>(c.yarn.n_ctx_orig) /
                      (n_rot_beta * 2.0f * static_cast<float>(M_PI))) /
             (2.0f * std::log(c.rope_freq_base));
    };
    c.yarn.corr_lo = std::max(0.0f, std::floor(corr_dim(32.0f)));
    c.yarn.corr_hi = std::min(static_cast<float>(c.n_rot - 1), std::ceil(corr_dim(1.0f)));
  }
  attn_factor *= rope_attn;
  const float ln_inv_fs = std::log(1.0f / fs);
  c.yarn.rope_mscale = c.yarn.enabled ? attn_factor * (1.0f + 0.1f * ln_inv_fs) : attn_factor;
  const float attn_factor_org = attn_factor * (1.0f + 0.1f * ln_inv_fs);
  const float mscale = attn_factor_org * (1.0f + 0.1f * log_mul * ln_inv_fs);
  c.attn_scale = mscale * mscale / std::sqrt(static_cast<float>(m.qk_dim()));
  return {};
}
#undef DS_ASSIGN

}  // namespace

Result<ModelConfig> load_model_config(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) return arch.error();
  c.arch = *arch;
  if (c.arch != "llama" && c.arch != "qwen2" && c.arch != "gemma3" && c.arch != "deepseek2") {
    return make_error(Errc::kUnsupported,
                      f.path() + ": architecture '" + c.arch +
                          "' is not supported (supported: llama, qwen2, gemma3, deepseek2)");
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
  KV_READ_INT(shared_kv_layers, "attention.shared_kv_layers", 0, 0, c.n_layers - 1);
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
  if (value_length != c.head_dim && c.arch != "deepseek2") {
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
  } else if (c.rope_scaling_type == "yarn" && c.arch == "deepseek2") {
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
  if (c.arch == "deepseek2") {
    KV_TRY_STATUS(apply_deepseek2(f, c, value_length));
    c.layer_rope_scale.assign(n_layers, c.rope_freq_scale);
  }
  if (Status st = assign_kv_sharing(c); !st.ok()) return bad(f, st.error().message);
  return c;
}

Status assign_kv_sharing(ModelConfig& c) {
  const int first_shared = c.n_layers - c.shared_kv_layers;
  c.layer_kv_source.assign(static_cast<size_t>(c.n_layers), 0);
  c.layer_kv_index.assign(static_cast<size_t>(c.n_layers), 0);
  for (int l = 0; l < c.n_layers; ++l) {
    if (l < first_shared) {
      c.layer_kv_source[static_cast<size_t>(l)] = l;
      c.layer_kv_index[static_cast<size_t>(l)] = l;
      continue;
    }
    int src = first_shared - 1;
    while (src >= 0 && c.window(src) != c.window(l)) --src;
    if (src < 0) {
      return make_error(Errc::kInvalidArgument,
                        "attention.shared_kv_layers: layer " + std::to_string(l) + " (window " +
                            std::to_string(c.window(l)) +
                            ") has no earlier KV-storing layer with its window");
    }
    c.layer_kv_source[static_cast<size_t>(l)] = src;
    c.layer_kv_index[static_cast<size_t>(l)] = src;
  }
  return {};
}

}  // namespace kvstack

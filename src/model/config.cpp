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

}  // namespace

Result<ModelConfig> load_model_config(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) return arch.error();
  c.arch = *arch;
  if (c.arch != "llama" && c.arch != "qwen2") {
    return make_error(Errc::kUnsupported, f.path() + ": architecture '" + c.arch +
                                              "' is not supported (supported: llama, qwen2)");
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

  c.rope_neox = c.arch == "qwen2";
  c.qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  c.layer_window.assign(static_cast<size_t>(c.n_layers), c.sliding_window);
  return c;
}

}  // namespace kvstack

// deepseek2 tensor binding (Model::bind_deepseek2): tensor names and ggml
// shapes as llama.cpp's deepseek2 loader (models/deepseek2.cpp,
// load_arch_tensors), listed in tests/python/deepseek2_gen.py.
#include <algorithm>

#include "engine/model.h"
#include "model/dequant.h"

namespace kvstack {
namespace {

std::string shape_of(const GgufTensor& t) {
  std::string s;
  for (auto d : t.dims) s += (s.empty() ? "" : " x ") + std::to_string(d);
  return "[" + s + "]";
}

}  // namespace

// A 3-D expert tensor {n_in, n_out, n_expert}: one view per expert, each a
// contiguous [n_out, n_in] matrix of the file's type (dequantized to f32 once
// when the matmul has no kernel for it).
Result<std::vector<WeightView>> Model::experts(const std::string& name, int64_t n_in, int64_t n_out,
                                               int64_t n_expert) {
  const GgufTensor* t = file_.find_tensor(name);
  if (t == nullptr) {
    return make_error(Errc::kCorruptFile, file_.path() + ": missing tensor '" + name + "'");
  }
  if (t->dims.size() != 3 || t->dims[0] != n_in || t->dims[1] != n_out || t->dims[2] != n_expert) {
    return make_error(Errc::kCorruptFile, file_.path() + ": tensor '" + name + "' has shape " +
                                              shape_of(*t) + ", expected [" + std::to_string(n_in) +
                                              " x " + std::to_string(n_out) + " x " +
                                              std::to_string(n_expert) + "]");
  }
  std::vector<WeightView> out;
  out.reserve(static_cast<size_t>(n_expert));
  if (matmul_supported(t->type)) {
    const size_t bytes = ggml_row_bytes(t->type, n_in) * static_cast<size_t>(n_out);
    for (int64_t e = 0; e < n_expert; ++e) {
      out.push_back(WeightView{t->type, t->data + static_cast<size_t>(e) * bytes, n_in, n_out});
    }
    return out;
  }
  const int64_t n = n_in * n_out * n_expert;
  auto buf = std::make_unique<float[]>(static_cast<size_t>(n));
  KV_TRY_STATUS(dequantize_tensor(*t, buf.get()));
  dequantized_bytes_ += static_cast<uint64_t>(n) * sizeof(float);
  for (int64_t e = 0; e < n_expert; ++e) {
    out.push_back(WeightView{GgmlType::kF32,
                             reinterpret_cast<const uint8_t*>(buf.get() + e * n_in * n_out), n_in,
                             n_out});
  }
  owned_.push_back(std::move(buf));
  return out;
}

// The key/value up-projection as one [H * (nope + v), kv_lora] matrix. The
// kv_b layout is that matrix already; the split layout (attn_k_b {nope,
// kv_lora, H}: q_lat = W_kb q_nope per head, so k_nope = W_kb^T c; attn_v_b
// {kv_lora, v, H}: v = W_vb c) is rearranged into it in f32.
Result<WeightView> Model::mla_kv_b(const std::string& p) {
  const ModelConfig& c = config_;
  const int64_t H = c.n_heads, r = c.mla.kv_lora_rank, nope = c.mla.qk_nope;
  const int64_t vd = c.mla.v_head_dim;
  if (!c.mla.split_kv_b) return matrix(p + "attn_kv_b.weight", r, H * (nope + vd));
  const GgufTensor* kb = file_.find_tensor(p + "attn_k_b.weight");
  const GgufTensor* vb = file_.find_tensor(p + "attn_v_b.weight");
  for (const auto& [t, name, d0, d1] :
       {std::tuple{kb, "attn_k_b", nope, r}, std::tuple{vb, "attn_v_b", r, vd}}) {
    if (t == nullptr) {
      return make_error(Errc::kCorruptFile,
                        file_.path() + ": missing tensor '" + p + name + ".weight'");
    }
    if (t->dims.size() != 3 || t->dims[0] != d0 || t->dims[1] != d1 || t->dims[2] != H) {
      return make_error(Errc::kCorruptFile,
                        file_.path() + ": tensor '" + p + name + ".weight' has shape " +
                            shape_of(*t) + ", expected [" + std::to_string(d0) + " x " +
                            std::to_string(d1) + " x " + std::to_string(H) + "]");
    }
  }
  std::vector<float> k(static_cast<size_t>(H * r * nope)), v(static_cast<size_t>(H * vd * r));
  KV_TRY_STATUS(dequantize_tensor(*kb, k.data()));
  KV_TRY_STATUS(dequantize_tensor(*vb, v.data()));
  const int64_t rows = H * (nope + vd);
  auto buf = std::make_unique<float[]>(static_cast<size_t>(rows * r));
  for (int64_t h = 0; h < H; ++h) {
    float* dst = buf.get() + h * (nope + vd) * r;
    const float* kh = k.data() + h * r * nope;  // [kv_lora][nope]
    for (int64_t i = 0; i < nope; ++i) {
      for (int64_t j = 0; j < r; ++j) dst[i * r + j] = kh[j * nope + i];
    }
    std::copy_n(v.data() + h * vd * r, vd * r, dst + nope * r);  // [v][kv_lora]
  }
  dequantized_bytes_ += static_cast<uint64_t>(rows * r) * sizeof(float);
  WeightView w{GgmlType::kF32, reinterpret_cast<const uint8_t*>(buf.get()), r, rows};
  owned_.push_back(std::move(buf));
  return w;
}

Status Model::bind_deepseek2() {
  const ModelConfig& c = config_;
  const ModelConfig::Mla& m = c.mla;
  const ModelConfig::Moe& e = c.moe;
  const int64_t H = c.n_heads;
#define KV_BIND(dst, expr)      \
  do {                          \
    auto r_ = (expr);           \
    if (!r_) return r_.error(); \
    (dst) = *r_;                \
  } while (0)
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights& l = layers_[static_cast<size_t>(i)];
    KV_BIND(l.attn_norm, vector_f32(p + "attn_norm.weight", c.n_embd));
    if (m.q_lora_rank > 0) {
      KV_BIND(l.mla.wq_a, matrix(p + "attn_q_a.weight", c.n_embd, m.q_lora_rank));
      KV_BIND(l.mla.q_a_norm, vector_f32(p + "attn_q_a_norm.weight", m.q_lora_rank));
      KV_BIND(l.mla.wq_b, matrix(p + "attn_q_b.weight", m.q_lora_rank, H * m.qk_dim()));
    } else {
      KV_BIND(l.wq, matrix(p + "attn_q.weight", c.n_embd, H * m.qk_dim()));
    }
    KV_BIND(l.mla.wkv_a, matrix(p + "attn_kv_a_mqa.weight", c.n_embd, m.kv_lora_rank + m.qk_rope));
    KV_BIND(l.mla.kv_a_norm, vector_f32(p + "attn_kv_a_norm.weight", m.kv_lora_rank));
    KV_BIND(l.mla.wkv_b, mla_kv_b(p));
    KV_BIND(l.wo, matrix(p + "attn_output.weight", H * m.v_head_dim, c.n_embd));
    KV_BIND(l.ffn_norm, vector_f32(p + "ffn_norm.weight", c.n_embd));
    if (!c.is_moe_layer(i)) {
      KV_BIND(l.w_gate, matrix(p + "ffn_gate.weight", c.n_embd, c.n_ff));
      KV_BIND(l.w_up, matrix(p + "ffn_up.weight", c.n_embd, c.n_ff));
      KV_BIND(l.w_down, matrix(p + "ffn_down.weight", c.n_ff, c.n_embd));
      continue;
    }
    MoeWeights& w = l.moe;
    KV_BIND(w.router, matrix(p + "ffn_gate_inp.weight", c.n_embd, e.n_expert));
    KV_BIND(w.probs_bias, vector_f32(p + "exp_probs_b.bias", e.n_expert, false));
    KV_BIND(w.gate, experts(p + "ffn_gate_exps.weight", c.n_embd, e.n_ff_exp, e.n_expert));
    KV_BIND(w.up, experts(p + "ffn_up_exps.weight", c.n_embd, e.n_ff_exp, e.n_expert));
    KV_BIND(w.down, experts(p + "ffn_down_exps.weight", e.n_ff_exp, c.n_embd, e.n_expert));
    if (e.n_expert_shared > 0) {
      const int64_t ff = static_cast<int64_t>(e.n_ff_exp) * e.n_expert_shared;
      KV_BIND(w.sh_gate, matrix(p + "ffn_gate_shexp.weight", c.n_embd, ff));
      KV_BIND(w.sh_up, matrix(p + "ffn_up_shexp.weight", c.n_embd, ff));
      KV_BIND(w.sh_down, matrix(p + "ffn_down_shexp.weight", ff, c.n_embd));
    }
  }
#undef KV_BIND
  return {};
}

}  // namespace kvstack

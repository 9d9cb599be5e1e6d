#include "engine/deepseek2.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "attention/mla_attention.h"
#include "kv/kv_codec.h"
#include "model/dequant.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"

namespace kvstack {

void moe_route(const float* logits, const MoeRouteParams& p, int32_t* ids, float* weights) {
  const int n = p.n_expert;
  thread_local std::vector<float> probs, sel;
  thread_local std::vector<int32_t> order;
  probs.assign(logits, logits + n);
  if (p.gating == ModelConfig::MoeGating::kSoftmax) {
    const float mx = *std::max_element(probs.begin(), probs.end());
    double sum = 0;
    for (float& v : probs) {
      v = std::exp(v - mx);
      sum += v;
    }
    for (float& v : probs) v = static_cast<float>(v / sum);
  } else if (p.gating == ModelConfig::MoeGating::kSigmoid) {
    for (float& v : probs) v = 1.0f / (1.0f + std::exp(-v));
  }
  sel = probs;
  if (p.bias != nullptr) {
    for (int e = 0; e < n; ++e) sel[static_cast<size_t>(e)] += p.bias[e];
  }
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(
      order.begin(), order.begin() + p.n_used, order.end(), [&](int32_t a, int32_t b) {
        const float sa = sel[static_cast<size_t>(a)], sb = sel[static_cast<size_t>(b)];
        return sa > sb || (sa == sb && a < b);
      });
  for (int k = 0; k < p.n_used; ++k) {
    ids[k] = order[static_cast<size_t>(k)];
    weights[k] = probs[static_cast<size_t>(ids[k])];
  }
  if (p.gating == ModelConfig::MoeGating::kSoftmaxWeight) {
    const float mx = *std::max_element(weights, weights + p.n_used);
    double sum = 0;
    for (int k = 0; k < p.n_used; ++k) {
      weights[k] = std::exp(weights[k] - mx);
      sum += weights[k];
    }
    for (int k = 0; k < p.n_used; ++k) weights[k] = static_cast<float>(weights[k] / sum);
  }
  if (p.norm) {
    float sum = 0;
    for (int k = 0; k < p.n_used; ++k) sum += weights[k];
    sum = std::max(sum, 6.103515625e-5f);  // llama.cpp's clamp (smallest normal f16)
    for (int k = 0; k < p.n_used; ++k) weights[k] /= sum;
  }
  if (p.scale != 1.0f) {
    for (int k = 0; k < p.n_used; ++k) weights[k] *= p.scale;
  }
}

void rope_yarn_rows(float* x, int64_t n_rows, int64_t stride, int64_t rows_per_pos,
                    const int32_t* pos, const ModelConfig& c) {
  const int n_rot = c.n_rot;
  const float fs = c.rope_freq_scale;
  const float theta_scale = std::pow(c.rope_freq_base, -2.0f / static_cast<float>(n_rot));
  const ModelConfig::Yarn& y = c.yarn;
  std::vector<float> cs(static_cast<size_t>(n_rot));
  int64_t last = -1;
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t t = r / rows_per_pos;
    if (t != last) {
      // As ggml_rope_cache_init + rope_yarn (ggml-cpu ops.cpp), in float.
      float theta = static_cast<float>(pos[t]);
      for (int i0 = 0; i0 < n_rot; i0 += 2) {
        float th = fs * theta;
        if (y.enabled) {
          const int pair = i0 / 2;  // ggml's rope_yarn_ramp: integer i0 / 2
          const float ramp_y =
              (static_cast<float>(pair) - y.corr_lo) / std::max(0.001f, y.corr_hi - y.corr_lo);
          const float mix = 1.0f - std::min(1.0f, std::max(0.0f, ramp_y));
          th = th * (1.0f - mix) + theta * mix;
        }
        cs[static_cast<size_t>(i0)] = std::cos(th) * y.rope_mscale;
        cs[static_cast<size_t>(i0) + 1] = std::sin(th) * y.rope_mscale;
        theta *= theta_scale;
      }
      last = t;
    }
    float* v = x + r * stride;
    for (int i0 = 0; i0 < n_rot; i0 += 2) {
      const float co = cs[static_cast<size_t>(i0)], si = cs[static_cast<size_t>(i0) + 1];
      const float x0 = v[i0], x1 = v[i0 + 1];
      v[i0] = x0 * co - x1 * si;
      v[i0 + 1] = x0 * si + x1 * co;
    }
  }
}

MlaPrefill mla_prefill_mode() {
  static const MlaPrefill mode = [] {
    const char* e = std::getenv("KVSTACK_MLA_PREFILL");
    if (e == nullptr) return MlaPrefill::kAuto;
    const std::string v = e;
    if (v == "absorbed") return MlaPrefill::kAbsorbed;
    if (v == "expanded") return MlaPrefill::kExpanded;
    if (v != "auto" && !v.empty()) {
      std::fprintf(
          stderr, "kvstack: KVSTACK_MLA_PREFILL=%s is not auto, absorbed or expanded; using auto\n",
          e);
    }
    return MlaPrefill::kAuto;
  }();
  return mode;
}

std::string deepseek2_kernel_summary(const ModelConfig& c, bool latent) {
  const ModelConfig::Mla& m = c.mla;
  const std::string lat = std::to_string(m.kv_lora_rank) + "+" + std::to_string(m.qk_rope);
  const MlaPrefill pm = mla_prefill_mode();
  const std::string prefill =
      pm == MlaPrefill::kAuto
          ? "prefill chunks of >= " + std::to_string(kMlaExpandMinRows) +
                " rows over >= " + std::to_string(kMlaExpandMinKeys) + " keys expanded, "
      : pm == MlaPrefill::kExpanded ? std::string("prefill expanded (KVSTACK_MLA_PREFILL), ")
                                    : std::string("prefill absorbed (KVSTACK_MLA_PREFILL), ");
  std::string s =
      latent ? "mla: latent cache, absorbed attention, " + lat + " per token shared by " +
                   std::to_string(c.n_heads) + " heads (" + prefill
             : "mla: expanded to per-head K/V (" + std::to_string(c.n_heads) + " heads, cached " +
                   std::to_string(c.head_dim) + " per head; latent " + lat + ", ";
  s += "k " + std::to_string(m.qk_nope) + "+" + std::to_string(m.qk_rope) + ", v " +
       std::to_string(m.v_head_dim) + ", " + (m.split_kv_b ? "attn_k_b/attn_v_b" : "attn_kv_b") +
       ", " + (m.q_lora_rank > 0 ? "q low-rank " + std::to_string(m.q_lora_rank) : "attn_q") +
       (c.yarn.enabled ? ", yarn" : "") + ")";
  const ModelConfig::Moe& e = c.moe;
  if (e.n_expert > 0) {
    const char* g = e.gating == ModelConfig::MoeGating::kSigmoid         ? "sigmoid"
                    : e.gating == ModelConfig::MoeGating::kSoftmaxWeight ? "softmax_weight"
                                                                         : "softmax";
    char scale[32];
    std::snprintf(scale, sizeof scale, "%g", static_cast<double>(e.weights_scale));
    s += "; moe: top-" + std::to_string(e.n_expert_used) + " of " + std::to_string(e.n_expert) +
         " experts (" + g + (e.weights_norm ? ", normalised" : "") + ", scale " + scale + ", " +
         std::to_string(e.n_expert_shared) + " shared) in layers " +
         std::to_string(e.n_dense_lead) + "-" + std::to_string(c.n_layers - 1);
  }
  return s;
}

void Deepseek2Layers::project_q_kv_a(const LayerWeights& w, const float* h, int64_t n_tok,
                                     bool kv) {
  const ModelConfig& c = model_.config();
  const ModelConfig::Mla& m = c.mla;
  const auto n = static_cast<size_t>(n_tok);
  qfull_.resize(n * static_cast<size_t>(c.n_heads * m.qk_dim()));
  if (m.q_lora_rank > 0) {
    qa_.resize(n * static_cast<size_t>(m.q_lora_rank));
    matmul(w.mla.wq_a, h, n_tok, qa_.data(), &threads_);
    rms_norm(qa_.data(), w.mla.q_a_norm, n_tok, m.q_lora_rank, c.norm_eps, qa_.data());
    matmul(w.mla.wq_b, qa_.data(), n_tok, qfull_.data(), &threads_);
  } else {
    matmul(w.wq, h, n_tok, qfull_.data(), &threads_);
  }
  if (!kv) return;
  kva_.resize(n * static_cast<size_t>(m.kv_lora_rank + m.qk_rope));
  matmul(w.mla.wkv_a, h, n_tok, kva_.data(), &threads_);
}

void Deepseek2Layers::qkv(int layer, const float* h, int64_t n_tok, const int32_t* pos, float* q,
                          float* k, float* v) {
  const ModelConfig& c = model_.config();
  const ModelConfig::Mla& m = c.mla;
  const LayerWeights& w = model_.layers()[static_cast<size_t>(layer)];
  const int64_t H = c.n_heads, hd = c.head_dim, dqk = m.qk_dim(), nope = m.qk_nope;
  const int64_t rope = m.qk_rope, r = m.kv_lora_rank, vd = m.v_head_dim;
  const auto n = static_cast<size_t>(n_tok);
  project_q_kv_a(w, h, n_tok);
  lat_.resize(n * static_cast<size_t>(r));
  for (int64_t t = 0; t < n_tok; ++t) {
    rms_norm(kva_.data() + t * (r + rope), w.mla.kv_a_norm, r, c.norm_eps, lat_.data() + t * r);
  }
  kv_.resize(n * static_cast<size_t>(H * (nope + vd)));
  matmul(w.mla.wkv_b, lat_.data(), n_tok, kv_.data(), &threads_);
  // RoPE: every head's q_rope part, and the one shared key part per token.
  rope_yarn_rows(qfull_.data() + nope, n_tok * H, dqk, H, pos, c);
  rope_yarn_rows(kva_.data() + r, n_tok, r + rope, 1, pos, c);
  std::fill_n(q, n_tok * H * hd, 0.0f);
  std::fill_n(k, n_tok * H * hd, 0.0f);
  std::fill_n(v, n_tok * H * hd, 0.0f);
  for (int64_t t = 0; t < n_tok; ++t) {
    const float* k_rope = kva_.data() + t * (r + rope) + r;
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t row = (t * H + hh) * hd;
      const float* kvh = kv_.data() + (t * H + hh) * (nope + vd);
      std::copy_n(qfull_.data() + (t * H + hh) * dqk, dqk, q + row);
      std::copy_n(kvh, nope, k + row);
      std::copy_n(k_rope, rope, k + row + nope);
      std::copy_n(kvh + nope, vd, v + row);
    }
  }
}

Status Deepseek2Layers::latent_attention(int layer, std::span<const StepSeq> batch, const float* h,
                                         int64_t n_tok, const int32_t* pos, float* out,
                                         int64_t* rejected) {
  const ModelConfig& c = model_.config();
  const ModelConfig::Mla& m = c.mla;
  const LayerWeights& w = model_.layers()[static_cast<size_t>(layer)];
  const int64_t H = c.n_heads, dqk = m.qk_dim(), nope = m.qk_nope, rope = m.qk_rope;
  const int64_t r = m.kv_lora_rank, vd = m.v_head_dim, dl = r + rope;
  const auto n = static_cast<size_t>(n_tok);
  // Cross-layer sharing (config.h): a shared layer reads the latent rows of
  // its source layer kl, which this step has already written, and uses the
  // source's up-projection W_kv_b (so it attends over exactly the source's
  // K/V, as with the expanded cache); it computes only its own q.
  const bool shared = !c.stores_kv(layer);
  const int kl = c.kv_index(layer);
  // q, the latent and the RoPE key, from the same projections as qkv().
  project_q_kv_a(w, h, n_tok, !shared);
  if (!shared) {
    rows_.resize(n * static_cast<size_t>(dl));
    for (int64_t t = 0; t < n_tok; ++t) {
      rms_norm(kva_.data() + t * dl, w.mla.kv_a_norm, r, c.norm_eps, rows_.data() + t * dl);
      std::copy_n(kva_.data() + t * dl + r, rope, rows_.data() + t * dl + r);
    }
    rope_yarn_rows(rows_.data() + r, n_tok, dl, 1, pos, c);
  }
  rope_yarn_rows(qfull_.data() + nope, n_tok * H, dqk, H, pos, c);

  // W_kvb in f32 once: rows h*(nope+v) + i (i < nope) are W_UK,h, then W_UV,h;
  // and W_UK,h^T [r][nope] per head, so both up-projections are matmuls.
  if (wkv_b_f32_.empty()) {
    wkv_b_f32_.resize(static_cast<size_t>(c.n_layers));
    wuk_t_f32_.resize(static_cast<size_t>(c.n_layers));
    wkv_b_t_f32_.resize(static_cast<size_t>(c.n_layers));
  }
  std::vector<float>& wb = wkv_b_f32_[static_cast<size_t>(kl)];
  std::vector<float>& wkt = wuk_t_f32_[static_cast<size_t>(kl)];
  if (wb.empty()) {
    const WeightView& kvb = model_.layers()[static_cast<size_t>(kl)].mla.wkv_b;
    wb.resize(static_cast<size_t>(kvb.n_out * kvb.n_in));
    const size_t rb = ggml_row_bytes(kvb.type, kvb.n_in);
    for (int64_t i = 0; i < kvb.n_out; ++i) {
      dequantize_row(kvb.type, kvb.data + static_cast<size_t>(i) * rb, wb.data() + i * kvb.n_in,
                     kvb.n_in);
    }
    wkt.resize(static_cast<size_t>(H * r * nope));
    for (int64_t hh = 0; hh < H; ++hh) {
      for (int64_t i = 0; i < nope; ++i) {
        for (int64_t j = 0; j < r; ++j) {
          wkt[static_cast<size_t>((hh * r + j) * nope + i)] =
              wb[static_cast<size_t>((hh * (nope + vd) + i) * r + j)];
        }
      }
    }
  }
  auto f32_view = [](const float* data, int64_t n_out, int64_t n_in) {
    return WeightView{.type = GgmlType::kF32,
                      .data = reinterpret_cast<const uint8_t*>(data),
                      .n_in = n_in,
                      .n_out = n_out};
  };
  // Which sequences run expanded (mla_prefer_expanded; KVSTACK_MLA_PREFILL
  // overrides), and the token rows of the others, which run absorbed.
  const MlaPrefill mode = mla_prefill_mode();
  std::vector<char> expanded(batch.size(), 0);
  abs_rows_.clear();
  {
    int64_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto nn = static_cast<int32_t>(batch[i].tokens.size());
      const auto past = static_cast<int32_t>(batch[i].table->length());
      expanded[i] = static_cast<char>(mode == MlaPrefill::kAuto ? mla_prefer_expanded(past, nn)
                                      : mode == MlaPrefill::kExpanded ? nn > 1
                                                                      : false);
      if (expanded[i] == 0) {
        for (int32_t t = 0; t < nn; ++t) abs_rows_.push_back(row + t);
      }
      row += nn;
    }
  }
  const auto n_abs = static_cast<int64_t>(abs_rows_.size());
  // Absorb W_UK into the query: q_abs,h = [W_UK,h^T q_nope,h ; q_rope,h], one
  // f32 matmul per head over the absorbed rows (gathered to contiguous rows).
  q_abs_.resize(n * static_cast<size_t>(H * dl));
  head_in_.resize(n * static_cast<size_t>(std::max(nope, r)));
  head_out_.resize(n * static_cast<size_t>(std::max(r, vd)));
  for (int64_t hh = 0; hh < H && n_abs > 0; ++hh) {
    for (int64_t a = 0; a < n_abs; ++a) {
      const int64_t t = abs_rows_[static_cast<size_t>(a)];
      std::copy_n(qfull_.data() + (t * H + hh) * dqk, nope, head_in_.data() + a * nope);
    }
    matmul(f32_view(wkt.data() + hh * r * nope, r, nope), head_in_.data(), n_abs, head_out_.data(),
           &threads_);
    for (int64_t a = 0; a < n_abs; ++a) {
      const int64_t t = abs_rows_[static_cast<size_t>(a)];
      float* qa = q_abs_.data() + (t * H + hh) * dl;
      std::copy_n(head_out_.data() + a * r, r, qa);
      std::copy_n(qfull_.data() + (t * H + hh) * dqk + nope, rope, qa + r);
    }
  }

  // Check every sequence's rows, then write them and attend.
  const PagedKvLayerView view = batch.front().table->pool().layer_view(kl);
  int64_t row = 0;
  for (size_t i = 0; i < batch.size() && !shared; ++i) {
    const auto nn = static_cast<int64_t>(batch[i].tokens.size());
    const Status st =
        kv_validate_rows(view, batch[i].table->length(), rows_.data() + row * dl, nullptr, nn);
    if (!st.ok()) {
      *rejected = static_cast<int64_t>(i);
      return make_error(st.error().code, "layer " + std::to_string(layer) + ", step entry " +
                                             std::to_string(i) + ": " + st.error().message);
    }
    row += nn;
  }
  o_lat_.resize(n * static_cast<size_t>(H * r));
  std::vector<AttnSeq> seqs, exp_seqs;
  seqs.reserve(batch.size());
  row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSeq& s = batch[i];
    const auto nn = static_cast<int64_t>(s.tokens.size());
    if (!shared) s.table->write(kl, s.table->length(), rows_.data() + row * dl, nullptr, nn);
    const std::span<const int32_t> ids = s.table->ids_for_layer(kl);
    AttnSeq a{.block_table = ids.data(),
              .n_blocks = static_cast<int32_t>(ids.size()),
              .n_past = static_cast<int32_t>(s.table->length()),
              .n_new = static_cast<int32_t>(nn),
              .q = q_abs_.data() + row * H * dl,
              .out = o_lat_.data() + row * H * r};
    if (expanded[i] != 0) {
      // Unabsorbed q (RoPE applied above); the output lands in out directly.
      a.q = qfull_.data() + row * H * dqk;
      a.out = out + row * H * vd;
      exp_seqs.push_back(a);
    } else {
      seqs.push_back(a);
    }
    row += nn;
  }
  const MlaAttnParams ap{.n_heads = c.n_heads,
                         .latent_dim = m.kv_lora_rank,
                         .rope_dim = m.qk_rope,
                         .scale = c.attn_scale};
  if (!exp_seqs.empty()) {
    // W_kv_b^T [r][H (nope + v)] for the expansion, built on first use.
    std::vector<float>& wbt = wkv_b_t_f32_[static_cast<size_t>(kl)];
    if (wbt.empty()) {
      const int64_t cols = H * (nope + vd);
      wbt.resize(static_cast<size_t>(r * cols));
      for (int64_t o = 0; o < cols; ++o) {
        for (int64_t j = 0; j < r; ++j) {
          wbt[static_cast<size_t>(j * cols + o)] = wb[static_cast<size_t>(o * r + j)];
        }
      }
    }
    const MlaUpProjection up{
        .w_kv_b_t = wbt.data(), .qk_nope = static_cast<int>(nope), .v_dim = static_cast<int>(vd)};
    KV_TRY_STATUS(mla_attention_expanded(view, ap, up, exp_seqs, &threads_));
  }
  if (n_abs == 0) return {};
  KV_TRY_STATUS(mla_attention(view, ap, seqs, &threads_));
  // W_UV after the weighted sum: out_h = W_UV,h o_lat,h (a matmul per head).
  for (int64_t hh = 0; hh < H; ++hh) {
    for (int64_t a = 0; a < n_abs; ++a) {
      const int64_t t = abs_rows_[static_cast<size_t>(a)];
      std::copy_n(o_lat_.data() + (t * H + hh) * r, r, head_in_.data() + a * r);
    }
    matmul(f32_view(wb.data() + (hh * (nope + vd) + nope) * r, vd, r), head_in_.data(), n_abs,
           head_out_.data(), &threads_);
    for (int64_t a = 0; a < n_abs; ++a) {
      const int64_t t = abs_rows_[static_cast<size_t>(a)];
      std::copy_n(head_out_.data() + a * vd, vd, out + (t * H + hh) * vd);
    }
  }
  return {};
}

void Deepseek2Layers::compact_attention(float* attn, int64_t n_tok) const {
  const ModelConfig& c = model_.config();
  const int64_t hd = c.head_dim, vd = c.mla.v_head_dim, rows = n_tok * c.n_heads;
  if (hd == vd) return;
  // Destination index <= source index: forward in-place copy is safe.
  for (int64_t i = 0; i < rows; ++i) std::copy_n(attn + i * hd, vd, attn + i * vd);
}

void Deepseek2Layers::moe(int layer, const float* h, int64_t n_tok, float* out) {
  const ModelConfig& c = model_.config();
  const ModelConfig::Moe& e = c.moe;
  const MoeWeights& w = model_.layers()[static_cast<size_t>(layer)].moe;
  const MoeRouteParams rp{.gating = e.gating,
                          .n_expert = e.n_expert,
                          .n_used = e.n_expert_used,
                          .norm = e.weights_norm,
                          .scale = e.weights_scale,
                          .bias = w.probs_bias};
  moe_forward(w, rp, h, n_tok, out, moe_, &threads_);
}

void moe_forward(const MoeWeights& w, const MoeRouteParams& p, const float* h, int64_t n_tok,
                 float* out, MoeScratch& s, ThreadPool* pool) {
  const int64_t d = w.router.n_in, E = p.n_expert, K = p.n_used;
  const auto n = static_cast<size_t>(n_tok);
  s.logits.resize(n * static_cast<size_t>(E));
  matmul(w.router, h, n_tok, s.logits.data(), pool);
  s.ids.resize(n * static_cast<size_t>(K));
  s.wts.resize(n * static_cast<size_t>(K));
  for (int64_t t = 0; t < n_tok; ++t) {
    moe_route(s.logits.data() + t * E, p, s.ids.data() + t * K, s.wts.data() + t * K);
  }
  // Shared experts first (llama.cpp adds them to the routed sum; the order of
  // the float additions per element is the only difference).
  if (w.sh_gate.data != nullptr) {
    const int64_t ff = w.sh_gate.n_out;
    s.gate.resize(n * static_cast<size_t>(ff));
    s.up.resize(n * static_cast<size_t>(ff));
    matmul(w.sh_gate, h, n_tok, s.gate.data(), pool);
    matmul(w.sh_up, h, n_tok, s.up.data(), pool);
    swiglu(s.gate.data(), s.up.data(), s.gate.data(), n_tok * ff);
    matmul(w.sh_down, s.gate.data(), n_tok, out, pool);
  } else {
    std::fill_n(out, n_tok * d, 0.0f);
  }
  // Routed experts: gather the tokens of each expert, run it once on them.
  for (int64_t ex = 0; ex < E; ++ex) {
    s.rows.clear();
    for (int64_t i = 0; i < n_tok * K; ++i) {
      if (s.ids[static_cast<size_t>(i)] == ex) s.rows.push_back(static_cast<int32_t>(i));
    }
    if (s.rows.empty()) continue;
    const auto m = static_cast<int64_t>(s.rows.size());
    const WeightView& wg = w.gate[static_cast<size_t>(ex)];
    const int64_t F = wg.n_out;
    s.xg.resize(static_cast<size_t>(m * d));
    for (int64_t j = 0; j < m; ++j) {
      std::copy_n(h + (s.rows[static_cast<size_t>(j)] / K) * d, d, s.xg.data() + j * d);
    }
    s.gate.resize(static_cast<size_t>(m * F));
    s.up.resize(static_cast<size_t>(m * F));
    s.down.resize(static_cast<size_t>(m * d));
    matmul(wg, s.xg.data(), m, s.gate.data(), pool);
    matmul(w.up[static_cast<size_t>(ex)], s.xg.data(), m, s.up.data(), pool);
    swiglu(s.gate.data(), s.up.data(), s.gate.data(), m * F);
    matmul(w.down[static_cast<size_t>(ex)], s.gate.data(), m, s.down.data(), pool);
    for (int64_t j = 0; j < m; ++j) {
      const int32_t i = s.rows[static_cast<size_t>(j)];
      const float wt = s.wts[static_cast<size_t>(i)];
      float* o = out + (i / K) * d;
      const float* dj = s.down.data() + j * d;
      for (int64_t x = 0; x < d; ++x) o[x] += wt * dj[x];
    }
  }
}

}  // namespace kvstack

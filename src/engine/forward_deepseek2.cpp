// Forward::mla_latent_layer: one deepseek2 layer whose KV layer is an MLA
// latent (--kv-mla latent). Attention in latent space (Deepseek2Layers::
// latent_attention), then the output projection, residual and FFN (dense for
// the leading layers, MoE after) as Forward::layer does for the expanded
// cache. Kept apart from forward.cpp so the shared layer code stays as it is.
#include "engine/deepseek2.h"
#include "engine/forward.h"
#include "ops/elementwise.h"

namespace kvstack {

Status Forward::mla_latent_layer(int l, std::span<const StepSeq> batch, int64_t n_tok) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers()[static_cast<size_t>(l)];
  KV_TRY_STATUS(deepseek2_->latent_attention(l, batch, h_.data(), n_tok, pos_.data(), attn_.data(),
                                             &rejected_entry_));
  matmul(w.wo, attn_.data(), n_tok, h_.data(), &threads_);
  add(x_.data(), h_.data(), x_.data(), n_tok * c.n_embd);
  rms_norm(x_.data(), w.ffn_norm, n_tok, c.n_embd, c.norm_eps, h_.data());
  if (c.is_moe_layer(l)) {
    deepseek2_->moe(l, h_.data(), n_tok, attn_.data());
  } else {
    matmul(w.w_gate, h_.data(), n_tok, gate_.data(), &threads_);
    matmul(w.w_up, h_.data(), n_tok, up_.data(), &threads_);
    swiglu(gate_.data(), up_.data(), gate_.data(), n_tok * c.n_ff);
    matmul(w.w_down, gate_.data(), n_tok, attn_.data(), &threads_);
  }
  add(x_.data(), attn_.data(), x_.data(), n_tok * c.n_embd);
  return {};
}

}  // namespace kvstack

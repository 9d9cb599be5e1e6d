// deepseek2 layer math for Forward (forward.cpp calls it for arch deepseek2):
// MLA attention projected into the expanded per-head Q/K/V rows that the
// paged KV cache and attention kernels take, YaRN RoPE of the decoupled key,
// and the MoE FFN. Facts as llama.cpp's deepseek2 graph (models/deepseek2.cpp)
// and build_moe_ffn (llama-graph.cpp).
//
// MLA, per token t and head h (d_c = kv_lora_rank, d_R = qk_rope):
//   q_t      = W_q x_t, or W_qb rmsnorm(W_qa x_t)            [H][nope + rope]
//   [c; k_R] = W_kva x_t; c = rmsnorm(c)                     d_c, d_R (k_R shared by every head)
//   [k_nope; v]_h = W_kvb,h c                                [nope], [v]
//   K_h = [k_nope_h ; rope(k_R)], Q_h = [q_nope_h ; rope(q_rope_h)], V_h = v_h,
// each zero-padded to ModelConfig::head_dim; softmax scale ModelConfig::attn_scale.
//
// Thread-safety: one object per Forward, driven by its thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <span>

#include "core/thread_pool.h"
#include "engine/forward.h"
#include "engine/model.h"

namespace kvstack {

struct MoeRouteParams {
  ModelConfig::MoeGating gating = ModelConfig::MoeGating::kSoftmax;
  int n_expert = 0;
  int n_used = 0;               // k
  bool norm = false;            // divide the k weights by their sum (clamped to >= 2^-14)
  float scale = 1.0f;           // then multiply by this
  const float* bias = nullptr;  // [n_expert] added to the probabilities for selection only
};

// Routes one token from its router logits [n_expert]: ids[n_used] are the
// experts with the largest selection scores, best first, ties going to the
// lower index; weights[n_used] their weights (see ModelConfig::Moe).
void moe_route(const float* logits, const MoeRouteParams& p, int32_t* ids, float* weights);

// Scratch buffers of moe_forward, reused across calls.
struct MoeScratch {
  std::vector<float> logits, wts, xg, gate, up, down;
  std::vector<int32_t> ids, rows;
};

// The MoE FFN: out[n_tok, d] = shared experts' SwiGLU(h) + sum over each
// token's routed experts of weight * SwiGLU_e(h), h [n_tok, d] (d = the
// router's n_in). Each expert runs once on the tokens routed to it.
// REQUIRES: w matches p (n_expert views, router [n_expert, d]); out != h.
void moe_forward(const MoeWeights& w, const MoeRouteParams& p, const float* h, int64_t n_tok,
                 float* out, MoeScratch& s, ThreadPool* pool);

// YaRN / plain RoPE over n_rot dims of n_rows vectors: row r is x + r * stride
// and is rotated at position pos[r / rows_per_pos]; adjacent pairs (x[2i],
// x[2i+1]) as ggml's GGML_ROPE_TYPE_NORM with ext_factor 1 when yarn.enabled.
void rope_yarn_rows(float* x, int64_t n_rows, int64_t stride, int64_t rows_per_pos,
                    const int32_t* pos, const ModelConfig& c);

// How the latent cache's prefill chunks run: kAuto picks per sequence by
// mla_prefer_expanded() (attention/mla_attention.h); the environment variable
// KVSTACK_MLA_PREFILL=absorbed|expanded|auto (read once) forces a form, for
// measurements (expanded: every chunk of more than one row).
enum class MlaPrefill { kAuto, kAbsorbed, kExpanded };
MlaPrefill mla_prefill_mode();

// For the load line: "mla: expanded to per-head K/V (...); moe: top-k of E
// experts (gating, ...)".
// latent: the KV cache holds latent rows (--kv-mla latent), else expanded K/V.
std::string deepseek2_kernel_summary(const ModelConfig& c, bool latent = false);

class Deepseek2Layers {
 public:
  Deepseek2Layers(const Model& model, ThreadPool& threads) : model_(model), threads_(threads) {}

  // h [n_tok, n_embd] (after attn_norm) -> q, k, v [n_tok, n_heads, head_dim]
  // at positions pos[n_tok], RoPE applied, padding zero.
  void qkv(int layer, const float* h, int64_t n_tok, const int32_t* pos, float* q, float* k,
           float* v);
  // MLA with the latent cache (layer l's pool view is a kMlaLatent layer,
  // --kv-mla latent): h [n_tok, n_embd] (after attn_norm) -> out [n_tok,
  // H * v]. Writes each sequence's latent rows [rmsnorm(c) ; rope(k_R)] at
  // its reserved slots, then per head q_lat = W_UK,h^T q_nope,h, latent
  // attention (mla_attention.h) and W_UV,h times the latent output. On a row
  // the cache dtype cannot hold, *rejected is the step entry and nothing of
  // this layer is written.
  Status latent_attention(int layer, std::span<const StepSeq> batch, const float* h, int64_t n_tok,
                          const int32_t* pos, float* out, int64_t* rejected);
  // The attention output [n_tok, n_heads, head_dim] -> [n_tok, n_heads * v_head_dim], in place.
  void compact_attention(float* attn, int64_t n_tok) const;
  // h [n_tok, n_embd] (after ffn_norm) -> out [n_tok, n_embd]: routed experts
  // plus shared experts. REQUIRES: config().is_moe_layer(layer); out != h.
  void moe(int layer, const float* h, int64_t n_tok, float* out);

 private:
  // The projections both attention paths start from: qfull_ [n_tok, H,
  // qk_nope + qk_rope] (through the low-rank q path when the file has one)
  // and kva_ [n_tok, kv_lora + qk_rope] = h . W_kv_a^T (only when kv); no
  // norm, no RoPE.
  void project_q_kv_a(const LayerWeights& w, const float* h, int64_t n_tok, bool kv = true);

  const Model& model_;
  ThreadPool& threads_;
  std::vector<float> qa_, qfull_, kva_, lat_, kv_;  // MLA workspace
  MoeScratch moe_;
  std::vector<float> q_abs_, rows_, o_lat_;  // latent path: [n,H,dc+dR], [n,dc+dR], [n,H,dc]
  // Per layer, wkv_b in f32 ([H * (nope + v)][kv_lora]) and W_UK,h^T per head
  // ([H][kv_lora][nope]), built on first latent use.
  std::vector<std::vector<float>> wkv_b_f32_, wuk_t_f32_;
  // Per layer, W_kv_b^T ([kv_lora][H * (nope + v)]) for the expanded prefill.
  std::vector<std::vector<float>> wkv_b_t_f32_;
  std::vector<int64_t> abs_rows_;          // token rows of the sequences that run absorbed
  std::vector<float> head_in_, head_out_;  // one head's rows gathered for a matmul
};

}  // namespace kvstack

// Attention over an MLA latent KV layer (KvLayerKind::kMlaLatent; layout.h):
// each cached token is one row [c_t ; k_R,t] of latent_dim + rope_dim
// elements shared by every query head, no V. With the key up-projection
// absorbed into the query (q_lat,h = W_UK,h^T q_nope,h) and the value
// up-projection applied after the weighted sum (engine/deepseek2.cpp):
//   score_h,j = scale * (q_lat,h . c_j + q_rope,h . k_R,j)
//   out_h     = sum_j softmax_j(score_h) c_j          (latent space, latent_dim)
// Each row is decoded once per query row and used by all heads (MQA-like:
// one latent for H heads, nothing replicated). Causal like paged_attention:
// query row r of a sequence sees positions 0 .. n_past + r.
//
// Scalar float32 kernel (f32/f16/bf16 latent rows); the engine's float64
// test (engine/deepseek2_latent_test.cpp) holds it to the unabsorbed formula.
// Thread-safety: reentrant; parallel over (sequence, query row) on the pool.
#pragma once

#include <span>

#include "attention/paged_attention.h"
#include "core/result.h"
#include "core/thread_pool.h"
#include "kv/kv_view.h"

namespace kvstack {

struct MlaAttnParams {
  int n_heads = 0;     // query heads H
  int latent_dim = 0;  // d_c
  int rope_dim = 0;    // d_R
  float scale = 0.0f;  // softmax scale of the full q.k
};

// seqs[i].q: [n_new, H, d_c + d_R] (absorbed q_lat then q_rope per head);
// seqs[i].out: [n_new, H, d_c]. The latent rows of all n_past + n_new
// positions must be written. kInvalidArgument when the view is not a latent
// layer of d_c + d_R elements; kUnsupported for a quantized latent dtype.
Status mla_attention(const PagedKvLayerView& view, const MlaAttnParams& p,
                     std::span<const AttnSeq> seqs, ThreadPool* pool);

}  // namespace kvstack

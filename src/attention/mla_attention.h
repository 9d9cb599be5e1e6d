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
// Latent rows are stored as f32, f16, bf16 or int8 (KvDtype::kInt8: d_c + d_R
// codes and one f16 scale per token row, kv_codec.h; dequantized tile by
// tile inside the kernel, never into a copy of the cache).
//
// Kernels: a scalar reference (mla_attention_reference) and AVX2 / AVX-512
// tile kernels (mla_attention_simd.cpp) chosen at run time from best_isa()
// (KVSTACK_ISA caps it). The SIMD path decodes each tile of 16 keys once
// into an L1 buffer that all H heads (and up to 4 consecutive prefill rows)
// read, and splits a decode row along its keys (partial max/sum/accumulator
// merged) when there are fewer rows than threads. Float32 accumulation on both; mla_attention_test
// holds the SIMD path to the reference and both to an unabsorbed float64 recomputation.
// Thread-safety: reentrant; parallel over pieces of (sequence, query row,
// key range) on the pool.
#pragma once

#include <span>
#include <string>

#include "attention/paged_attention.h"
#include "core/cpu_features.h"
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
// layer of d_c + d_R elements; kUnsupported for a latent dtype other than
// f32, f16, bf16, int8. Runs the best kernel best_isa() allows.
Status mla_attention(const PagedKvLayerView& view, const MlaAttnParams& p,
                     std::span<const AttnSeq> seqs, ThreadPool* pool);

// The same on the kernel of `isa` (kAvx512 falls back to kAvx2, and either to
// the reference when the CPU lacks it); for tests and benchmarks.
Status mla_attention_isa(Isa isa, const PagedKvLayerView& view, const MlaAttnParams& p,
                         std::span<const AttnSeq> seqs, ThreadPool* pool);

// Scalar reference (same contract): one (sequence, query row) at a time,
// rows decoded with kv_decode_row, float32 online softmax.
Status mla_attention_reference(const PagedKvLayerView& view, const MlaAttnParams& p,
                               std::span<const AttnSeq> seqs, ThreadPool* pool);

// The up-projection of an MLA latent, transposed: f32 row-major
// [d_c][H (qk_nope + v_dim)], the transpose of llama.cpp's attn_kv_b
// [H (qk_nope + v_dim)][d_c], whose rows h (qk_nope + v_dim) + i are W_UK,h
// for i < qk_nope, then W_UV,h.
struct MlaUpProjection {
  const float* w_kv_b_t = nullptr;
  int qk_nope = 0;
  int v_dim = 0;
};

// Expanded (unabsorbed) form over the same latent layer, for prefill chunks:
// seqs[i].q: [n_new, H, qk_nope + d_R] (q_nope and the rotated q_rope per
// head, not absorbed); seqs[i].out: [n_new, H, v_dim], the attention output
// after W_UV. Per sequence, K_h,j = [W_UK,h c_j ; k_R,j] and V_h,j = W_UV,h
// c_j of all n_past + n_new positions are materialised from the stored
// latent rows into a temporary (f32 for an f32 latent, else f16, or f32 again
// for a sequence with an element outside f16's range; thread-local,
// grows only: H (n_past + n_new) max(qk_nope + d_R, v_dim) elements for each
// of K and V) and read by paged_attention()'s prefill kernel. The cache stays
// latent. Same errors as mla_attention, kInvalidArgument without w_kv_b_t.
Status mla_attention_expanded(const PagedKvLayerView& view, const MlaAttnParams& p,
                              const MlaUpProjection& up, std::span<const AttnSeq> seqs,
                              ThreadPool* pool);

// The rule between the two forms of a chunk of n_new query rows over n_past
// cached ones: per head and (query, key) pair the absorbed kernel does
// 2 d_c + d_R multiply-adds, the expanded one qk_nope + d_R + v_dim (plus
// padding) after expanding the n_past + n_new latents at (qk_nope + v_dim)
// d_c each, so expanding pays once a chunk has enough rows to spread the
// expansion over; measured (docs/benchmarks.md, mla_attention_bench
// --prefill, DeepSeek-V2 widths, 16 heads) the expanded form wins from ~192
// rows at 4096 cached tokens and only ties at 384-512 rows on an empty
// cache, where the absorbed kernel's working set stays in cache. Expanded
// when n_new >= kMlaExpandMinRows and n_past + n_new >= kMlaExpandMinKeys.
inline constexpr int32_t kMlaExpandMinRows = 256;
inline constexpr int32_t kMlaExpandMinKeys = 1024;
bool mla_prefer_expanded(int32_t n_past, int32_t n_new);

// Latent dtypes the kernels read: f32, f16, bf16, int8.
bool mla_latent_dtype_supported(KvDtype dtype);

// "<dtype> <isa>" of the kernel mla_attention() runs now, e.g. "int8 avx512".
std::string mla_attention_kernel_name(KvDtype dtype);

}  // namespace kvstack

// Causal attention over a paged KV cache (kv-cache-spec.md sections 2 and 4).
//
// One entry point serves decode (n_new = 1 per sequence, a batch of sequences
// of different lengths with scattered blocks) and chunked prefill on top of a
// cached prefix (a prefix hit is the same path with n_past > 0). Internally:
//   - decode (n_new == 1): one query row; all q heads of one KV head group are
//     processed together, so each K/V row is loaded once per group; a long
//     sequence is split along the keys (split-K) and the partial
//     (max, sum, acc) are merged, so one sequence can use every thread.
//   - prefill (n_new > 1): tiles of query rows x key chunks with an online
//     softmax (running max and sum); no n x n score matrix is materialised.
// K/V are read through the block table in their stored dtype (f32, f16, bf16)
// and converted in registers (AVX2+FMA+F16C when the CPU has it, else a
// scalar path; core/cpu_features.h best_isa() decides at run time).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/result.h"
#include "core/thread_pool.h"
#include "kv/kv_view.h"
#include "kv/layout.h"

namespace kvstack {

struct AttnParams {
  int n_q_heads = 0;   // H_q; must be a multiple of n_kv_heads
  int n_kv_heads = 0;  // H_kv; must equal the view's n_kv_heads
  int head_dim = 0;    // d; must equal the view's head_dim (d_k = d_v)
  float scale = 0.0f;  // multiplies q.k before the softmax, usually 1/sqrt(d)
  // 0: full causal. Otherwise a query at logical position t sees only the
  // positions max(0, t - window + 1) .. t (its last `window` positions,
  // itself included), as a sliding-window layer does.
  int window = 0;
};

// One sequence of a batch. Its K/V for all n_past + n_new positions must
// already be written (the n_new new tokens included) before the call.
struct AttnSeq {
  const int32_t* block_table = nullptr;  // [n_blocks] physical block ids, logical order
  int32_t n_blocks = 0;                  // >= ceil((n_past + n_new) / block_size)
  int32_t n_past = 0;                    // tokens cached before this chunk
  int32_t n_new = 0;                     // query tokens in this chunk (0: nothing to do)
  const float* q = nullptr;              // [n_new, n_q_heads, head_dim], contiguous
  float* out = nullptr;                  // [n_new, n_q_heads, head_dim], contiguous
  // H2O (kv/retention.h): optional [n_past + 1] accumulated attention mass.
  // When set (REQUIRES n_new == 1 and AttnParams::window == 0), the call
  // adds to key_mass[t], for every key t, the sum over all n_q_heads query
  // heads of the softmax probability the decode row gives key t: the
  // probabilities the decode kernel computes anyway, stored per key as
  // exp(s - m_chunk) in f16 with the chunk's running max and rescaled once
  // per chunk after the split-K merge (no second pass over K or V; the f16
  // records add a relative error of at most 2^-11). The output is bitwise
  // the same as without it. Not supported for KIVI views.
  float* key_mass = nullptr;
};

// Causal attention of every query row over the cached positions it may see:
// row r (logical position n_past + r) sees positions 0 .. n_past + r, cut to
// the window when p.window > 0. GQA/MQA: q head h uses KV head
// h / (n_q_heads / n_kv_heads); K/V are never replicated.
//
// Slots past a sequence's n_past + n_new are never read, nor (window > 0)
// positions before the window of the chunk's first row: table entries of
// blocks wholly before it may be released (any negative id, kNullBlock).
// Block ids in the
// table are trusted to lie inside the pool the view points at (the view does
// not carry the pool size); everything else is validated and a bad argument
// returns kInvalidArgument naming the field and sequence, without touching
// any output.
//
// `pool` may be null (run on the calling thread). Per-thread scratch is kept
// in thread-local buffers that only grow, so steady-state calls do not
// allocate. Not reentrant from several threads sharing one `pool`.
// REQUIRES: q/out of different sequences do not overlap; out does not alias
// q or the cache.
Status paged_attention(const PagedKvLayerView& kv, const AttnParams& p,
                       std::span<const AttnSeq> seqs, ThreadPool* pool);

// Scalar reference with the same contract, straightforward two-pass softmax
// per (row, q head) with double accumulation, reading K/V through the table.
// Slow; for tests.
Status paged_attention_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                 std::span<const AttnSeq> seqs);

// The kernels paged_attention() runs for keys in k, values in v and
// head_dim at the current ISA cap (best_isa(), KVSTACK_ISA, and
// KVSTACK_ATTN_ISA=scalar|avx2, which caps attention alone), from the
// function that dispatches them: "scalar", "avx2", or "<decode path> decode
// + <prefill path> prefill" when decode rows (n_new == 1) and prefill rows
// run on different paths (e.g. "avx512-vnni decode + avx512 prefill").
std::string attention_kernel_name(KvDtype k, KvDtype v, int head_dim);

// attention_kernel_name() for each distinct (K dtype, V dtype, head_dim) of
// the layout's standard layers, in layer order: "int8 avx2" or "int8/f16
// avx2, f16 avx2"; "none" when it has none (MLA layers are not named).
std::string attention_kernel_summary(const KvLayout& layout);

// Checks the arguments as paged_attention does (exposed for callers that
// validate once per batch and for tests).
Status validate_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                               std::span<const AttnSeq> seqs);

}  // namespace kvstack

// The model forward pass over a batch that mixes prefill chunks and decode
// tokens of different sequences, reading and writing K/V through each
// sequence's block table (kv-cache-spec.md sections 2 and 4).
//
// One step: reserve KV slots for every sequence (all or nothing), embed,
// then per layer RMSNorm -> Q/K/V projections -> RoPE at logical positions ->
// write K/V -> paged attention -> output projection -> residual -> RMSNorm ->
// SwiGLU FFN -> residual (gemma3: q/k head norms before RoPE, a per-layer
// RoPE base, RMSNorm of the attention and FFN outputs before each residual,
// GeGLU instead of SwiGLU); final norm and the output projection only for the
// rows whose logits were asked for; commit every sequence's new length.
//
// Thread-safety: one Forward is driven by one thread; it uses the ThreadPool
// for matmuls and attention.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/result.h"
#include "core/thread_pool.h"
#include "engine/model.h"
#include "kv/block_table.h"
#include "kv/rotation.h"

namespace kvstack {

struct KeyCenter;
class Deepseek2Layers;

enum class LogitsMode : uint8_t {
  kNone,  // intermediate prefill chunk: no logits
  kLast,  // logits of the last new token (prefill end, decode)
  kAll,   // logits of every new token (scoring, perplexity)
};

// One sequence's part of a step. Its new tokens take logical positions
// table->length() .. table->length() + tokens.size() - 1.
struct StepSeq {
  BlockTable* table = nullptr;
  std::span<const int32_t> tokens;
  LogitsMode logits = LogitsMode::kLast;
  uint64_t watch = 0;  // SeqRequest::watch_id (0: none), for the layer hook
};

class Forward {
 public:
  // REQUIRES: model and pool outlive this object; the pool's layout matches
  // the model (one standard layer per model layer, n_kv_heads, head_dim);
  // kv_rotation_check(rotation, head_dim) passed. `rotation` (--kv-rotate)
  // is applied to Q and K after RoPE and to V, so the cache holds rotated
  // keys and values; attention outputs are rotated back before o_proj.
  Forward(const Model& model, ThreadPool& threads, KvRotation rotation = KvRotation::kNone);
  ~Forward();

  // Runs one step. On success `logits` holds the requested rows in batch
  // order ([n_rows, n_vocab]) and every table's length has advanced by its
  // token count. Errors (no state changed): kInvalidArgument for an empty
  // step, a token id out of range or a sequence past the model's context,
  // kOutOfBlocks when the pool cannot hold the new tokens; kInvalidArgument
  // naming the layer, step entry, K or V, position and head when a computed
  // K/V row holds NaN/Inf or a value its KV dtype cannot store (the step's
  // reservations are rolled back and no table's length changes; fp8 caveat
  // in forward.cpp).
  Status step(std::span<const StepSeq> batch, std::vector<float>* logits);

  int64_t n_vocab() const { return model_.config().n_vocab; }

  // --kv-center (key_center.h): subtract center->layer(l) from every key
  // head of layer l after RoPE, before the rotation and before K is stored.
  // nullptr (the default) turns it off. REQUIRES: `center` matches the model
  // (n_layers, n_kv_heads * head_dim) and outlives its use here.
  void set_key_center(const KeyCenter* center) { key_center_ = center; }

  // Batch index of the entry whose K/V row made the last step fail (-1 when
  // the last step succeeded or failed for another reason): a scheduler fails
  // that request only and runs the others again.
  int64_t rejected_entry() const { return rejected_entry_; }

  // Per-layer readiness (P/D layer timing, server/pd_agent.h): when set,
  // step() calls hook(0, batch) once every entry's slots are reserved and
  // before layer 0, and hook(l + 1, batch) once layer l's K/V of every
  // entry of the step are written. Runs on the engine thread; must be cheap
  // and must not call back into the engine (it may take BlockRefs of the
  // entries' blocks). An empty function (the default) turns it off.
  using LayerHook = std::function<void(int n_layers_done, std::span<const StepSeq> batch)>;
  void set_layer_hook(LayerHook hook) { layer_hook_ = std::move(hook); }

 private:
  Status layer(int l, std::span<const StepSeq> batch, int64_t n_tok);
  // deepseek2 layer over a latent KV layer (forward_deepseek2.cpp); called by
  // layer() after the attention RMSNorm (h_ holds it).
  Status mla_latent_layer(int l, std::span<const StepSeq> batch, int64_t n_tok);
  void ensure_workspace(int64_t n_tok);

  const Model& model_;
  ThreadPool& threads_;
  KvRotation rotation_;
  const KeyCenter* key_center_ = nullptr;
  std::unique_ptr<Deepseek2Layers> deepseek2_;  // MLA + MoE math (arch deepseek2), else null
  int64_t rejected_entry_ = -1;
  // h_ holds the next layer's attention RMSNorm of x_ (the previous layer's
  // residual pass wrote it); reset by every layer and every step.
  bool attn_normed_ = false;
  LayerHook layer_hook_;
  // Workspace, grown on demand ([n_tok, ...] float32 each).
  int64_t capacity_ = 0;
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_;
  // topk decode rows' gathered block tables (a deque: stable addresses).
  std::deque<std::vector<int32_t>> topk_ids_;
  std::vector<int32_t> pos_;
};

}  // namespace kvstack

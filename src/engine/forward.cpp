#include "engine/forward.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#include "attention/attention_kivi.h"
#include "attention/paged_attention.h"
#include "engine/deepseek2.h"
#include "engine/key_center.h"
#include "kv/kv_codec.h"
#include "ops/elementwise.h"

namespace kvstack {
namespace {

// Per-row elementwise work of a step (norms, residual adds, SwiGLU, key
// centring, the KV rotation, K/V checks) runs on the pool, in chunks of
// rows, when it is at least this much work (row_work units per row, about
// a float add each: a pool call costs ~1 us, a 16-row add + RMSNorm of 576
// floats ~3 us on one core); less runs on the calling thread. Every row
// goes through the same functions with the same inputs either way (none of
// them reads another row), so a row's bits do not depend on the chunking or
// on which thread ran it (batch invariance).
constexpr int64_t kPoolWork = 16384;

// Calls fn(r0, r1) over [0, n) in contiguous chunks of rows, claimed by the
// pool's threads (run_shared: the calling thread alone finishes what no
// worker claimed), or fn(0, n) on the calling thread for small work.
template <class Fn>
void for_row_chunks(ThreadPool& pool, int64_t n, int64_t row_work, const Fn& fn) {
  if (n < 2 || n * row_work < kPoolWork || pool.n_threads() == 1) {
    if (n > 0) fn(0, n);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    int64_t n;
    int64_t chunk;
    const Fn* fn;
  } sh{.n = n, .chunk = std::max<int64_t>(1, n / (2 * pool.n_threads())), .fn = &fn};
  Shared* p = &sh;  // one captured pointer: std::function stores it inline
  pool.run_shared([p](int) {
    for (int64_t c = p->next.fetch_add(1, std::memory_order_relaxed); c * p->chunk < p->n;
         c = p->next.fetch_add(1, std::memory_order_relaxed)) {
      (*p->fn)(c * p->chunk, std::min(p->n, (c + 1) * p->chunk));
    }
  });
}

// The residual pass after attention and after the feed-forward block, per
// row of [n_tok, n_embd]: h through post_norm where the model has one, then
// x += h, then h = norm(x) when norm is given (the next norm fused in).
void residual_add_norm(ThreadPool& pool, int64_t n_tok, const ModelConfig& c, float* x, float* h,
                       const float* post_norm, const float* norm) {
  for_row_chunks(pool, n_tok, c.n_embd, [&](int64_t r0, int64_t r1) {
    const int64_t n = r1 - r0;
    float* xr = x + r0 * c.n_embd;
    float* hr = h + r0 * c.n_embd;
    if (post_norm != nullptr) rms_norm(hr, post_norm, n, c.n_embd, c.norm_eps, hr);
    add(xr, hr, xr, n * c.n_embd);
    if (norm != nullptr) rms_norm(xr, norm, n, c.n_embd, c.norm_eps, hr);
  });
}

}  // namespace

Forward::Forward(const Model& model, ThreadPool& threads, KvRotation rotation)
    : model_(model), threads_(threads), rotation_(rotation) {
  if (model.config().arch == "deepseek2") {
    deepseek2_ = std::make_unique<Deepseek2Layers>(model, threads);
  }
}

Forward::~Forward() = default;

void Forward::ensure_workspace(int64_t n_tok) {
  if (n_tok <= capacity_) return;
  const ModelConfig& c = model_.config();
  const auto n = static_cast<size_t>(n_tok);
  x_.resize(n * c.n_embd);
  h_.resize(n * c.n_embd);
  q_.resize(n * c.n_heads * c.head_dim);
  k_.resize(n * c.n_kv_heads * c.head_dim);
  v_.resize(n * c.n_kv_heads * c.head_dim);
  // attn_ also takes the MoE output ([n_tok, n_embd]) of deepseek2 layers.
  attn_.resize(n * std::max(c.n_heads * c.head_dim, c.n_embd));
  gate_.resize(n * c.n_ff);
  up_.resize(n * c.n_ff);
  pos_.resize(n);
  capacity_ = n_tok;
}

Status Forward::step(std::span<const StepSeq> batch, std::vector<float>* logits) {
  const ModelConfig& c = model_.config();
  rejected_entry_ = -1;
  if (batch.empty()) return make_error(Errc::kInvalidArgument, "empty step");
  int64_t n_tok = 0;
  std::vector<BlockTable*> tables;
  std::vector<int64_t> n_new;
  tables.reserve(batch.size());
  n_new.reserve(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSeq& s = batch[i];
    if (s.table == nullptr || s.tokens.empty()) {
      return make_error(Errc::kInvalidArgument,
                        "step entry " + std::to_string(i) + " has no table or no tokens");
    }
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= c.n_vocab) {
        return make_error(Errc::kInvalidArgument, "token id " + std::to_string(t) +
                                                      " is out of range [0, " +
                                                      std::to_string(c.n_vocab) + ")");
      }
    }
    if (s.table->length() + static_cast<int64_t>(s.tokens.size()) > c.n_ctx_train) {
      return make_error(
          Errc::kInvalidArgument,
          "sequence would reach " + std::to_string(s.table->length() + s.tokens.size()) +
              " tokens, past the model's context length of " + std::to_string(c.n_ctx_train));
    }
    tables.push_back(s.table);
    n_new.push_back(static_cast<int64_t>(s.tokens.size()));
    n_tok += static_cast<int64_t>(s.tokens.size());
  }
  // Plan/commit: reserve every sequence's slots or none.
  KV_TRY_STATUS(reserve_all(tables, n_new));

  ensure_workspace(n_tok);
  int64_t row = 0;
  for (const StepSeq& s : batch) {
    model_.embed(s.tokens.data(), static_cast<int64_t>(s.tokens.size()),
                 x_.data() + row * c.n_embd);
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      pos_[row + j] = static_cast<int32_t>(s.table->length() + static_cast<int64_t>(j));
    }
    row += static_cast<int64_t>(s.tokens.size());
  }

  if (layer_hook_) layer_hook_(0, batch);
  attn_normed_ = false;
  for (int l = 0; l < c.n_layers; ++l) {
    // A rejected K/V row fails the whole step: drop its reservations. Layers
    // before l wrote only uncommitted slots, except that an fp8 layer may
    // have re-encoded the committed slots of a partial tail block with a
    // larger block scale (same values except E4M3 subnormals).
    if (Status st = layer(l, batch, n_tok); !st.ok()) {
      for (BlockTable* t : tables) t->rollback();
      return st;
    }
    if (layer_hook_) layer_hook_(l + 1, batch);
  }

  // Logits for the requested rows only.
  std::vector<int64_t> rows;
  row = 0;
  for (const StepSeq& s : batch) {
    const auto n = static_cast<int64_t>(s.tokens.size());
    if (s.logits == LogitsMode::kAll) {
      for (int64_t j = 0; j < n; ++j) rows.push_back(row + j);
    } else if (s.logits == LogitsMode::kLast) {
      rows.push_back(row + n - 1);
    }
    row += n;
  }
  if (logits != nullptr) {
    const auto n_rows = static_cast<int64_t>(rows.size());
    for_row_chunks(threads_, n_rows, c.n_embd, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        rms_norm(x_.data() + rows[r] * c.n_embd, model_.output_norm(), c.n_embd, c.norm_eps,
                 h_.data() + r * c.n_embd);
      }
    });
    logits->resize(static_cast<size_t>(n_rows) * c.n_vocab);
    if (n_rows > 0) matmul(model_.output(), h_.data(), n_rows, logits->data(), &threads_);
  }

  for (size_t i = 0; i < batch.size(); ++i) batch[i].table->commit(n_new[i]);
  return {};
}

Status Forward::layer(int l, std::span<const StepSeq> batch, int64_t n_tok) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers()[l];
  const int64_t q_dim = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  // Cross-layer KV sharing (config.h): a shared layer computes only q and
  // attends over its source layer's K/V (KV layout layer kl), writing nothing.
  const bool shared = !c.stores_kv(l);
  const int kl = c.kv_index(l);

  // Attention block (the previous layer's last pool call may have written
  // this norm already: attn_normed_).
  if (!attn_normed_) rms_norm(x_.data(), w.attn_norm, n_tok, c.n_embd, c.norm_eps, h_.data());
  attn_normed_ = false;
  // deepseek2 with a latent KV layer (--kv-mla latent): forward_deepseek2.cpp.
  if (deepseek2_ && batch.front().table->pool().layer_view(kl).v == nullptr) {
    return mla_latent_layer(l, batch, n_tok);
  }
  // Q, K and V in one pass when their types allow (one activation
  // quantization, one thread dispatch).
  if (deepseek2_) {
    // MLA: latent -> per-head K/V rows, RoPE (YaRN) on the decoupled parts.
    deepseek2_->qkv(l, h_.data(), n_tok, pos_.data(), q_.data(), k_.data(), v_.data());
  } else if (shared) {
    matmul(w.wq, h_.data(), n_tok, q_.data(), &threads_);
  } else if (matmul_can_fuse(w.wq, w.wk) && matmul_can_fuse(w.wq, w.wv)) {
    const WeightView qkv[3] = {w.wq, w.wk, w.wv};
    float* const out[3] = {q_.data(), k_.data(), v_.data()};
    matmul_multi(qkv, h_.data(), n_tok, out, &threads_);
  } else {
    matmul(w.wq, h_.data(), n_tok, q_.data(), &threads_);
    matmul(w.wk, h_.data(), n_tok, k_.data(), &threads_);
    matmul(w.wv, h_.data(), n_tok, v_.data(), &threads_);
  }
  // A shared layer's k_/v_ are not computed: everything on them below is
  // skipped (n_kv_tok = 0 rows).
  const int64_t n_kv_tok = shared ? 0 : n_tok;
  if (w.bq != nullptr) {
    for (int64_t t = 0; t < n_tok; ++t) {
      add(q_.data() + t * q_dim, w.bq, q_.data() + t * q_dim, q_dim);
    }
    for (int64_t t = 0; t < n_kv_tok; ++t) {
      add(k_.data() + t * kv_dim, w.bk, k_.data() + t * kv_dim, kv_dim);
      add(v_.data() + t * kv_dim, w.bv, v_.data() + t * kv_dim, kv_dim);
    }
  }
  if (w.attn_q_norm != nullptr) {
    // gemma3: RMSNorm over each head's head_dim values of q and k, before RoPE.
    rms_norm(q_.data(), w.attn_q_norm, n_tok * c.n_heads, c.head_dim, c.norm_eps, q_.data());
    if (n_kv_tok > 0) {
      rms_norm(k_.data(), w.attn_k_norm, n_kv_tok * c.n_kv_heads, c.head_dim, c.norm_eps,
               k_.data());
    }
  }
  if (!deepseek2_) {
    const RopeParams rp{.style = c.rope_neox ? RopeStyle::kNeox : RopeStyle::kNormal,
                        .n_rot = c.n_rot,
                        .freq_base = c.rope_base(l),
                        .freq_scale = c.rope_scale(l)};
    rope(q_.data(), pos_.data(), n_tok, c.n_heads, c.head_dim, rp);
    if (n_kv_tok > 0) rope(k_.data(), pos_.data(), n_kv_tok, c.n_kv_heads, c.head_dim, rp);
  }
  // --kv-center: every key of a head moves by the same mu, so each query's
  // scores shift by one constant (q.mu), which softmax removes.
  // --kv-rotate: q.k is unchanged; K and V are stored (quantized) in the
  // rotated basis, and the attention output is rotated back below.
  // Both per row, on the pool for many rows, with each row's K/V check
  // (a failure is found again below, in entry order, for its message).
  const PagedKvLayerView view = batch.front().table->pool().layer_view(kl);
  std::atomic<bool> any_bad{false};
  // Work per row: the K/V checks, and ~4 units per rotated float.
  const int64_t rot_work = rotation_ != KvRotation::kNone ? 4 : 0;
  const int64_t chain_work = 2 * kv_dim + rot_work * (q_dim + 2 * kv_dim);
  for_row_chunks(threads_, n_tok, chain_work, [&](int64_t r0, int64_t r1) {
    const int64_t k0 = std::min(r0, n_kv_tok), k1 = std::min(r1, n_kv_tok);
    if (key_center_ != nullptr) {
      const float* mu = key_center_->layer(l);
      for (int64_t t = k0; t < k1; ++t) {
        float* kr = k_.data() + t * kv_dim;
        for (int64_t i = 0; i < kv_dim; ++i) kr[i] -= mu[i];
      }
    }
    kv_rotate(rotation_, q_.data() + r0 * q_dim, (r1 - r0) * c.n_heads, c.head_dim);
    kv_rotate(rotation_, k_.data() + k0 * kv_dim, (k1 - k0) * c.n_kv_heads, c.head_dim);
    kv_rotate(rotation_, v_.data() + k0 * kv_dim, (k1 - k0) * c.n_kv_heads, c.head_dim);
    for (int64_t t = k0; t < k1; ++t) {
      if (!kv_validate_rows(view, pos_[t], k_.data() + t * kv_dim, v_.data() + t * kv_dim, 1)
               .ok()) {
        any_bad.store(true, std::memory_order_relaxed);
      }
    }
  });

  // Check every sequence's rows before writing any of them.
  int64_t row = 0;
  for (size_t i = 0; i < batch.size() && any_bad.load(std::memory_order_relaxed); ++i) {
    const auto n = static_cast<int64_t>(batch[i].tokens.size());
    const Status st = kv_validate_rows(view, batch[i].table->length(), k_.data() + row * kv_dim,
                                       v_.data() + row * kv_dim, n);
    if (!st.ok()) {
      rejected_entry_ = static_cast<int64_t>(i);
      return make_error(st.error().code, "layer " + std::to_string(l) + ", step entry " +
                                             std::to_string(i) + ": " + st.error().message);
    }
    row += n;
  }
  KV_CHECK(!any_bad.load(std::memory_order_relaxed), "a K/V row failed its check only on the pool");

  // Write this layer's K/V for every sequence, then attend through the tables.
  // Many entries: the writes run on the pool, one entry per claim (each
  // table writes only its own unshared, uncommitted slots, and a row's
  // encoding does not depend on who writes it; quantized formats spend real
  // time here: int4's per-group fit was ~20% of a 16-sequence step when
  // the calling thread wrote every row).
  const bool parallel_write = !shared && batch.size() >= 4 && threads_.n_threads() > 1;
  if (parallel_write) {
    std::vector<int64_t> rows(batch.size());
    for (size_t i = 0, r = 0; i < batch.size(); ++i) {
      rows[i] = static_cast<int64_t>(r);
      r += batch[i].tokens.size();
    }
    std::atomic<size_t> next{0};
    struct Ctx {
      std::span<const StepSeq> batch;
      const std::vector<int64_t>* rows;
      std::atomic<size_t>* next;
      const float* k;
      const float* v;
      int64_t kv_dim;
      int l;
    } ctx{batch, &rows, &next, k_.data(), v_.data(), kv_dim, l};
    const Ctx* cp = &ctx;  // one captured pointer: std::function stores it inline
    threads_.run_shared([cp](int) {
      for (size_t i = cp->next->fetch_add(1, std::memory_order_relaxed); i < cp->batch.size();
           i = cp->next->fetch_add(1, std::memory_order_relaxed)) {
        const StepSeq& s = cp->batch[i];
        const int64_t r = (*cp->rows)[i];
        s.table->write(cp->l, s.table->length(), cp->k + r * cp->kv_dim, cp->v + r * cp->kv_dim,
                       static_cast<int64_t>(s.tokens.size()));
      }
    });
  }
  std::vector<AttnSeq> seqs;
  seqs.reserve(batch.size());
  topk_ids_.clear();  // gathered tables of topk decode rows, alive until the call
  row = 0;
  for (const StepSeq& s : batch) {
    const auto n = static_cast<int64_t>(s.tokens.size());
    if (!shared && !parallel_write) {
      s.table->write(l, s.table->length(), k_.data() + row * kv_dim, v_.data() + row * kv_dim, n);
    }
    // SnapKV (kv/retention.h): the table keeps its prompt's last queries.
    if (n > 1 && !shared && s.table->wants_queries()) {
      s.table->observe_queries(
          l, s.table->length(), q_.data() + row * q_dim, n,
          {.n_q_heads = c.n_heads, .head_dim = c.head_dim, .scale = c.attn_scale});
    }
    // Layer l's group table: entries before the window may be kNullBlock
    // (never read: the kernels start at the first visible key).
    const std::span<const int32_t> ids = s.table->ids_for_layer(kl);
    const int64_t n_resident = s.table->resident_length(kl);
    // H2O (kv/retention.h): decode rows of full-attention layers add their
    // attention probabilities to the slots' accumulated mass (a layer that
    // reads another layer's K/V adds nothing: one mass per stored layer).
    float* mass = n == 1 && s.table->wants_mass() && c.window(l) == 0 && kl == l
                      ? s.table->key_mass(kl, n_resident + 1)
                      : nullptr;
    // topk (kv/retention.h): a decode row of a full-attention layer reads
    // its own block, the sink and recent blocks, and the rest of k by key bound.
    std::span<const int32_t> read_ids = ids;
    int64_t read_past = n_resident;
    if (n == 1 && s.table->topk_reads() && c.window(l) == 0) {
      const int64_t P = view.block_size;
      const int64_t n_keys = n_resident + 1;
      const int64_t n_full = (n_keys + P - 1) / P - 1;  // every block but the query's
      const RetentionConfig& rc = s.table->retention();
      const int64_t k = rc.topk;
      std::vector<int64_t>& choice = s.table->topk_choice(kl);
      choice.clear();
      if (n_full + 1 > k) {
        choice = topk_blocks(std::span<const float>(q_.data() + row * q_dim, q_dim), c.n_heads,
                             c.n_kv_heads, c.head_dim, s.table->key_summary(kl, n_full), n_full,
                             k - 1, rc.topk_sink, rc.topk_recent);
        std::vector<int32_t>& g = topk_ids_.emplace_back();
        for (int64_t b : choice) g.push_back(ids[static_cast<size_t>(b)]);
        g.push_back(ids[static_cast<size_t>(n_full)]);
        read_ids = g;
        read_past = (k - 1) * P + (n_keys - n_full * P) - 1;
      }
      s.table->count_topk_reads(std::min(k, n_full + 1), n_full + 1);
    }
    seqs.push_back(AttnSeq{.block_table = read_ids.data(),
                           .n_blocks = static_cast<int32_t>(read_ids.size()),
                           // Resident slots (retention compacts them;
                           // RoPE above used logical positions).
                           .n_past = static_cast<int32_t>(read_past),
                           .n_new = static_cast<int32_t>(n),
                           .q = q_.data() + row * q_dim,
                           .out = attn_.data() + row * q_dim,
                           .key_mass = mass});
    row += n;
  }
  const AttnParams ap{.n_q_heads = c.n_heads,
                      .n_kv_heads = c.n_kv_heads,
                      .head_dim = c.head_dim,
                      .scale = c.attn_scale,
                      .window = c.window(l)};
  Status st;
  if (kv_view_is_kivi(view)) {
    // KIVI: each sequence's newest tokens are read from its f16 residual.
    std::vector<KvResidualView> residuals;
    residuals.reserve(batch.size());
    for (const StepSeq& s : batch) residuals.push_back(s.table->residual_view(kl));
    st = paged_attention_kivi(view, ap, seqs, residuals, &threads_);
  } else {
    st = paged_attention(view, ap, seqs, &threads_);
  }
  KV_CHECK(st.ok(), "paged_attention rejected arguments the forward pass built");
  // attn_ [n_tok, n_heads, head_dim] = sum_j p_j (R v_j) per head: back to R^T.
  if (rotation_ != KvRotation::kNone) {
    for_row_chunks(threads_, n_tok, 4 * q_dim, [&](int64_t r0, int64_t r1) {
      kv_unrotate(rotation_, attn_.data() + r0 * q_dim, (r1 - r0) * c.n_heads, c.head_dim);
    });
  }
  if (deepseek2_) deepseek2_->compact_attention(attn_.data(), n_tok);  // [n_tok, H * v]

  matmul(w.wo, attn_.data(), n_tok, h_.data(), &threads_);
  // Residual add and the feed-forward norm, per row.
  residual_add_norm(threads_, n_tok, c, x_.data(), h_.data(), w.attn_post_norm, w.ffn_norm);
  if (deepseek2_ && c.is_moe_layer(l)) {
    // Routed + shared experts into attn_ (free here; sized for it).
    deepseek2_->moe(l, h_.data(), n_tok, attn_.data());
    add(x_.data(), attn_.data(), x_.data(), n_tok * c.n_embd);
    return {};
  }
  if (matmul_can_fuse(w.w_gate, w.w_up)) {
    const WeightView gate_up[2] = {w.w_gate, w.w_up};
    float* const out[2] = {gate_.data(), up_.data()};
    matmul_multi(gate_up, h_.data(), n_tok, out, &threads_);
  } else {
    matmul(w.w_gate, h_.data(), n_tok, gate_.data(), &threads_);
    matmul(w.w_up, h_.data(), n_tok, up_.data(), &threads_);
  }
  const bool gelu = c.ffn_act == ModelConfig::FfnAct::kGeluTanh;
  for_row_chunks(threads_, n_tok, 2 * c.n_ff, [&](int64_t r0, int64_t r1) {
    float* g = gate_.data() + r0 * c.n_ff;
    const float* u = up_.data() + r0 * c.n_ff;
    (gelu ? geglu : swiglu)(g, u, g, (r1 - r0) * c.n_ff);
  });
  matmul(w.w_down, gate_.data(), n_tok, h_.data(), &threads_);
  // Residual add, and the next layer's attention norm in the same pass.
  const LayerWeights* next = l + 1 < c.n_layers ? &model_.layers()[l + 1] : nullptr;
  residual_add_norm(threads_, n_tok, c, x_.data(), h_.data(), w.ffn_post_norm,
                    next != nullptr ? next->attn_norm : nullptr);
  attn_normed_ = next != nullptr;
  return {};
}

}  // namespace kvstack

// SnapKV on a block table (retention.h, block_table.h): the observation
// window's query rows, their attention over the stored keys, the selection
// and the compaction that frees the dropped tokens' blocks.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kv/block_table.h"
#include "kv/kv_write.h"

namespace kvstack {

void BlockTable::observe_queries(int l, int64_t pos, const float* q, int64_t n_tokens,
                                 const QueryShape& shape) {
  if (!wants_queries() || n_tokens <= 0) return;
  const int n_layers = pool_->groups().n_layers();
  KV_CHECK(l >= 0 && l < n_layers, "observe_queries: layer index out of range");
  if (obs_.empty()) obs_.resize(static_cast<size_t>(n_layers));
  obs_shape_ = shape;
  const int64_t q_dim = int64_t{shape.n_q_heads} * shape.head_dim;
  ObservedQueries& o = obs_[static_cast<size_t>(l)];
  const int64_t n_held = static_cast<int64_t>(o.rows.size()) / q_dim;
  if (o.rows.empty() || pos < o.start || pos > o.start + n_held) {
    o.start = pos;  // not contiguous with what is held: start over
    o.rows.clear();
  } else {
    // Rows from a step that was rolled back (positions >= pos) are replaced.
    o.rows.resize(static_cast<size_t>((pos - o.start) * q_dim));
  }
  o.rows.insert(o.rows.end(), q, q + n_tokens * q_dim);
  const int64_t n = static_cast<int64_t>(o.rows.size()) / q_dim;
  if (n > retention_.observed_rows()) {
    const int64_t cut = n - retention_.observed_rows();
    o.rows.erase(o.rows.begin(), o.rows.begin() + cut * q_dim);
    o.start += cut;
  }
}

int64_t BlockTable::apply_snapkv() {
  if (!wants_queries() || obs_.empty()) {
    obs_.clear();
    return 0;
  }
  std::vector<ObservedQueries> obs = std::move(obs_);
  obs_.clear();
  const int64_t length = this->length();
  const int64_t q_dim = int64_t{obs_shape_.n_q_heads} * obs_shape_.head_dim;
  // Every layer must hold rows up to the committed length (the prompt's end).
  int64_t n_obs = retention_.observed_rows();
  for (const ObservedQueries& o : obs) {
    const int64_t n = static_cast<int64_t>(o.rows.size()) / q_dim;
    if (n == 0 || o.start + n < length) return 0;
    n_obs = std::min(n_obs, length - o.start);
  }
  if (n_obs <= 0) return 0;
  int64_t n_freed = 0;
  std::vector<float> k, v, attn;
  const bool h2o = retention_.is_h2o();
  if (h2o) trim_mass();
  for (GroupTable& gt : groups_) {
    const KvGroup& group = pool_->group(gt.group());
    if (group.window > 0) continue;  // windows are exact and bounded
    const int64_t n_keys = gt.length();
    // The group's budget: its first layer's (pyramidkv groups hold one layer).
    RetentionConfig rc = retention_;
    rc.budget =
        retention_layer_budget(retention_, group.layers.front(), pool_->groups().n_layers());
    if (!h2o && n_keys - n_obs <= rc.budget) continue;
    // h2o: the observation rows' probabilities seed the slots' mass (the
    // selection happens before each decode step, apply_retention).
    float* mass = h2o ? mass_[static_cast<size_t>(&gt - groups_.data())].data() : nullptr;
    std::vector<uint8_t> keep(static_cast<size_t>(n_keys), 0);
    for (int64_t j = n_keys - n_obs; j < n_keys; ++j) keep[static_cast<size_t>(j)] = 1;
    bool ok = true;
    for (int i = 0; i < gt.layout().n_layers() && ok; ++i) {
      if (gt.layout().layer(i).kind != KvLayerKind::kStandard) {
        ok = false;  // MLA: the query of an absorbed latent is another shape
        break;
      }
      const int l = group.layers[static_cast<size_t>(i)];
      const PagedKvLayerView view = pool_->group_layer_view(gt.group(), i);
      const int n_kv = view.n_kv_heads, d = view.head_dim;
      const int n_group = obs_shape_.n_q_heads / n_kv;
      KV_CHECK(d == obs_shape_.head_dim && n_group * n_kv == obs_shape_.n_q_heads,
               "apply_snapkv: query rows do not match the layer's KV heads");
      k.resize(static_cast<size_t>(n_keys * n_kv * d));
      v.resize(k.size());
      read_kv(view, gt.ids(), 0, n_keys, k.data(), v.data());
      const ObservedQueries& o = obs[static_cast<size_t>(l)];
      attn.assign(static_cast<size_t>(int64_t{n_group} * n_obs * n_keys), 0.0f);
      for (int h = 0; h < n_kv; ++h) {
        // Row (qi, r): query head h * n_group + qi at observation slot
        // n_keys - n_obs + r, softmax over the keys up to itself.
        auto rows = [&](int64_t begin, int64_t end) {
          std::vector<double> scores(static_cast<size_t>(n_keys));
          for (int64_t row_i = begin; row_i < end; ++row_i) {
            const int qi = static_cast<int>(row_i / n_obs);
            const int64_t r = row_i % n_obs;
            const int qh = h * n_group + qi;
            const int64_t pos = length - n_obs + r;
            const float* q = o.rows.data() + (pos - o.start) * q_dim + int64_t{qh} * d;
            const int64_t last = n_keys - n_obs + r;  // the query's own slot
            double mx = -std::numeric_limits<double>::infinity();
            for (int64_t j = 0; j <= last; ++j) {
              const float* kj = k.data() + (j * n_kv + h) * d;
              // Eight partial sums: lets the compiler vectorize the dot.
              float acc[8] = {};
              int c = 0;
              for (; c + 8 <= d; c += 8) {
                for (int u = 0; u < 8; ++u) acc[u] += q[c + u] * kj[c + u];
              }
              float dot = 0.0f;
              for (; c < d; ++c) dot += q[c] * kj[c];
              for (float a : acc) dot += a;
              scores[static_cast<size_t>(j)] = double{dot} * obs_shape_.scale;
              mx = std::max(mx, scores[static_cast<size_t>(j)]);
            }
            double sum = 0.0;
            for (int64_t j = 0; j <= last; ++j) {
              sum +=
                  (scores[static_cast<size_t>(j)] = std::exp(scores[static_cast<size_t>(j)] - mx));
            }
            float* out = attn.data() + row_i * n_keys;
            std::fill(out, out + n_keys, 0.0f);
            for (int64_t j = 0; j <= last; ++j) {
              out[j] = static_cast<float>(scores[static_cast<size_t>(j)] / sum);
            }
          }
        };
        const int64_t n_rows = int64_t{n_group} * n_obs;
        if (pool_->threads() != nullptr) {
          pool_->threads()->parallel_for(n_rows, 1, rows);
        } else {
          rows(0, n_rows);
        }
        if (h2o) {
          // Rows (qi, r) in order: a fixed summation order per slot.
          for (int64_t row_i = 0; row_i < n_rows; ++row_i) {
            const float* row = attn.data() + row_i * n_keys;
            for (int64_t j = 0; j < n_keys; ++j) mass[j] += row[j];
          }
        } else {
          snapkv_mark_unit(rc, attn, n_group, n_obs, n_keys, keep);
        }
      }
    }
    if (!ok || h2o) continue;
    std::vector<int64_t> slots;
    for (int64_t j = 0; j < n_keys; ++j) {
      if (keep[static_cast<size_t>(j)] != 0) slots.push_back(j);
    }
    if (static_cast<int64_t>(slots.size()) == n_keys) continue;
    const int64_t before = retention_stats_.n_blocks_freed;
    const Status st = gt.compact(slots, &retention_stats_);
    if (!st.ok()) {
      KV_CHECK(st.error().code == Errc::kOutOfBlocks, "apply_snapkv: compaction refused");
      ++retention_stats_.n_deferred;  // SnapKV decides once: the tokens stay
      ++pool_->retention_.n_deferred;
      continue;
    }
    n_freed += retention_stats_.n_blocks_freed - before;
  }
  return n_freed;
}

}  // namespace kvstack

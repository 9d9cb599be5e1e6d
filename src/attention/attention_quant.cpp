// Validation, work planning (tiles, split-K), threading and the split-K merge
// for paged_attention_quant(); its double-precision reference.
#include "attention/attention_quant.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_quant_kernels.h"
#include "kv/kv_codec.h"

namespace kvstack {
namespace {

using attn_detail::first_visible;
using attn_quant::HeadStream;
using attn_quant::QuantTileArgs;

constexpr int kPrefillVectors = 32;     // query vectors per prefill tile
constexpr int32_t kMinSplitKeys = 256;  // a split-K piece covers at least this many keys
constexpr int kItemsPerThread = 8;
constexpr int32_t kSplitAlign = 32;  // piece boundaries: multiples of the kernel's key chunk

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t row0;
  int32_t n_rows;
  int32_t key_begin;
  int32_t key_end;
  int64_t cost;
  int64_t part_offset;  // float offset of its partial slot, or -1
};

struct MergeGroup {
  int32_t seq;
  int32_t kv_head;
  int32_t row0;
  int32_t n_rows;
  int32_t n_parts;
  int64_t first_offset;
};

struct Plan {
  std::vector<WorkItem> items;
  std::vector<MergeGroup> merges;
  attn_detail::ScratchBuffer partials;
};

Plan& calling_thread_plan() {
  thread_local Plan plan;
  return plan;
}

Error bad(const std::string& what) {
  return make_error(Errc::kInvalidArgument, "paged_attention: " + what);
}

template <class Fn>
void run_dynamic(ThreadPool* pool, size_t n, const Fn& fn) {
  if (pool == nullptr || pool->n_threads() == 1 || n <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<size_t> next{0};
    size_t n;
    const Fn* fn;
  } shared{.n = n, .fn = &fn};
  Shared* sh = &shared;
  pool->run([sh](int) {
    for (size_t i = sh->next.fetch_add(1, std::memory_order_relaxed); i < sh->n;
         i = sh->next.fetch_add(1, std::memory_order_relaxed)) {
      (*sh->fn)(i);
    }
  });
}

// Tiles of every sequence, long ones split along the keys so that each of
// n_threads threads gets about kItemsPerThread items.
void make_plan(Plan& plan, const AttnParams& p, std::span<const AttnSeq> seqs, int n_threads) {
  const int g = p.n_q_heads / p.n_kv_heads;
  std::vector<WorkItem> tiles;
  int64_t total = 0;
  for (size_t si = 0; si < seqs.size(); ++si) {
    const AttnSeq& s = seqs[si];
    const int32_t rows_per_tile = s.n_new == 1 ? 1 : std::max(1, kPrefillVectors / g);
    for (int32_t row0 = 0; row0 < s.n_new; row0 += rows_per_tile) {
      const int32_t n_rows = std::min(rows_per_tile, s.n_new - row0);
      const int32_t pos_first = s.n_past + row0;
      const int32_t key_begin = first_visible(pos_first, p.window);
      const int32_t key_end = pos_first + n_rows;
      const int64_t cost = int64_t{key_end - key_begin} * n_rows;
      for (int32_t h = 0; h < p.n_kv_heads; ++h) {
        tiles.push_back(
            WorkItem{static_cast<int32_t>(si), h, row0, n_rows, key_begin, key_end, cost, -1});
        total += cost;
      }
    }
  }
  plan.items.clear();
  plan.merges.clear();
  const int64_t target = std::max<int64_t>(1, total / (int64_t{n_threads} * kItemsPerThread));
  int64_t offset = 0;
  for (const WorkItem& t : tiles) {
    const int32_t len = t.key_end - t.key_begin;
    int64_t n_parts = 1;
    if (n_threads > 1 && t.cost > target && len >= 2 * kMinSplitKeys) {
      n_parts = std::min<int64_t>((t.cost + target - 1) / target, len / kMinSplitKeys);
    }
    if (n_parts < 2) {
      plan.items.push_back(t);
      continue;
    }
    const int64_t slot_floats = int64_t{t.n_rows} * g * (p.head_dim + 2);
    MergeGroup mg{t.seq, t.kv_head, t.row0, t.n_rows, 0, offset};
    int32_t begin = t.key_begin;
    for (int64_t part = 1; part <= n_parts; ++part) {
      int32_t end = t.key_end;
      if (part < n_parts) {
        end = static_cast<int32_t>(t.key_begin + len * part / n_parts);
        end = end / kSplitAlign * kSplitAlign;
      }
      if (end <= begin) continue;
      WorkItem piece = t;
      piece.key_begin = begin;
      piece.key_end = end;
      piece.cost = t.cost * (end - begin) / len;
      piece.part_offset = offset;
      plan.items.push_back(piece);
      offset += slot_floats;
      ++mg.n_parts;
      begin = end;
    }
    plan.merges.push_back(mg);
  }
  std::sort(plan.items.begin(), plan.items.end(),
            [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  plan.partials.get(static_cast<size_t>(std::max<int64_t>(offset, 1)));
}

HeadStream k_head(const PagedKvLayerView& kv, int h) {
  return HeadStream{kv.k + h * kv.head_stride,
                    kv.k_meta == nullptr ? nullptr : kv.k_meta + h * kv.k_meta_head_stride,
                    kv.slot_stride, kv.k_meta_slot_stride, kv.dtype};
}

HeadStream v_head(const PagedKvLayerView& kv, int h) {
  return HeadStream{kv.v + h * kv.value_head_stride(),
                    kv.v_meta == nullptr ? nullptr : kv.v_meta + h * kv.v_meta_head_stride,
                    kv.value_slot_stride(), kv.v_meta_slot_stride, kv.value_dtype()};
}

}  // namespace

Status validate_quant_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                                     std::span<const AttnSeq> seqs) {
  for (int which = 0; which < 2; ++which) {
    const KvDtype t = which == 0 ? kv.dtype : kv.value_dtype();
    const char* name = which == 0 ? "K" : "V";
    if (static_cast<uint8_t>(t) > static_cast<uint8_t>(KvDtype::kInt4)) {
      return bad(std::string(name) + " dtype " + std::to_string(static_cast<int>(t)) +
                 " is unknown");
    }
    auto geo = kv_row_geometry(t, kv.head_dim);
    if (!geo) return bad(std::string(name) + ": " + geo.error().message);
    const bool has_meta = (which == 0 ? kv.k_meta : kv.v_meta) != nullptr;
    if (kv_dtype_is_quantized(t) && !has_meta) {
      return bad(std::string(name) + " dtype " + kv_dtype_name(t) + " needs a metadata pointer");
    }
  }
  // The remaining checks do not depend on the element format.
  PagedKvLayerView plain = kv;
  plain.dtype = KvDtype::kF16;
  plain.v_distinct = false;
  return validate_attention_args(plain, p, seqs);
}

Status paged_attention_quant_isa(Isa isa, const PagedKvLayerView& kv, const AttnParams& p,
                                 std::span<const AttnSeq> seqs, ThreadPool* pool) {
  KV_TRY_STATUS(validate_quant_attention_args(kv, p, seqs));
  const int g = p.n_q_heads / p.n_kv_heads;
  const int d = p.head_dim;
  const int64_t row_stride = int64_t{p.n_q_heads} * d;
  const bool use_avx2 = isa >= Isa::kAvx2 && best_isa() >= Isa::kAvx2 && cpu_features().f16c &&
                        cpu_features().fma && d % 8 == 0;
  Plan& plan = calling_thread_plan();  // a reference: workers must see this thread's plan
  const int n_threads = pool == nullptr ? 1 : pool->n_threads();
  make_plan(plan, p, seqs, n_threads);
  float* partials = plan.partials.get(1);

  run_dynamic(pool, plan.items.size(), [&](size_t i) {
    const WorkItem& it = plan.items[i];
    const AttnSeq& s = seqs[it.seq];
    QuantTileArgs a;
    a.k = k_head(kv, it.kv_head);
    a.v = v_head(kv, it.kv_head);
    a.block_table = s.block_table;
    a.block_stride = kv.block_stride;
    a.block_size = kv.block_size;
    a.head_dim = d;
    const int64_t q_off = it.row0 * row_stride + int64_t{it.kv_head} * g * d;
    a.q = s.q + q_off;
    a.out = s.out + q_off;
    a.row_stride = row_stride;
    a.n_rows = it.n_rows;
    a.group = g;
    a.pos0 = s.n_past + it.row0;
    a.window = p.window;
    a.key_begin = it.key_begin;
    a.key_end = it.key_end;
    a.scale = p.scale;
    if (it.part_offset >= 0) {
      const int n_vec = it.n_rows * g;
      a.part_m = partials + it.part_offset;
      a.part_l = a.part_m + n_vec;
      a.part_acc = a.part_l + n_vec;
    }
    if (use_avx2 && it.n_rows == 1) {
      attn_quant::quant_decode_tile_avx2(a);
    } else if (use_avx2) {
      attn_quant::quant_tile_avx2(a);
    } else {
      attn_quant::quant_tile_scalar(a);
    }
  });

  run_dynamic(pool, plan.merges.size(), [&](size_t i) {
    const MergeGroup& mg = plan.merges[i];
    const AttnSeq& s = seqs[mg.seq];
    const int n_vec = mg.n_rows * g;
    const int64_t slot_floats = int64_t{n_vec} * (d + 2);
    for (int v = 0; v < n_vec; ++v) {
      float m_max = -std::numeric_limits<float>::infinity();
      for (int pi = 0; pi < mg.n_parts; ++pi) {
        m_max = std::max(m_max, partials[mg.first_offset + pi * slot_floats + v]);
      }
      float* dst = s.out + (mg.row0 + v / g) * row_stride + (int64_t{mg.kv_head} * g + v % g) * d;
      std::fill(dst, dst + d, 0.0f);
      float l_sum = 0.0f;
      for (int pi = 0; pi < mg.n_parts; ++pi) {
        const float* slot = partials + mg.first_offset + pi * slot_floats;
        if (slot[v] == -std::numeric_limits<float>::infinity()) continue;
        const float w = std::exp(slot[v] - m_max);
        l_sum += w * slot[n_vec + v];
        const float* acc = slot + 2 * n_vec + int64_t{v} * d;
        for (int c = 0; c < d; ++c) dst[c] += w * acc[c];
      }
      const float inv = l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
      for (int c = 0; c < d; ++c) dst[c] *= inv;
    }
  });
  return {};
}

Status paged_attention_quant(const PagedKvLayerView& kv, const AttnParams& p,
                             std::span<const AttnSeq> seqs, ThreadPool* pool) {
  return paged_attention_quant_isa(best_isa(), kv, p, seqs, pool);
}

Status paged_attention_quant_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                       std::span<const AttnSeq> seqs) {
  KV_TRY_STATUS(validate_quant_attention_args(kv, p, seqs));
  const int g = p.n_q_heads / p.n_kv_heads;
  const int d = p.head_dim;
  std::vector<double> scores;
  std::vector<double> acc(d);
  std::vector<float> row(d);
  QuantTileArgs a;  // addressing only
  a.block_stride = kv.block_stride;
  a.block_size = kv.block_size;
  for (const AttnSeq& s : seqs) {
    a.block_table = s.block_table;
    for (int32_t r = 0; r < s.n_new; ++r) {
      const int32_t pos = s.n_past + r;
      const int32_t lo = first_visible(pos, p.window);
      scores.assign(pos + 1 - lo, 0.0);
      for (int h = 0; h < p.n_q_heads; ++h) {
        const HeadStream ks = k_head(kv, h / g);
        const HeadStream vs = v_head(kv, h / g);
        const float* q = s.q + (int64_t{r} * p.n_q_heads + h) * d;
        double mx = -std::numeric_limits<double>::infinity();
        for (int32_t t = lo; t <= pos; ++t) {
          kv_decode_row(ks.dtype, attn_quant::stream_row(a, ks, t),
                        attn_quant::stream_meta(a, ks, t), d, row.data());
          double dot = 0.0;
          for (int i = 0; i < d; ++i) dot += double{q[i]} * row[i];
          scores[t - lo] = dot * p.scale;
          mx = std::max(mx, scores[t - lo]);
        }
        double sum = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int32_t t = lo; t <= pos; ++t) {
          const double w = std::exp(scores[t - lo] - mx);
          sum += w;
          kv_decode_row(vs.dtype, attn_quant::stream_row(a, vs, t),
                        attn_quant::stream_meta(a, vs, t), d, row.data());
          for (int i = 0; i < d; ++i) acc[i] += w * row[i];
        }
        float* out = s.out + (int64_t{r} * p.n_q_heads + h) * d;
        for (int i = 0; i < d; ++i) out[i] = static_cast<float>(acc[i] / sum);
      }
    }
  }
  return {};
}

}  // namespace kvstack

#include "attention/attention_kivi.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_kivi_kernels.h"
#include "core/half.h"
#include "kv/kivi_codec.h"
#include "kv/kv_codec.h"

namespace kvstack {
namespace {

using kivi_detail::KiviOps;

constexpr int kRowsPerItem = 16;   // query rows per work item
constexpr int kResidualTile = 32;  // residual rows per tile

Status bad(const std::string& m) {
  return make_error(Errc::kInvalidArgument, "KIVI attention: " + m);
}

int64_t first_visible(int64_t pos, int window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Positions below this come from the blocks.
int64_t blocks_end(const AttnSeq& s, std::span<const KvResidualView> res, size_t i) {
  return res.empty() ? int64_t{s.n_past} + s.n_new : res[i].start;
}

// Decodes positions [t0, t0 + n) of K (value == false) or V of KV head h into
// out [n, d]. REQUIRES the tile lies in one key group of one block, or wholly
// in the residual.
void decode_tile(const KiviOps& ops, const PagedKvLayerView& kv, const AttnSeq& s,
                 const KvResidualView* res, int64_t q_start, int h, bool value, int64_t t0, int n,
                 float* out) {
  const int d = kv.head_dim;
  if (t0 >= q_start) {
    const uint16_t* src = (value ? res->v : res->k) + ((t0 - res->start) * kv.n_kv_heads + h) * d;
    ops.f16_rows(src, int64_t{kv.n_kv_heads} * d, n, d, out);
    return;
  }
  const int64_t b = s.block_table[t0 / kv.block_size];
  const int64_t slot = t0 % kv.block_size;
  const KvDtype dt = value ? kv.value_dtype() : kv.dtype;
  const int64_t head_stride = value ? kv.value_head_stride() : kv.head_stride;
  const int64_t slot_stride = value ? kv.value_slot_stride() : kv.slot_stride;
  const uint8_t* meta_base = value ? kv.v_meta : kv.k_meta;
  const int64_t meta_head = value ? kv.v_meta_head_stride : kv.k_meta_head_stride;
  const int64_t meta_slot = value ? kv.v_meta_slot_stride : kv.k_meta_slot_stride;
  const uint8_t* codes =
      (value ? kv.v : kv.k) + b * kv.block_stride + h * head_stride + slot * slot_stride;
  const uint8_t* meta =
      meta_base == nullptr ? nullptr : meta_base + b * kv.block_stride + h * meta_head;
  if (kv_dtype_is_kivi(dt) && !value) {
    ops.key_rows(kv_dtype_kivi_bits(dt), codes, slot_stride, meta + (slot / kv.kivi_group) * d * 4,
                 n, d, out);
  } else if (kv_dtype_is_kivi(dt)) {
    ops.value_rows(kv_dtype_kivi_bits(dt), codes, slot_stride, meta + slot * meta_slot, meta_slot,
                   n, d, out);
  } else {
    for (int t = 0; t < n; ++t) {
      kv_decode_row(dt, codes + t * slot_stride,
                    meta == nullptr ? nullptr : meta + (slot + t) * meta_slot, d, out + t * d);
    }
  }
}

struct Scratch {
  std::vector<float> k, v, m, l, acc, sc;
};

struct Item {
  int32_t seq;
  int32_t head;
  int32_t r0;
  int32_t r1;
  int64_t k0 = 0;                                    // keys [k0, k1) of this piece
  int64_t k1 = std::numeric_limits<int64_t>::max();  // (split-K of one decode row)
  int64_t part = -1;  // >= 0: writes its partial state to partials + part, else the output
  // Rows [r0, r1) on the shared AVX2 tile kernels: keys [k0, k1) of the
  // blocks, or (residual) the whole visible residual.
  bool shared = false;
  bool residual = false;
};

// Split-K of decode rows: pieces of kSplitKeys keys at fixed absolute
// positions (a multiple of every key group), so a sequence's result does not
// depend on the rest of the batch or the thread count.
constexpr int64_t kSplitKeys = 512;

void run_item(const KiviOps& ops, const PagedKvLayerView& kv, const AttnParams& p, const AttnSeq& s,
              const KvResidualView* res, int64_t q_start, const Item& it, Scratch& w,
              float* partials) {
  const int d = p.head_dim;
  const int n_rep = p.n_q_heads / p.n_kv_heads;
  const int rows = it.r1 - it.r0;
  const int64_t g = kv.kivi_group;
  w.k.resize(static_cast<size_t>(kKiviMaxKeyGroup) * d);
  w.v.resize(static_cast<size_t>(kKiviMaxKeyGroup) * d);
  w.m.assign(static_cast<size_t>(rows) * n_rep, -std::numeric_limits<float>::infinity());
  w.l.assign(static_cast<size_t>(rows) * n_rep, 0.0f);
  w.acc.assign(static_cast<size_t>(rows) * n_rep * d, 0.0f);
  w.sc.resize(kKiviMaxKeyGroup);
  const int64_t lo = std::max(it.k0, first_visible(int64_t{s.n_past} + it.r0, p.window));
  const int64_t hi = std::min(it.k1, int64_t{s.n_past} + it.r1);
  for (int64_t t0 = lo; t0 < hi;) {
    const int64_t te = t0 < q_start ? std::min({q_start, (t0 / g + 1) * g, hi})
                                    : std::min<int64_t>(hi, t0 + kResidualTile);
    const int n = static_cast<int>(te - t0);
    decode_tile(ops, kv, s, res, q_start, it.head, false, t0, n, w.k.data());
    decode_tile(ops, kv, s, res, q_start, it.head, true, t0, n, w.v.data());
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = int64_t{s.n_past} + it.r0 + r;
      const int64_t rlo = std::max(t0, first_visible(pos, p.window));
      const int64_t rhi = std::min(te, pos + 1);
      if (rlo >= rhi) continue;
      const int nk = static_cast<int>(rhi - rlo);
      for (int j = 0; j < n_rep; ++j) {
        const int64_t qh = int64_t{it.head} * n_rep + j;
        const float* q = s.q + (int64_t{it.r0 + r} * p.n_q_heads + qh) * d;
        const size_t st = static_cast<size_t>(r) * n_rep + j;
        float mx = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < nk; ++t) {
          const float x = p.scale * ops.dot(q, w.k.data() + (rlo - t0 + t) * d, d);
          w.sc[t] = x;
          mx = std::max(mx, x);
        }
        const float m_new = std::max(w.m[st], mx);
        // exp(-inf) = 0: the first tile of a row starts from empty state;
        // exactly 1 when the max holds.
        const float c0 = m_new == w.m[st] ? 1.0f : std::exp(w.m[st] - m_new);
        ops.exp_shift(w.sc.data(), nk, m_new);
        float sum = 0.0f;
        for (int t = 0; t < nk; ++t) sum += w.sc[t];
        ops.scale_pv(w.acc.data() + st * d, c0, w.sc.data(), w.v.data() + (rlo - t0) * d, nk, d);
        w.l[st] = w.l[st] * c0 + sum;
        w.m[st] = m_new;
      }
    }
    t0 = te;
  }
  if (it.part >= 0) {  // one row: [m, l, acc] of its n_rep heads
    float* dst = partials + it.part;
    for (int j = 0; j < n_rep; ++j) {
      dst[j] = w.m[j];
      dst[n_rep + j] = w.l[j];
    }
    std::copy(w.acc.begin(), w.acc.begin() + static_cast<int64_t>(n_rep) * d, dst + 2 * n_rep);
    return;
  }
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < n_rep; ++j) {
      const size_t st = static_cast<size_t>(r) * n_rep + j;
      const int64_t qh = int64_t{it.head} * n_rep + j;
      float* out = s.out + (int64_t{it.r0 + r} * p.n_q_heads + qh) * d;
      const float inv = w.l[st] > 0.0f ? 1.0f / w.l[st] : 0.0f;
      for (int i = 0; i < d; ++i) out[i] = w.acc[st * d + i] * inv;
    }
  }
}

// One piece of query rows [it.r0, it.r1) of KV head it.head through the
// shared AVX2 kernels (attention_kernels.h: decode_tile_avx2 for one row,
// prefill_tile_avx2 for more, or prefill_tile_avx512 where select_kernels
// chose it: the same bits; every q head of the KV head together, each K/V
// row read once per chunk): the blocks' keys [k0, k1), or the f16 residual,
// addressed as one block of f16 rows with positions relative to its start.
// Writes the piece's partial state (m, l, acc per query vector) for the
// merge.
void run_shared_piece(const PagedKvLayerView& kv, const AttnParams& p, const AttnSeq& s,
                      const KvResidualView* res, int64_t q_start, const Item& it,
                      attn_detail::KernelPath prefill, float* partials) {
  static const int32_t kOneBlock = 0;
  const int d = p.head_dim;
  const int g = p.n_q_heads / p.n_kv_heads;
  const int rows = it.r1 - it.r0;
  attn_detail::TileArgs a;
  if (it.residual) {
    const int64_t row = int64_t{kv.n_kv_heads} * d * 2;  // bytes per residual position
    auto stream = [&](const uint16_t* base) {
      return attn_detail::HeadStream{reinterpret_cast<const uint8_t*>(base + int64_t{it.head} * d),
                                     nullptr,
                                     row,
                                     0,
                                     int64_t{d} * 2,
                                     0,
                                     KvDtype::kF16};
    };
    a.k = stream(res->k);
    a.v = stream(res->v);
    a.block_table = &kOneBlock;
    a.block_size = std::numeric_limits<int32_t>::max();
    a.pos0 = static_cast<int32_t>(s.n_past + it.r0 - res->start);
    a.key_begin = 0;
    a.key_end = static_cast<int32_t>(res->n_tokens);
  } else {
    a.k = attn_detail::k_stream(kv, it.head);
    a.v = attn_detail::v_stream(kv, it.head);
    a.block_table = s.block_table;
    a.block_stride = kv.block_stride;
    a.block_size = kv.block_size;
    a.pos0 = s.n_past + it.r0;
    a.key_begin = static_cast<int32_t>(it.k0);
    a.key_end = static_cast<int32_t>(std::min(it.k1, q_start));
  }
  a.head_dim = d;
  a.row_stride = int64_t{p.n_q_heads} * d;
  a.q = s.q + it.r0 * a.row_stride + int64_t{it.head} * g * d;
  a.n_rows = rows;
  a.group = g;
  a.window = p.window;
  a.scale = p.scale;
  const int n_vec = rows * g;
  a.part_m = partials + it.part;
  a.part_l = a.part_m + n_vec;
  a.part_acc = a.part_l + n_vec;
  // int4 keys beside a KIVI V keep the float query here (this path does not
  // round it: attention_quant.h), and the decode kernel reads int4 keys only
  // with q^, so their rows take the prefill kernel.
  if (rows == 1 && a.k.dtype != KvDtype::kInt4) {
    attn_detail::decode_tile_avx2(a);
  } else {
    attn_detail::prefill_tile_on(prefill, a);
  }
}

// The pieces of query rows [r0, r0 + n_rows) of one KV head (split-K of a
// decode row, or blocks + residual), merged in key order.
struct SplitRow {
  int32_t seq;
  int32_t head;
  int64_t first_part;  // offset of piece 0 in the partials
  int n_parts;
  int32_t r0 = 0;
  int32_t n_rows = 1;
  int64_t part_floats = 0;  // floats per piece: n_rows * group * (head_dim + 2)
};

}  // namespace

Status validate_kivi_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                                    std::span<const AttnSeq> seqs,
                                    std::span<const KvResidualView> residuals) {
  if (!kv_view_is_kivi(kv)) return bad("the KV view has no KIVI K or V");
  if (p.n_q_heads <= 0 || p.n_kv_heads <= 0 || p.n_q_heads % p.n_kv_heads != 0) {
    return bad("n_q_heads " + std::to_string(p.n_q_heads) + " must be a positive multiple of " +
               "n_kv_heads " + std::to_string(p.n_kv_heads));
  }
  if (p.n_kv_heads != kv.n_kv_heads) {
    return bad("n_kv_heads " + std::to_string(p.n_kv_heads) + " != KV view's " +
               std::to_string(kv.n_kv_heads));
  }
  if (p.head_dim != kv.head_dim || p.head_dim <= 0 || p.head_dim % 32 != 0) {
    return bad("head_dim " + std::to_string(p.head_dim) + " must equal the view's " +
               std::to_string(kv.head_dim) + " and be a multiple of 32");
  }
  if (!std::isfinite(p.scale)) return bad("scale is not finite");
  if (p.window < 0) return bad("window " + std::to_string(p.window) + " is negative");
  if (kv.block_size <= 0 || kv.kivi_group <= 0 || kv.kivi_group > kKiviMaxKeyGroup ||
      kv.block_size % kv.kivi_group != 0) {
    return bad("key group " + std::to_string(kv.kivi_group) + " must be in [1, 32] and divide " +
               "the block size " + std::to_string(kv.block_size));
  }
  if (kv.k == nullptr || kv.v == nullptr) return bad("KV view has null k or v");
  if (!residuals.empty() && residuals.size() != seqs.size()) {
    return bad(std::to_string(residuals.size()) + " residuals for " + std::to_string(seqs.size()) +
               " sequences");
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    const AttnSeq& s = seqs[i];
    auto who = [i] { return "sequence " + std::to_string(i) + ": "; };
    if (s.n_past < 0 || s.n_new < 0) return bad(who() + "n_past / n_new negative");
    if (s.key_mass != nullptr) {
      return bad(who() + "key_mass (H2O attention mass) is not supported for KIVI K/V");
    }
    if (s.n_new == 0) continue;
    if (s.q == nullptr || s.out == nullptr) return bad(who() + "q or out is null");
    const int64_t n_tokens = int64_t{s.n_past} + s.n_new;
    if (!residuals.empty()) {
      const KvResidualView& r = residuals[i];
      if (r.start < 0 || r.n_tokens < 0 || r.start % kv.kivi_group != 0 ||
          r.start + r.n_tokens != n_tokens) {
        return bad(who() + "residual [" + std::to_string(r.start) + ", " +
                   std::to_string(r.start + r.n_tokens) + ") must start at a multiple of " +
                   std::to_string(kv.kivi_group) + " and end at " + std::to_string(n_tokens));
      }
      if (r.n_tokens > 0 && (r.k == nullptr || r.v == nullptr)) {
        return bad(who() + "residual has null k or v");
      }
    }
    const int64_t in_blocks = blocks_end(s, residuals, i);
    const int64_t need = (in_blocks + kv.block_size - 1) / kv.block_size;
    if (s.n_blocks < need || (need > 0 && s.block_table == nullptr)) {
      return bad(who() + std::to_string(in_blocks) + " quantized tokens need " +
                 std::to_string(need) + " blocks, block table has " + std::to_string(s.n_blocks));
    }
    for (int64_t b = first_visible(s.n_past, p.window) / kv.block_size; b < need; ++b) {
      if (s.block_table[b] < 0) {
        return bad(who() + "block table entry " + std::to_string(b) + " is " +
                   std::to_string(s.block_table[b]));
      }
    }
  }
  return {};
}

Status paged_attention_kivi_isa(Isa isa, const PagedKvLayerView& kv, const AttnParams& p,
                                std::span<const AttnSeq> seqs,
                                std::span<const KvResidualView> residuals, ThreadPool* pool) {
  KV_TRY_STATUS(validate_kivi_attention_args(kv, p, seqs, residuals));
  const attn_detail::KernelChoice kc =
      attn_detail::select_kernels(isa, kv.dtype, kv.value_dtype(), p.head_dim);
  const bool avx2 = kc.decode != attn_detail::KernelPath::kScalar;
  const KiviOps& ops = kivi_detail::scalar_ops();  // rows not on the shared AVX2 kernels
  const int n_rep = p.n_q_heads / p.n_kv_heads;
  const int64_t part_floats = int64_t{n_rep} * (p.head_dim + 2);
  std::vector<Item> items;
  std::vector<SplitRow> splits;
  int64_t n_partial_floats = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const AttnSeq& s = seqs[i];
    for (int h = 0; h < p.n_kv_heads; ++h) {
      const int64_t pos = s.n_past;
      const int64_t lo = first_visible(pos, p.window);
      if (avx2) {
        // Blocks of kRowsPerItem rows; each: the blocks' keys (a decode row
        // in pieces at fixed positions), then the residual.
        const int64_t q_start = blocks_end(s, residuals, i);
        for (int r0 = 0; r0 < s.n_new; r0 += kRowsPerItem) {
          const int r1 = std::min(s.n_new, r0 + kRowsPerItem);
          const int64_t lo0 = first_visible(int64_t{s.n_past} + r0, p.window);  // smallest
          SplitRow sr{static_cast<int32_t>(i),
                      h,
                      n_partial_floats,
                      0,
                      r0,
                      r1 - r0,
                      int64_t{r1 - r0} * n_rep * (p.head_dim + 2)};
          auto add = [&](Item it) {
            it.part = n_partial_floats;
            it.shared = true;
            items.push_back(it);
            n_partial_floats += sr.part_floats;
            ++sr.n_parts;
          };
          const int64_t blocks_hi = std::min(q_start, int64_t{s.n_past} + r1);
          const int64_t step = s.n_new == 1 ? kSplitKeys : std::max<int64_t>(blocks_hi, 1);
          for (int64_t k0 = s.n_new == 1 ? lo0 / kSplitKeys * kSplitKeys : 0; k0 < blocks_hi;
               k0 += step) {
            if (k0 + step > lo0) add(Item{static_cast<int32_t>(i), h, r0, r1, k0, k0 + step});
          }
          if (q_start < int64_t{s.n_past} + r1) {
            add(Item{static_cast<int32_t>(i), h, r0, r1, q_start, int64_t{s.n_past} + r1, -1, true,
                     true});
          }
          splits.push_back(sr);
        }
        continue;
      }
      if (s.n_new == 1 && pos + 1 - lo > kSplitKeys) {
        // Pieces [k * kSplitKeys, (k + 1) * kSplitKeys) overlapping [lo, pos].
        SplitRow sr{static_cast<int32_t>(i), h, n_partial_floats, 0, 0, 1, part_floats};
        for (int64_t k0 = lo / kSplitKeys * kSplitKeys; k0 <= pos; k0 += kSplitKeys) {
          items.push_back(
              Item{static_cast<int32_t>(i), h, 0, 1, k0, k0 + kSplitKeys, n_partial_floats});
          n_partial_floats += part_floats;
          ++sr.n_parts;
        }
        splits.push_back(sr);
        continue;
      }
      for (int r = 0; r < s.n_new; r += kRowsPerItem) {
        items.push_back(Item{static_cast<int32_t>(i), h, r, std::min(s.n_new, r + kRowsPerItem)});
      }
    }
  }
  std::vector<float> partials(static_cast<size_t>(n_partial_floats));
  auto body = [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t k = begin; k < end; ++k) {
      const Item& it = items[static_cast<size_t>(k)];
      const AttnSeq& s = seqs[static_cast<size_t>(it.seq)];
      const KvResidualView* res = residuals.empty() ? nullptr : &residuals[it.seq];
      const int64_t q_start = blocks_end(s, residuals, static_cast<size_t>(it.seq));
      if (it.shared) {
        run_shared_piece(kv, p, s, res, q_start, it, kc.prefill, partials.data());
      } else {
        run_item(ops, kv, p, s, res, q_start, it, scratch, partials.data());
      }
    }
  };
  const auto n = static_cast<int64_t>(items.size());
  if (pool != nullptr && n > 1) {
    pool->parallel_for(n, 1, body);
  } else {
    body(0, n);
  }
  const int d = p.head_dim;
  for (const SplitRow& sr : splits) {
    const AttnSeq& s = seqs[static_cast<size_t>(sr.seq)];
    const int n_vec = sr.n_rows * n_rep;  // vector v: row r0 + v / n_rep, q head v % n_rep
    for (int v = 0; v < n_vec; ++v) {
      float* dst =
          s.out +
          ((int64_t{sr.r0} + v / n_rep) * p.n_q_heads + int64_t{sr.head} * n_rep + v % n_rep) * d;
      attn_detail::merge_split_k(partials.data() + sr.first_part, sr.n_parts, sr.part_floats, n_vec,
                                 v, d, dst);
    }
  }
  return {};
}

Status paged_attention_kivi(const PagedKvLayerView& kv, const AttnParams& p,
                            std::span<const AttnSeq> seqs,
                            std::span<const KvResidualView> residuals, ThreadPool* pool) {
  return paged_attention_kivi_isa(best_isa(), kv, p, seqs, residuals, pool);
}

Status paged_attention_kivi_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                      std::span<const AttnSeq> seqs,
                                      std::span<const KvResidualView> residuals) {
  KV_TRY_STATUS(validate_kivi_attention_args(kv, p, seqs, residuals));
  const KiviOps& ops = kivi_detail::scalar_ops();
  const int d = p.head_dim;
  const int n_rep = p.n_q_heads / p.n_kv_heads;
  std::vector<float> kt(static_cast<size_t>(d)), vt(static_cast<size_t>(d));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const AttnSeq& s = seqs[i];
    const KvResidualView* res = residuals.empty() ? nullptr : &residuals[i];
    const int64_t q_start = blocks_end(s, residuals, i);
    for (int r = 0; r < s.n_new; ++r) {
      const int64_t pos = int64_t{s.n_past} + r;
      const int64_t lo = first_visible(pos, p.window);
      for (int qh = 0; qh < p.n_q_heads; ++qh) {
        const int h = qh / n_rep;
        const float* q = s.q + (int64_t{r} * p.n_q_heads + qh) * d;
        std::vector<double> sc(static_cast<size_t>(pos + 1 - lo));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t t = lo; t <= pos; ++t) {
          decode_tile(ops, kv, s, res, q_start, h, false, t, 1, kt.data());
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * kt[c];
          sc[t - lo] = dot * p.scale;
          mx = std::max(mx, sc[t - lo]);
        }
        std::vector<double> acc(static_cast<size_t>(d), 0.0);
        double sum = 0;
        for (int64_t t = lo; t <= pos; ++t) {
          const double e = std::exp(sc[t - lo] - mx);
          sum += e;
          decode_tile(ops, kv, s, res, q_start, h, true, t, 1, vt.data());
          for (int c = 0; c < d; ++c) acc[c] += e * vt[c];
        }
        float* out = s.out + (int64_t{r} * p.n_q_heads + qh) * d;
        for (int c = 0; c < d; ++c) out[c] = static_cast<float>(acc[c] / sum);
      }
    }
  }
  return {};
}

namespace kivi_detail {
namespace {

void key_rows_scalar(int bits, const uint8_t* codes, int64_t code_stride, const uint8_t* meta,
                     int n, int d, float* out) {
  for (int t = 0; t < n; ++t)
    kivi_decode_key_row(bits, codes + t * code_stride, meta, d, out + t * d);
}
void value_rows_scalar(int bits, const uint8_t* codes, int64_t code_stride, const uint8_t* meta,
                       int64_t meta_stride, int n, int d, float* out) {
  for (int t = 0; t < n; ++t) {
    kivi_decode_value_row(bits, codes + t * code_stride, meta + t * meta_stride, d, out + t * d);
  }
}
void f16_rows_scalar(const uint16_t* src, int64_t stride, int n, int d, float* out) {
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < d; ++i) out[t * d + i] = f16_to_f32(src[t * stride + i]);
  }
}
float dot_scalar(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}
void exp_shift_scalar(float* x, int n, float m) {
  for (int t = 0; t < n; ++t) x[t] = std::exp(x[t] - m);
}
void scale_pv_scalar(float* acc, float c, const float* w, const float* x, int n, int d) {
  for (int i = 0; i < d; ++i) {
    float a = acc[i] * c;
    for (int t = 0; t < n; ++t) a += w[t] * x[static_cast<int64_t>(t) * d + i];
    acc[i] = a;
  }
}

}  // namespace

const KiviOps& scalar_ops() {
  static const KiviOps ops{key_rows_scalar, value_rows_scalar, f16_rows_scalar,
                           dot_scalar,      exp_shift_scalar,  scale_pv_scalar};
  return ops;
}

}  // namespace kivi_detail
}  // namespace kvstack

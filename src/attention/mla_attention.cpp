#include "attention/mla_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "attention/mla_attention_kernels.h"
#include "kv/kv_codec.h"

namespace kvstack {
namespace {

using mla_detail::kMlaTile;
using mla_detail::meta_at;
using mla_detail::mla_pad;
using mla_detail::MlaTileFns;
using mla_detail::row_at;

// A decode row is split along its keys into pieces of at least this many
// keys when there are too few rows to keep every thread busy (split-K).
constexpr int32_t kMinSplitKeys = 256;

Status validate(const PagedKvLayerView& view, const MlaAttnParams& p) {
  const int d = p.latent_dim + p.rope_dim;
  if (view.v != nullptr || view.n_kv_heads != 1 || view.head_dim != d || p.n_heads < 1 ||
      p.latent_dim < 1) {
    return make_error(Errc::kInvalidArgument,
                      "mla_attention: the view is not an MLA latent layer of " + std::to_string(d) +
                          " elements per token");
  }
  if (!mla_latent_dtype_supported(view.dtype)) {
    return make_error(Errc::kUnsupported, std::string("mla_attention: latent dtype ") +
                                              kv_dtype_name(view.dtype) +
                                              " is not supported (f32, f16, bf16, int8)");
  }
  if (view.dtype == KvDtype::kInt8 && view.k_meta == nullptr) {
    return make_error(Errc::kInvalidArgument, "mla_attention: int8 latent view without scales");
  }
  return {};
}

// Prefill: up to this many consecutive query rows of a sequence share each
// decoded key tile (the cache is streamed once per group, not per row).
constexpr int32_t kRowGroup = 4;

// Keys [k0, k1) of query rows row .. row + n_rows - 1 (row r sees keys up to
// n_past + r only); a split piece is one row.
struct Piece {
  int32_t seq = 0, row = 0, k0 = 0, k1 = 0;
  int32_t part = -1;  // partial-state slot when the row is split, else -1
  int32_t n_rows = 1;
};

struct Scratch {
  std::vector<float> q, buf, s, m, l, f, acc;
  std::vector<const uint8_t*> rows, metas;
};

}  // namespace

bool mla_latent_dtype_supported(KvDtype dt) {
  return dt == KvDtype::kF32 || dt == KvDtype::kF16 || dt == KvDtype::kBF16 || dt == KvDtype::kInt8;
}

std::string mla_attention_kernel_name(KvDtype dtype) {
  Isa isa = best_isa();
  if (isa == Isa::kAvx512 && mla_detail::mla_tile_fns(isa) == nullptr) isa = Isa::kAvx2;
  if (mla_detail::mla_tile_fns(isa) == nullptr) isa = Isa::kScalar;
  return std::string(kv_dtype_name(dtype)) + " " + isa_name(isa);
}

Status mla_attention_reference(const PagedKvLayerView& view, const MlaAttnParams& p,
                               std::span<const AttnSeq> seqs, ThreadPool* pool) {
  KV_TRY_STATUS(validate(view, p));
  const int d = p.latent_dim + p.rope_dim;
  // Work items: (sequence, query row).
  std::vector<std::pair<int32_t, int32_t>> items;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int32_t r = 0; r < seqs[s].n_new; ++r) items.emplace_back(static_cast<int32_t>(s), r);
  }
  const int H = p.n_heads, dc = p.latent_dim;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(d)), acc(static_cast<size_t>(H) * dc);
    std::vector<float> m(static_cast<size_t>(H)), l(static_cast<size_t>(H));
    for (int64_t it = begin; it < end; ++it) {
      const AttnSeq& s = seqs[static_cast<size_t>(items[static_cast<size_t>(it)].first)];
      const int32_t r = items[static_cast<size_t>(it)].second;
      const float* q = s.q + static_cast<int64_t>(r) * H * d;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      const int32_t n_keys = s.n_past + r + 1;
      for (int32_t j = 0; j < n_keys; ++j) {
        kv_decode_row(view.dtype, row_at(view, s, j), meta_at(view, s, j), d, row.data());
        for (int h = 0; h < H; ++h) {
          const float* qh = q + static_cast<int64_t>(h) * d;
          float dot = 0.0f;
          for (int i = 0; i < d; ++i) dot += qh[i] * row[static_cast<size_t>(i)];
          const float sc = dot * p.scale;
          float* a = acc.data() + static_cast<size_t>(h) * dc;
          // Online softmax: rescale the running sum when the max grows.
          if (sc > m[static_cast<size_t>(h)]) {
            const float f = std::exp(m[static_cast<size_t>(h)] - sc);
            l[static_cast<size_t>(h)] *= f;
            for (int i = 0; i < dc; ++i) a[i] *= f;
            m[static_cast<size_t>(h)] = sc;
          }
          const float w = std::exp(sc - m[static_cast<size_t>(h)]);
          l[static_cast<size_t>(h)] += w;
          for (int i = 0; i < dc; ++i) a[i] += w * row[static_cast<size_t>(i)];
        }
      }
      float* out = s.out + static_cast<int64_t>(r) * H * dc;
      for (int h = 0; h < H; ++h) {
        const float inv = 1.0f / l[static_cast<size_t>(h)];
        for (int i = 0; i < dc; ++i) {
          out[static_cast<int64_t>(h) * dc + i] = acc[static_cast<size_t>(h) * dc + i] * inv;
        }
      }
    }
  };
  const auto n = static_cast<int64_t>(items.size());
  if (pool != nullptr && n > 1) {
    pool->parallel_for(n, 1, run);
  } else {
    run(0, n);
  }
  return {};
}

Status mla_attention_isa(Isa isa, const PagedKvLayerView& view, const MlaAttnParams& p,
                         std::span<const AttnSeq> seqs, ThreadPool* pool) {
  // The requested ISA, else AVX2, else the scalar reference.
  const MlaTileFns* fns = mla_detail::mla_tile_fns(isa);
  if (fns == nullptr && isa == Isa::kAvx512) fns = mla_detail::mla_tile_fns(Isa::kAvx2);
  if (fns == nullptr) return mla_attention_reference(view, p, seqs, pool);
  KV_TRY_STATUS(validate(view, p));
  const int H = p.n_heads, dc = p.latent_dim, d = dc + p.rope_dim;
  const int dpad = mla_pad(d), dcpad = mla_pad(dc);

  // Pieces: every query row, a row split along its keys when there are too
  // few rows to give each thread several pieces.
  const int n_threads = pool != nullptr ? pool->n_threads() : 1;
  int64_t n_rows = 0;
  for (const AttnSeq& s : seqs) n_rows += std::max(s.n_new, 0);
  const int64_t want = 4LL * n_threads;
  // Rows per piece when no row is split: groups of kRowGroup while that
  // still leaves two pieces per thread.
  const auto group = static_cast<int32_t>(
      n_rows < want ? 1 : std::clamp<int64_t>(n_rows / (2LL * n_threads), 1, kRowGroup));
  std::vector<Piece> pieces;
  struct SplitRow {
    int32_t seq, row, first_part, n_parts;
  };
  std::vector<SplitRow> split_rows;
  int32_t n_parts = 0;
  for (size_t si = 0; si < seqs.size(); ++si) {
    const AttnSeq& s = seqs[si];
    if (group > 1) {
      for (int32_t r = 0; r < s.n_new; r += group) {
        const int32_t g = std::min(group, s.n_new - r);
        pieces.push_back(Piece{static_cast<int32_t>(si), r, 0, s.n_past + r + g, -1, g});
      }
      continue;
    }
    for (int32_t r = 0; r < s.n_new; ++r) {
      const int32_t n_keys = s.n_past + r + 1;
      int32_t split = 1;
      if (n_rows < want) {
        split = static_cast<int32_t>(
            std::min<int64_t>((want + n_rows - 1) / n_rows, std::max(1, n_keys / kMinSplitKeys)));
      }
      if (split == 1) {
        pieces.push_back(Piece{static_cast<int32_t>(si), r, 0, n_keys, -1});
        continue;
      }
      split_rows.push_back(SplitRow{static_cast<int32_t>(si), r, n_parts, split});
      // Piece boundaries on tile multiples.
      const int32_t per = (n_keys + split - 1) / split;
      const int32_t step = (per + kMlaTile - 1) / kMlaTile * kMlaTile;
      int32_t k = 0, used = 0;
      for (; k < n_keys; k += step, ++used) {
        pieces.push_back(
            Piece{static_cast<int32_t>(si), r, k, std::min(k + step, n_keys), n_parts + used});
      }
      for (; used < split; ++used) {  // a part with no keys: empty state
        pieces.push_back(Piece{static_cast<int32_t>(si), r, n_keys, n_keys, n_parts + used});
      }
      n_parts += split;
    }
  }
  // Partial states: m [H], l [H], acc [H][dcpad] per part.
  std::vector<float> part_m(static_cast<size_t>(n_parts) * H),
      part_l(static_cast<size_t>(n_parts) * H), part_acc(static_cast<size_t>(n_parts) * H * dcpad);

  auto run_piece = [&](const Piece& pc, Scratch& sc) {
    const AttnSeq& s = seqs[static_cast<size_t>(pc.seq)];
    const int R = pc.n_rows;
    for (int rr = 0; rr < R; ++rr) {
      const float* q = s.q + static_cast<int64_t>(pc.row + rr) * H * d;
      for (int h = 0; h < H; ++h) {
        float* qd = sc.q.data() + (static_cast<size_t>(rr) * H + h) * dpad;
        std::copy_n(q + static_cast<int64_t>(h) * d, d, qd);
        std::fill(qd + d, qd + dpad, 0.0f);
      }
    }
    // Row rr's state: m/l [H], acc [H][dcpad] (a split piece: its part's).
    auto m_of = [&](int rr) {
      return pc.part >= 0 ? part_m.data() + static_cast<size_t>(pc.part) * H
                          : sc.m.data() + static_cast<size_t>(rr) * H;
    };
    auto l_of = [&](int rr) {
      return pc.part >= 0 ? part_l.data() + static_cast<size_t>(pc.part) * H
                          : sc.l.data() + static_cast<size_t>(rr) * H;
    };
    auto acc_of = [&](int rr) {
      return pc.part >= 0 ? part_acc.data() + static_cast<size_t>(pc.part) * H * dcpad
                          : sc.acc.data() + static_cast<size_t>(rr) * H * dcpad;
    };
    for (int rr = 0; rr < R; ++rr) {
      std::fill_n(m_of(rr), H, -INFINITY);
      std::fill_n(l_of(rr), H, 0.0f);
      std::fill_n(acc_of(rr), static_cast<size_t>(H) * dcpad, 0.0f);
    }
    for (int32_t k = pc.k0; k < pc.k1; k += kMlaTile) {
      const int n = std::min<int32_t>(kMlaTile, pc.k1 - k);
      for (int j = 0; j < n; ++j) {
        sc.rows[static_cast<size_t>(j)] = row_at(view, s, k + j);
        sc.metas[static_cast<size_t>(j)] = meta_at(view, s, k + j);
      }
      fns->decode(view.dtype, sc.rows.data(), sc.metas.data(), n, d, dpad, sc.buf.data());
      for (int rr = 0; rr < R; ++rr) {
        // Causal: row pc.row + rr sees keys < n_past + row + rr + 1.
        const int nv = std::min<int32_t>(n, s.n_past + pc.row + rr + 1 - k);
        if (nv <= 0) continue;
        const float* q = sc.q.data() + static_cast<size_t>(rr) * H * dpad;
        fns->scores(q, sc.buf.data(), H, nv, dpad, p.scale, sc.s.data());
        fns->softmax(sc.s.data(), H, nv, m_of(rr), l_of(rr), sc.f.data());
        fns->accum(sc.s.data(), sc.buf.data(), H, nv, dpad, dcpad, sc.f.data(), acc_of(rr));
      }
    }
    if (pc.part >= 0) return;
    for (int rr = 0; rr < R; ++rr) {
      float* out = s.out + static_cast<int64_t>(pc.row + rr) * H * dc;
      const float* l = l_of(rr);
      for (int h = 0; h < H; ++h) {
        const float inv = 1.0f / l[h];
        const float* a = acc_of(rr) + static_cast<size_t>(h) * dcpad;
        for (int i = 0; i < dc; ++i) out[static_cast<int64_t>(h) * dc + i] = a[i] * inv;
      }
    }
  };
  auto scratch = [&]() -> Scratch& {
    thread_local Scratch sc;  // grows only
    auto grow = [](std::vector<float>& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(sc.q, static_cast<size_t>(kRowGroup) * H * dpad);
    grow(sc.buf, static_cast<size_t>(kMlaTile) * dpad);
    grow(sc.s, static_cast<size_t>(H) * kMlaTile);
    grow(sc.m, static_cast<size_t>(kRowGroup) * H);
    grow(sc.l, static_cast<size_t>(kRowGroup) * H);
    grow(sc.f, static_cast<size_t>(H));
    grow(sc.acc, static_cast<size_t>(kRowGroup) * H * dcpad);
    if (sc.rows.size() < static_cast<size_t>(kMlaTile)) {
      sc.rows.resize(kMlaTile);
      sc.metas.resize(kMlaTile);
    }
    return sc;
  };
  const auto n_pieces = static_cast<int64_t>(pieces.size());
  if (pool != nullptr && n_pieces > 1) {
    std::atomic<int64_t> next{0};
    pool->run_shared([&](int) {
      Scratch& sc = scratch();
      for (int64_t i = next.fetch_add(1); i < n_pieces; i = next.fetch_add(1)) {
        run_piece(pieces[static_cast<size_t>(i)], sc);
      }
    });
  } else {
    Scratch& sc = scratch();
    for (const Piece& pc : pieces) run_piece(pc, sc);
  }
  // Merge the parts of split rows.
  for (const SplitRow& sr : split_rows) {
    const AttnSeq& s = seqs[static_cast<size_t>(sr.seq)];
    float* out = s.out + static_cast<int64_t>(sr.row) * H * dc;
    for (int h = 0; h < H; ++h) {
      float mx = -INFINITY;
      for (int32_t t = 0; t < sr.n_parts; ++t) {
        mx = std::max(mx, part_m[static_cast<size_t>(sr.first_part + t) * H + h]);
      }
      float* o = out + static_cast<int64_t>(h) * dc;
      std::fill_n(o, dc, 0.0f);
      float z = 0.0f;
      for (int32_t t = 0; t < sr.n_parts; ++t) {
        const size_t pi = static_cast<size_t>(sr.first_part) + static_cast<size_t>(t);
        const float pm = part_m[pi * H + h];
        if (pm == -INFINITY) continue;  // a part without keys
        const float w = std::exp(pm - mx);
        z += w * part_l[pi * H + h];
        const float* a = part_acc.data() + (pi * H + h) * dcpad;
        for (int i = 0; i < dc; ++i) o[i] += w * a[i];
      }
      const float inv = 1.0f / z;
      for (int i = 0; i < dc; ++i) o[i] *= inv;
    }
  }
  return {};
}

Status mla_attention(const PagedKvLayerView& view, const MlaAttnParams& p,
                     std::span<const AttnSeq> seqs, ThreadPool* pool) {
  return mla_attention_isa(best_isa(), view, p, seqs, pool);
}

}  // namespace kvstack

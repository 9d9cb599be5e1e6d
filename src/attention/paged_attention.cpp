// Argument validation, work planning (tiles, split-K), threading and the
// split-K merge for paged_attention(); the double-precision reference.
#include "attention/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_kivi.h"
#include "attention/attention_quant.h"
#include "core/cpu_features.h"
#include "core/half.h"

namespace kvstack {
namespace {

using attn_detail::first_visible;

// Query vectors ((row, q head) pairs of one KV group) per prefill tile.
constexpr int kPrefillVectors = 32;
// Split-K pieces: a tile seeing more keys than this is cut at the multiples
// of it (absolute positions, so the cut depends only on the tile's own key
// range), the last piece taking a tail of less than a quarter piece. A piece's partial state costs
// n_vec * (head_dim + 2) floats to write and merge; decode pieces are short so that one long
// sequence spreads over every thread, prefill tiles are many already.
constexpr int32_t kDecodeSplitKeys = 512;
constexpr int32_t kPrefillSplitKeys = 4096;
// Decode rows seeing at least this many keys take all KV heads in one tile:
// the heads of a block lie next to each other, so the tile streams whole
// blocks.
constexpr int32_t kMergeHeadsKeys = 2 * kDecodeSplitKeys;
// A call with at least this many decode rows per thread takes all KV heads
// of every decode row in one tile, whatever its length: the rows alone give
// every thread several tiles, and one tile per row computes its slot lists
// once for all heads. A decode tile's heads are computed one after the other
// with the same chunks and the same arithmetic as one-head tiles, so this
// changes no bits (scheduler_test BatchInvariance, paged_attention_test).
constexpr int kMergeHeadsRowsPerThread = 2;

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t row0;
  int32_t n_rows;
  int32_t key_begin;
  int32_t key_end;
  int64_t cost;         // ~ key rows touched times query rows times KV heads
  int64_t part_offset;  // float offset of its partial slot, or -1
  int32_t n_heads;      // KV heads kv_head .. kv_head + n_heads - 1 (> 1 only for decode)
};

// The pieces of one split tile: slot p at first_offset + p * slot_floats,
// each [m: n_vec][l: n_vec][acc: n_vec, head_dim].
struct MergeGroup {
  int32_t seq;
  int32_t kv_head;
  int32_t row0;
  int32_t n_rows;
  int32_t n_parts;
  int32_t n_heads;
  int64_t first_offset;
};

// Key-mass buffers of one sequence with AttnSeq::key_mass (offsets into
// Plan::mass, floats), chunk-major (TileArgs::mass_p): p [n_chunks,
// n_q_heads, chunk] f16 (exp(s - m_chunk) per key; its floats rounded up
// to a multiple of 16), chunk maxima [n_chunks, n_q_heads], then the final
// (max, sum) [n_q_heads, 2].
struct MassSeq {
  int32_t seq;
  int32_t n_keys;
  int32_t chunk;  // keys per max record (the decode kernel's chunk)
  int32_t n_chunks;
  int64_t p_offset;
  int64_t m_offset;
  int64_t ml_offset;
  // Its one merge group has every KV head: the merge runs its mass pass.
  bool in_merge;
};

struct Plan {
  std::vector<WorkItem> items;
  std::vector<MergeGroup> merges;
  attn_detail::ScratchBuffer partials;
  std::vector<MassSeq> mass_seqs;
  std::vector<int32_t> mass_of_seq;  // [n_seqs] index into mass_seqs, or -1
  attn_detail::ScratchBuffer mass;
};

Plan& thread_plan() {
  thread_local Plan plan;
  return plan;
}

// (mass sequence, first key) pieces of the key-mass pass.
std::vector<std::pair<int32_t, int32_t>>& mass_work() {
  thread_local std::vector<std::pair<int32_t, int32_t>> work;
  return work;
}

Error bad(const std::string& what) {
  return make_error(Errc::kInvalidArgument, "paged_attention: " + what);
}

float kv_element(const PagedKvLayerView& kv, const uint8_t* head_base, const int32_t* table,
                 int32_t t, int i) {
  const uint8_t* p = head_base + table[t / kv.block_size] * kv.block_stride +
                     (t % kv.block_size) * kv.slot_stride + i * kv_dtype_bytes(kv.dtype);
  if (kv.dtype == KvDtype::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return kv.dtype == KvDtype::kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Cuts every sequence into tiles and split-K pieces. Everything here depends
// only on the sequence itself (see run_attention's contract): the thread
// count only changes who runs which item.
void make_plan(Plan& plan, const AttnParams& p, std::span<const AttnSeq> seqs,
               const attn_detail::KernelChoice& kc, int n_threads) {
  const int g = p.n_q_heads / p.n_kv_heads;
  int64_t n_decode = 0;
  for (const AttnSeq& s : seqs) n_decode += s.n_new == 1 ? 1 : 0;
  const bool many_decodes = n_decode >= int64_t{kMergeHeadsRowsPerThread} * n_threads;
  plan.items.clear();
  plan.merges.clear();
  int64_t offset = 0;
  for (size_t si = 0; si < seqs.size(); ++si) {
    const AttnSeq& s = seqs[si];
    const int32_t rows_per_tile = s.n_new == 1 ? 1 : std::max(1, kPrefillVectors / g);
    for (int32_t row0 = 0; row0 < s.n_new; row0 += rows_per_tile) {
      const int32_t n_rows = std::min(rows_per_tile, s.n_new - row0);
      const int32_t pos_first = s.n_past + row0;
      const int32_t key_begin = first_visible(pos_first, p.window);
      const int32_t key_end = pos_first + n_rows;
      const int32_t len = key_end - key_begin;
      // Decode (one new token) and prefill rows go through different kernels
      // (their float order differs slightly). Which one a row takes depends
      // on n_new only, never on how the prompt was cut into tiles or chunks,
      // so a prompt row gives the same bits in any chunking with entries of
      // at least 2 tokens (a 1-row tile of a chunk stays on the prefill path).
      const bool decode = s.n_new == 1;
      const int n_heads = kc.decode != attn_detail::KernelPath::kScalar && decode &&
                                  (len >= kMergeHeadsKeys || many_decodes)
                              ? p.n_kv_heads
                              : 1;
      const int32_t piece = decode ? kDecodeSplitKeys : kPrefillSplitKeys;
      const int64_t slot_floats = int64_t{n_rows} * g * n_heads * (p.head_dim + 2);
      for (int32_t h = 0; h < p.n_kv_heads; h += n_heads) {
        WorkItem t{static_cast<int32_t>(si),        h,  row0,   n_rows, key_begin, key_end,
                   int64_t{len} * n_rows * n_heads, -1, n_heads};
        // A sequence accumulating key mass always takes the split-K path
        // (one piece when short): the merge gives every q head's final max
        // and sum. One piece merges to the same bits finish_tile writes.
        // The last piece takes a tail shorter than a quarter piece (a decode
        // at 513..639 keys is one tile, not a full piece plus a few keys and a
        // merge: for 16 sequences at context 512 that was 48 extra items and
        // merges per layer).
        const int32_t tail = piece / 4;
        auto piece_end = [&](int32_t begin) {
          const int32_t end = std::min<int32_t>(key_end, (begin / piece + 1) * piece);
          return key_end - end < tail ? key_end : end;
        };
        if (piece_end(key_begin) == key_end && s.key_mass == nullptr) {
          plan.items.push_back(t);
          continue;
        }
        MergeGroup mg{t.seq, h, row0, n_rows, 0, n_heads, offset};
        for (int32_t begin = key_begin; begin < key_end;) {
          const int32_t end = piece_end(begin);
          WorkItem part = t;
          part.key_begin = begin;
          part.key_end = end;
          part.cost = int64_t{end - begin} * n_rows * n_heads;
          part.part_offset = offset;
          plan.items.push_back(part);
          offset += slot_floats;
          ++mg.n_parts;
          begin = end;
        }
        plan.merges.push_back(mg);
      }
    }
  }
  // Largest first, so the dynamic schedule ends with small items (the order
  // does not change any result).
  std::sort(plan.items.begin(), plan.items.end(), [](const WorkItem& x, const WorkItem& y) {
    if (x.cost != y.cost) return x.cost > y.cost;
    if (x.seq != y.seq) return x.seq < y.seq;
    if (x.kv_head != y.kv_head) return x.kv_head < y.kv_head;
    if (x.row0 != y.row0) return x.row0 < y.row0;
    return x.key_begin < y.key_begin;
  });
  plan.partials.get(static_cast<size_t>(std::max<int64_t>(offset, 1)));
  // Key-mass buffers (decode rows asking for AttnSeq::key_mass).
  plan.mass_seqs.clear();
  plan.mass_of_seq.assign(seqs.size(), -1);
  int64_t mass_floats = 0;
  for (size_t si = 0; si < seqs.size(); ++si) {
    const AttnSeq& s = seqs[si];
    if (s.key_mass == nullptr || s.n_new != 1) continue;
    const int32_t n_keys = s.n_past + 1;
    const int32_t chunk = attn_detail::decode_mass_chunk(kc.decode);
    const int32_t n_chunks = (n_keys + chunk - 1) / chunk;
    MassSeq ms{static_cast<int32_t>(si), n_keys, chunk, n_chunks, mass_floats, 0, 0, false};
    const int64_t p_halves = int64_t{p.n_q_heads} * n_chunks * chunk;
    ms.m_offset = ms.p_offset + (p_halves + 31) / 32 * 16;
    ms.ml_offset = ms.m_offset + int64_t{p.n_q_heads} * n_chunks;
    mass_floats = (ms.ml_offset + 2 * int64_t{p.n_q_heads} + 15) / 16 * 16;  // 64-byte aligned
    plan.mass_of_seq[si] = static_cast<int32_t>(plan.mass_seqs.size());
    plan.mass_seqs.push_back(ms);
  }
  for (const MergeGroup& mg : plan.merges) {
    if (const int32_t mi = plan.mass_of_seq[static_cast<size_t>(mg.seq)];
        mi >= 0 && mg.n_heads == p.n_kv_heads) {
      plan.mass_seqs[static_cast<size_t>(mi)].in_merge = true;
    }
  }
  if (mass_floats > 0) plan.mass.get(static_cast<size_t>(mass_floats));
}

// Runs fn(i) for i in [0, n) on the pool's threads, each taking the next
// index as it finishes the previous one.
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
  Shared* sh = &shared;  // one captured pointer: std::function stores it inline
  pool->run_shared([sh](int) {
    for (size_t i = sh->next.fetch_add(1, std::memory_order_relaxed); i < sh->n;
         i = sh->next.fetch_add(1, std::memory_order_relaxed)) {
      (*sh->fn)(i);
    }
  });
}

}  // namespace

Status validate_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                               std::span<const AttnSeq> seqs) {
  if (p.n_q_heads <= 0 || p.n_kv_heads <= 0) {
    return bad("n_q_heads (" + std::to_string(p.n_q_heads) + ") and n_kv_heads (" +
               std::to_string(p.n_kv_heads) + ") must be positive");
  }
  if (p.n_q_heads % p.n_kv_heads != 0) {
    return bad("n_q_heads (" + std::to_string(p.n_q_heads) + ") is not a multiple of n_kv_heads (" +
               std::to_string(p.n_kv_heads) + ")");
  }
  if (p.n_kv_heads != kv.n_kv_heads) {
    return bad("n_kv_heads " + std::to_string(p.n_kv_heads) + " != KV view's " +
               std::to_string(kv.n_kv_heads));
  }
  if (p.head_dim <= 0 || p.head_dim != kv.head_dim) {
    return bad("head_dim " + std::to_string(p.head_dim) + " must be positive and equal the KV " +
               "view's " + std::to_string(kv.head_dim));
  }
  if (!std::isfinite(p.scale)) return bad("scale is not finite");
  if (p.window < 0) return bad("window " + std::to_string(p.window) + " is negative");
  if (kv.dtype != KvDtype::kF32 && kv.dtype != KvDtype::kF16 && kv.dtype != KvDtype::kBF16) {
    return bad("unsupported KV dtype " + std::to_string(static_cast<int>(kv.dtype)));
  }
  if (kv.block_size <= 0) return bad("block_size " + std::to_string(kv.block_size) + " <= 0");
  bool any_work = false;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const AttnSeq& s = seqs[i];
    auto who = [i] { return "sequence " + std::to_string(i) + ": "; };  // built only on error
    if (s.n_past < 0 || s.n_new < 0) {
      return bad(who() + "n_past " + std::to_string(s.n_past) + " / n_new " +
                 std::to_string(s.n_new) + " negative");
    }
    if (s.n_new == 0) continue;
    any_work = true;
    const int64_t n_tokens = int64_t{s.n_past} + s.n_new;
    if (n_tokens > std::numeric_limits<int32_t>::max())
      return bad(who() + "length overflows int32");
    const int64_t need = (n_tokens + kv.block_size - 1) / kv.block_size;
    if (s.n_blocks < need || s.block_table == nullptr) {
      return bad(who() + std::to_string(n_tokens) + " tokens need " + std::to_string(need) +
                 " blocks of " + std::to_string(kv.block_size) + ", block table has " +
                 std::to_string(s.block_table == nullptr ? 0 : s.n_blocks));
    }
    // With a window, blocks wholly before the first visible position of the
    // first query row are never read and may be released (kNullBlock).
    for (int64_t b = first_visible(s.n_past, p.window) / kv.block_size; b < need; ++b) {
      if (s.block_table[b] < 0) {
        return bad(who() + "block table entry " + std::to_string(b) + " is " +
                   std::to_string(s.block_table[b]));
      }
    }
    if (s.q == nullptr || s.out == nullptr) return bad(who() + "q or out is null");
    if (s.key_mass != nullptr && (s.n_new != 1 || p.window != 0)) {
      return bad(who() + "key_mass (H2O attention mass) needs a decode row (n_new 1, not " +
                 std::to_string(s.n_new) + ") and full attention (window 0, not " +
                 std::to_string(p.window) + ")");
    }
  }
  if (any_work && (kv.k == nullptr || kv.v == nullptr)) return bad("KV view has null k or v");
  return {};
}

namespace attn_detail {

HeadStream k_stream(const PagedKvLayerView& kv, int h) {
  const bool kivi = kv_dtype_is_kivi(kv.dtype);
  return HeadStream{kv.k + h * kv.head_stride,
                    kv.k_meta == nullptr ? nullptr : kv.k_meta + h * kv.k_meta_head_stride,
                    kv.slot_stride,
                    kivi ? int64_t{kv.head_dim} * 4 : kv.k_meta_slot_stride,
                    kv.head_stride,
                    kv.k_meta_head_stride,
                    kv.dtype,
                    kivi ? kv.kivi_group : 1};
}

HeadStream v_stream(const PagedKvLayerView& kv, int h) {
  return HeadStream{kv.v + h * kv.value_head_stride(),
                    kv.v_meta == nullptr ? nullptr : kv.v_meta + h * kv.v_meta_head_stride,
                    kv.value_slot_stride(),
                    kv.v_meta_slot_stride,
                    kv.value_head_stride(),
                    kv.v_meta_head_stride,
                    kv.value_dtype()};
}

void run_attention(const KernelChoice& kc, const PagedKvLayerView& kv, const AttnParams& p,
                   std::span<const AttnSeq> seqs, ThreadPool* pool) {
  const int g = p.n_q_heads / p.n_kv_heads;
  const int d = p.head_dim;
  const int64_t row_stride = int64_t{p.n_q_heads} * d;
  Plan& plan = thread_plan();  // a reference: workers must see this thread's plan
  make_plan(plan, p, seqs, kc, pool == nullptr ? 1 : pool->n_threads());
  float* partials = plan.partials.get(1);
  float* mass = plan.mass.get(1);

  run_dynamic(pool, plan.items.size(), [&](size_t i) {
    const WorkItem& it = plan.items[i];
    const AttnSeq& s = seqs[it.seq];
    TileArgs a;
    a.k = k_stream(kv, it.kv_head);
    a.v = v_stream(kv, it.kv_head);
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
    a.round_query = seqs[it.seq].n_new == 1 && decode_rounds_query(kc, kv.dtype);
    a.n_heads = it.n_heads;
    if (it.part_offset >= 0) {
      const int n_vec = it.n_rows * g * it.n_heads;
      a.part_m = partials + it.part_offset;
      a.part_l = a.part_m + n_vec;
      a.part_acc = a.part_l + n_vec;
    }
    if (const int32_t mi = plan.mass_of_seq[it.seq]; mi >= 0) {
      const MassSeq& ms = plan.mass_seqs[static_cast<size_t>(mi)];
      const int q0 = it.kv_head * g;  // the tile's first q head
      a.mass_p = reinterpret_cast<uint16_t*>(mass + ms.p_offset) + int64_t{q0} * ms.chunk;
      a.mass_m = mass + ms.m_offset + q0;
      a.mass_stride = int64_t{p.n_q_heads} * ms.chunk;
      a.mass_m_stride = p.n_q_heads;
    }
    const KernelPath path = seqs[it.seq].n_new == 1 ? kc.decode : kc.prefill;
    if (path == KernelPath::kScalar) {
      tile_scalar(a);
    } else if (seqs[it.seq].n_new != 1) {
      prefill_tile_on(path, a);
    } else if (path == KernelPath::kAvx512Vnni) {
      decode_tile_avx512_vnni(a);
    } else if (path == KernelPath::kAvx512F16) {
      decode_tile_avx512_f16(a);
    } else {
      decode_tile_avx2(a);
    }
  });

  // Key mass: key_mass[t] += sum_h p_h[t] exp(m_h[chunk(t)] - M_h) / L_h for
  // keys [t0, t1) of one sequence (whole chunks: disjoint writes), summed
  // over the q heads in order per key, then added once (deterministic, and
  // the same bits however the keys are cut into pieces). A head's factor is
  // recomputed only where its chunk max moved (the same value otherwise).
  const int n_q = p.n_q_heads;
  // The SIMD kernels' CPU has AVX2+FMA+F16C (select_kernels).
  const bool simd = kc.decode != KernelPath::kScalar;
  auto mass_keys = [&](const MassSeq& ms, int32_t t0, int32_t t1) {
    const int32_t C = ms.chunk;
    float* dst = seqs[ms.seq].key_mass;
    const float* ml = mass + ms.ml_offset;
    thread_local std::vector<float> tl_buf;
    thread_local std::vector<const uint16_t*> tl_rows;
    tl_buf.resize(4 * static_cast<size_t>(n_q));
    tl_rows.resize(static_cast<size_t>(n_q));
    float* corr = tl_buf.data();  // [n_q] the current chunk's factors
    float* last_m = corr + n_q;   // [n_q] the chunk max they were computed for
    float* inv = last_m + n_q;    // [n_q] 1 / L_h (0: a head that saw nothing)
    float* f = inv + n_q;         // [n_rows] the factors of the heads summed
    const uint16_t** rows = tl_rows.data();
    for (int qh = 0; qh < n_q; ++qh) {
      const float l_fin = ml[2 * qh + 1];
      inv[qh] = l_fin > 0.0f ? 1.0f / l_fin : 0.0f;
      last_m[qh] = std::numeric_limits<float>::quiet_NaN();  // never equal: first chunk computes
    }
    for (int32_t c0 = t0; c0 < t1; c0 += C) {
      const int32_t ci = c0 / C;
      const int32_t n = std::min(C, t1 - c0);
      const uint16_t* pc =
          reinterpret_cast<const uint16_t*>(mass + ms.p_offset) + int64_t{ci} * n_q * C;
      const float* mc = mass + ms.m_offset + int64_t{ci} * n_q;
      int n_rows = 0;
      for (int qh = 0; qh < n_q; ++qh) {
        if (inv[qh] == 0.0f) continue;  // a head that saw nothing
        if (mc[qh] != last_m[qh]) {
          last_m[qh] = mc[qh];
          corr[qh] = std::exp(mc[qh] - ml[2 * qh]) * inv[qh];
        }
        rows[n_rows] = pc + int64_t{qh} * C;
        f[n_rows++] = corr[qh];
      }
      if (simd) {
        attn_detail::mass_add_rows_avx2(rows, f, n_rows, n, dst + c0);
      } else {
        for (int32_t j = 0; j < n; ++j) {
          float acc = 0.0f;
          for (int r = 0; r < n_rows; ++r) acc += f16_to_f32(rows[r][j]) * f[r];
          dst[c0 + j] += acc;
        }
      }
    }
  };

  // Parts are combined in key order, whatever thread computed them.
  run_dynamic(pool, plan.merges.size(), [&](size_t i) {
    const MergeGroup& mg = plan.merges[i];
    const AttnSeq& s = seqs[mg.seq];
    const int n_vec = mg.n_rows * g * mg.n_heads;
    const int64_t slot_floats = int64_t{n_vec} * (d + 2);
    for (int v = 0; v < n_vec; ++v) {
      // One query row: vector v is q head kv_head * g + v (any n_heads).
      float* dst = mg.n_rows == 1 ? s.out + mg.row0 * row_stride + (int64_t{mg.kv_head} * g + v) * d
                                  : s.out + (mg.row0 + v / g) * row_stride +
                                        (int64_t{mg.kv_head} * g + v % g) * d;
      merge_split_k(partials + mg.first_offset, mg.n_parts, slot_floats, n_vec, v, d, dst);
    }
    if (const int32_t mi = plan.mass_of_seq[mg.seq]; mi >= 0) {
      // The q heads' final softmax max and sum, for the key-mass pass.
      float* ml = mass + plan.mass_seqs[static_cast<size_t>(mi)].ml_offset;
      for (int v = 0; v < n_vec; ++v) {
        const float* parts = partials + mg.first_offset;
        float m_max = -std::numeric_limits<float>::infinity();
        for (int pi = 0; pi < mg.n_parts; ++pi)
          m_max = std::max(m_max, parts[pi * slot_floats + v]);
        float l_sum = 0.0f;
        for (int pi = 0; pi < mg.n_parts; ++pi) {
          const float mp = parts[pi * slot_floats + v];
          if (mp == -std::numeric_limits<float>::infinity()) continue;
          l_sum += std::exp(mp - m_max) * parts[pi * slot_floats + n_vec + v];
        }
        const int qh = mg.kv_head * g + v;
        ml[2 * qh] = m_max;
        ml[2 * qh + 1] = l_sum;
      }
      // A group of every KV head (a long decode row) has every q head's
      // (max, sum) now: its mass pass runs here, with no dispatch of its own.
      if (const MassSeq& ms = plan.mass_seqs[static_cast<size_t>(mi)]; ms.in_merge) {
        mass_keys(ms, 0, ms.n_keys);
      }
    }
  });

  // The other mass sequences (merged per KV head), in pieces of keys.
  if (plan.mass_seqs.empty()) return;
  constexpr int32_t kMassPiece = 1024;
  static_assert(kMassPiece % attn_detail::kMassChunkAvx2 == 0 &&
                    kMassPiece % attn_detail::kMassChunkVnni == 0,
                "mass pieces are whole decode chunks");
  std::vector<std::pair<int32_t, int32_t>>& work = mass_work();
  work.clear();
  for (size_t mi = 0; mi < plan.mass_seqs.size(); ++mi) {
    if (plan.mass_seqs[mi].in_merge) continue;
    for (int32_t t0 = 0; t0 < plan.mass_seqs[mi].n_keys; t0 += kMassPiece) {
      work.emplace_back(static_cast<int32_t>(mi), t0);
    }
  }
  run_dynamic(pool, work.size(), [&](size_t i) {
    const MassSeq& ms = plan.mass_seqs[static_cast<size_t>(work[i].first)];
    const int32_t t0 = work[i].second;
    mass_keys(ms, t0, std::min(ms.n_keys, t0 + kMassPiece));
  });
}

void merge_split_k(const float* parts, int n_parts, int64_t part_floats, int n_vec, int v,
                   int head_dim, float* dst) {
  const int d = head_dim;
  float m_max = -std::numeric_limits<float>::infinity();
  for (int pi = 0; pi < n_parts; ++pi) m_max = std::max(m_max, parts[pi * part_floats + v]);
  std::fill(dst, dst + d, 0.0f);
  float l_sum = 0.0f;
  for (int pi = 0; pi < n_parts; ++pi) {
    const float* slot = parts + pi * part_floats;
    if (slot[v] == -std::numeric_limits<float>::infinity()) continue;  // saw no key
    const float w = std::exp(slot[v] - m_max);
    l_sum += w * slot[n_vec + v];
    const float* acc = slot + 2 * n_vec + int64_t{v} * d;
    for (int c = 0; c < d; ++c) dst[c] += w * acc[c];
  }
  const float inv = l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
  for (int c = 0; c < d; ++c) dst[c] *= inv;
}

}  // namespace attn_detail

Status paged_attention(const PagedKvLayerView& kv, const AttnParams& p,
                       std::span<const AttnSeq> seqs, ThreadPool* pool) {
  if (kv_view_is_kivi(kv)) return paged_attention_kivi(kv, p, seqs, {}, pool);
  if (kv_view_is_quantized(kv)) return paged_attention_quant(kv, p, seqs, pool);
  KV_TRY_STATUS(validate_attention_args(kv, p, seqs));
  attn_detail::run_attention(
      attn_detail::select_kernels(best_isa(), kv.dtype, kv.dtype, p.head_dim), kv, p, seqs, pool);
  return {};
}

Status paged_attention_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                 std::span<const AttnSeq> seqs) {
  if (kv_view_is_kivi(kv)) return paged_attention_kivi_reference(kv, p, seqs, {});
  if (kv_view_is_quantized(kv)) return paged_attention_quant_reference(kv, p, seqs);
  KV_TRY_STATUS(validate_attention_args(kv, p, seqs));
  const int g = p.n_q_heads / p.n_kv_heads;
  const int d = p.head_dim;
  std::vector<double> scores;
  std::vector<double> acc(d);
  for (const AttnSeq& s : seqs) {
    for (int32_t r = 0; r < s.n_new; ++r) {
      const int32_t pos = s.n_past + r;
      const int32_t lo = first_visible(pos, p.window);
      scores.assign(pos + 1 - lo, 0.0);
      for (int h = 0; h < p.n_q_heads; ++h) {
        const int kvh = h / g;
        const uint8_t* kb = kv.k + kvh * kv.head_stride;
        const uint8_t* vb = kv.v + kvh * kv.head_stride;
        const float* q = s.q + (int64_t{r} * p.n_q_heads + h) * d;
        double mx = -std::numeric_limits<double>::infinity();
        for (int32_t t = lo; t <= pos; ++t) {
          double dot = 0.0;
          for (int i = 0; i < d; ++i) dot += double{q[i]} * kv_element(kv, kb, s.block_table, t, i);
          scores[t - lo] = dot * p.scale;
          mx = std::max(mx, scores[t - lo]);
        }
        double sum = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int32_t t = lo; t <= pos; ++t) {
          const double w = std::exp(scores[t - lo] - mx);
          sum += w;
          for (int i = 0; i < d; ++i) acc[i] += w * kv_element(kv, vb, s.block_table, t, i);
        }
        float* out = s.out + (int64_t{r} * p.n_q_heads + h) * d;
        for (int i = 0; i < d; ++i) out[i] = static_cast<float>(acc[i] / sum);
        if (s.key_mass != nullptr) {
          for (int32_t t = lo; t <= pos; ++t) {
            s.key_mass[t] += static_cast<float>(std::exp(scores[t - lo] - mx) / sum);
          }
        }
      }
    }
  }
  return {};
}

}  // namespace kvstack

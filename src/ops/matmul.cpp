#include "ops/matmul.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/cpu_features.h"
#include "core/half.h"
#include "ops/matmul_kernels.h"
#include "ops/quantize_act.h"

namespace kvstack {
namespace {

using ops_detail::ActKind;
using ops_detail::MatmulKernel;
using ops_detail::PreparedAct;

// Per calling thread: the prepared activation of the current call. Buffers
// only grow, so steady-state calls do not allocate.
struct Workspace {
  std::vector<int8_t> qs;
  std::vector<int32_t> qsum;
  std::vector<float> d, s, ds, f32;
  std::vector<BlockQ8_K> q8k;
};

Workspace& workspace() {
  static thread_local Workspace ws;
  return ws;
}

template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Runs fn(r0, r1) over activation rows [0, m) on the pool, in chunks that
// threads claim from a shared counter (each row is converted independently,
// so the result does not depend on who converts which row).
template <class Fn>
void for_rows(int64_t m, ThreadPool* pool, const Fn& fn) {
  const int n_threads = pool ? pool->n_threads() : 1;
  if (n_threads <= 1 || m < 4) return fn(0, m);
  const int64_t chunk = std::max<int64_t>(1, m / (4 * n_threads));
  // The job captures one pointer, so std::function stores it without allocating.
  struct Ctx {
    const Fn* fn;
    int64_t m;
    int64_t chunk;
    std::atomic<int64_t> next{0};
  } ctx{&fn, m, chunk};
  Ctx* c = &ctx;
  pool->run_shared([c](int) {
    for (int64_t r0 = c->next.fetch_add(c->chunk, std::memory_order_relaxed); r0 < c->m;
         r0 = c->next.fetch_add(c->chunk, std::memory_order_relaxed)) {
      (*c->fn)(r0, std::min(c->m, r0 + c->chunk));
    }
  });
}

PreparedAct prepare(ActKind kind, const float* x, int64_t m, int64_t n_in, ThreadPool* pool) {
  Workspace& ws = workspace();
  PreparedAct a;
  a.m = m;
  a.n_in = n_in;
  const size_t n = static_cast<size_t>(m * n_in);
  switch (kind) {
    case ActKind::kF32:
      a.f32 = x;
      break;
    case ActKind::kF16: {
      float* f = grow(ws.f32, n);
      for_rows(m, pool, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * n_in; i < r1 * n_in; ++i) f[i] = f16_to_f32(f32_to_f16(x[i]));
      });
      a.f32 = f;
      break;
    }
    case ActKind::kQ8_0:
    case ActKind::kQ8_1: {
      const int64_t nb = n_in / kQK;
      int8_t* qs = grow(ws.qs, n);
      float* d = grow(ws.d, static_cast<size_t>(m * nb));
      float* s = kind == ActKind::kQ8_1 ? grow(ws.s, static_cast<size_t>(m * nb)) : nullptr;
      float* ds = kind == ActKind::kQ8_1 ? grow(ws.ds, static_cast<size_t>(2 * m * nb)) : nullptr;
      int32_t* qsum = grow(ws.qsum, static_cast<size_t>(m * nb));
      // A chunk of rows is one call: rows are contiguous and whole blocks,
      // so the AVX-512 quantizer's groups of 16 blocks run across rows.
      for_rows(m, pool, [&](int64_t r0, int64_t r1) {
        quantize_act_q8(x + r0 * n_in, qs + r0 * n_in, d + r0 * nb, s ? s + r0 * nb : nullptr,
                        (r1 - r0) * n_in, qsum + r0 * nb);
        if (ds == nullptr) return;
        for (int64_t b = r0 * nb; b < r1 * nb; ++b) {
          ds[2 * b] = d[b];
          ds[2 * b + 1] = s[b];
        }
      });
      a.qs = qs;
      a.qsum = qsum;
      a.d = d;
      a.s = s;
      a.ds = ds;
      break;
    }
    case ActKind::kQ8_K: {
      const int64_t nb = n_in / kQK_K;
      BlockQ8_K* q = grow(ws.q8k, static_cast<size_t>(m * nb));
      for_rows(m, pool, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) quantize_row_q8_K(x + r * n_in, q + r * nb, n_in);
      });
      a.q8k = q;
      break;
    }
  }
  return a;
}

// The kernel matmul() runs for `type` and the name of its path: the one
// place that decides, so matmul_kernel_name() cannot name a path that does
// not run.
struct Selected {
  MatmulKernel kernel = nullptr;
  const char* name = nullptr;
};
Selected select_kernel(GgmlType type) {
  if (MatmulKernel k = ops_detail::avx512_kernel(type)) {
    return {k, ops_detail::avx512_kernel_path(type)};
  }
  if (best_isa() >= Isa::kAvx2) {
    if (MatmulKernel k = ops_detail::avx2_kernel(type)) return {k, "avx2"};
  }
  if (MatmulKernel k = ops_detail::scalar_kernel(type)) return {k, "scalar"};
  return {};
}
Selected select_kernel(const WeightView& w) {
  if (w.layout == WeightLayout::kPanels16) {
    return {ops_detail::avx512_panels_kernel(w.type), "avx512-vnni-panels"};
  }
  return select_kernel(w.type);
}

// Writes block b of column c (0..15) of a kPanels16 group-block `gb` (16
// blocks' bytes) back in GGUF's layout at `blk`, for the three packable
// formats (layout: matmul.h, WeightLayout). Plain scalar code, apart from the
// AVX-512 packer (ops_detail::avx512_pack_group), so weight_row also checks
// it (matmul_test).
void unpack_block(GgmlType type, const uint8_t* gb, int c, uint8_t* blk) {
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1: {
      using ops_detail::kPanelsQsBytesQ4;
      const size_t qs_off = type == GgmlType::kQ4_0 ? 2 : 4;  // after d (and m)
      for (int k = 0; k < 4; ++k) std::memcpy(blk + qs_off + 4 * k, gb + 64 * k + 4 * c, 4);
      std::memcpy(blk, gb + kPanelsQsBytesQ4 + 2 * c, 2);  // d
      if (type == GgmlType::kQ4_1)
        std::memcpy(blk + 2, gb + kPanelsQsBytesQ4 + 32 + 2 * c, 2);  // m
      break;
    }
    case GgmlType::kQ8_0:
      for (int k = 0; k < 8; ++k) {
        for (int i = 0; i < 4; ++i) {
          blk[2 + 4 * k + i] = static_cast<uint8_t>(gb[64 * k + 4 * c + i] ^ 0x80);  // q + 128 -> q
        }
      }
      std::memcpy(blk, gb + ops_detail::kPanelsQsBytesQ8 + 2 * c, 2);  // d
      break;
    default:
      KV_CHECK(false, "kPanels16: not a packable weight type");
  }
}

// One output of a fused call: weight matrix, its kernel and output [m, n_out].
struct Part {
  const WeightView* w;
  MatmulKernel kernel;
  float* y;
  int64_t col0;  // first column of this part in the concatenated column space (a multiple of 16)
};

// A thread's share of the concatenated columns: [next, end), claimed from the
// front in `grain`-column steps by the owner and, once their own share is
// done, by other threads. One cache line each so owners do not contend.
struct alignas(64) Share {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

constexpr int kMaxThreads = 64;

// Columns [c0, c1) of the concatenated space (c0, c1 multiples of 16 except
// at a part's end), split at part boundaries.
void run_columns(const Part* parts, int n_parts, const PreparedAct& act, int64_t c0, int64_t c1) {
  for (int i = 0; i < n_parts && c0 < c1; ++i) {
    const Part& p = parts[i];
    const int64_t lo = std::max(c0, p.col0), hi = std::min(c1, p.col0 + p.w->n_out);
    if (lo < hi) p.kernel(*p.w, act, lo - p.col0, hi - p.col0, p.y, p.w->n_out);
  }
}

// Runs every part over the activation `act` on the pool. Each thread starts on
// its own contiguous column range (one sequential weight stream, so hardware
// prefetch stays on it) and then steals grains from the other ranges, so a
// thread slowed by other load does not hold up the call.
void run_parts(const Part* parts, int n_parts, const PreparedAct& act, ThreadPool* pool) {
  const int64_t n_cols = parts[n_parts - 1].col0 + parts[n_parts - 1].w->n_out;
  const int n_threads = std::min(pool ? pool->n_threads() : 1, kMaxThreads);
  // Grains are multiples of 16 columns (the widest kernel tile, the AVX-512
  // column group). Decode: ~32 per thread, 16 to 256 columns (small enough
  // to steal cheaply at the end; for Gemma 3's 262,144-column output matrix
  // 256 columns instead of 16 cut the claims from 16,384 atomic adds per
  // token to 1,024). Prefill: ~8 per thread.
  const int64_t grain =
      act.m == 1
          ? std::clamp<int64_t>(n_cols / (32 * n_threads) / 16 * 16, 16, 256)
          : std::max<int64_t>(16, (std::max<int64_t>(1, n_cols / (8 * n_threads)) + 15) / 16 * 16);
  if (n_threads <= 1 || n_cols <= grain) {
    run_columns(parts, n_parts, act, 0, n_cols);
    return;
  }
  std::array<Share, kMaxThreads> shares;
  for (int t = 0; t < n_threads; ++t) {
    const int64_t b = n_cols * t / n_threads / 16 * 16;
    const int64_t e = t + 1 == n_threads ? n_cols : n_cols * (t + 1) / n_threads / 16 * 16;
    shares[t].next.store(b, std::memory_order_relaxed);
    shares[t].end = e;
  }
  struct Ctx {
    const Part* parts;
    int n_parts;
    int n_threads;
    int64_t grain;
    const PreparedAct* act;
    Share* shares;
  } ctx{parts, n_parts, n_threads, grain, &act, shares.data()};
  const Ctx* c = &ctx;  // one captured pointer: std::function stores it without allocating
  // run_shared: a worker that other load keeps off the CPU simply takes no
  // part; its share is stolen and the call does not wait for it.
  pool->run_shared([c](int t) {
    if (t >= c->n_threads) return;
    for (int k = 0; k < c->n_threads; ++k) {
      Share& sh = c->shares[(t + k) % c->n_threads];
      for (;;) {
        const int64_t c0 = sh.next.fetch_add(c->grain, std::memory_order_relaxed);
        if (c0 >= sh.end) break;
        run_columns(c->parts, c->n_parts, *c->act, c0, std::min(sh.end, c0 + c->grain));
      }
    }
  });
}

// "q4_1" for GgmlType::kQ4_1: the type's name in lower case ("?" if unknown).
std::string lower_type_name(GgmlType t) {
  const GgmlTypeTraits* traits = ggml_type_traits(static_cast<uint32_t>(t));
  std::string name = traits ? traits->name : "?";
  for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return name;
}

}  // namespace

bool matmul_supported(GgmlType type) {
  return ops_detail::scalar_kernel(type) != nullptr;
}

const char* matmul_kernel_name(GgmlType type) {
  return select_kernel(type).name;
}

const char* matmul_kernel_name(const WeightView& w) {
  return select_kernel(w).name;
}

bool weight_panels_supported(const WeightView& w) {
  // avx512_panels_kernel names the packable types (nullptr for the rest).
  return w.layout == WeightLayout::kRows && w.n_out > 0 && w.n_out % 16 == 0 && w.n_in > 0 &&
         w.n_in % kQK == 0 && ops_detail::avx512_vnni_usable() &&
         ops_detail::avx512_panels_kernel(w.type) != nullptr;
}

WeightView pack_weight_panels(const WeightView& w, uint8_t* bytes) {
  KV_CHECK(weight_panels_supported(w), "pack_weight_panels: weights not packable here");
  KV_CHECK(bytes == w.data, "pack_weight_panels: packs the view's own bytes in place");
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  const size_t group_bytes = 16 * row_bytes;
  const int64_t nb = w.n_in / kQK;
  std::vector<uint8_t> rows(group_bytes);  // one group's rows, as stored
  for (int64_t g = 0; g < w.n_out / 16; ++g) {
    uint8_t* group = bytes + static_cast<size_t>(g) * group_bytes;
    std::memcpy(rows.data(), group, group_bytes);
    KV_CHECK(ops_detail::avx512_pack_group(w.type, rows.data(), row_bytes, nb, group),
             "pack_weight_panels: no packer for this type on this CPU");
  }
  WeightView packed = w;
  packed.layout = WeightLayout::kPanels16;
  return packed;
}

void weight_row(const WeightView& w, int64_t row, uint8_t* out) {
  KV_CHECK(row >= 0 && row < w.n_out, "weight_row: row out of range");
  const size_t row_bytes = ggml_row_bytes(w.type, w.n_in);
  if (w.layout == WeightLayout::kRows) {
    std::memcpy(out, w.data + static_cast<size_t>(row) * row_bytes, row_bytes);
    return;
  }
  const int64_t nb = w.n_in / kQK;
  const size_t block_bytes = row_bytes / static_cast<size_t>(nb);
  const uint8_t* group = w.data + static_cast<size_t>(row / 16) * 16 * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_block(w.type, group + static_cast<size_t>(b) * 16 * block_bytes,
                 static_cast<int>(row % 16), out + b * block_bytes);
  }
}

std::string matmul_kernel_summary(std::span<const GgmlType> types) {
  // kRows views of each type (no bytes: only their kernel is named).
  std::vector<WeightView> views;
  views.reserve(types.size());
  for (GgmlType t : types) views.push_back(WeightView{t, nullptr, 0, 0});
  std::vector<const WeightView*> ptrs;
  ptrs.reserve(views.size());
  for (const WeightView& w : views) ptrs.push_back(&w);
  return matmul_kernel_summary(std::span<const WeightView* const>(ptrs));
}

std::string matmul_kernel_summary(std::span<const WeightView* const> views) {
  std::vector<std::pair<GgmlType, std::string>> seen;
  std::string out;
  for (const WeightView* w : views) {
    const char* name = matmul_kernel_name(*w);
    std::pair<GgmlType, std::string> key{w->type, name ? name : "none"};
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
    seen.push_back(key);
    if (!out.empty()) out += ", ";
    out += lower_type_name(w->type) + " " + key.second;
  }
  return out;
}

bool matmul_can_fuse(const WeightView& a, const WeightView& b) {
  return matmul_supported(a.type) && matmul_supported(b.type) && a.n_in == b.n_in &&
         ops_detail::act_kind(a.type) == ops_detail::act_kind(b.type);
}

void matmul(const WeightView& w, const float* x, int64_t m, float* y, ThreadPool* pool) {
  float* ys[1] = {y};
  matmul_multi(std::span<const WeightView>(&w, 1), x, m, ys, pool);
}

void matmul_multi(std::span<const WeightView> ws, const float* x, int64_t m,
                  std::span<float* const> ys, ThreadPool* pool) {
  KV_CHECK(!ws.empty() && ws.size() == ys.size() && ws.size() <= 8,
           "matmul_multi: 1..8 weight matrices, one output each");
  Part parts[8];
  int64_t col0 = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const WeightView& w = ws[i];
    KV_CHECK(matmul_supported(w.type), "matmul: unsupported weight type");
    const GgmlTypeTraits* traits = ggml_type_traits(static_cast<uint32_t>(w.type));
    KV_CHECK(w.n_in > 0 && w.n_in % traits->block_elems == 0,
             "matmul: n_in must be a positive multiple of the weight block size");
    KV_CHECK(i == 0 || matmul_can_fuse(ws[0], w),
             "matmul_multi: weights differ in n_in or activation format");
    KV_CHECK(w.n_out >= 0, "matmul: negative n_out");
    const MatmulKernel kernel = select_kernel(w).kernel;
    KV_CHECK(kernel != nullptr, "matmul: no kernel for kPanels16 weights on this CPU");
    parts[i] = Part{&w, kernel, ys[i], col0};
    // Each part starts on a multiple of 16 columns (the gap before it is
    // empty), so every grain of a part is whole 16-column groups but its
    // last: kPanels16 kernels read whole groups.
    col0 += (w.n_out + 15) / 16 * 16;
  }
  if (m <= 0 || col0 == 0) return;
  const PreparedAct act = prepare(ops_detail::act_kind(ws[0].type), x, m, ws[0].n_in, pool);
  run_parts(parts, static_cast<int>(ws.size()), act, pool);
}

}  // namespace kvstack

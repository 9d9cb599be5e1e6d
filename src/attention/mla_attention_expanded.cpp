// mla_attention_expanded (mla_attention.h): a chunk of query rows over an MLA
// latent layer through the ordinary paged prefill kernel. For each sequence,
// all n_past + n_new cached latent rows [c_j ; k_R,j] are read back (the
// stored dtype decoded, int8's scale applied) in pieces of kExpandPiece
// tokens, up-projected by an f32 GEMM per piece (the gemm tile function of
// mla_attention_kernels.h) against W_kv_b^T [d_c][H (nope + v)], and packed as per-head rows
//   K_h,j = [W_UK,h c_j ; k_R,j ; 0 ...],  V_h,j = [W_UV,h c_j ; 0 ...]
// of hd = max(nope + d_R, v) elements into a temporary paged layer (H KV
// heads, kTmpBlock tokens per block, f32 when the latent is f32, else f16),
// which paged_attention() then reads with the unabsorbed q. The cache itself
// stays latent; the temporary is thread-local scratch that only grows.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "attention/mla_attention.h"
#include "attention/mla_attention_kernels.h"
#include "core/half.h"
#include "kv/kv_codec.h"

namespace kvstack {
namespace {

using mla_detail::meta_at;
using mla_detail::row_at;

constexpr int32_t kExpandPiece = 240;  // tokens up-projected per GEMM (a multiple of 6 rows)
constexpr int kTmpBlock = 64;          // tokens per block of the temporary layer

struct ExpandScratch {
  std::vector<uint8_t> k, v;   // temporary layer, [blocks][H][kTmpBlock][hd]
  std::vector<int32_t> table;  // identity block table
  std::vector<float> lat, kv;  // [piece][d_c + d_R] decoded rows, [piece][H (nope + v)]
  std::vector<float> rope;     // [piece][d_R] the rows' k_R
  std::vector<float> q, out;   // [n_new][H][hd]
};

void grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// out[m][ncol] = c[m][k] . wt[k][ncol]: the SIMD gemm over whole column
// blocks (parallel over them), scalar for the rest and without SIMD.
void up_project(const mla_detail::MlaTileFns* fns, const float* c, int m, int k, const float* wt,
                int ncol, float* out, ThreadPool* pool) {
  using mla_detail::kMlaGemmCols;
  const int nblk = fns != nullptr ? ncol / kMlaGemmCols : 0;
  if (nblk > 0) {
    auto run = [&](int64_t b, int64_t e) {
      fns->gemm(c, m, k, wt, ncol, static_cast<int>(b) * kMlaGemmCols,
                static_cast<int>(e) * kMlaGemmCols, out);
    };
    if (pool != nullptr && nblk > 1) {
      pool->parallel_for(nblk, 1, run);
    } else {
      run(0, nblk);
    }
  }
  for (int t = 0; t < m; ++t) {
    for (int o = nblk * kMlaGemmCols; o < ncol; ++o) {
      float acc = 0.0f;
      for (int i = 0; i < k; ++i) {
        acc += c[static_cast<int64_t>(t) * k + i] * wt[static_cast<int64_t>(i) * ncol + o];
      }
      out[static_cast<int64_t>(t) * ncol + o] = acc;
    }
  }
}

}  // namespace

bool mla_prefer_expanded(int32_t n_past, int32_t n_new) {
  return n_new >= kMlaExpandMinRows && int64_t{n_past} + n_new >= kMlaExpandMinKeys;
}

Status mla_attention_expanded(const PagedKvLayerView& view, const MlaAttnParams& p,
                              const MlaUpProjection& up, std::span<const AttnSeq> seqs,
                              ThreadPool* pool) {
  const int H = p.n_heads, dc = p.latent_dim, dr = p.rope_dim, d = dc + dr;
  const int nope = up.qk_nope, vd = up.v_dim;
  if (view.v != nullptr || view.n_kv_heads != 1 || view.head_dim != d || H < 1 || dc < 1 ||
      nope < 0 || vd < 1 || up.w_kv_b_t == nullptr) {
    return make_error(Errc::kInvalidArgument,
                      "mla_attention_expanded: the view is not an MLA latent layer of " +
                          std::to_string(d) + " elements per token, or no W_kv_b^T");
  }
  if (!mla_latent_dtype_supported(view.dtype) ||
      (view.dtype == KvDtype::kInt8 && view.k_meta == nullptr)) {
    return make_error(Errc::kUnsupported, std::string("mla_attention_expanded: latent dtype ") +
                                              kv_dtype_name(view.dtype) + " is not readable here");
  }
  const int dqk = nope + dr, hd = std::max(dqk, vd), kvw = nope + vd;
  // The temporary's dtype: f32 for an f32 latent, else f16 unless an element
  // of the sequence's K/V falls outside f16's range (then that sequence is
  // expanded again in f32: never an inf the absorbed form would not see).
  const KvDtype first_dt = view.dtype == KvDtype::kF32 ? KvDtype::kF32 : KvDtype::kF16;
  const int ncol = H * kvw;
  // As mla_attention: best_isa()'s tile functions, AVX-512 falling back to
  // AVX2, none (scalar loops) under KVSTACK_ISA=scalar or without AVX2.
  const Isa isa = best_isa();
  const mla_detail::MlaTileFns* fns = mla_detail::mla_tile_fns(isa);
  if (fns == nullptr && isa == Isa::kAvx512) fns = mla_detail::mla_tile_fns(Isa::kAvx2);
  thread_local ExpandScratch sc;
  PagedKvLayerView tv;
  tv.block_size = kTmpBlock;
  tv.n_kv_heads = H;
  tv.head_dim = hd;
  const AttnParams ap{.n_q_heads = H, .n_kv_heads = H, .head_dim = hd, .scale = p.scale};

  for (const AttnSeq& s : seqs) {
    if (s.n_new <= 0) continue;
    const int32_t T = s.n_past + s.n_new;
    const int32_t nb = (T + kTmpBlock - 1) / kTmpBlock;
    for (KvDtype tdt = first_dt;; tdt = KvDtype::kF32) {
      tv.dtype = tdt;
      tv.slot_stride = hd * (tdt == KvDtype::kF32 ? 4 : 2);
      tv.head_stride = kTmpBlock * tv.slot_stride;
      tv.block_stride = H * tv.head_stride;
      std::atomic<bool> overflow{false};
      const auto bytes = static_cast<size_t>(nb * tv.block_stride);
      if (sc.k.size() < bytes) {
        sc.k.resize(bytes);
        sc.v.resize(bytes);
      }
      if (sc.table.size() < static_cast<size_t>(nb)) {
        const size_t old = sc.table.size();
        sc.table.resize(static_cast<size_t>(nb));
        for (size_t b = old; b < sc.table.size(); ++b) sc.table[b] = static_cast<int32_t>(b);
      }
      tv.k = sc.k.data();
      tv.v = sc.v.data();
      grow(sc.lat, static_cast<size_t>(kExpandPiece) * d);
      grow(sc.kv, static_cast<size_t>(kExpandPiece) * H * kvw);
      for (int32_t t0 = 0; t0 < T; t0 += kExpandPiece) {
        const int32_t m = std::min(kExpandPiece, T - t0);
        // Decoded rows; the matmul reads the first d_c of each (stride d).
        for (int32_t j = 0; j < m; ++j) {
          kv_decode_row(view.dtype, row_at(view, s, t0 + j), meta_at(view, s, t0 + j), d,
                        sc.lat.data() + static_cast<size_t>(j) * d);
        }
        // matmul wants contiguous [m][d_c] rows: compact in place (d_c <= d).
        std::vector<float>& kr = sc.rope;
        grow(kr, static_cast<size_t>(m) * dr);
        for (int32_t j = 0; j < m; ++j) {
          std::copy_n(sc.lat.data() + static_cast<size_t>(j) * d + dc, dr,
                      kr.data() + static_cast<size_t>(j) * dr);
          std::copy_n(sc.lat.data() + static_cast<size_t>(j) * d, dc,
                      sc.lat.data() + static_cast<size_t>(j) * dc);
        }
        up_project(fns, sc.lat.data(), m, dc, up.w_kv_b_t, ncol, sc.kv.data(), pool);
        // sc is thread-local: the pool's workers get its buffers as pointers.
        const float* kvp = sc.kv.data();
        const float* krp = kr.data();
        uint8_t* kbase = sc.k.data();
        uint8_t* vbase = sc.v.data();
        auto pack = [&](int64_t b, int64_t e) {
          std::vector<float> krow(static_cast<size_t>(hd)), vrow(static_cast<size_t>(hd));
          for (int64_t j = b; j < e; ++j) {
            const int32_t t = t0 + static_cast<int32_t>(j);
            const float* kvj = kvp + j * H * kvw;
            for (int h = 0; h < H; ++h) {
              std::fill(krow.begin(), krow.end(), 0.0f);
              std::fill(vrow.begin(), vrow.end(), 0.0f);
              std::copy_n(kvj + static_cast<int64_t>(h) * kvw, nope, krow.data());
              std::copy_n(krp + j * dr, dr, krow.data() + nope);
              std::copy_n(kvj + static_cast<int64_t>(h) * kvw + nope, vd, vrow.data());
              const int64_t off = (t / kTmpBlock) * tv.block_stride + h * tv.head_stride +
                                  (t % kTmpBlock) * tv.slot_stride;
              if (tdt == KvDtype::kF32) {
                std::copy_n(krow.data(), hd, reinterpret_cast<float*>(kbase + off));
                std::copy_n(vrow.data(), hd, reinterpret_cast<float*>(vbase + off));
              } else {
                for (int i = 0; i < hd; ++i) {
                  if (!(std::fabs(krow[static_cast<size_t>(i)]) <= kF16Max) ||
                      !(std::fabs(vrow[static_cast<size_t>(i)]) <= kF16Max)) {
                    overflow.store(true, std::memory_order_relaxed);
                  }
                }
                auto* ko = reinterpret_cast<uint16_t*>(kbase + off);
                auto* vo = reinterpret_cast<uint16_t*>(vbase + off);
                if (fns != nullptr) {
                  fns->to_f16(krow.data(), hd, ko);
                  fns->to_f16(vrow.data(), hd, vo);
                } else {
                  for (int i = 0; i < hd; ++i) {
                    ko[i] = f32_to_f16(krow[static_cast<size_t>(i)]);
                    vo[i] = f32_to_f16(vrow[static_cast<size_t>(i)]);
                  }
                }
              }
            }
          }
        };
        if (pool != nullptr && m > 1) {
          pool->parallel_for(m, 8, pack);
        } else {
          pack(0, m);
        }
      }
      if (tdt == KvDtype::kF32 || !overflow.load()) break;
    }
    // q padded to hd; out [n_new][H][hd], of which the first v are kept.
    const auto nq = static_cast<size_t>(s.n_new) * H;
    grow(sc.q, nq * hd);
    grow(sc.out, nq * hd);
    for (size_t i = 0; i < nq; ++i) {
      float* qd = sc.q.data() + i * hd;
      std::copy_n(s.q + i * dqk, dqk, qd);
      std::fill(qd + dqk, qd + hd, 0.0f);
    }
    const AttnSeq ts{.block_table = sc.table.data(),
                     .n_blocks = nb,
                     .n_past = s.n_past,
                     .n_new = s.n_new,
                     .q = sc.q.data(),
                     .out = sc.out.data()};
    KV_TRY_STATUS(paged_attention(tv, ap, std::span<const AttnSeq>(&ts, 1), pool));
    for (size_t i = 0; i < nq; ++i) std::copy_n(sc.out.data() + i * hd, vd, s.out + i * vd);
  }
  return {};
}

}  // namespace kvstack

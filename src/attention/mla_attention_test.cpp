// mla_attention (absorbed MLA over a latent KV layer) against a float64
// recomputation with the unabsorbed formula: per head, K_j = [W_UK c_j ; k_R,j]
// and V_j = W_UV c_j materialised, softmax(scale q.K) V. The absorbed side
// multiplies q_nope by W_UK^T before the kernel and the kernel's latent output
// by W_UV after it. Every block size (1 .. 64), several sequences per call
// with different n_past / n_new splits (decode rows and prefill chunks), f32,
// f16, bf16 and int8 latent rows (the reference reads the stored, rounded
// rows), on the scalar reference, on the kernel mla_attention() picks and in
// the expanded form (mla_attention_expanded: K/V materialised from the
// latents, the paged prefill kernel), which must also agree with the
// absorbed result.
// The SIMD kernels (AVX2, AVX-512) against the scalar reference over random
// shapes; the int8 latent against float64 on the unquantized rows.
#include "attention/mla_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "core/check.h"
#include "core/cpu_features.h"
#include "kv/kv_codec.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

constexpr int H = 4, DC = 24, DR = 8, NOPE = 16, DV = 12;

// 64-byte aligned start of a buffer with 64 spare bytes (KvLayout's pool base).
uint8_t* aligned(std::vector<uint8_t>& buf) {
  const auto a = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - a % 64) % 64);
}

struct Case {
  int n_past, n_new;
};

TEST(MlaAttention, AbsorbedEqualsUnabsorbedFloat64) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // W_UK,h [NOPE][DC], W_UV,h [DV][DC].
  std::vector<float> wk(H * NOPE * DC), wv(H * DV * DC);
  for (float& x : wk) x = nd(rng) / std::sqrt(static_cast<float>(DC));
  for (float& x : wv) x = nd(rng) / std::sqrt(static_cast<float>(DC));
  const float scale = 1.0f / std::sqrt(static_cast<float>(NOPE + DR));
  // W_kv_b^T [DC][H (NOPE + DV)] for the expanded form: 112 columns, one
  // SIMD GEMM block of 64 and a scalar tail.
  constexpr int kCols = H * (NOPE + DV);
  std::vector<float> wt(static_cast<size_t>(DC) * kCols);
  for (int d = 0; d < DC; ++d) {
    for (int h = 0; h < H; ++h) {
      for (int k = 0; k < NOPE; ++k) {
        wt[static_cast<size_t>(d) * kCols + h * (NOPE + DV) + k] =
            wk[(static_cast<size_t>(h) * NOPE + k) * DC + d];
      }
      for (int o = 0; o < DV; ++o) {
        wt[static_cast<size_t>(d) * kCols + h * (NOPE + DV) + NOPE + o] =
            wv[(static_cast<size_t>(h) * DV + o) * DC + d];
      }
    }
  }
  const MlaUpProjection up{.w_kv_b_t = wt.data(), .qk_nope = NOPE, .v_dim = DV};
  // The last case spans two expansion pieces (240 tokens each).
  const std::vector<Case> cases = {{0, 1}, {0, 9}, {5, 1}, {17, 6}, {40, 1}, {63, 3}, {230, 20}};
  int checked = 0;
  // Mode 0: the absorbed scalar reference, 1: the absorbed kernel
  // mla_attention() picks, 2: the expanded form (mla_attention_expanded).
  // Absorbed within 2e-5 of float64; expanded within 2e-5 from an f32 latent
  // (f32 temporary K/V) and 4e-3 from the others (K/V rounded to f16), and
  // within the sum of both of the absorbed result.
  for (const int mode : {0, 1, 2}) {
    for (KvDtype dt : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kInt8}) {
      for (int bs : {1, 2, 4, 16, 64}) {
        auto layout = KvLayout::create(
            {KvLayerSpec{
                .kind = KvLayerKind::kMlaLatent, .latent_dim = DC, .rope_dim = DR, .dtype = dt}},
            bs);
        ASSERT_TRUE(layout.ok()) << layout.error().message;
        // Each sequence gets its own blocks, handed out in reverse order so that
        // logical and physical order differ.
        int total_blocks = 0;
        for (const Case& c : cases) total_blocks += (c.n_past + c.n_new + bs - 1) / bs;
        std::vector<uint8_t> pool(static_cast<size_t>(total_blocks * layout->block_bytes()) + 64);
        const PagedKvLayerView view = layout->layer_view(0, aligned(pool));
        int next = total_blocks;
        std::vector<std::vector<int32_t>> tables;
        std::vector<std::vector<float>> rows;  // as stored (decoded), [n][DC + DR]
        std::vector<std::vector<float>> q_nope, q_rope, q_abs, out_lat, q_exp, out_exp;
        std::vector<AttnSeq> seqs;
        for (const Case& c : cases) {
          const int n = c.n_past + c.n_new;
          std::vector<int32_t> t(static_cast<size_t>((n + bs - 1) / bs));
          for (int32_t& b : t) b = --next;
          std::vector<float> r(static_cast<size_t>(n) * (DC + DR));
          for (int j = 0; j < n; ++j) {
            std::vector<float> x(DC + DR);
            for (float& v : x) v = nd(rng);
            uint8_t* dst = view.k + static_cast<int64_t>(t[j / bs]) * view.block_stride +
                           static_cast<int64_t>(j % bs) * view.slot_stride;
            uint8_t* meta = view.k_meta == nullptr
                                ? nullptr
                                : view.k_meta +
                                      static_cast<int64_t>(t[j / bs]) * view.block_stride +
                                      static_cast<int64_t>(j % bs) * view.k_meta_slot_stride;
            kv_encode_row(dt, x.data(), DC + DR, dst, meta);
            kv_decode_row(dt, dst, meta, DC + DR, r.data() + static_cast<size_t>(j) * (DC + DR));
          }
          std::vector<float> qn(static_cast<size_t>(c.n_new) * H * NOPE),
              qr(static_cast<size_t>(c.n_new) * H * DR),
              qa(static_cast<size_t>(c.n_new) * H * (DC + DR), 0.0f);
          for (float& v : qn) v = nd(rng);
          for (float& v : qr) v = nd(rng);
          for (int i = 0; i < c.n_new; ++i) {
            for (int h = 0; h < H; ++h) {
              float* a = qa.data() + (static_cast<size_t>(i) * H + h) * (DC + DR);
              for (int k = 0; k < NOPE; ++k) {
                for (int d = 0; d < DC; ++d) {
                  a[d] += qn[(static_cast<size_t>(i) * H + h) * NOPE + k] *
                          wk[(static_cast<size_t>(h) * NOPE + k) * DC + d];
                }
              }
              std::copy_n(qr.data() + (static_cast<size_t>(i) * H + h) * DR, DR, a + DC);
            }
          }
          std::vector<float> qe(static_cast<size_t>(c.n_new) * H * (NOPE + DR));
          for (int i = 0; i < c.n_new * H; ++i) {
            std::copy_n(qn.data() + static_cast<size_t>(i) * NOPE, NOPE,
                        qe.data() + static_cast<size_t>(i) * (NOPE + DR));
            std::copy_n(qr.data() + static_cast<size_t>(i) * DR, DR,
                        qe.data() + static_cast<size_t>(i) * (NOPE + DR) + NOPE);
          }
          q_exp.push_back(std::move(qe));
          out_exp.emplace_back(static_cast<size_t>(c.n_new) * H * DV, -7.0f);
          tables.push_back(std::move(t));
          rows.push_back(std::move(r));
          q_nope.push_back(std::move(qn));
          q_rope.push_back(std::move(qr));
          q_abs.push_back(std::move(qa));
          out_lat.emplace_back(static_cast<size_t>(c.n_new) * H * DC, -7.0f);
        }
        for (size_t s = 0; s < cases.size(); ++s) {
          seqs.push_back(AttnSeq{.block_table = tables[s].data(),
                                 .n_blocks = static_cast<int32_t>(tables[s].size()),
                                 .n_past = cases[s].n_past,
                                 .n_new = cases[s].n_new,
                                 .q = mode == 2 ? q_exp[s].data() : q_abs[s].data(),
                                 .out = mode == 2 ? out_exp[s].data() : out_lat[s].data()});
        }
        ThreadPool threads(2);
        const MlaAttnParams p{.n_heads = H, .latent_dim = DC, .rope_dim = DR, .scale = scale};
        ASSERT_TRUE((mode == 0   ? mla_attention_reference(view, p, seqs, &threads)
                     : mode == 1 ? mla_attention(view, p, seqs, &threads)
                                 : mla_attention_expanded(view, p, up, seqs, &threads))
                        .ok());
        // The absorbed result, for the agreement check of the expanded one.
        std::vector<std::vector<float>> out_abs;
        if (mode == 2) {
          std::vector<AttnSeq> as = seqs;
          for (size_t s = 0; s < cases.size(); ++s) {
            as[s].q = q_abs[s].data();
            as[s].out = out_lat[s].data();
          }
          ASSERT_TRUE(mla_attention(view, p, as, &threads).ok());
        }
        const double tol = mode == 2 && dt != KvDtype::kF32 ? 4e-3 : 2e-5;
        for (size_t s = 0; s < cases.size(); ++s) {
          const Case& c = cases[s];
          for (int i = 0; i < c.n_new; ++i) {
            const int n_keys = c.n_past + i + 1;
            for (int h = 0; h < H; ++h) {
              // Unabsorbed float64: materialise K_j and V_j of head h.
              std::vector<double> sc(static_cast<size_t>(n_keys));
              double mx = -1e300;
              for (int j = 0; j < n_keys; ++j) {
                const float* cj = rows[s].data() + static_cast<size_t>(j) * (DC + DR);
                double dot = 0;
                for (int k = 0; k < NOPE; ++k) {
                  double kk = 0;  // k_nope[k] = sum_d W_UK[k][d] c[d]
                  for (int d = 0; d < DC; ++d) {
                    kk += double{wk[(static_cast<size_t>(h) * NOPE + k) * DC + d]} * cj[d];
                  }
                  dot += double{q_nope[s][(static_cast<size_t>(i) * H + h) * NOPE + k]} * kk;
                }
                for (int d = 0; d < DR; ++d) {
                  dot += double{q_rope[s][(static_cast<size_t>(i) * H + h) * DR + d]} * cj[DC + d];
                }
                sc[static_cast<size_t>(j)] = dot * scale;
                mx = std::max(mx, sc[static_cast<size_t>(j)]);
              }
              double z = 0;
              for (double& v : sc) z += (v = std::exp(v - mx));
              for (int o = 0; o < DV; ++o) {
                double ref = 0;
                for (int j = 0; j < n_keys; ++j) {
                  const float* cj = rows[s].data() + static_cast<size_t>(j) * (DC + DR);
                  double vj = 0;
                  for (int d = 0; d < DC; ++d) {
                    vj += double{wv[(static_cast<size_t>(h) * DV + o) * DC + d]} * cj[d];
                  }
                  ref += sc[static_cast<size_t>(j)] / z * vj;
                }
                // Absorbed: W_UV applied to the kernel's latent output.
                const float* ol = out_lat[s].data() + (static_cast<size_t>(i) * H + h) * DC;
                double absorbed = 0;
                for (int d = 0; d < DC; ++d) {
                  absorbed += double{wv[(static_cast<size_t>(h) * DV + o) * DC + d]} * ol[d];
                }
                const double got =
                    mode == 2 ? out_exp[s][(static_cast<size_t>(i) * H + h) * DV + o] : absorbed;
                ASSERT_NEAR(got, ref, tol) << (mode == 0   ? "reference"
                                               : mode == 1 ? "dispatched"
                                                           : "expanded")
                                           << " dtype " << kv_dtype_name(dt) << " block " << bs
                                           << " seq " << s << " row " << i << " head " << h;
                if (mode == 2) {
                  ASSERT_NEAR(got, absorbed, tol + 2e-5)
                      << "expanded vs absorbed, dtype " << kv_dtype_name(dt) << " block " << bs;
                }
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 4 * 5 * (1 + 9 + 1 + 6 + 1 + 3 + 20) * H * DV);
}

// A latent layer of random rows and sequences with random splits; rows as
// stored (decoded) and as generated (before rounding to the dtype).
struct Latent {
  int h = 0, dc = 0, dr = 0, bs = 0;
  KvDtype dt = KvDtype::kF32;
  std::vector<uint8_t> pool;
  PagedKvLayerView view;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<float>> raw, q, out;  // raw: [n][dc + dr]
  std::vector<AttnSeq> seqs;

  Latent(std::mt19937& rng, int h_, int dc_, int dr_, int bs_, KvDtype dt_,
         const std::vector<Case>& cases, float rope_scale)
      : h(h_), dc(dc_), dr(dr_), bs(bs_), dt(dt_) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int d = dc + dr;
    auto layout = KvLayout::create(
        {KvLayerSpec{
            .kind = KvLayerKind::kMlaLatent, .latent_dim = dc, .rope_dim = dr, .dtype = dt}},
        bs);
    KV_CHECK(layout.ok(), "layout");
    int total = 0;
    for (const Case& c : cases) total += (c.n_past + c.n_new + bs - 1) / bs;
    pool.assign(static_cast<size_t>(total * layout->block_bytes()) + 64, 0);
    view = layout->layer_view(0, aligned(pool));
    int next = total;
    for (const Case& c : cases) {
      const int n = c.n_past + c.n_new;
      std::vector<int32_t> t(static_cast<size_t>((n + bs - 1) / bs));
      for (int32_t& b : t) b = --next;
      std::vector<float> r(static_cast<size_t>(n) * d);
      for (int j = 0; j < n; ++j) {
        float* x = r.data() + static_cast<size_t>(j) * d;
        for (int i = 0; i < d; ++i) x[i] = nd(rng) * (i < dc ? 1.0f : rope_scale);
        const int32_t b = t[static_cast<size_t>(j / bs)];
        uint8_t* dst = view.k + static_cast<int64_t>(b) * view.block_stride +
                       static_cast<int64_t>(j % bs) * view.slot_stride;
        uint8_t* meta = view.k_meta == nullptr
                            ? nullptr
                            : view.k_meta + static_cast<int64_t>(b) * view.block_stride +
                                  static_cast<int64_t>(j % bs) * view.k_meta_slot_stride;
        kv_encode_row(dt, x, d, dst, meta);
      }
      std::vector<float> qq(static_cast<size_t>(c.n_new) * h * d);
      for (float& v : qq) v = nd(rng) * 0.5f;
      tables.push_back(std::move(t));
      raw.push_back(std::move(r));
      q.push_back(std::move(qq));
      out.emplace_back(static_cast<size_t>(c.n_new) * h * dc, -7.0f);
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      seqs.push_back(AttnSeq{.block_table = tables[i].data(),
                             .n_blocks = static_cast<int32_t>(tables[i].size()),
                             .n_past = cases[i].n_past,
                             .n_new = cases[i].n_new,
                             .q = q[i].data(),
                             .out = out[i].data()});
    }
  }
  MlaAttnParams params() const {
    return MlaAttnParams{.n_heads = h,
                         .latent_dim = dc,
                         .rope_dim = dr,
                         .scale = 1.0f / std::sqrt(static_cast<float>(dc + dr))};
  }
};

// The AVX2 and AVX-512 kernels against the scalar reference: random head
// counts, latent and RoPE widths (odd ones, widths below one vector, the
// DeepSeek 512 + 64), block sizes and splits (decode rows long enough to be
// split along the keys, prefill chunks), every latent dtype, 1 and 2 threads.
TEST(MlaAttention, SimdMatchesScalarReference) {
  const CpuFeatures& cf = cpu_features();
  std::vector<Isa> isas;
  if (cf.avx2 && cf.fma && cf.f16c) isas.push_back(Isa::kAvx2);
  if (cf.avx2 && cf.fma && cf.f16c && cf.avx512f && cf.avx512bw && cf.avx512vl) {
    isas.push_back(Isa::kAvx512);
  } else {
    std::printf("[ note ] the CPU has no AVX-512 F/BW/VL: the AVX-512 MLA kernel is not tested\n");
  }
  if (isas.empty()) GTEST_SKIP() << "the CPU has no AVX2+FMA+F16C: no SIMD MLA kernel to test";
  std::mt19937 rng(11);
  struct Shape {
    int h, dc, dr, bs;
  };
  const std::vector<Shape> shapes = {{1, 1, 0, 1},      {3, 7, 5, 2},    {4, 24, 8, 16},
                                     {5, 33, 3, 4},     {16, 64, 16, 8}, {2, 17, 0, 64},
                                     {16, 512, 64, 16}, {7, 100, 13, 32}};
  // Mixed rows (one piece per row), and decode rows alone (fewer rows than
  // 4 x threads: split along the keys, 256 keys or more per piece, merged).
  const std::vector<std::vector<Case>> case_sets = {
      {{0, 1}, {700, 1}, {3, 5}, {33, 17}, {1200, 1}, {15, 1}}, {{700, 1}, {1200, 1}}, {{2047, 1}}};
  int compared = 0;
  for (const std::vector<Case>& cases : case_sets) {
    for (const Shape& sh : shapes) {
      for (KvDtype dt : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kInt8}) {
        // The large shape once, in f16 and int8 (its reference run is slow).
        if (sh.dc == 512 && dt != KvDtype::kF16 && dt != KvDtype::kInt8) continue;
        Latent ref(rng, sh.h, sh.dc, sh.dr, sh.bs, dt, cases, 2.0f);
        ASSERT_TRUE(mla_attention_reference(ref.view, ref.params(), ref.seqs, nullptr).ok());
        for (Isa isa : isas) {
          for (int nt : {1, 2}) {
            ThreadPool threads(nt);
            // Fresh outputs (the same rows and queries).
            std::vector<std::vector<float>> out;
            std::vector<AttnSeq> seqs = ref.seqs;
            for (size_t i = 0; i < seqs.size(); ++i) {
              out.emplace_back(ref.out[i].size(), -9.0f);
              seqs[i].out = out.back().data();
            }
            ASSERT_TRUE(mla_attention_isa(isa, ref.view, ref.params(), seqs, &threads).ok());
            for (size_t i = 0; i < seqs.size(); ++i) {
              for (size_t k = 0; k < out[i].size(); ++k) {
                const float want = ref.out[i][k];
                ASSERT_NEAR(out[i][k], want, 2e-5f + 2e-5f * std::fabs(want))
                    << isa_name(isa) << " threads " << nt << " dtype " << kv_dtype_name(dt) << " H "
                    << sh.h << " dc " << sh.dc << " dr " << sh.dr << " block " << sh.bs << " seq "
                    << i << " element " << k;
                ++compared;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// The int8 latent (one f16 scale per token row) against a float64 recomputation
// on the rows before quantization: the error of quantizing, not of the
// kernel. Stated tolerance: the output's RMS error is below 1.5% of its RMS
// and no element is off by more than 0.05 (outputs are O(0.1 .. 1) here: a
// softmax mix of N(0, 1) latents). The f16 latent under the same measure
// stays below 0.1%, as a check that the measure separates the formats.
TEST(MlaAttention, Int8LatentAgainstFloat64OnUnquantizedRows) {
  std::mt19937 rng(23);
  const std::vector<Case> cases = {{0, 1}, {60, 1}, {300, 1}, {20, 12}};
  for (KvDtype dt : {KvDtype::kInt8, KvDtype::kF16}) {
    Latent lt(rng, 8, 64, 16, 16, dt, cases, 1.0f);
    ThreadPool threads(2);
    ASSERT_TRUE(mla_attention(lt.view, lt.params(), lt.seqs, &threads).ok());
    const int d = lt.dc + lt.dr;
    const double scale = lt.params().scale;
    double err2 = 0, ref2 = 0, max_err = 0;
    for (size_t s = 0; s < cases.size(); ++s) {
      for (int r = 0; r < cases[s].n_new; ++r) {
        const int n_keys = cases[s].n_past + r + 1;
        for (int h = 0; h < lt.h; ++h) {
          const float* qh = lt.q[s].data() + (static_cast<size_t>(r) * lt.h + h) * d;
          std::vector<double> sc(static_cast<size_t>(n_keys));
          double mx = -1e300;
          for (int j = 0; j < n_keys; ++j) {
            double dot = 0;
            for (int i = 0; i < d; ++i)
              dot += double{qh[i]} * lt.raw[s][static_cast<size_t>(j) * d + i];
            sc[static_cast<size_t>(j)] = dot * scale;
            mx = std::max(mx, sc[static_cast<size_t>(j)]);
          }
          double z = 0;
          for (double& v : sc) z += (v = std::exp(v - mx));
          for (int i = 0; i < lt.dc; ++i) {
            double ref = 0;
            for (int j = 0; j < n_keys; ++j) {
              ref += sc[static_cast<size_t>(j)] / z * lt.raw[s][static_cast<size_t>(j) * d + i];
            }
            const double got = lt.out[s][(static_cast<size_t>(r) * lt.h + h) * lt.dc + i];
            err2 += (got - ref) * (got - ref);
            ref2 += ref * ref;
            max_err = std::max(max_err, std::fabs(got - ref));
          }
        }
      }
    }
    const double rel = std::sqrt(err2 / ref2);
    std::printf("[ info ] %s latent: RMS error %.5f of RMS, max abs error %.5f\n",
                kv_dtype_name(dt), rel, max_err);
    if (dt == KvDtype::kInt8) {
      EXPECT_LT(rel, 0.015);
      EXPECT_LT(max_err, 0.05);
      EXPECT_GT(rel, 1e-4);  // it is quantized: not silently a float format
    } else {
      EXPECT_LT(rel, 1e-3);
    }
  }
}

// The int8 latent's bytes: d codes plus one f16 scale per token and layer
// (payload), the scales in their own 64-byte aligned region of the block.
// The expanded form's f16 temporary cannot hold K/V beyond 65504: with an
// up-projection that large the sequence is expanded again in f32, so the
// result is the absorbed one, not inf or NaN.
TEST(MlaAttention, ExpandedFormFallsBackToF32OutsideF16Range) {
  constexpr int h = 2, dc = 16, dr = 8, nope = 8, dv = 8, cols = h * (nope + dv);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::vector<Case> cases = {{40, 30}};
  Latent lat(rng, h, dc, dr, 16, KvDtype::kF16, cases, 1.0f);
  std::vector<float> wt(static_cast<size_t>(dc) * cols);  // W_kv_b^T, entries ~3e4
  for (float& x : wt) x = nd(rng) * 3e4f;
  // Unabsorbed q (small, so the softmax stays soft) and its absorbed form.
  const int n = cases[0].n_new;
  std::vector<float> qe(static_cast<size_t>(n) * h * (nope + dr));
  for (float& x : qe) x = nd(rng) * 1e-5f;
  std::vector<float> qa(static_cast<size_t>(n) * h * (dc + dr), 0.0f);
  for (int i = 0; i < n * h; ++i) {
    const int hh = i % h;
    for (int d = 0; d < dc; ++d) {
      for (int k = 0; k < nope; ++k) {
        qa[static_cast<size_t>(i) * (dc + dr) + d] +=
            qe[static_cast<size_t>(i) * (nope + dr) + k] *
            wt[static_cast<size_t>(d) * cols + hh * (nope + dv) + k];
      }
    }
    for (int k = 0; k < dr; ++k) {
      qa[static_cast<size_t>(i) * (dc + dr) + dc + k] =
          qe[static_cast<size_t>(i) * (nope + dr) + nope + k];
    }
  }
  const MlaAttnParams p{.n_heads = h, .latent_dim = dc, .rope_dim = dr, .scale = 0.25f};
  std::vector<float> o_exp(static_cast<size_t>(n) * h * dv), o_lat(static_cast<size_t>(n) * h * dc);
  AttnSeq s = lat.seqs[0];
  s.q = qe.data();
  s.out = o_exp.data();
  const MlaUpProjection up{.w_kv_b_t = wt.data(), .qk_nope = nope, .v_dim = dv};
  ASSERT_TRUE(mla_attention_expanded(lat.view, p, up, {&s, 1}, nullptr).ok());
  s.q = qa.data();
  s.out = o_lat.data();
  ASSERT_TRUE(mla_attention_reference(lat.view, p, {&s, 1}, nullptr).ok());
  double max_v = 0;
  for (int i = 0; i < n * h; ++i) {
    const int hh = i % h;
    for (int o = 0; o < dv; ++o) {
      double absorbed = 0;  // W_UV,h . o_lat
      for (int d = 0; d < dc; ++d) {
        absorbed += double{wt[static_cast<size_t>(d) * cols + hh * (nope + dv) + nope + o]} *
                    o_lat[static_cast<size_t>(i) * dc + d];
      }
      const float got = o_exp[static_cast<size_t>(i) * dv + o];
      ASSERT_TRUE(std::isfinite(got)) << "row " << i / h << " head " << hh;
      ASSERT_NEAR(got, absorbed, 1e-4 * std::fabs(absorbed) + 1.0) << "row " << i / h;
      max_v = std::max(max_v, std::fabs(absorbed));
    }
  }
  EXPECT_GT(max_v, 65504.0);  // the outputs themselves lie outside f16's range
}

TEST(MlaAttention, Int8LatentLayoutBytes) {
  auto l = KvLayout::create({KvLayerSpec{.kind = KvLayerKind::kMlaLatent,
                                         .latent_dim = 512,
                                         .rope_dim = 64,
                                         .dtype = KvDtype::kInt8}},
                            16);
  ASSERT_TRUE(l.ok()) << l.error().message;
  EXPECT_EQ(l->payload_bytes_per_token(), 576 + 2);
  EXPECT_EQ(l->block_bytes(), 576 * 16 + 64);  // codes, then 32 scale bytes padded to 64
  const KvLayerPlacement& p = l->placement(0);
  EXPECT_EQ(p.k_meta_offset, 576 * 16);
  EXPECT_EQ(p.k_meta_slot_stride, 2);
}

TEST(MlaAttention, RejectsAStandardLayerAndOtherQuantizedLatents) {
  auto std_layout = KvLayout::uniform(1, 1, DC + DR, KvDtype::kF16, 16);
  ASSERT_TRUE(std_layout.ok());
  std::vector<uint8_t> pool(static_cast<size_t>(std_layout->block_bytes()) + 64);
  const MlaAttnParams p{.n_heads = H, .latent_dim = DC, .rope_dim = DR, .scale = 1.0f};
  const Status st = mla_attention(std_layout->layer_view(0, aligned(pool)), p, {}, nullptr);
  EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
  for (KvDtype dt : {KvDtype::kFp8, KvDtype::kInt4}) {
    auto q = KvLayout::create(
        {KvLayerSpec{
            .kind = KvLayerKind::kMlaLatent, .latent_dim = DC, .rope_dim = DR, .dtype = dt}},
        16);
    ASSERT_FALSE(q.ok()) << kv_dtype_name(dt);
    EXPECT_EQ(q.error().code, Errc::kUnsupported);
  }
  // A hand-made view in a dtype the kernels do not read.
  auto f = KvLayout::create({KvLayerSpec{.kind = KvLayerKind::kMlaLatent,
                                         .latent_dim = DC,
                                         .rope_dim = DR,
                                         .dtype = KvDtype::kF16}},
                            16);
  ASSERT_TRUE(f.ok());
  std::vector<uint8_t> fp(static_cast<size_t>(f->block_bytes()) + 64);
  PagedKvLayerView v = f->layer_view(0, aligned(fp));
  v.dtype = KvDtype::kFp8;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    EXPECT_EQ(mla_attention_isa(isa, v, p, {}, nullptr).error().code, Errc::kUnsupported);
  }
}

}  // namespace
}  // namespace kvstack

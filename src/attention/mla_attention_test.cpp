// mla_attention (absorbed MLA over a latent KV layer) against a float64
// recomputation with the unabsorbed formula: per head, K_j = [W_UK c_j ; k_R,j]
// and V_j = W_UV c_j materialised, softmax(scale q.K) V. The absorbed side
// multiplies q_nope by W_UK^T before the kernel and the kernel's latent output
// by W_UV after it. Every block size (1 .. 64), several sequences per call
// with different n_past / n_new splits (decode rows and prefill chunks), f32
// and f16 latent rows (the f16 reference reads the stored, rounded rows).
#include "attention/mla_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

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
  const std::vector<Case> cases = {{0, 1}, {0, 9}, {5, 1}, {17, 6}, {40, 1}, {63, 3}};
  int checked = 0;
  for (KvDtype dt : {KvDtype::kF32, KvDtype::kF16}) {
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
      std::vector<std::vector<float>> q_nope, q_rope, q_abs, out_lat;
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
          kv_encode_row(dt, x.data(), DC + DR, dst, nullptr);
          kv_decode_row(dt, dst, nullptr, DC + DR, r.data() + static_cast<size_t>(j) * (DC + DR));
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
                               .q = q_abs[s].data(),
                               .out = out_lat[s].data()});
      }
      ThreadPool threads(2);
      const MlaAttnParams p{.n_heads = H, .latent_dim = DC, .rope_dim = DR, .scale = scale};
      ASSERT_TRUE(mla_attention(view, p, seqs, &threads).ok());
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
              double got = 0;
              for (int d = 0; d < DC; ++d) {
                got += double{wv[(static_cast<size_t>(h) * DV + o) * DC + d]} * ol[d];
              }
              ASSERT_NEAR(got, ref, 2e-5) << "dtype " << kv_dtype_name(dt) << " block " << bs
                                          << " seq " << s << " row " << i << " head " << h;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 5 * (1 + 9 + 1 + 6 + 1 + 3) * H * DV);
}

TEST(MlaAttention, RejectsAStandardLayerAndQuantizedLatent) {
  auto std_layout = KvLayout::uniform(1, 1, DC + DR, KvDtype::kF16, 16);
  ASSERT_TRUE(std_layout.ok());
  std::vector<uint8_t> pool(static_cast<size_t>(std_layout->block_bytes()) + 64);
  const MlaAttnParams p{.n_heads = H, .latent_dim = DC, .rope_dim = DR, .scale = 1.0f};
  const Status st = mla_attention(std_layout->layer_view(0, aligned(pool)), p, {}, nullptr);
  EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
  auto q = KvLayout::create({KvLayerSpec{.kind = KvLayerKind::kMlaLatent,
                                         .latent_dim = DC,
                                         .rope_dim = DR,
                                         .dtype = KvDtype::kInt8}},
                            16);
  if (q.ok()) {
    std::vector<uint8_t> qp(static_cast<size_t>(q->block_bytes()) + 64);
    EXPECT_EQ(mla_attention(q->layer_view(0, aligned(qp)), p, {}, nullptr).error().code,
              Errc::kUnsupported);
  }
}

}  // namespace
}  // namespace kvstack

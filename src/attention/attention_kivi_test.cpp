// KIVI attention: AVX2 primitives decode bit-identically to the scalar
// reference; the tiled kernels (scalar and AVX2) match the float64 reference
// on batches mixing decode and prefill chunks, GQA, windows, scattered blocks
// and mixed K/V formats; and incremental decode through a KIVI cache equals
// attention recomputed from K/V quantized independently, group by group, at
// the same moments (cache equivalence in KIVI's own terms).
#include "attention/attention_kivi.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kivi_codec.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

template <typename T>
T must(Result<T> r) {
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return std::move(*r);
}

struct Fmt {
  KvDtype k, v;
};

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, static_cast<double>(std::fabs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::fabs(b[i])));
  }
  return num / den;
}

TEST(KiviAttention, KernelsMatchReferenceOnMixedBatches) {
  const int n_kv = 2, n_q = 6, d = 64;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Fmt f : {Fmt{kKvDtypeKivi2, kKvDtypeKivi2}, Fmt{kKvDtypeKivi4, kKvDtypeKivi4},
                Fmt{kKvDtypeKivi2, KvDtype::kInt8}, Fmt{KvDtype::kF16, kKvDtypeKivi4},
                Fmt{KvDtype::kInt4, kKvDtypeKivi4}}) {
    for (int p : {16, 64}) {
      for (int window : {0, 20, 700}) {
        SCOPED_TRACE(std::string(kv_dtype_name(f.k)) + "/" + kv_dtype_name(f.v) + " P " +
                     std::to_string(p) + " window " + std::to_string(window));
        auto layout = must(
            KvLayout::uniform(1, n_kv, d, f.k, p, f.v, {.kivi_residual = 2 * kivi_group_size(p)}));
        auto pool = must(BlockPool::create(layout, {.n_tokens = 4096}));
        // Three sequences, grown in interleaved steps (scattered blocks);
        // the first one decodes past several split-K pieces of 512 keys, the
        // second prefills on top of converted blocks and its residual.
        const int lens[3] = {1300, 137, 9};
        const int news[3] = {1, 29, 9};
        std::vector<BlockTable> tables;
        tables.reserve(3);
        for (int i = 0; i < 3; ++i) tables.emplace_back(*pool);
        std::vector<float> k(static_cast<size_t>(n_kv) * d), v(k.size());
        for (int step = 0; step < lens[0]; ++step) {
          for (int i = 0; i < 3; ++i) {
            if (step >= lens[i]) continue;
            for (auto& x : k) x = nd(rng) * 2.0f;
            for (auto& x : v) x = nd(rng);
            ASSERT_TRUE(tables[i].reserve(1).ok());
            tables[i].write(0, tables[i].length(), k.data(), v.data(), 1);
            tables[i].commit(1);
          }
        }
        // The step: n_new more tokens per sequence, written but not committed.
        std::vector<std::vector<float>> q(3), out_s(3), out_a(3), out_r(3);
        std::vector<AttnSeq> seqs;
        std::vector<KvResidualView> res;
        for (int i = 0; i < 3; ++i) {
          const int n = news[i];
          std::vector<float> kn(static_cast<size_t>(n) * n_kv * d), vn(kn.size());
          for (auto& x : kn) x = nd(rng) * 2.0f;
          for (auto& x : vn) x = nd(rng);
          ASSERT_TRUE(tables[i].reserve(n).ok());
          tables[i].write(0, tables[i].length(), kn.data(), vn.data(), n);
          q[i].resize(static_cast<size_t>(n) * n_q * d);
          for (auto& x : q[i]) x = nd(rng);
          out_s[i].assign(q[i].size(), 0.0f);
          out_a[i].assign(q[i].size(), 0.0f);
          out_r[i].assign(q[i].size(), 0.0f);
          seqs.push_back(AttnSeq{.block_table = tables[i].data(),
                                 .n_blocks = static_cast<int32_t>(tables[i].n_blocks()),
                                 .n_past = static_cast<int32_t>(tables[i].length()),
                                 .n_new = n,
                                 .q = q[i].data()});
          res.push_back(tables[i].residual_view(0));
        }
        const AttnParams ap{
            .n_q_heads = n_q, .n_kv_heads = n_kv, .head_dim = d, .scale = 0.125f, .window = window};
        const PagedKvLayerView view = pool->layer_view(0);
        ThreadPool threads(2);
        auto run = [&](std::vector<std::vector<float>>& outs, int mode) {
          for (int i = 0; i < 3; ++i) seqs[i].out = outs[i].data();
          if (mode == 0) return paged_attention_kivi_reference(view, ap, seqs, res);
          const Isa isa = mode == 1 ? Isa::kScalar : mode == 2 ? Isa::kAvx2 : Isa::kAvx512;
          return paged_attention_kivi_isa(isa, view, ap, seqs, res, &threads);
        };
        ASSERT_TRUE(run(out_r, 0).ok());
        ASSERT_TRUE(run(out_s, 1).ok());
        ASSERT_TRUE(run(out_a, 2).ok());
        for (int i = 0; i < 3; ++i) {
          EXPECT_LT(max_rel_diff(out_s[i], out_r[i]), 2e-5) << "scalar, sequence " << i;
          EXPECT_LT(max_rel_diff(out_a[i], out_r[i]), 2e-5) << "avx2, sequence " << i;
        }
        // At the avx512 cap the prefill rows take the AVX-512 prefill tiles
        // where the CPU has AVX-512 F: the AVX2 bits either way.
        std::vector<std::vector<float>> out_w(3);
        for (int i = 0; i < 3; ++i) out_w[i].assign(q[i].size(), 0.0f);
        ASSERT_TRUE(run(out_w, 3).ok());
        for (int i = 0; i < 3; ++i) {
          EXPECT_EQ(std::memcmp(out_w[i].data(), out_a[i].data(), out_a[i].size() * sizeof(float)),
                    0)
              << "avx512 cap, sequence " << i;
        }
        // Bad arguments are rejected with the field named, nothing written.
        std::vector<KvResidualView> bad_res = res;
        bad_res[1].start += 1;
        const Status st = paged_attention_kivi(view, ap, seqs, bad_res, nullptr);
        ASSERT_FALSE(st.ok());
        EXPECT_NE(st.error().message.find("sequence 1"), std::string::npos) << st.error().message;
      }
    }
  }
}

// Decode one token at a time through a KIVI cache; at every step the kernel's
// output equals float64 attention over K/V built independently: positions of
// groups converted before this step decoded from encode(f16 rows of the
// group), the rest f16 rows.
TEST(KiviAttention, IncrementalDecodeEqualsRecomputationOverSameGroups) {
  const int n_kv = 1, n_q = 3, d = 64, p = 16, r = 32, n_steps = 150;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (KvDtype t : {kKvDtypeKivi2, kKvDtypeKivi4}) {
    SCOPED_TRACE(kv_dtype_name(t));
    auto layout = must(KvLayout::uniform(1, n_kv, d, t, p, std::nullopt, {.kivi_residual = r}));
    auto pool = must(BlockPool::create(layout, {.n_tokens = 1024}));
    BlockTable table(*pool);
    const int bits = kv_dtype_kivi_bits(t);
    const int g = layout.kivi_group();
    std::vector<float> ks, vs;  // f16-rounded rows written so far [pos, d]
    int64_t converted_seen = 0;
    for (int step = 0; step < n_steps; ++step) {
      std::vector<float> k(d), v(d), q(static_cast<size_t>(n_q) * d), out(q.size());
      for (int c = 0; c < d; ++c) k[c] = nd(rng) * (c == 9 ? 30.0f : 1.0f) + (c == 2 ? 5.0f : 0.0f);
      for (auto& x : v) x = nd(rng);
      for (auto& x : q) x = nd(rng);
      for (int c = 0; c < d; ++c) {
        ks.push_back(f16_to_f32(f32_to_f16(k[c])));
        vs.push_back(f16_to_f32(f32_to_f16(v[c])));
      }
      ASSERT_TRUE(table.reserve(1).ok());
      table.write(0, step, k.data(), v.data(), 1);
      const int64_t qlen = table.converted();
      ASSERT_GE(qlen, converted_seen);
      converted_seen = qlen;
      const KvResidualView res = table.residual_view(0);
      const AttnSeq s{.block_table = table.data(),
                      .n_blocks = static_cast<int32_t>(table.n_blocks()),
                      .n_past = step,
                      .n_new = 1,
                      .q = q.data(),
                      .out = out.data()};
      const AttnParams ap{.n_q_heads = n_q, .n_kv_heads = n_kv, .head_dim = d, .scale = 0.125f};
      ASSERT_TRUE(paged_attention_kivi(pool->layer_view(0), ap, std::span(&s, 1),
                                       std::span(&res, 1), nullptr)
                      .ok());
      table.commit(1);
      // Independent reference K/V.
      const int n = step + 1;
      std::vector<float> kr(ks), vr(vs);
      std::vector<uint8_t> codes(static_cast<size_t>(g) * d), meta(static_cast<size_t>(d) * 4);
      std::vector<uint8_t> vcodes(d), vmeta(static_cast<size_t>(d / 32) * 4);
      for (int64_t t0 = 0; t0 < qlen; t0 += g) {
        kivi_encode_key_group(bits, ks.data() + t0 * d, d, g, d, codes.data(), d, meta.data());
        for (int j = 0; j < g; ++j) {
          kivi_decode_key_row(bits, codes.data() + j * d, meta.data(), d, kr.data() + (t0 + j) * d);
          kivi_encode_value_row(bits, vs.data() + (t0 + j) * d, d, vcodes.data(), vmeta.data());
          kivi_decode_value_row(bits, vcodes.data(), vmeta.data(), d, vr.data() + (t0 + j) * d);
        }
      }
      double worst = 0, den = 1e-30;
      for (int qh = 0; qh < n_q; ++qh) {
        std::vector<double> sc(n);
        double mx = -1e300;
        for (int j = 0; j < n; ++j) {
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += double{q[qh * d + c]} * kr[j * d + c];
          sc[j] = dot * 0.125;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        std::vector<double> acc(d, 0.0);
        for (int j = 0; j < n; ++j) {
          const double e = std::exp(sc[j] - mx);
          sum += e;
          for (int c = 0; c < d; ++c) acc[c] += e * vr[j * d + c];
        }
        for (int c = 0; c < d; ++c) {
          worst = std::max(worst, std::fabs(acc[c] / sum - out[qh * d + c]));
          den = std::max(den, std::fabs(acc[c] / sum));
        }
      }
      ASSERT_LT(worst / den, 2e-5) << "step " << step << " converted " << qlen;
    }
    EXPECT_EQ(table.converted(), (n_steps - r) / g * g);
  }
}

}  // namespace
}  // namespace kvstack

// H2O key mass (AttnSeq::key_mass): on every decode kernel (scalar, AVX2,
// AVX-512 VNNI where the CPU has them) and every K/V format retention
// supports, the accumulated mass equals a float64 recomputation of the
// paper's quantity (sum over query heads of softmax(q.k * scale)[t]), the
// attention output is bitwise the same as without the mass output, mass
// accumulates over calls, and bad requests are refused. The kernels keep
// each probability as f16 until the final pass (TileArgs::mass_p): a
// relative error of at most 2^-11 per term, so of the mass, on top of the
// float kernels' own (kF16Rel below), plus at most 2^-25 per term below
// 2^-14 (inside the absolute part of the bounds).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_quant.h"
#include "attention/paged_attention.h"
#include "core/thread_pool.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_write.h"
#include "kv/retention.h"

namespace kvstack {
namespace {

using attn_detail::KernelChoice;
using attn_detail::KernelPath;

// Relative error of the f16 records: half an f16 ulp.
constexpr double kF16Rel = 1.0 / 2048;

struct MassWorld {
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<BlockTable> table;
  std::vector<float> k;  // decoded keys [n_keys, n_kv, d]
  std::vector<float> q;  // [n_q, d]
  AttnParams p;
};

MassWorld make_setup(KvDtype dtype, int n_q, int n_kv, int d, int n_keys, uint32_t seed) {
  MassWorld s;
  auto layout = KvLayout::uniform(1, n_kv, d, dtype, 16);
  KV_CHECK(layout.ok(), "layout");
  auto pool = BlockPool::create(*layout, {.n_tokens = n_keys + 64});
  KV_CHECK(pool.ok(), "pool");
  s.pool = std::move(pool).value();
  s.table = std::make_unique<BlockTable>(*s.pool);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(n_keys) * n_kv * d), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 1.5f * nd(rng);
    v[i] = nd(rng);
  }
  // A few keys repeated exactly: equal scores inside a chunk (ties).
  for (int t = 5; t + 1 < n_keys; t += 97) {
    std::copy_n(k.begin() + int64_t{t} * n_kv * d, n_kv * d, k.begin() + int64_t{t + 1} * n_kv * d);
  }
  KV_CHECK(s.table->reserve(n_keys).ok(), "reserve");
  s.table->write(0, 0, k.data(), v.data(), n_keys);
  s.table->commit(n_keys);
  s.k.resize(k.size());
  std::vector<float> vd(k.size());
  read_kv(s.pool->layer_view(0), s.table->ids(), 0, n_keys, s.k.data(), vd.data());
  s.q.resize(static_cast<size_t>(n_q) * d);
  for (float& x : s.q) x = nd(rng);
  s.p = {.n_q_heads = n_q, .n_kv_heads = n_kv, .head_dim = d, .scale = 1.0f / std::sqrt(1.0f * d)};
  return s;
}

// The paper's accumulated attention of one decode query: for every key t,
// sum over query heads h of softmax_t(q_h . k_{h / group, t} * scale), in
// double, from the stored (decoded) keys and the query the kernel uses (q^
// when the kernel rounds it, attention_quant.h).
std::vector<double> reference_mass(const MassWorld& s, bool round_query) {
  const int n_q = s.p.n_q_heads, n_kv = s.p.n_kv_heads, d = s.p.head_dim, g = n_q / n_kv;
  const auto n_keys = static_cast<int64_t>(s.k.size()) / (int64_t{n_kv} * d);
  std::vector<double> mass(static_cast<size_t>(n_keys), 0.0), sc(mass.size());
  std::vector<float> qs(static_cast<size_t>(d));
  std::vector<int8_t> codes(static_cast<size_t>(d));
  std::vector<float> gscale(static_cast<size_t>(d / kQueryGroup + 1));
  for (int h = 0; h < n_q; ++h) {
    std::vector<double> qd(static_cast<size_t>(d));
    for (int i = 0; i < d; ++i) qs[i] = s.q[static_cast<size_t>(h) * d + i] * s.p.scale;
    if (round_query) {
      round_query_int8(qs.data(), d, codes.data(), gscale.data());
      for (int i = 0; i < d; ++i) qd[i] = double{gscale[i / kQueryGroup]} * codes[i];
    } else {
      for (int i = 0; i < d; ++i) qd[i] = qs[i];
    }
    double mx = -INFINITY;
    for (int64_t t = 0; t < n_keys; ++t) {
      const float* kt = s.k.data() + (t * n_kv + h / g) * d;
      double dot = 0.0;
      for (int i = 0; i < d; ++i) dot += qd[i] * kt[i];
      sc[static_cast<size_t>(t)] = dot;
      mx = std::max(mx, dot);
    }
    double sum = 0.0;
    for (double& x : sc) sum += (x = std::exp(x - mx));
    for (int64_t t = 0; t < n_keys; ++t)
      mass[static_cast<size_t>(t)] += sc[static_cast<size_t>(t)] / sum;
  }
  return mass;
}

struct PathCase {
  KvDtype dtype;
  KernelPath path;
};

std::vector<PathCase> path_cases() {
  std::vector<PathCase> out;
  for (KvDtype t : {KvDtype::kF16, KvDtype::kF32, KvDtype::kBF16, KvDtype::kInt8, KvDtype::kInt4}) {
    out.push_back({t, KernelPath::kScalar});
    const KernelChoice kc = attn_detail::select_kernels(best_isa(), t, t, 64);
    if (kc.decode != KernelPath::kScalar) out.push_back({t, kc.decode});
    // The AVX2 decode kernel also serves int8/int4/f16 below AVX-512.
    if (kc.decode == KernelPath::kAvx512Vnni || kc.decode == KernelPath::kAvx512F16) {
      out.push_back({t, KernelPath::kAvx2});
    }
  }
  return out;
}

TEST(AttentionMass, MatchesFloat64ReferenceOnEveryKernelBitwiseSameOutput) {
  ThreadPool threads(3);
  int n_checked = 0;
  for (const PathCase& pc : path_cases()) {
    for (const auto& [n_q, n_kv] : {std::pair{9, 3}, std::pair{8, 2}, std::pair{4, 4}}) {
      for (int n_keys : {1, 37, 512, 513, 1100, 2100}) {
        const std::string where = std::string(kv_dtype_name(pc.dtype)) + " " +
                                  attn_detail::kernel_path_name(pc.path) +
                                  " H_q=" + std::to_string(n_q) + " H_kv=" + std::to_string(n_kv) +
                                  " keys=" + std::to_string(n_keys);
        const MassWorld s = make_setup(pc.dtype, n_q, n_kv, 64, n_keys, 17u + n_keys + n_q);
        const KernelChoice kc{pc.path, pc.path};
        const std::span<const int32_t> ids = s.table->ids();
        std::vector<float> out_plain(s.q.size()), out_mass(s.q.size());
        std::vector<float> mass(static_cast<size_t>(n_keys), 0.0f);
        AttnSeq seq{.block_table = ids.data(),
                    .n_blocks = static_cast<int32_t>(ids.size()),
                    .n_past = n_keys - 1,
                    .n_new = 1,
                    .q = s.q.data(),
                    .out = out_plain.data()};
        const PagedKvLayerView view = s.pool->layer_view(0);
        attn_detail::run_attention(kc, view, s.p, {&seq, 1}, &threads);
        seq.out = out_mass.data();
        seq.key_mass = mass.data();
        attn_detail::run_attention(kc, view, s.p, {&seq, 1}, &threads);
        EXPECT_EQ(0,
                  std::memcmp(out_plain.data(), out_mass.data(), sizeof(float) * out_plain.size()))
            << where << ": the mass output changed the attention output";
        const bool round = attn_detail::decode_rounds_query(kc, pc.dtype);
        const std::vector<double> ref = reference_mass(s, round);
        double total = 0.0;
        for (int t = 0; t < n_keys; ++t) {
          total += mass[static_cast<size_t>(t)];
          ASSERT_NEAR(mass[static_cast<size_t>(t)], ref[static_cast<size_t>(t)],
                      2e-5 * n_q + (1e-4 + kF16Rel) * ref[static_cast<size_t>(t)])
              << where << " key " << t;
        }
        EXPECT_NEAR(total, n_q, 1e-4 * n_q) << where;
        // Accumulates: a second call adds the same mass again.
        std::vector<float> once = mass;
        attn_detail::run_attention(kc, view, s.p, {&seq, 1}, &threads);
        for (int t = 0; t < n_keys; ++t) {
          ASSERT_FLOAT_EQ(mass[static_cast<size_t>(t)], 2 * once[static_cast<size_t>(t)])
              << where << " key " << t;
        }
        ++n_checked;
      }
    }
  }
  EXPECT_GE(n_checked, 5 * 3 * 6);
}

// The public entry point (paged_attention, the quantized dispatch included)
// and the double reference give the same mass; a batch of sequences, only
// some asking for mass, gets each its own.
TEST(AttentionMass, PublicEntryBatchAndReference) {
  ThreadPool threads(2);
  for (KvDtype t : {KvDtype::kF16, KvDtype::kInt8}) {
    const MassWorld a = make_setup(t, 6, 2, 64, 700, 3);
    const MassWorld b = make_setup(t, 6, 2, 64, 90, 4);
    std::vector<float> oa(a.q.size()), ob(b.q.size()), ma(700, 0.0f), mr(700, 0.0f);
    const auto ia = a.table->ids();
    const auto ib = b.table->ids();
    // b has its own pool: run them as two batches of the same shape.
    AttnSeq sa{ia.data(), static_cast<int32_t>(ia.size()), 699, 1, a.q.data(), oa.data(),
               ma.data()};
    AttnSeq sb{ib.data(), static_cast<int32_t>(ib.size()), 89, 1, b.q.data(), ob.data(), nullptr};
    ASSERT_TRUE(paged_attention(a.pool->layer_view(0), a.p, {&sa, 1}, &threads).ok());
    ASSERT_TRUE(paged_attention(b.pool->layer_view(0), b.p, {&sb, 1}, &threads).ok());
    sa.key_mass = mr.data();
    ASSERT_TRUE(paged_attention_reference(a.pool->layer_view(0), a.p, {&sa, 1}).ok());
    // The reference rounds no query: compare float formats tightly only.
    const double tol = t == KvDtype::kF16 ? 1e-5 : 2e-2;
    for (int j = 0; j < 700; ++j) {
      ASSERT_NEAR(ma[j], mr[j], tol * (1 + mr[j]) + kF16Rel * mr[j]) << j;
    }
  }
}

TEST(AttentionMass, RefusesPrefillRowsAndWindows) {
  const MassWorld s = make_setup(KvDtype::kF16, 4, 2, 64, 40, 9);
  std::vector<float> out(2 * s.q.size()), q2(2 * s.q.size()), mass(40);
  const auto ids = s.table->ids();
  AttnSeq seq{ids.data(), static_cast<int32_t>(ids.size()), 38, 2, q2.data(), out.data(),
              mass.data()};
  Status st = paged_attention(s.pool->layer_view(0), s.p, {&seq, 1}, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("key_mass"), std::string::npos) << st.error().message;
  seq.n_past = 39;
  seq.n_new = 1;
  AttnParams pw = s.p;
  pw.window = 8;
  st = paged_attention(s.pool->layer_view(0), pw, {&seq, 1}, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("window"), std::string::npos) << st.error().message;
  EXPECT_TRUE(paged_attention(s.pool->layer_view(0), s.p, {&seq, 1}, nullptr).ok());
}

// H2O end to end on a block table, against a float64 simulation written from
// the paper: every token's mass is the sum over the queries that saw it
// (the prompt's, then each decode query's, all query heads of the group) of
// its softmax probability; before each decode step the cache keeps the
// `window` most recent tokens and the `budget` older ones of highest mass.
// The table's resident positions equal the simulation's after every step
// (a step whose budget-th and next masses are closer than the float
// accumulation can resolve adopts the table's choice, counted), and its
// masses match. obs = the prompt length: every prompt query counts (the
// paper's definition); obs = 0: decode queries only. Windows larger than
// the sequence keep everything.
TEST(H2oDecode, SelectionMatchesFloat64PaperSimulation) {
  ThreadPool threads(2);
  int n_compared = 0, n_ambiguous = 0;
  for (const auto& heads : {std::pair{6, 2}, std::pair{4, 4}}) {
    const int n_q = heads.first, n_kv = heads.second;
    for (const auto& [budget, window] : {std::pair{6, 4}, std::pair{3, 9}, std::pair{5, 200}}) {
      for (const int obs : {0, 12}) {
        const int d = 32, n_prompt = 12, n_total = 60;
        const std::string where = "H_q=" + std::to_string(n_q) + " H_kv=" + std::to_string(n_kv) +
                                  " budget " + std::to_string(budget) + " window " +
                                  std::to_string(window) + " obs " + std::to_string(obs);
        auto layout = KvLayout::uniform(1, n_kv, d, KvDtype::kF32, 4);
        ASSERT_TRUE(layout.ok());
        auto pool = BlockPool::create(*layout, {.n_tokens = 256});
        ASSERT_TRUE(pool.ok());
        BlockTable table(**pool);
        const RetentionConfig rc{.policy = RetentionPolicy::kH2o,
                                 .window = window,
                                 .slack = 1,
                                 .budget = budget,
                                 .obs = obs};
        ASSERT_TRUE(table.set_retention(rc).ok());
        std::mt19937 rng(static_cast<uint32_t>(budget * 100 + window + obs + n_q));
        std::normal_distribution<float> nd;
        const int kv_dim = n_kv * d, q_dim = n_q * d, g = n_q / n_kv;
        std::vector<float> k(static_cast<size_t>(n_total) * kv_dim), v(k.size()),
            q(static_cast<size_t>(n_total) * q_dim);
        for (float& x : k) x = 2.0f * nd(rng);
        for (float& x : v) x = nd(rng);
        for (float& x : q) x = nd(rng);
        const float scale = 1.0f / std::sqrt(1.0f * d);
        const AttnParams p{.n_q_heads = n_q, .n_kv_heads = n_kv, .head_dim = d, .scale = scale};
        // Probabilities query t gives to the keys `keys` (summed over heads), in double.
        auto probs = [&](int t, const std::vector<int>& keys) {
          std::vector<double> out(keys.size(), 0.0), sc(keys.size());
          for (int h = 0; h < n_q; ++h) {
            double mx = -INFINITY;
            for (size_t i = 0; i < keys.size(); ++i) {
              double dot = 0.0;
              for (int c = 0; c < d; ++c) {
                dot +=
                    double{q[static_cast<size_t>(t) * q_dim + static_cast<size_t>(h) * d + c]} *
                    k[static_cast<size_t>(keys[i]) * kv_dim + static_cast<size_t>(h / g) * d + c];
              }
              sc[i] = dot * scale;
              mx = std::max(mx, sc[i]);
            }
            double sum = 0.0;
            for (double& x : sc) sum += (x = std::exp(x - mx));
            for (size_t i = 0; i < keys.size(); ++i) out[i] += sc[i] / sum;
          }
          return out;
        };
        // The simulation: resident tokens (ascending) and their mass.
        std::vector<int> res;
        std::vector<double> mass;
        // Prompt: written in one step; its last `obs` queries seed the mass.
        ASSERT_TRUE(table.reserve(n_prompt).ok());
        table.write(0, 0, k.data(), v.data(), n_prompt);
        table.observe_queries(0, 0, q.data(), n_prompt,
                              {.n_q_heads = n_q, .head_dim = d, .scale = scale});
        table.commit(n_prompt);
        for (int t = 0; t < n_prompt; ++t) {
          res.push_back(t);
          mass.push_back(0.0);
        }
        for (int t = std::max(0, n_prompt - obs); t < n_prompt; ++t) {
          const std::vector<int> keys(res.begin(), res.begin() + t + 1);
          const std::vector<double> pr = probs(t, keys);
          for (size_t i = 0; i < pr.size(); ++i) mass[i] += pr[i];
        }
        std::vector<float> out(static_cast<size_t>(q_dim));
        for (int t = n_prompt; t < n_total; ++t) {
          ASSERT_TRUE(table.reserve(1).ok()) << where;
          // Simulation: evict to budget + window (slack 1: every step).
          const auto n = static_cast<int64_t>(res.size());
          bool ambiguous = false;
          if (n > budget + window) {
            const int64_t n_old = n - window;
            std::vector<int64_t> order(static_cast<size_t>(n_old));
            for (int64_t i = 0; i < n_old; ++i) order[static_cast<size_t>(i)] = i;
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
              return mass[static_cast<size_t>(a)] > mass[static_cast<size_t>(b)];
            });
            // Closer than twice the mass's bound below: the f16 records
            // may order them either way.
            const double m_b = mass[static_cast<size_t>(order[budget - 1])];
            ambiguous = m_b - mass[static_cast<size_t>(order[budget])] <
                        2 * (1e-4 * (1.0 + m_b) + kF16Rel * m_b);
            std::vector<char> keep(static_cast<size_t>(n), 0);
            for (int64_t i = 0; i < budget; ++i) keep[static_cast<size_t>(order[i])] = 1;
            for (int64_t i = n_old; i < n; ++i) keep[static_cast<size_t>(i)] = 1;
            std::vector<int> r2;
            std::vector<double> m2;
            for (int64_t i = 0; i < n; ++i) {
              if (keep[static_cast<size_t>(i)] == 0) continue;
              r2.push_back(res[static_cast<size_t>(i)]);
              m2.push_back(mass[static_cast<size_t>(i)]);
            }
            res = std::move(r2);
            mass = std::move(m2);
          }
          const GroupTable& gt = table.group(0);
          std::vector<int> got;
          for (int64_t sl = 0; sl < gt.length(); ++sl)
            got.push_back(static_cast<int>(gt.position(sl)));
          if (ambiguous && got != res) {
            ++n_ambiguous;  // a float near-tie: follow the table
            std::vector<double> m2;
            for (int pos : got) {
              const auto it = std::find(res.begin(), res.end(), pos);
              m2.push_back(it == res.end() ? 0.0 : mass[static_cast<size_t>(it - res.begin())]);
            }
            res = got;
            mass = std::move(m2);
          } else {
            ASSERT_EQ(got, res) << where << " before step " << t;
            ++n_compared;
          }
          // Decode step t: write, attend with the mass output, commit.
          table.write(0, t, k.data() + static_cast<size_t>(t) * kv_dim,
                      v.data() + static_cast<size_t>(t) * kv_dim, 1);
          const int64_t n_res = table.resident_length(0);
          const auto ids = table.ids_for_layer(0);
          AttnSeq seq{.block_table = ids.data(),
                      .n_blocks = static_cast<int32_t>(ids.size()),
                      .n_past = static_cast<int32_t>(n_res),
                      .n_new = 1,
                      .q = q.data() + static_cast<size_t>(t) * q_dim,
                      .out = out.data(),
                      .key_mass = table.key_mass(0, n_res + 1)};
          ASSERT_TRUE(paged_attention((*pool)->layer_view(0), p, {&seq, 1}, &threads).ok());
          table.commit(1);
          res.push_back(t);
          mass.push_back(0.0);
          const std::vector<double> pr = probs(t, res);
          for (size_t i = 0; i < pr.size(); ++i) mass[i] += pr[i];
          const std::span<const float> tm = table.group_mass(0);
          ASSERT_EQ(tm.size(), mass.size()) << where;
          for (size_t i = 0; i < mass.size(); ++i) {
            ASSERT_NEAR(tm[i], mass[i], 1e-4 * (1.0 + mass[i]) + kF16Rel * mass[i])
                << where << " slot " << i;
          }
        }
        const int64_t cap = std::min<int64_t>(n_total, budget + window + 1);
        EXPECT_EQ(table.group(0).length(), cap) << where;
        EXPECT_EQ(table.compacted(), budget + window + 1 < n_total) << where;
        (*pool)->check_invariants();
        table.release();
        EXPECT_EQ((*pool)->n_free(), (*pool)->n_blocks()) << where;
      }
    }
  }
  EXPECT_GT(n_compared, 500);
  EXPECT_LE(n_ambiguous, n_compared / 50) << "too many near-ties to trust the comparison";
}

}  // namespace
}  // namespace kvstack

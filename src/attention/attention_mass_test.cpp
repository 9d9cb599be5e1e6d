// H2O key mass (AttnSeq::key_mass): on every decode kernel (scalar, AVX2,
// AVX-512 VNNI where the CPU has them) and every K/V format retention
// supports, the accumulated mass equals a float64 recomputation of the
// paper's quantity (sum over query heads of softmax(q.k * scale)[t]), the
// attention output is bitwise the same as without the mass output, mass
// accumulates over calls, and bad requests are refused.
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

namespace kvstack {
namespace {

using attn_detail::KernelChoice;
using attn_detail::KernelPath;

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
    for (int i = 0; i < d; ++i) qs[i] = s.q[static_cast<size_t>(h * d + i)] * s.p.scale;
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
    // The AVX2 decode kernel also serves int8/int4 below AVX-512.
    if (kc.decode == KernelPath::kAvx512Vnni) out.push_back({t, KernelPath::kAvx2});
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
                      2e-5 * n_q + 1e-4 * ref[static_cast<size_t>(t)])
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
    for (int j = 0; j < 700; ++j) ASSERT_NEAR(ma[j], mr[j], tol * (1 + mr[j])) << j;
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

}  // namespace
}  // namespace kvstack

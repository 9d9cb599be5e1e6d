// Cache equivalence for quantized KV formats (fp8, int8, int4, and mixed K/V
// dtypes): logits from chunked prefill + incremental decode through the
// paged, quantized cache equal a float64 recomputation of the whole prefix
// that attends over the same quantized K/V, i.e. the values the cache holds
// (decoded with the scalar reference codec) at that step. Also checks that
// the stored rows are the quantization of the reference's own K/V (right
// position, right head, error within the format's bound), and that a fork
// adopting shared full blocks of another sequence sees the same values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "core/half.h"
#include "engine/forward.h"
#include "engine/testing/logits_check.h"
#include "engine/testing/synthetic_model.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_codec.h"
#include "kv/kv_write.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

using testing::kLogitTol;
using testing::logits_rel_err;
using testing::reference_last_logits;
using testing::run_prefill_decode_fork;
using testing::stored_row;
using testing::SyntheticCase;
using testing::SyntheticSpec;

// Reference logits of tokens[0..n) attending over what `table` stores.
std::vector<double> reference_from_cache(const testing::SyntheticWeights& w,
                                         const std::vector<int32_t>& tokens, int n,
                                         const BlockPool& pool, const BlockTable& table,
                                         double* worst_quant_err) {
  const int d = w.spec.head_dim();
  return reference_last_logits(
      w, std::vector<int32_t>(tokens.begin(), tokens.begin() + n),
      [&](int layer, int pos, std::vector<double>& k, std::vector<double>& v) {
        const PagedKvLayerView view = pool.layer_view(layer);
        for (int h = 0; h < w.spec.n_kv_heads; ++h) {
          for (int which = 0; which < 2; ++which) {
            std::vector<double>& x = which == 0 ? k : v;
            const std::vector<float> s = stored_row(view, table, pos, h, which);
            double amax = 1e-30;
            for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[h * d + i]));
            for (int i = 0; i < d; ++i) {
              *worst_quant_err = std::max(*worst_quant_err, std::fabs(x[h * d + i] - s[i]) / amax);
              x[h * d + i] = s[i];
            }
          }
        }
      });
}

struct Format {
  const char* name;
  KvDtype k, v;
  double max_quant_err;  // worst |x - stored| / row amax the format allows
};

const Format kFormats[] = {
    {"fp8", KvDtype::kFp8, KvDtype::kFp8, 1.0 / 16},
    {"int8", KvDtype::kInt8, KvDtype::kInt8, 0.5 / 127 * 1.01},
    {"int4", KvDtype::kInt4, KvDtype::kInt4, testing::kInt4MaxErr},
    {"int4_k_f16_v", KvDtype::kInt4, KvDtype::kF16, testing::kInt4MaxErr},
    {"int8_k_fp8_v", KvDtype::kInt8, KvDtype::kFp8, 1.0 / 16},
};

class QuantCacheEquivalence : public testing::SyntheticForwardTest {};

TEST_P(QuantCacheEquivalence, PrefillDecodeAndForkMatchRecomputationOverStoredKv) {
  const SyntheticSpec& spec = GetParam().spec;
  const testing::SyntheticWeights& w = w_;
  Forward& fwd = *fwd_;
  std::mt19937 rng(spec.seed + 200);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  const int n_prompt = 19, n_decode = 5;
  std::vector<int32_t> prompt(n_prompt + n_decode), fork_tail(6);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : fork_tail) t = tok(rng);

  for (const Format& f : kFormats) {
    for (int block_size : {4, 16}) {
      if (f.k != f.v && block_size != 4) continue;  // mixed pairs: one block size
      SCOPED_TRACE(std::string(f.name) + " block " + std::to_string(block_size));
      std::vector<KvLayerSpec> layers(spec.n_layers, KvLayerSpec{.n_kv_heads = spec.n_kv_heads,
                                                                 .head_dim_k = spec.head_dim(),
                                                                 .head_dim_v = spec.head_dim(),
                                                                 .dtype = f.k});
      for (auto& l : layers) {
        if (f.v != f.k) l.dtype_v = f.v;
      }
      auto layout = KvLayout::create(layers, block_size);
      ASSERT_TRUE(layout.ok()) << layout.error().message;
      auto pool_r = BlockPool::create(*layout, {.n_tokens = 1024});
      ASSERT_TRUE(pool_r.ok());
      BlockPool& pool = **pool_r;
      double worst = 0;
      run_prefill_decode_fork(
          fwd, pool, spec.n_vocab, prompt, n_prompt, 1, fork_tail,
          [&](const std::vector<int32_t>& tokens, int n, const BlockTable& t) {
            return reference_from_cache(w, tokens, n, pool, t, &worst);
          },
          testing::decode_row_tol(*layout));
      if (HasFatalFailure()) return;
      // Where decode rows attend with q^ (decode_row_tol), the rows a later
      // layer writes after a decode step come from a hidden state that q^
      // moved (the reference attends exactly): up to 0.85% of amax measured
      // for int8 on the AVX-512 VNNI kernel, within int4's own bound.
      const bool q_rounded = testing::decode_row_tol(*layout) != kLogitTol;
      EXPECT_LE(worst, f.max_quant_err + (q_rounded ? 0.01 : 0.0))
          << "stored rows are not the quantized reference K/V";
      EXPECT_GT(worst, 0.0) << "no quantization error at all: K/V not quantized?";
      pool.check_invariants();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantCacheEquivalence,
    ::testing::Values(
        SyntheticCase{"gqa_3_1_d32", {.n_embd = 96, .n_heads = 3, .n_kv_heads = 1, .seed = 2}},
        SyntheticCase{"gqa_4_2_d32", {.n_embd = 128, .n_heads = 4, .n_kv_heads = 2, .seed = 7}},
        SyntheticCase{"mqa_d64_neox",
                      {.n_embd = 128, .n_heads = 2, .n_kv_heads = 1, .neox = true, .seed = 4}}),
    testing::synthetic_case_name);

// ---------------------------------------------------------------------------
// KIVI: the newest tokens stay in the table's f16 residual and whole key
// groups are quantized at commit. The reference recomputes the whole prefix
// in float64 attending over exactly what the last step read: positions
// converted before the step from the blocks (reference decoder), positions
// still in the residual at the step from the f16 rows (snapshot before the
// step, or the residual after it for the step's own rows), i.e. the same
// groups quantized at the same moments. Covers many group boundaries,
// chunked prefill, a fork in the middle (shared unconverted blocks, copied
// on conversion) and prefix sharing of converted blocks.
// ---------------------------------------------------------------------------

struct ResidualSnapshot {
  int64_t start = 0;
  std::vector<std::vector<uint16_t>> k, v;  // per layer [n, H * d]
};

ResidualSnapshot snapshot(const BlockTable& t) {
  ResidualSnapshot s;
  s.start = t.converted();
  const int n_layers = t.pool().layout().n_layers();
  for (int l = 0; l < n_layers; ++l) {
    const KvResidualView r = t.residual_view(l);
    const int64_t w = r.n_tokens > 0 ? static_cast<int64_t>(t.pool().layer_view(l).n_kv_heads) *
                                           t.pool().layer_view(l).head_dim
                                     : 0;
    s.k.emplace_back(r.k, r.k + r.n_tokens * w);
    s.v.emplace_back(r.v, r.v + r.n_tokens * w);
  }
  return s;
}

std::vector<double> kivi_reference(const testing::SyntheticWeights& w,
                                   const std::vector<int32_t>& tokens, const BlockPool& pool,
                                   const BlockTable& table, const ResidualSnapshot& before) {
  const int d = w.spec.head_dim();
  const int hw = w.spec.n_kv_heads * d;
  return reference_last_logits(
      w, tokens, [&](int layer, int pos, std::vector<double>& k, std::vector<double>& v) {
        std::vector<float> kf(hw), vf(hw);
        const KvResidualView after = table.residual_view(layer);
        if (pos < before.start) {
          read_kv(pool.layer_view(layer), table.ids(), pos, 1, kf.data(), vf.data());
        } else if (pos >= after.start) {
          for (int i = 0; i < hw; ++i) {
            kf[i] = f16_to_f32(after.k[(pos - after.start) * hw + i]);
            vf[i] = f16_to_f32(after.v[(pos - after.start) * hw + i]);
          }
        } else {
          const size_t off = static_cast<size_t>(pos - before.start) * hw;
          ASSERT_LT(off, before.k[layer].size()) << "position " << pos << " in neither state";
          for (int i = 0; i < hw; ++i) {
            kf[i] = f16_to_f32(before.k[layer][off + i]);
            vf[i] = f16_to_f32(before.v[layer][off + i]);
          }
        }
        for (int i = 0; i < hw; ++i) {
          k[i] = kf[i];
          v[i] = vf[i];
        }
      });
}

class KiviCacheEquivalence : public testing::SyntheticForwardTest {};

TEST_P(KiviCacheEquivalence, GroupBoundariesForkAndPrefixSharingMatchSameMomentReference) {
  const SyntheticSpec& spec = GetParam().spec;
  const testing::SyntheticWeights& w = w_;
  Forward& fwd = *fwd_;
  std::mt19937 rng(spec.seed + 300);
  std::uniform_int_distribution<int32_t> tok(0, spec.n_vocab - 1);
  struct KFormat {
    const char* name;
    KvDtype k, v;
  };
  const KFormat formats[] = {{"kivi2", kKvDtypeKivi2, kKvDtypeKivi2},
                             {"kivi4", kKvDtypeKivi4, kKvDtypeKivi4},
                             {"kivi2_k_int8_v", kKvDtypeKivi2, KvDtype::kInt8}};
  for (const KFormat& f : formats) {
    for (int block_size : {4, 16}) {
      // Block 16 (G = 16) once: the reference is O(n^2) per step.
      if (block_size == 16 && f.k != kKvDtypeKivi4) continue;
      const int residual = block_size == 4 ? 8 : 16;  // G = block size here; chunks <= R
      SCOPED_TRACE(std::string(f.name) + " block " + std::to_string(block_size));
      auto layout = KvLayout::uniform(spec.n_layers, spec.n_kv_heads, spec.head_dim(), f.k,
                                      block_size, f.v, {.kivi_residual = residual});
      ASSERT_TRUE(layout.ok()) << layout.error().message;
      auto pool_r = BlockPool::create(*layout, {.n_tokens = 2048});
      ASSERT_TRUE(pool_r.ok());
      BlockPool& pool = **pool_r;
      std::vector<float> logits;
      // One step of `n` new tokens on `t` (history `hist`), checked.
      auto step = [&](BlockTable& t, std::vector<int32_t>& hist, int n, const char* what) {
        std::vector<int32_t> fresh(n);
        for (auto& x : fresh) x = tok(rng);
        const ResidualSnapshot before = snapshot(t);
        const StepSeq s{.table = &t, .tokens = fresh, .logits = LogitsMode::kLast};
        ASSERT_TRUE(fwd.step(std::span<const StepSeq>(&s, 1), &logits).ok());
        hist.insert(hist.end(), fresh.begin(), fresh.end());
        const auto ref = kivi_reference(w, hist, pool, t, before);
        ASSERT_LT(logits_rel_err(logits.data(), ref), kLogitTol)
            << what << " at length " << t.length();
      };
      BlockTable junk(pool), a(pool);
      ASSERT_TRUE(junk.reserve(3 * block_size).ok());  // scattered blocks
      std::vector<int32_t> ha;
      for (int chunk : {1, 4, 7, 3}) step(a, ha, std::min(chunk, residual), "prefill");
      junk.release();
      for (int i = 0; i < residual + block_size + 3; ++i) step(a, ha, 1, "decode");
      ASSERT_GT(a.converted(), 0);
      ASSERT_LT(a.converted(), a.length());
      // Fork in the middle: shares every block, including unconverted ones.
      BlockTable b = a.fork();
      std::vector<int32_t> hb = ha;
      for (int i = 0; i < block_size + 2; ++i) {
        step(a, ha, 1, "decode after fork (parent)");
        step(b, hb, 1, "decode after fork (child)");
      }
      EXPECT_GT(pool.stats().n_cow_copies, 0);
      // Prefix sharing: a new table adopts a's converted full blocks.
      const int64_t n_share = a.shareable_length() / block_size;
      ASSERT_GT(n_share, 1);
      std::vector<BlockRef> refs;
      for (int64_t i = 0; i < n_share; ++i) refs.push_back(a.share_block(i));
      BlockTable c(pool);
      c.adopt_prefix(std::move(refs));
      std::vector<int32_t> hc(ha.begin(), ha.begin() + n_share * block_size);
      step(c, hc, std::min(5, residual), "prefill after prefix hit");
      for (int i = 0; i < block_size + 2; ++i) step(c, hc, 1, "decode after prefix hit");
      step(a, ha, 1, "parent after sharing");
      EXPECT_GT(b.converted(), 0);
      pool.check_invariants();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KiviCacheEquivalence,
    ::testing::Values(
        SyntheticCase{"gqa_3_1_d32", {.n_embd = 96, .n_heads = 3, .n_kv_heads = 1, .seed = 2}},
        SyntheticCase{"mqa_d64_neox",
                      {.n_embd = 128, .n_heads = 2, .n_kv_heads = 1, .neox = true, .seed = 4}}),
    testing::synthetic_case_name);

}  // namespace
}  // namespace kvstack

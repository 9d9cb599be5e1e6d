// Quantized paged attention: the AVX2 kernel and the scalar kernel against
// the double-precision reference (all reading the same stored codes), for
// every K/V format pair, decode and prefill, GQA/MQA, windows, scattered
// blocks, odd lengths and split-K across threads; and the dispatch from
// paged_attention().
#include "attention/attention_quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "kv/kv_write.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

struct Free {
  void operator()(uint8_t* p) const { std::free(p); }
};

struct Shape {
  int n_q_heads, n_kv_heads, head_dim, block_size;
  std::vector<int> n_past, n_new;  // per sequence
  int window = 0;
};

struct CacheFixture {
  KvLayout layout;
  std::unique_ptr<uint8_t, Free> base;
  PagedKvLayerView view;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<float>> q;
};

// Writes random K/V for every sequence into scattered blocks of one layer.
CacheFixture make_setup(KvDtype kt, KvDtype vt, const Shape& s, uint32_t seed) {
  std::vector<KvLayerSpec> layers = {KvLayerSpec{.n_kv_heads = s.n_kv_heads,
                                                 .head_dim_k = s.head_dim,
                                                 .head_dim_v = s.head_dim,
                                                 .dtype = kt,
                                                 .window = s.window}};
  if (vt != kt) layers[0].dtype_v = vt;
  auto layout = KvLayout::create(layers, s.block_size);
  EXPECT_TRUE(layout.ok()) << layout.error().message;
  int n_blocks = 0;
  std::vector<int> need;
  for (size_t i = 0; i < s.n_past.size(); ++i) {
    need.push_back((s.n_past[i] + s.n_new[i] + s.block_size - 1) / s.block_size);
    n_blocks += need.back();
  }
  std::vector<int32_t> ids(n_blocks + 3);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  const size_t bytes = static_cast<size_t>(layout->block_bytes()) * (n_blocks + 3);
  CacheFixture out{
      *layout,
      std::unique_ptr<uint8_t, Free>(static_cast<uint8_t*>(std::aligned_alloc(64, bytes))),
      {},
      {},
      {}};
  for (size_t i = 0; i < bytes; ++i) out.base.get()[i] = static_cast<uint8_t>(rng());
  out.view = out.layout.layer_view(0, out.base.get());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  size_t next = 0;
  for (size_t i = 0; i < s.n_past.size(); ++i) {
    out.tables.emplace_back(ids.begin() + next, ids.begin() + next + need[i]);
    next += need[i];
    const int n = s.n_past[i] + s.n_new[i];
    std::vector<float> k(static_cast<size_t>(n) * s.n_kv_heads * s.head_dim);
    std::vector<float> v(k.size());
    for (size_t j = 0; j < k.size(); ++j) {
      // A few outlier channels, as real keys have.
      k[j] = nd(rng) * ((j % s.head_dim) % 13 == 5 ? 8.0f : 1.0f);
      v[j] = nd(rng);
    }
    write_kv(out.view, out.tables.back(), 0, k.data(), v.data(), n);
    std::vector<float> q(static_cast<size_t>(s.n_new[i]) * s.n_q_heads * s.head_dim);
    for (float& x : q) x = nd(rng);
    out.q.push_back(std::move(q));
  }
  return out;
}

std::vector<AttnSeq> seqs_for(CacheFixture& st, const Shape& s,
                              std::vector<std::vector<float>>& out) {
  std::vector<AttnSeq> seqs;
  out.clear();
  for (size_t i = 0; i < s.n_past.size(); ++i) {
    out.emplace_back(st.q[i].size(), -7.0f);
    seqs.push_back(AttnSeq{.block_table = st.tables[i].data(),
                           .n_blocks = static_cast<int32_t>(st.tables[i].size()),
                           .n_past = s.n_past[i],
                           .n_new = s.n_new[i],
                           .q = st.q[i].data(),
                           .out = out[i].data()});
  }
  return seqs;
}

double max_diff(const std::vector<std::vector<float>>& a,
                const std::vector<std::vector<float>>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::fabs(double{a[i][j]} - b[i][j]));
  }
  return m;
}

const KvDtype kAll[] = {KvDtype::kF32, KvDtype::kF16,  KvDtype::kBF16,
                        KvDtype::kFp8, KvDtype::kInt8, KvDtype::kInt4};

bool have_avx2() {
  return best_isa() >= Isa::kAvx2 && cpu_features().f16c && cpu_features().fma;
}

// Whether paged_attention() runs the AVX-512 VNNI decode kernel for this
// format pair here.
bool dispatch_is_vnni(KvDtype k, KvDtype v, int head_dim) {
  return attn_detail::select_kernels(best_isa(), k, v, head_dim).decode ==
         attn_detail::KernelPath::kAvx512Vnni;
}

// Bound on |VNNI kernel - reference with q^| on these tests' data (unit
// normal K/V, outputs of magnitude ~0.1-1): the int16 weight rounding, at
// most half of 2^-15 of a chunk's largest weight per weight; int4 V codes
// reach 15 steps of their scale, so its sums carry the most (measured up to
// 4.4e-4 with 64-key chunks, printed by Avx512VnniDecodeMatchesReference).
// int8-rounded weights would be 128 times coarser.
constexpr double kVnniTolerance = 1e-3;

TEST(QuantAttention, KernelsMatchReferenceForEveryFormatPair) {
  const Shape shapes[] = {
      {9, 3, 64, 16, {0, 37, 300}, {1, 1, 1}},  // decode batch, GQA 3
      {9, 3, 64, 16, {0, 70}, {45, 9}},         // prefill on a cached prefix
      {4, 1, 32, 1, {5, 64}, {3, 1}},           // MQA, block size 1
      {8, 8, 96, 8, {33}, {17}, 20},            // MHA, window 20
      {6, 2, 128, 32, {1100}, {1}},             // long decode (split-K below)
  };
  ThreadPool pool(2);
  int si = 0;
  for (const Shape& s : shapes) {
    for (KvDtype kt : kAll) {
      for (KvDtype vt : kAll) {
        if (!kv_dtype_is_quantized(kt) && !kv_dtype_is_quantized(vt) && kt == vt) continue;
        // Every pair on the first two shapes; same-format and two mixed pairs on the rest.
        const bool mixed_ok = (kt == KvDtype::kInt8 && vt == KvDtype::kF16) ||
                              (kt == KvDtype::kInt4 && vt == KvDtype::kFp8);
        if (si >= 2 && kt != vt && !mixed_ok) continue;
        if ((kt == KvDtype::kInt4 || vt == KvDtype::kInt4) && s.head_dim % 32 != 0) continue;
        SCOPED_TRACE(std::string("shape ") + std::to_string(si) + " K " + kv_dtype_name(kt) +
                     " V " + kv_dtype_name(vt));
        CacheFixture st = make_setup(kt, vt, s, 17 + si);
        const AttnParams p{.n_q_heads = s.n_q_heads,
                           .n_kv_heads = s.n_kv_heads,
                           .head_dim = s.head_dim,
                           .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                           .window = s.window};
        std::vector<std::vector<float>> ref, scal, simd, hook;
        auto seqs = seqs_for(st, s, ref);
        ASSERT_TRUE(paged_attention_quant_reference(st.view, p, seqs).ok());
        seqs = seqs_for(st, s, scal);
        ASSERT_TRUE(paged_attention_quant_isa(Isa::kScalar, st.view, p, seqs, &pool).ok());
        EXPECT_LT(max_diff(scal, ref), 2e-5);
        if (have_avx2()) {
          seqs = seqs_for(st, s, simd);
          ASSERT_TRUE(paged_attention_quant_isa(Isa::kAvx2, st.view, p, seqs, &pool).ok());
          EXPECT_LT(max_diff(simd, ref), 2e-5);
        }
        seqs = seqs_for(st, s, hook);
        ASSERT_TRUE(paged_attention(st.view, p, seqs, &pool).ok());  // dispatches here
        if (dispatch_is_vnni(kt, vt, s.head_dim)) {
          // The VNNI decode kernel (tested on its own below): q^ for int8
          // keys too, int16-rounded weights.
          std::vector<std::vector<float>> ref_q;
          seqs = seqs_for(st, s, ref_q);
          ASSERT_TRUE(
              paged_attention_quant_reference(st.view, p, seqs, {.round_int8_query = true}).ok());
          EXPECT_LT(max_diff(hook, ref_q), kVnniTolerance);
        } else {
          EXPECT_LT(max_diff(hook, ref), 2e-5);
        }
      }
    }
    ++si;
  }
  std::printf(
      "[ paths    ] scalar: ran; avx2: %s; paged_attention() ran int8 %s, int4 %s, fp8 %s\n",
      have_avx2() ? "ran" : "skipped (no AVX2/FMA/F16C, or KVSTACK_ISA=scalar)",
      attention_kernel_name(KvDtype::kInt8, KvDtype::kInt8, 64).c_str(),
      attention_kernel_name(KvDtype::kInt4, KvDtype::kInt4, 64).c_str(),
      attention_kernel_name(KvDtype::kFp8, KvDtype::kFp8, 64).c_str());
}

TEST(QuantAttention, SplitKAcrossThreadsEqualsSingleThread) {
  const Shape s{9, 3, 64, 16, {4000, 1500}, {1, 1}};
  for (KvDtype t : {KvDtype::kFp8, KvDtype::kInt8, KvDtype::kInt4}) {
    SCOPED_TRACE(kv_dtype_name(t));
    CacheFixture st = make_setup(t, t, s, 3);
    const AttnParams p{.n_q_heads = 9, .n_kv_heads = 3, .head_dim = 64, .scale = 0.125f};
    std::vector<std::vector<float>> one, many, ref;
    auto seqs = seqs_for(st, s, one);
    ASSERT_TRUE(paged_attention_quant(st.view, p, seqs, nullptr).ok());
    ThreadPool pool(4);
    seqs = seqs_for(st, s, many);
    ASSERT_TRUE(paged_attention_quant(st.view, p, seqs, &pool).ok());
    seqs = seqs_for(st, s, ref);
    const bool vnni = dispatch_is_vnni(t, t, 64);
    ASSERT_TRUE(paged_attention_quant_reference(st.view, p, seqs, {.round_int8_query = vnni}).ok());
    EXPECT_EQ(max_diff(one, many), 0.0);
    EXPECT_LT(max_diff(one, ref), vnni ? kVnniTolerance : 2e-5);
    EXPECT_LT(max_diff(many, ref), vnni ? kVnniTolerance : 2e-5);
  }
}

TEST(QuantAttention, RejectsBadArguments) {
  const Shape s{4, 2, 64, 16, {10}, {1}};
  CacheFixture st = make_setup(KvDtype::kInt8, KvDtype::kInt8, s, 1);
  const AttnParams p{.n_q_heads = 4, .n_kv_heads = 2, .head_dim = 64, .scale = 0.125f};
  std::vector<std::vector<float>> out;
  auto seqs = seqs_for(st, s, out);
  PagedKvLayerView no_meta = st.view;
  no_meta.k_meta = nullptr;
  const Status a = paged_attention(no_meta, p, seqs, nullptr);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.error().message.find("metadata"), std::string::npos) << a.error().message;
  seqs[0].n_blocks = 0;
  const Status b = paged_attention(st.view, p, seqs, nullptr);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message.find("sequence 0"), std::string::npos) << b.error().message;
  EXPECT_EQ(out[0][0], -7.0f);  // untouched
}

// Batch invariance for the quantized formats: a sequence's output is bitwise
// the same alone on one thread and in a mixed decode/prefill batch on any
// number of threads.
TEST(QuantAttention, OutputIsBitwiseIndependentOfBatchAndThreads) {
  const Shape s{9, 3, 64, 16, {2500, 37, 1200, 0, 5000}, {1, 1, 30, 50, 2}};
  for (KvDtype t : {KvDtype::kFp8, KvDtype::kInt8, KvDtype::kInt4}) {
    SCOPED_TRACE(kv_dtype_name(t));
    CacheFixture st = make_setup(t, t, s, 5);
    const AttnParams p{.n_q_heads = 9, .n_kv_heads = 3, .head_dim = 64, .scale = 0.125f};
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {  // clamped to the CPU
      for (int n_threads : {1, 2, 3}) {
        ThreadPool pool(n_threads);
        std::vector<std::vector<float>> out;
        auto seqs = seqs_for(st, s, out);
        ASSERT_TRUE(paged_attention_quant_isa(isa, st.view, p, seqs, &pool).ok());
        for (size_t i = 0; i < seqs.size(); ++i) {
          std::vector<float> alone(out[i].size(), -1.0f);
          AttnSeq one = seqs[i];
          one.out = alone.data();
          ASSERT_TRUE(
              paged_attention_quant_isa(isa, st.view, p, std::span<const AttnSeq>(&one, 1), nullptr)
                  .ok());
          EXPECT_EQ(std::memcmp(alone.data(), out[i].data(), alone.size() * sizeof(float)), 0)
              << isa_name(isa) << " seq " << i << " threads " << n_threads;
        }
      }
    }
  }
}

// ---- AVX-512 VNNI decode kernel (attention_kernels_avx512.cpp) ----

// Why the VNNI kernel cannot run here, or nullptr.
const char* vnni_missing() {
  const CpuFeatures& f = cpu_features();
  if (!f.avx512f || !f.avx512bw || !f.avx512vl || !f.avx512dq) {
    return "no AVX-512 F/BW/VL/DQ on this CPU";
  }
  if (!f.avx512vnni) return "no AVX-512 VNNI on this CPU";
  if (!__builtin_cpu_supports("avx512vbmi")) return "no AVX-512 VBMI on this CPU";
  if (best_isa() < Isa::kAvx512) return "KVSTACK_ISA caps below avx512";
  if (!dispatch_is_vnni(KvDtype::kInt8, KvDtype::kInt8, 64)) {
    return "KVSTACK_ATTN_ISA caps below avx512";
  }
  if (!f.fma || !f.f16c) return "no FMA/F16C on this CPU";
  return nullptr;
}

// Every int8/int4 K x V pair, decode batches with GQA ratios 1..8 (odd
// ones and more than 4 q heads per KV head: sub-groups), head_dim 64..256,
// block sizes 1..32, lengths around the 16-key steps and the 64-key chunk, split-K
// (> 512 keys), all KV heads in one tile (>= 1024 keys), windows; against
// the reference with q^ for int8 keys too.
TEST(QuantAttention, Avx512VnniDecodeMatchesReference) {
  if (const char* why = vnni_missing()) GTEST_SKIP() << "avx512-vnni decode not run: " << why;
  const Shape shapes[] = {
      {9,
       3,
       64,
       16,
       {0, 1, 14, 15, 16, 31, 32, 33, 62, 63, 64, 65, 300},
       {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},
      {4, 4, 128, 2, {5, 47, 100}, {1, 1, 1}},  // MHA, block size 2
      {8, 1, 64, 1, {63, 200}, {1, 1}},         // MQA 8 (two sub-groups), block 1
      {10, 2, 256, 32, {77, 1100}, {1, 1}},     // GQA 5, head_dim 256, split-K
      {6, 3, 192, 16, {2100, 9}, {1, 1}},       // GQA 2, merged heads (>= 1024 keys)
      {14, 2, 64, 16, {600, 40}, {1, 1}, 37},   // GQA 7, window 37
      {9, 3, 64, 16, {70, 500}, {1, 5}},        // decode beside a prefill chunk
  };
  const KvDtype kq[] = {KvDtype::kInt8, KvDtype::kInt4};
  ThreadPool pool(3);
  double worst = 0.0;
  int si = 0, n_runs = 0;
  for (const Shape& s : shapes) {
    for (KvDtype kt : kq) {
      for (KvDtype vt : kq) {
        SCOPED_TRACE(std::string("shape ") + std::to_string(si) + " K " + kv_dtype_name(kt) +
                     " V " + kv_dtype_name(vt));
        ASSERT_EQ(attn_detail::select_kernels(Isa::kAvx512, kt, vt, s.head_dim).decode,
                  attn_detail::KernelPath::kAvx512Vnni);
        CacheFixture st = make_setup(kt, vt, s, 41 + si);
        const AttnParams p{.n_q_heads = s.n_q_heads,
                           .n_kv_heads = s.n_kv_heads,
                           .head_dim = s.head_dim,
                           .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                           .window = s.window};
        std::vector<std::vector<float>> ref, got, one;
        auto seqs = seqs_for(st, s, ref);
        ASSERT_TRUE(
            paged_attention_quant_reference(st.view, p, seqs, {.round_int8_query = true}).ok());
        seqs = seqs_for(st, s, got);
        ASSERT_TRUE(paged_attention_quant_isa(Isa::kAvx512, st.view, p, seqs, &pool).ok());
        const double diff = max_diff(got, ref);
        worst = std::max(worst, diff);
        EXPECT_LT(diff, kVnniTolerance);
        seqs = seqs_for(st, s, one);  // one thread: the same bits
        ASSERT_TRUE(paged_attention_quant_isa(Isa::kAvx512, st.view, p, seqs, nullptr).ok());
        EXPECT_EQ(max_diff(got, one), 0.0);
        ++n_runs;
      }
    }
    ++si;
  }
  std::printf("[ paths    ] avx512-vnni decode ran on %d shape x format cases; worst |diff| %.3g\n",
              n_runs, worst);
}

// The int16 weights lose next to nothing: against the float AVX2 kernel on
// the same q^, the VNNI kernel's error is of the order of the AVX2 kernel's
// own float error, not of int8 rounding (2^-8).
TEST(QuantAttention, Avx512VnniWeightRoundingIsSmall) {
  if (const char* why = vnni_missing()) GTEST_SKIP() << "avx512-vnni decode not run: " << why;
  const Shape s{9, 3, 64, 16, {4000, 333, 31}, {1, 1, 1}};
  CacheFixture st = make_setup(KvDtype::kInt4, KvDtype::kInt4, s, 9);  // q^ on every path
  const AttnParams p{.n_q_heads = 9, .n_kv_heads = 3, .head_dim = 64, .scale = 0.125f};
  std::vector<std::vector<float>> ref, avx2, vnni;
  auto seqs = seqs_for(st, s, ref);
  ASSERT_TRUE(paged_attention_quant_reference(st.view, p, seqs).ok());
  seqs = seqs_for(st, s, avx2);
  ASSERT_TRUE(paged_attention_quant_isa(Isa::kAvx2, st.view, p, seqs, nullptr).ok());
  seqs = seqs_for(st, s, vnni);
  ASSERT_TRUE(paged_attention_quant_isa(Isa::kAvx512, st.view, p, seqs, nullptr).ok());
  const double e_avx2 = max_diff(avx2, ref), e_vnni = max_diff(vnni, ref);
  std::printf("[ paths    ] int4 decode |diff| vs reference: avx2 %.3g, avx512-vnni %.3g\n", e_avx2,
              e_vnni);
  EXPECT_LT(e_vnni, kVnniTolerance);
}

// Formats and head sizes the VNNI kernel does not read stay on AVX2.
TEST(QuantAttention, Avx512VnniServesOnlyInt8AndInt4) {
  using attn_detail::KernelPath;
  using attn_detail::select_kernels;
  for (KvDtype k : kAll) {
    for (KvDtype v : kAll) {
      const bool served = (k == KvDtype::kInt8 || k == KvDtype::kInt4) &&
                          (v == KvDtype::kInt8 || v == KvDtype::kInt4);
      EXPECT_EQ(attn_detail::avx512_vnni_decode_serves(k, v, 64), served);
      if (!served) {
        EXPECT_NE(select_kernels(Isa::kAvx512, k, v, 64).decode, KernelPath::kAvx512Vnni);
      }
    }
  }
  for (int d : {32, 96, 320}) {
    EXPECT_FALSE(attn_detail::avx512_vnni_decode_serves(KvDtype::kInt8, KvDtype::kInt8, d)) << d;
  }
  // Prefill rows always take the AVX2 tiles (or scalar).
  EXPECT_NE(select_kernels(Isa::kAvx512, KvDtype::kInt8, KvDtype::kInt8, 64).prefill,
            KernelPath::kAvx512Vnni);
}

// q^ of a decode row over int4 keys: per group of 32, codes in [-127, 127]
// with the group's largest |q| at +-127, every element within half a step
// of q; an all-zero group gives scale 0; a group with an infinity or a NaN
// gets a NaN scale and zero codes.
TEST(QuantAttention, RoundQueryInt8PerGroup) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(128);
  for (float& x : q) x = nd(rng);
  q[7] = -9.0f;                                      // group 0: amax from a negative outlier
  for (int i = 32; i < 64; ++i) q[i] = 0.0f;         // group 1: all zero
  q[70] = std::numeric_limits<float>::infinity();    // group 2: an infinity
  q[100] = std::numeric_limits<float>::quiet_NaN();  // group 3: a NaN
  std::vector<int8_t> codes(128, 99);
  float scale[4] = {-1.0f, -1.0f, -1.0f, -1.0f};
  round_query_int8(q.data(), 128, codes.data(), scale);
  EXPECT_FLOAT_EQ(scale[0], 9.0f / 127.0f);
  EXPECT_EQ(codes[7], -127);
  for (int i = 0; i < 32; ++i) {
    EXPECT_GE(codes[i], -127);
    EXPECT_LE(codes[i], 127);
    EXPECT_LE(std::fabs(codes[i] * scale[0] - q[i]), 0.5f * scale[0] * 1.0001f) << i;
  }
  EXPECT_EQ(scale[1], 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(codes[i], 0) << i;
  EXPECT_TRUE(std::isnan(scale[2]));
  EXPECT_TRUE(std::isnan(scale[3]));
  for (int i = 64; i < 128; ++i) EXPECT_EQ(codes[i], 0) << i;
}

}  // namespace
}  // namespace kvstack

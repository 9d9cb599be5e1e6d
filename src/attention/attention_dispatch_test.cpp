// Kernel selection (select_kernels) and its report (attention_kernel_name):
// the report follows the ISA cap and names only paths the CPU has, for every
// KV format.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "attention/attention_kernels.h"
#include "attention/paged_attention.h"
#include "core/cpu_features.h"

namespace kvstack {
namespace {

using attn_detail::KernelChoice;
using attn_detail::KernelPath;
using attn_detail::select_kernels;

class IsaOverride {
 public:
  explicit IsaOverride(Isa isa) : saved_(best_isa()) { set_isa_override(isa); }
  ~IsaOverride() { set_isa_override(saved_); }
  IsaOverride(const IsaOverride&) = delete;
  IsaOverride& operator=(const IsaOverride&) = delete;

 private:
  Isa saved_;
};

const KvDtype kFormats[] = {KvDtype::kF32,  KvDtype::kF16,  KvDtype::kBF16,  KvDtype::kFp8,
                            KvDtype::kInt8, KvDtype::kInt4, KvDtype::kKivi2, KvDtype::kKivi4};

bool cpu_has_avx2() {
  const CpuFeatures& f = cpu_features();
  return f.avx2 && f.fma && f.f16c;
}

TEST(AttentionDispatch, ScalarCapRunsScalarForEveryFormat) {
  IsaOverride cap(Isa::kScalar);
  for (KvDtype k : kFormats) {
    EXPECT_EQ(select_kernels(Isa::kAvx512, k, k, 64), KernelChoice{}) << kv_dtype_name(k);
    EXPECT_EQ(attention_kernel_name(k, k, 64), "scalar") << kv_dtype_name(k);
  }
}

TEST(AttentionDispatch, Avx2CapRunsAvx2WhereHeadDimAllows) {
  if (!cpu_has_avx2()) GTEST_SKIP() << "no AVX2/FMA/F16C on this CPU";
  IsaOverride cap(Isa::kAvx2);
  if (best_isa() < Isa::kAvx2) GTEST_SKIP() << "KVSTACK_ISA caps below avx2";
  if (const char* env = std::getenv("KVSTACK_ATTN_ISA"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "KVSTACK_ATTN_ISA=" << env << " caps the attention kernels";
  }
  for (KvDtype k : kFormats) {
    for (KvDtype v : {k, KvDtype::kF16}) {
      EXPECT_EQ(attention_kernel_name(k, v, 64), "avx2") << kv_dtype_name(k);
      const KernelChoice kc = select_kernels(Isa::kAvx512, k, v, 64);
      EXPECT_EQ(kc.decode, KernelPath::kAvx2);
      EXPECT_EQ(kc.prefill, KernelPath::kAvx2);
    }
    // head_dim % 8 != 0 has no SIMD kernel.
    EXPECT_EQ(attention_kernel_name(k, k, 36), "scalar") << kv_dtype_name(k);
  }
}

TEST(AttentionDispatch, Avx512VnniDecodeForInt8AndInt4) {
  const CpuFeatures& f = cpu_features();
  if (!(f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.avx512dq &&
        __builtin_cpu_supports("avx512vbmi"))) {
    GTEST_SKIP() << "no AVX-512 F/BW/VL/DQ + VNNI + VBMI on this CPU";
  }
  if (best_isa() < Isa::kAvx512) GTEST_SKIP() << "KVSTACK_ISA caps below avx512";
  if (const char* env = std::getenv("KVSTACK_ATTN_ISA"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "KVSTACK_ATTN_ISA=" << env << " caps the attention kernels";
  }
  const KvDtype q[] = {KvDtype::kInt8, KvDtype::kInt4};
  for (KvDtype k : q) {
    for (KvDtype v : q) {
      for (int d : {64, 128, 256}) {
        EXPECT_EQ(attention_kernel_name(k, v, d), "avx512-vnni decode + avx512 prefill")
            << kv_dtype_name(k) << "/" << kv_dtype_name(v) << " d " << d;
      }
      // Not a multiple of 64: AVX2 decode, still the AVX-512 prefill products.
      EXPECT_EQ(attention_kernel_name(k, v, 96), "avx2 decode + avx512 prefill");
    }
  }
  EXPECT_EQ(attention_kernel_name(KvDtype::kInt8, KvDtype::kF16, 64),
            "avx2 decode + avx512 prefill");
  // KVSTACK_ISA=avx2 (or the *_isa entry points' cap) keeps AVX2.
  EXPECT_EQ(select_kernels(Isa::kAvx2, KvDtype::kInt8, KvDtype::kInt8, 64).decode,
            KernelPath::kAvx2);
  IsaOverride cap(Isa::kAvx2);
  EXPECT_EQ(attention_kernel_name(KvDtype::kInt8, KvDtype::kInt8, 64), "avx2");
}

TEST(AttentionDispatch, Avx512F16DecodeForF16) {
  if (!cpu_has_avx2() || !cpu_features().avx512f) GTEST_SKIP() << "no AVX-512 F on this CPU";
  if (best_isa() < Isa::kAvx512) GTEST_SKIP() << "KVSTACK_ISA caps below avx512";
  if (const char* env = std::getenv("KVSTACK_ATTN_ISA"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "KVSTACK_ATTN_ISA=" << env << " caps the attention kernels";
  }
  for (int d : {16, 64, 128, 256}) {
    EXPECT_EQ(attention_kernel_name(KvDtype::kF16, KvDtype::kF16, d),
              "avx512-f16 decode + avx512 prefill")
        << "d " << d;
  }
  // No AVX-512 decode kernel (d % 16 != 0, or the formats): AVX2 decode, the
  // AVX-512 prefill products.
  for (auto [k, v, d] : {std::tuple{KvDtype::kF16, KvDtype::kF16, 40},
                         {KvDtype::kF32, KvDtype::kF32, 64},
                         {KvDtype::kBF16, KvDtype::kBF16, 64},
                         {KvDtype::kF16, KvDtype::kInt8, 64}}) {
    EXPECT_EQ(attention_kernel_name(k, v, d), "avx2 decode + avx512 prefill")
        << kv_dtype_name(k) << "/" << kv_dtype_name(v) << " d " << d;
    EXPECT_EQ(select_kernels(Isa::kAvx512, k, v, d).prefill, KernelPath::kAvx512);
  }
  EXPECT_EQ(select_kernels(Isa::kAvx2, KvDtype::kF16, KvDtype::kF16, 64).prefill,
            KernelPath::kAvx2);
  EXPECT_EQ(select_kernels(Isa::kAvx2, KvDtype::kF16, KvDtype::kF16, 64).decode, KernelPath::kAvx2);
  IsaOverride cap(Isa::kAvx2);
  EXPECT_EQ(attention_kernel_name(KvDtype::kF16, KvDtype::kF16, 64), "avx2");
}

TEST(AttentionDispatch, CallerCapAndCpuCapBothApply) {
  // The isa argument caps further (the *_isa entry points); it never raises
  // the level above best_isa().
  for (KvDtype k : kFormats) {
    EXPECT_EQ(select_kernels(Isa::kScalar, k, k, 64), KernelChoice{}) << kv_dtype_name(k);
  }
  IsaOverride cap(Isa::kScalar);
  EXPECT_EQ(select_kernels(Isa::kAvx512, KvDtype::kInt8, KvDtype::kInt8, 64), KernelChoice{});
}

TEST(AttentionDispatch, SummaryNamesEachDistinctLayerFormat) {
  IsaOverride cap(Isa::kScalar);
  std::vector<KvLayerSpec> layers = {
      KvLayerSpec{.n_kv_heads = 2, .head_dim_k = 64, .head_dim_v = 64, .dtype = KvDtype::kInt8},
      KvLayerSpec{.n_kv_heads = 2, .head_dim_k = 64, .head_dim_v = 64, .dtype = KvDtype::kInt8},
      KvLayerSpec{.n_kv_heads = 2,
                  .head_dim_k = 64,
                  .head_dim_v = 64,
                  .dtype = KvDtype::kInt8,
                  .dtype_v = KvDtype::kF16}};
  auto layout = KvLayout::create(layers, 16);
  ASSERT_TRUE(layout.ok()) << layout.error().message;
  EXPECT_EQ(attention_kernel_summary(*layout), "int8 scalar, int8/f16 scalar");
}

}  // namespace
}  // namespace kvstack

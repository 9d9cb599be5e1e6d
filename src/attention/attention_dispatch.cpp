// Kernel selection for every paged attention entry point, and its report
// (attention_kernel_name, the model-load line).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/paged_attention.h"
#include "core/cpu_features.h"

namespace kvstack {
namespace attn_detail {

const char* kernel_path_name(KernelPath path) {
  switch (path) {
    case KernelPath::kScalar:
      return "scalar";
    case KernelPath::kAvx2:
      return "avx2";
    case KernelPath::kAvx512Vnni:
      return "avx512-vnni";
    case KernelPath::kAvx512F16:
      return "avx512-f16";
    case KernelPath::kAvx512:
      return "avx512";
  }
  return "?";
}

namespace {

bool cpu_has_avx512_vnni() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.avx512dq &&
         __builtin_cpu_supports("avx512vbmi");
}

// KVSTACK_ATTN_ISA=scalar|avx2 caps the attention kernels only (read once),
// so a benchmark can compare attention paths under the same matmul kernels;
// KVSTACK_ISA caps both.
Isa attention_cap() {
  static const Isa cap = [] {
    const char* env = std::getenv("KVSTACK_ATTN_ISA");
    if (env == nullptr) return Isa::kAvx512;
    if (std::strcmp(env, "scalar") == 0) return Isa::kScalar;
    if (std::strcmp(env, "avx2") == 0) return Isa::kAvx2;
    return Isa::kAvx512;
  }();
  return cap;
}

}  // namespace

KernelChoice select_kernels(Isa isa, KvDtype k, KvDtype v, int head_dim) {
  const Isa cap = std::min({isa, best_isa(), attention_cap()});
  const CpuFeatures& f = cpu_features();
  KernelChoice kc;
  if (cap < Isa::kAvx2 || !f.f16c || !f.fma || head_dim % 8 != 0) return kc;
  kc.decode = kc.prefill = KernelPath::kAvx2;
  // Prefill: the AVX2 tiles with their q . K and p . V products on 16-lane
  // vectors (same bits; measured in docs/benchmarks.md, session 23).
  if (cap >= Isa::kAvx512 && f.avx512f) kc.prefill = KernelPath::kAvx512;
  // Decode over int8/int4 codes: integer dot products (measured in
  // docs/benchmarks.md).
  if (cap >= Isa::kAvx512 && cpu_has_avx512_vnni() && avx512_vnni_decode_serves(k, v, head_dim)) {
    kc.decode = KernelPath::kAvx512Vnni;
  }
  // Decode over f16 K and V: the 16-lane float kernel (measured against the
  // AVX2 one in docs/benchmarks.md, "AVX-512 f16 decode kernel").
  if (cap >= Isa::kAvx512 && f.avx512f && avx512_f16_decode_serves(k, v, head_dim)) {
    kc.decode = KernelPath::kAvx512F16;
  }
  return kc;
}

}  // namespace attn_detail

std::string attention_kernel_name(KvDtype k, KvDtype v, int head_dim) {
  const attn_detail::KernelChoice kc = attn_detail::select_kernels(best_isa(), k, v, head_dim);
  std::string name = attn_detail::kernel_path_name(kc.decode);
  if (kc.decode == kc.prefill) return name;
  name += " decode + ";
  name += attn_detail::kernel_path_name(kc.prefill);
  name += " prefill";
  return name;
}

std::string attention_kernel_summary(const KvLayout& layout) {
  struct Seen {
    KvDtype k, v;
    int head_dim;
  };
  std::vector<Seen> seen;
  std::string out;
  for (int l = 0; l < layout.n_layers(); ++l) {
    const KvLayerSpec& spec = layout.layer(l);
    if (spec.kind != KvLayerKind::kStandard) continue;
    const Seen s{spec.dtype, spec.value_dtype(), spec.head_dim_k};
    if (std::any_of(seen.begin(), seen.end(), [&](const Seen& x) {
          return x.k == s.k && x.v == s.v && x.head_dim == s.head_dim;
        })) {
      continue;
    }
    seen.push_back(s);
    if (!out.empty()) out += ", ";
    out += kv_dtype_name(s.k);
    if (s.v != s.k) {
      out += '/';
      out += kv_dtype_name(s.v);
    }
    out += ' ';
    out += attention_kernel_name(s.k, s.v, s.head_dim);
  }
  return out.empty() ? "none" : out;
}

}  // namespace kvstack

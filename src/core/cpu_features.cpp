#include "core/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace kvstack {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = f.avx2;  // every AVX2 x86 CPU shipped has F16C; GCC 12 cannot query it.
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#if defined(__clang__)
  f.avx_vnni = false;  // clang 14 does not know the "avxvnni" feature name
#else
  f.avx_vnni = __builtin_cpu_supports("avxvnni");
#endif
  f.amx_int8 = false;  // AMX also needs OS permission (arch_prctl); not used yet.
  return f;
}

Isa detect_isa(const CpuFeatures& f) {
  Isa isa = Isa::kScalar;
  if (f.avx2 && f.fma) isa = Isa::kAvx2;
  if (isa == Isa::kAvx2 && f.avx512f && f.avx512bw && f.avx512vl) isa = Isa::kAvx512;
  if (const char* env = std::getenv("KVSTACK_ISA")) {
    Isa cap = isa;
    if (std::strcmp(env, "scalar") == 0) cap = Isa::kScalar;
    if (std::strcmp(env, "avx2") == 0) cap = Isa::kAvx2;
    if (static_cast<int>(cap) < static_cast<int>(isa)) isa = cap;
  }
  return isa;
}

Isa g_isa = detect_isa(cpu_features());

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

Isa best_isa() {
  return g_isa;
}

void set_isa_override(Isa isa) {
  const Isa hw = detect_isa(cpu_features());
  g_isa = static_cast<int>(isa) < static_cast<int>(hw) ? isa : hw;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

}  // namespace kvstack

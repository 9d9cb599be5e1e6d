// Runtime CPU feature detection for kernel dispatch. Read once, cached.
// KVSTACK_ISA=scalar|avx2|avx512 (read at start-up) caps the level used, so
// tests and benchmarks can force a path.
#pragma once

namespace kvstack {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avx_vnni = false;
  bool amx_int8 = false;
};

const CpuFeatures& cpu_features();
// Best ISA level the CPU supports, capped by KVSTACK_ISA if set.
Isa best_isa();
// Force a level (tests); clamps to what the CPU supports. Not thread-safe
// against concurrent kernel calls.
void set_isa_override(Isa isa);
const char* isa_name(Isa isa);

}  // namespace kvstack

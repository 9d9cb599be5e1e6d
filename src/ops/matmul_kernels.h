// Internal to kvstack_ops: the per-ISA matmul kernels behind matmul() and the
// prepared (converted or quantized) activations they read.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/ggml_types.h"
#include "ops/matmul.h"

namespace kvstack::ops_detail {

// What the activation is turned into before it meets a weight type.
enum class ActKind { kF32, kF16, kQ8_0, kQ8_1, kQ8_K };
ActKind act_kind(GgmlType type);

// Activations prepared once per matmul call and read by every thread.
struct PreparedAct {
  int64_t m = 0;
  int64_t n_in = 0;
  const float* f32 = nullptr;      // [m, n_in]: x (kF32) or x rounded to f16 (kF16)
  const int8_t* qs = nullptr;      // [m, n_in]            (kQ8_0, kQ8_1)
  const float* d = nullptr;        // [m, n_in / 32]       (kQ8_0, kQ8_1)
  const float* s = nullptr;        // [m, n_in / 32]       (kQ8_1)
  const float* ds = nullptr;       // [m, n_in / 32, 2]: (d, s) pairs (kQ8_1)
  const int32_t* qsum = nullptr;   // [m, n_in / 32]: sum of qs per block (kQ8_0, kQ8_1)
  const BlockQ8_K* q8k = nullptr;  // [m, n_in / 256]      (kQ8_K)
};

// Computes y[r * ldy + c] for every r < act.m and c in [c0, c1).
using MatmulKernel = void (*)(const WeightView& w, const PreparedAct& act, int64_t c0, int64_t c1,
                              float* y, int64_t ldy);

// Scalar reference kernel for a type (nullptr if unsupported).
MatmulKernel scalar_kernel(GgmlType type);
// AVX2 kernel for a type (nullptr if there is none; callers fall back to scalar).
MatmulKernel avx2_kernel(GgmlType type);
// AVX2 kernels for Q4_K/Q5_K/Q6_K (bit-identical to scalar; nullptr otherwise).
MatmulKernel avx2_k_kernel(GgmlType type);
// True when the CPU has AVX-512 F/BW/VL/DQ + VNNI and best_isa() allows AVX-512.
bool avx512_vnni_usable();
// AVX-512 VNNI kernel for a type (bit-identical to scalar), or nullptr when
// there is none or avx512_vnni_usable() is false.
MatmulKernel avx512_kernel(GgmlType type);
// The path name of avx512_kernel(type).
const char* avx512_kernel_path(GgmlType type);
// Bytes of a kPanels16 group-block's transposed quants (matmul.h,
// WeightLayout): the f16 scales start here, Q4_1's f16 mins 32 bytes later.
constexpr size_t kPanelsQsBytesQ4 = 256;  // Q4_0, Q4_1: uint32 qs[4][16]
constexpr size_t kPanelsQsBytesQ8 = 512;  // Q8_0: uint32 qs[8][16]

// True when the CPU itself has AVX-512 F/BW/VL/DQ + VNNI, whatever the ISA
// cap (kPanels16 weights have no other kernel, so a cap lowered after they
// were packed does not take their kernel away).
bool avx512_vnni_present();
// The kernel for kPanels16 weights of a type (Q4_0, Q4_1, Q8_0; columns in
// whole groups of 16), bit-identical to scalar_kernel(type) on the kRows
// bytes; nullptr for other types or without avx512_vnni_present().
MatmulKernel avx512_panels_kernel(GgmlType type);
// Packs one 16-column group of a packable type from its 16 rows (GGUF's
// layout, row_bytes each, nb 32-blocks) into `dst` (kPanels16, not
// overlapping them); false (nothing written) for other types or without
// avx512_vnni_present().
bool avx512_pack_group(GgmlType type, const uint8_t* rows, size_t row_bytes, int64_t nb,
                       uint8_t* dst);

}  // namespace kvstack::ops_detail

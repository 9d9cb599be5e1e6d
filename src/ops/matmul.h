// Weight matmuls over GGUF-stored (possibly block-quantized) weight matrices.
//
// Numerics follow ggml's CPU backend: before a quantized weight row is dotted,
// the activation row is quantized once per call (Q4_0/Q5_0/Q8_0 weights ->
// Q8_0 activations, Q4_1/Q5_1 -> Q8_1, Q4_K/Q5_K/Q6_K -> Q8_K); F16 weights
// dot activations rounded to f16; F32 weights dot f32 activations.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/ggml_types.h"
#include "core/thread_pool.h"

namespace kvstack {

// A weight matrix as stored in GGUF: n_out rows, each n_in elements of `type`,
// rows contiguous, ggml_row_bytes(type, n_in) bytes each (data is mmapped,
// read-only). n_in must be a multiple of the type's block size.
struct WeightView {
  GgmlType type;
  const uint8_t* data;  // [n_out, row_bytes]
  int64_t n_in;
  int64_t n_out;
};

// Y[m, n_out] = X[m, n_in] . W^T  (row-major X and Y; float32).
// X: [m, n_in], Y: [m, n_out]; Y must not alias X.
// Multithreaded over pool (may be nullptr = single thread). Not reentrant per
// pool (the activation scratch is per calling thread).
// REQUIRES: matmul_supported(w.type), w.n_in a multiple of the block size.
void matmul(const WeightView& w, const float* x, int64_t m, float* y, ThreadPool* pool);

// Several weight matrices applied to the same activations in one pass:
// ys[i][m, ws[i].n_out] = X[m, n_in] . ws[i]^T. X is converted/quantized once
// and one parallel job covers every output (fewer thread dispatches than
// separate calls, e.g. for Q/K/V or gate/up). Each output is bit-identical to
// a separate matmul() call.
// REQUIRES: 1 <= ws.size() == ys.size() <= 8; every pair of weights passes
// matmul_can_fuse(); outputs do not alias each other or X.
void matmul_multi(std::span<const WeightView> ws, const float* x, int64_t m,
                  std::span<float* const> ys, ThreadPool* pool);

// True when matmul() has a kernel for weights of this type.
bool matmul_supported(GgmlType type);

// The kernel path matmul() runs for weights of `type` on this CPU under the
// current ISA cap (best_isa(), KVSTACK_ISA): "avx512-vnni", "avx2" or
// "scalar"; nullptr when matmul_supported(type) is false. Decided by the same
// function that picks the kernel, so it names only paths that exist and run.
const char* matmul_kernel_name(GgmlType type);

// "q4_1 avx512-vnni, q8_0 avx512-vnni": each distinct type of `types` (first
// seen first) with matmul_kernel_name() ("none" for unsupported types).
std::string matmul_kernel_summary(std::span<const GgmlType> types);

// True when a and b can share one matmul_multi() call: both supported, same
// n_in, and their types want the same activation format.
bool matmul_can_fuse(const WeightView& a, const WeightView& b);

}  // namespace kvstack

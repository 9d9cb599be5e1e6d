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

// How a weight matrix's bytes are laid out.
//   kRows: as stored in GGUF: n_out rows, each n_in elements of `type`, rows
//     contiguous, ggml_row_bytes(type, n_in) bytes each.
//   kPanels16: the same bytes regrouped for the AVX-512 VNNI kernels by
//     pack_weight_panels(): columns (output rows) in groups of 16, each group
//     occupying the bytes its 16 rows had, as one block after another, and
//     within a block the 16 columns' quants transposed to dword lanes (lane c
//     = column c), then their f16 scales (and Q4_1's f16 mins):
//       Q4_0 / Q4_1: uint32 qs[4][16] (dword k of column c's 16 qs bytes),
//                    uint16 d[16], Q4_1: uint16 m[16]      (288 / 320 bytes)
//       Q8_0:        uint32 qs[8][16] (dword k of column c's 32 quants, each
//                    byte + 128, i.e. unsigned), uint16 d[16]   (544 bytes)
//     That is 16 x sizeof(block): the matrix keeps its size. A kernel reads a
//     group's 16 columns as one sequential stream and needs no transpose.
enum class WeightLayout : uint8_t { kRows, kPanels16 };

// A weight matrix: n_out output columns (GGUF rows) of n_in elements of
// `type` (data is read-only; mapped or copied from the file). n_in must be a
// multiple of the type's block size.
struct WeightView {
  GgmlType type;
  const uint8_t* data;  // [n_out, row_bytes] in `layout`
  int64_t n_in;
  int64_t n_out;
  WeightLayout layout = WeightLayout::kRows;
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

// True when w (kRows) can be packed into kPanels16 and matmul() would run it
// there: this CPU has AVX-512 F/BW/VL/DQ + VNNI under the ISA cap, w is
// Q4_0, Q4_1 or Q8_0, and n_out is a multiple of 16.
bool weight_panels_supported(const WeightView& w);

// Rewrites the n_out * row_bytes bytes at `bytes` (w's own bytes, writable:
// bytes == w.data) from kRows into kPanels16, in place, and returns the view
// of them. Outputs are bit-identical to the kRows view's: the kernels do the
// same integer products and the same float update per block.
// REQUIRES: weight_panels_supported(w).
WeightView pack_weight_panels(const WeightView& w, uint8_t* bytes);

// Copies output column (GGUF row) `row` of w as GGUF stores it, in either
// layout, into out[ggml_row_bytes(w.type, w.n_in)]: a kPanels16 row comes
// back byte for byte as it was before packing (for readers of single rows,
// e.g. a tied token embedding).
// REQUIRES: 0 <= row < w.n_out.
void weight_row(const WeightView& w, int64_t row, uint8_t* out);

// The kernel path matmul() runs for weights of `type` (kRows) on this CPU
// under the current ISA cap (best_isa(), KVSTACK_ISA): "avx512-vnni", "avx2"
// or "scalar"; nullptr when matmul_supported(type) is false. Decided by the
// same function that picks the kernel, so it names only paths that exist and
// run.
const char* matmul_kernel_name(GgmlType type);
// The same for a view: "avx512-vnni-panels" for a kPanels16 view.
const char* matmul_kernel_name(const WeightView& w);

// "q4_1 avx512-vnni, q8_0 avx512-vnni": each distinct type of `types` (first
// seen first) with matmul_kernel_name() ("none" for unsupported types).
std::string matmul_kernel_summary(std::span<const GgmlType> types);
// The same over views: each distinct (type, path) first seen first, e.g.
// "q4_1 avx512-vnni-panels, q8_0 avx512-vnni".
std::string matmul_kernel_summary(std::span<const WeightView* const> views);

// True when a and b can share one matmul_multi() call: both supported, same
// n_in, and their types want the same activation format.
bool matmul_can_fuse(const WeightView& a, const WeightView& b);

}  // namespace kvstack

// Activation quantization used before dotting with quantized weights, with
// ggml's x86 rounding rules (so dot products match llama.cpp's CPU backend):
//   q8_0/q8_1 (per 32): amax = max|x|, d = amax / 127, id = amax ? 127 / amax : 0,
//     q = round-half-to-even(x * id); d (and q8_1's s = d * sum(q)) stored as f16.
//   q8_K (per 256): max = the element of largest |x| (first one on ties),
//     iscale = -127 / max, q = min(127, round-half-to-even(iscale * x)),
//     d = 1 / iscale (f32), bsums = sums of 16 consecutive q.
// REQUIRES: n a multiple of the block size (32 or 256).
#pragma once

#include <cstdint>

#include "core/ggml_types.h"

namespace kvstack {

void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t n);
void quantize_row_q8_1(const float* x, BlockQ8_1* y, int64_t n);
void quantize_row_q8_K(const float* x, BlockQ8_K* y, int64_t n);

// The 32-block quantizer in the split layout the matmul kernels read:
// qs: [n] int8, d: [n / 32] (f16-rounded scale as float), s: [n / 32]
// (f16-rounded d * sum(q) as float; may be nullptr when not needed), qsum:
// [n / 32] sum of each block's q (may be nullptr).
// Scalar, AVX2 and AVX-512 (16 blocks at a time) versions give identical
// bits (quantize_row_q8_K: scalar and AVX2).
void quantize_act_q8(const float* x, int8_t* qs, float* d, float* s, int64_t n,
                     int32_t* qsum = nullptr);

}  // namespace kvstack

// Scalar reference dequantization of GGML tensor rows to f32. These are the
// references every optimised kernel is checked against, and they are checked
// bit for bit against the `gguf` Python package.
#pragma once

#include <cstdint>

#include "core/ggml_types.h"
#include "core/result.h"

namespace kvstack {

// REQUIRES: n is a multiple of the type's block size; src holds
// ggml_row_bytes(type, n) bytes; dst holds n floats.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

// Whole tensor (any shape) to f32; error for unsupported types.
struct GgufTensor;
Status dequantize_tensor(const GgufTensor& tensor, float* dst);

}  // namespace kvstack

// Writing NumPy .npy files (format version 1.0, little-endian float32).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"

namespace kvstack::cli {

// Writes data as a C-order float32 array of the given shape.
Status write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);

}  // namespace kvstack::cli

// Plain, non-owning views of paged KV storage handed to attention kernels.
// The block pool produces them; kernels assume they were validated.
#pragma once

#include <cstdint>

namespace kvstack {

// Element format of cached K or V. Quantized formats are appended later; each
// declares its bytes per element including metadata (spec section 3).
enum class KvDtype : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline int kv_dtype_bytes(KvDtype t) { return t == KvDtype::kF32 ? 4 : 2; }
const char* kv_dtype_name(KvDtype t);

// One layer's K and V inside the block pool. Element (block b, kv head h,
// slot s, dim i) of K is at
//   k + b * block_stride + h * head_stride + s * slot_stride + i * elem_bytes
// (all strides in bytes), and likewise for V. Slot s of block table entry j
// holds logical position j * block_size + s.
struct PagedKvLayerView {
  uint8_t* k = nullptr;  // [n_blocks] x (strided) [n_kv_heads, block_size, head_dim]
  uint8_t* v = nullptr;  // same shape as k
  int64_t block_stride = 0;
  int64_t head_stride = 0;
  int64_t slot_stride = 0;
  KvDtype dtype = KvDtype::kF32;
  int block_size = 16;
  int n_kv_heads = 0;
  int head_dim = 0;
};

}  // namespace kvstack

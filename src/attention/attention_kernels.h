// Internal tile kernels behind paged_attention(); not part of the public API.
//
// A tile is the work of one (sequence, KV head, run of query rows, key range)
// (decode tiles may take several KV heads, see TileArgs::n_heads):
// its "query vectors" are the n_rows x group (row, q head) pairs that share
// that KV head, vector i = row i / group, q head kv_head * group + i % group.
// A tile either writes the normalised output, or (split-K) its unnormalised
// partial state (running max, running sum, accumulator) for a later merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "core/check.h"
#include "kv/kv_view.h"

namespace kvstack::attn_detail {

// Keys and values of one KV head of one sequence, addressed through its table.
struct KeySource {
  const uint8_t* k_head = nullptr;  // view.k + kv_head * head_stride
  const uint8_t* v_head = nullptr;  // view.v + kv_head * head_stride
  const int32_t* block_table = nullptr;
  int64_t block_stride = 0;  // bytes
  int64_t slot_stride = 0;   // bytes
  int block_size = 0;
  KvDtype dtype = KvDtype::kF32;
  int head_dim = 0;
};

struct TileArgs {
  KeySource keys;
  const float* q = nullptr;  // vector (r, g) at q + r * row_stride + g * head_dim
  float* out = nullptr;      // same layout as q; used when part_acc is null
  int64_t row_stride = 0;    // floats between query rows: n_q_heads * head_dim
  int n_rows = 0;
  int group = 0;          // q heads per KV head
  int32_t pos0 = 0;       // logical position of row 0
  int window = 0;         // 0: full causal
  int32_t key_begin = 0;  // keys [key_begin, key_end) of this piece (split-K)
  int32_t key_end = 0;    // each row additionally sees only its causal/window range
  float scale = 0.0f;
  // Decode tiles (n_rows == 1) may cover n_heads consecutive KV heads: head j
  // reads keys.k_head / v_head + j * head_stride and its q heads are vectors
  // j * group .. j * group + group - 1 (consecutive q heads, so vector i is at
  // q + i * head_dim). Prefill tiles and the scalar kernel take n_heads == 1.
  int n_heads = 1;
  int64_t head_stride = 0;  // bytes
  // Split-K partial output, [n_rows * group * n_heads] entries each, or all null.
  float* part_m = nullptr;
  float* part_l = nullptr;
  float* part_acc = nullptr;  // [n_rows * group * n_heads, head_dim]
};

// First position visible to a query at position `pos`.
inline int32_t first_visible(int32_t pos, int window) {
  if (window <= 0) return 0;
  const int64_t lo = static_cast<int64_t>(pos) - window + 1;
  return lo < 0 ? 0 : static_cast<int32_t>(lo);
}

// Address of element 0 of position `t` in one head's K (or V) storage.
inline const uint8_t* row_ptr(const KeySource& ks, const uint8_t* head_base, int32_t t) {
  const int32_t block = ks.block_table[t / ks.block_size];
  return head_base + block * ks.block_stride + (t % ks.block_size) * ks.slot_stride;
}

// Generic kernel for any tile shape; float accumulation, std::exp.
void attention_tile_scalar(const TileArgs& a);
// AVX2+FMA+F16C kernels. REQUIRES: head_dim % 8 == 0 and a CPU with them.
void decode_tile_avx2(const TileArgs& a);   // REQUIRES: n_rows == 1
void prefill_tile_avx2(const TileArgs& a);  // any n_rows

// Growable 64-byte-aligned float buffer for per-thread scratch: it only
// grows, so steady-state calls do not allocate.
class ScratchBuffer {
 public:
  float* get(size_t n_floats) {
    if (n_floats > capacity_) {
      const size_t cap = (n_floats + 15) / 16 * 16;
      data_.reset(static_cast<float*>(std::aligned_alloc(64, cap * sizeof(float))));
      KV_CHECK(data_ != nullptr, "attention scratch allocation failed");
      capacity_ = cap;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  size_t capacity_ = 0;
};

// The calling thread's kernel scratch.
ScratchBuffer& thread_scratch();

}  // namespace kvstack::attn_detail

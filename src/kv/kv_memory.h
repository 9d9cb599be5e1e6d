// KV memory accounting (spec section 3), shared by `kvstack bench`, the
// capacity planner's --verify and the pool's own stats: the figures a layout
// implies for given sequence lengths. A live BlockPool holding tables of
// exactly these lengths (no sharing, nothing reserved beyond them) reports
// payload_bytes and allocated_bytes equal to these, byte for byte.
#pragma once

#include <cstdint>
#include <span>

#include "kv/layout.h"

namespace kvstack {

struct KvFootprint {
  int64_t n_sequences = 0;
  int64_t n_tokens = 0;         // sum T_i
  int64_t payload_bytes = 0;    // sum over layers of per-token payload * sum T_i
                                // (standard: 2 N H_kv d b sum T_i)
  int64_t n_slots = 0;          // sum P * ceil(T_i / P)
  int64_t n_waste_slots = 0;    // n_slots - n_tokens (each sequence < P)
  int64_t n_blocks = 0;         // sum ceil(T_i / P)
  int64_t allocated_bytes = 0;  // n_blocks * block_bytes (includes 64-byte padding)
  int64_t table_bytes = 0;      // n_blocks * sizeof(int32_t) block-table entries
};

// REQUIRES: every length >= 0.
KvFootprint kv_footprint(const KvLayout& layout, std::span<const int64_t> seq_lengths);

// Blocks for one sequence of n_tokens: ceil(n_tokens / P).
int64_t blocks_for_tokens(const KvLayout& layout, int64_t n_tokens);

}  // namespace kvstack

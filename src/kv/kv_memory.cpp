#include "kv/kv_memory.h"

#include "core/check.h"

namespace kvstack {

int64_t blocks_for_tokens(const KvLayout& layout, int64_t n_tokens) {
  KV_CHECK(n_tokens >= 0, "blocks_for_tokens: negative length");
  const int64_t p = layout.block_size();
  return (n_tokens + p - 1) / p;
}

KvFootprint kv_footprint(const KvLayout& layout, std::span<const int64_t> seq_lengths) {
  KvFootprint f;
  for (int64_t t : seq_lengths) {
    KV_CHECK(t >= 0, "kv_footprint: negative sequence length");
    ++f.n_sequences;
    f.n_tokens += t;
    f.n_blocks += blocks_for_tokens(layout, t);
  }
  f.payload_bytes = layout.payload_bytes_per_token() * f.n_tokens;
  f.n_slots = f.n_blocks * layout.block_size();
  f.n_waste_slots = f.n_slots - f.n_tokens;
  f.allocated_bytes = f.n_blocks * layout.block_bytes();
  f.table_bytes = f.n_blocks * static_cast<int64_t>(sizeof(int32_t));
  return f;
}

}  // namespace kvstack

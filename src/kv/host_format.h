// Colder storage formats for the local tiers below the pool (kv-cache-spec.md
// section 9: "warm: host memory, possibly compressed or in a colder
// format"). `--kv-host-format int8` stores every host and disk block of an
// f16 pool as int8: the pool block's bytes are read as f16 values (every
// layer of the layout is f16; padding bytes are values too) and stored as
//
//   [scales: G f16] [codes: N int8]     N = block bytes / 2, G = N / 32
//
// group g = values [32 g, 32 g + 32): s = the smallest f16 >= amax / 127,
// amax the largest finite |x| of the group; code = clamp(round_even(x *
// (1 / s)), -127, 127) (0 when s = 0 or x is not finite); decoded x' =
// f16(s * code). So |x' - x| <= s / 2 + the f16 rounding of x' (tested
// bound: s / 2 + |x| / 1024); 53% of the f16 bytes.
//
// The encoder and decoder have a scalar reference and an AVX2+F16C path
// with bit-identical output (tested); the SIMD path is used when the CPU
// has it (KVSTACK_ISA caps it like every kernel).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "core/result.h"

namespace kvstack {

enum class HostFormat : uint8_t {
  kPool,  // the pool's own bytes (default)
  kInt8,  // int8 codes + f16 scale per 32 values, of an all-f16 pool
};

// "pool" or "int8" (kInvalidArgument naming --kv-host-format otherwise).
Result<HostFormat> parse_host_format(const std::string& s);
const char* host_format_name(HostFormat f);

inline constexpr int64_t kInt8GroupValues = 32;

// Stored bytes of a pool block of `pool_bytes` (a multiple of 64).
inline int64_t int8_block_bytes(int64_t pool_bytes) {
  const int64_t n = pool_bytes / 2;
  return n + 2 * (n / kInt8GroupValues);
}

// f16 block (pool_bytes) -> stored form (int8_block_bytes(pool_bytes)).
void encode_int8_block(const uint8_t* f16, int64_t pool_bytes, uint8_t* out);
// Stored form -> f16 block.
void decode_int8_block(const uint8_t* in, int64_t pool_bytes, uint8_t* f16);
// The scalar references (what the SIMD path must equal).
void encode_int8_block_scalar(const uint8_t* f16, int64_t pool_bytes, uint8_t* out);
void decode_int8_block_scalar(const uint8_t* in, int64_t pool_bytes, uint8_t* f16);

}  // namespace kvstack

// Block records: the serialised form of one cached KV block outside the pool
// (kv-cache-spec.md section 12, identity apart from location). The host,
// disk and (later) remote tiers and a block transfer all carry a block as
// one record:
//
//   [header: 128 bytes fixed + 4 P bytes of token ids] [padding] [payload]
//
// The header names the block's identity, never its location:
//   model_digest   CacheIdentity::with_namespace("").digest(): weights,
//                  architecture, adapters, KV format, transform, position and
//                  attention rules (everything but the namespace)
//   format_digest  XXH3-128 of kv_format_key + kv_transform (the KV format and
//                  layout alone, so a mismatch can say which part differs)
//   ns_digest      the namespace's root digest (identity + salt name)
//   hash           the chained block hash of the prefix index's node
//                  (prefix_index.h: parent hash, ns digest, tokens)
//   parent_hash    the parent node's hash (zero at the top of a prefix)
//   group          KV group of the payload (0: the node's own block; g >= 1:
//                  the node's companion checkpoint in group g, kv_groups.h)
//   block_size, payload_bytes, the P token ids of the block
// and two XXH3-64 checksums: one over the payload, one over the header (with
// its checksum field zero) and the token ids. A record is read back only
// when every identity field equals what the reader expects and both
// checksums hold; anything else is a miss (never wrong K/V).
//
// Units: bytes. All integers little-endian (the only host order kvstack
// builds for). Thread-safety: plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kv/cache_identity.h"
#include "kv/prefix_index.h"

namespace kvstack {

inline constexpr char kBlockRecordMagic[8] = {'K', 'V', 'S', 'B', 'L', 'K', '0', '1'};
inline constexpr uint32_t kBlockRecordVersion = 1;

// The identity a reader expects of every record of one model and layout.
struct BlockRecordIdentity {
  Hash128 model_digest;
  Hash128 format_digest;
  int32_t block_size = 0;
  int64_t payload_bytes = 0;  // bytes of one pool block (BlockPool::block_bytes)
  bool operator==(const BlockRecordIdentity&) const = default;
};

// The record identity of blocks cached under `identity` in a pool of
// `block_size`-token blocks of `payload_bytes` bytes.
BlockRecordIdentity block_record_identity(const CacheIdentity& identity, int32_t block_size,
                                          int64_t payload_bytes);

// Fixed part of the header, as stored (128 bytes).
struct BlockRecordHeader {
  char magic[8];
  uint32_t version = kBlockRecordVersion;
  uint32_t header_bytes = 0;  // 128 + 4 * block_size
  int32_t block_size = 0;
  int32_t group = 0;
  int64_t payload_bytes = 0;
  Hash128 model_digest;
  Hash128 format_digest;
  Hash128 ns_digest;
  Hash128 hash;
  Hash128 parent_hash;
  uint64_t payload_checksum = 0;
  uint64_t header_checksum = 0;
};
static_assert(sizeof(BlockRecordHeader) == 128, "block record header is 128 bytes");

// What the index knows about a cached block (the record's key fields).
struct BlockRecordKey {
  Hash128 ns_digest;
  Hash128 hash;
  Hash128 parent_hash;
  int32_t group = 0;
};

// Bytes of a record's header including the token ids.
inline int64_t block_record_header_bytes(int32_t block_size) {
  return static_cast<int64_t>(sizeof(BlockRecordHeader)) + 4 * static_cast<int64_t>(block_size);
}

// XXH3-64 of a payload.
uint64_t block_payload_checksum(std::span<const uint8_t> payload);

// Writes the header (fixed part + token ids) of a record for `payload` into
// out[0, block_record_header_bytes(P)), checksums included.
// REQUIRES: tokens.size() == id.block_size, payload.size() == id.payload_bytes.
void write_block_record_header(const BlockRecordIdentity& id, const BlockRecordKey& key,
                               std::span<const int32_t> tokens, std::span<const uint8_t> payload,
                               uint8_t* out);

// Why a record was refused.
enum class BlockRecordCheck : uint8_t {
  kOk,
  kCorrupt,           // bad magic/version/sizes or header checksum (torn, truncated, flipped)
  kIdentityMismatch,  // another model, KV format or layout (or block size)
  kKeyMismatch,       // a valid record of another block (hash, namespace or group)
  kPayloadChecksum,   // the payload differs from its checksum
};
const char* block_record_check_name(BlockRecordCheck c);

// Validates a header at `header` (block_record_header_bytes(P) bytes
// readable) against the identity: magic, version, sizes, header checksum,
// model and format digests. Does not look at the payload.
BlockRecordCheck check_block_record_header(const BlockRecordIdentity& id, const uint8_t* header);
// The same plus the key fields (ns digest, hash, group) and, when
// `expected_tokens` is not empty, the stored token ids.
BlockRecordCheck check_block_record(const BlockRecordIdentity& id, const BlockRecordKey& key,
                                    std::span<const int32_t> expected_tokens,
                                    const uint8_t* header);
// Payload checksum of a header-checked record.
BlockRecordCheck check_block_payload(const uint8_t* header, std::span<const uint8_t> payload);

// Header fields / tokens of a checked header.
BlockRecordHeader read_record_header(const uint8_t* header);
std::vector<int32_t> record_tokens(const uint8_t* header);

}  // namespace kvstack

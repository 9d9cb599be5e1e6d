#include "kv/block_record.h"

#include <xxhash.h>

#include <cstring>

namespace kvstack {

BlockRecordIdentity block_record_identity(const CacheIdentity& identity, int32_t block_size,
                                          int64_t payload_bytes) {
  BlockRecordIdentity id;
  id.model_digest = identity.with_namespace("").digest();
  const std::string fmt =
      "kvstack-kv-format-v1\n" + identity.kv_format + "\n" + identity.kv_transform;
  id.format_digest = hash128(fmt.data(), fmt.size());
  id.block_size = block_size;
  id.payload_bytes = payload_bytes;
  return id;
}

uint64_t block_payload_checksum(std::span<const uint8_t> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

namespace {

uint64_t header_checksum(const uint8_t* header, int64_t n_bytes) {
  BlockRecordHeader h;
  std::memcpy(&h, header, sizeof(h));
  h.header_checksum = 0;
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, &h, sizeof(h));
  XXH3_64bits_update(st, header + sizeof(h), static_cast<size_t>(n_bytes) - sizeof(h));
  const uint64_t out = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return out;
}

}  // namespace

void write_block_record_header(const BlockRecordIdentity& id, const BlockRecordKey& key,
                               std::span<const int32_t> tokens, std::span<const uint8_t> payload,
                               uint8_t* out) {
  KV_CHECK(static_cast<int64_t>(tokens.size()) == id.block_size &&
               static_cast<int64_t>(payload.size()) == id.payload_bytes,
           "write_block_record_header: tokens or payload size differs from the identity");
  BlockRecordHeader h;
  std::memcpy(h.magic, kBlockRecordMagic, sizeof(h.magic));
  h.version = kBlockRecordVersion;
  h.header_bytes = static_cast<uint32_t>(block_record_header_bytes(id.block_size));
  h.block_size = id.block_size;
  h.group = key.group;
  h.payload_bytes = id.payload_bytes;
  h.model_digest = id.model_digest;
  h.format_digest = id.format_digest;
  h.ns_digest = key.ns_digest;
  h.hash = key.hash;
  h.parent_hash = key.parent_hash;
  h.payload_checksum = block_payload_checksum(payload);
  h.header_checksum = 0;
  std::memcpy(out, &h, sizeof(h));
  std::memcpy(out + sizeof(h), tokens.data(), 4 * tokens.size());
  h.header_checksum = header_checksum(out, h.header_bytes);
  std::memcpy(out, &h, sizeof(h));
}

const char* block_record_check_name(BlockRecordCheck c) {
  switch (c) {
    case BlockRecordCheck::kOk:
      return "ok";
    case BlockRecordCheck::kCorrupt:
      return "corrupt header";
    case BlockRecordCheck::kIdentityMismatch:
      return "identity mismatch";
    case BlockRecordCheck::kKeyMismatch:
      return "key mismatch";
    case BlockRecordCheck::kPayloadChecksum:
      return "payload checksum";
  }
  return "?";
}

BlockRecordHeader read_record_header(const uint8_t* header) {
  BlockRecordHeader h;
  std::memcpy(&h, header, sizeof(h));
  return h;
}

std::vector<int32_t> record_tokens(const uint8_t* header) {
  const BlockRecordHeader h = read_record_header(header);
  std::vector<int32_t> t(static_cast<size_t>(h.block_size));
  std::memcpy(t.data(), header + sizeof(h), 4 * t.size());
  return t;
}

BlockRecordCheck check_block_record_header(const BlockRecordIdentity& id, const uint8_t* header) {
  const BlockRecordHeader h = read_record_header(header);
  if (std::memcmp(h.magic, kBlockRecordMagic, sizeof(h.magic)) != 0 ||
      h.version != kBlockRecordVersion || h.block_size <= 0 ||
      h.block_size > KvLayout::kMaxBlockSize ||
      h.header_bytes != block_record_header_bytes(h.block_size)) {
    return BlockRecordCheck::kCorrupt;
  }
  if (header_checksum(header, h.header_bytes) != h.header_checksum) {
    return BlockRecordCheck::kCorrupt;
  }
  if (h.model_digest != id.model_digest || h.format_digest != id.format_digest ||
      h.block_size != id.block_size || h.payload_bytes != id.payload_bytes) {
    return BlockRecordCheck::kIdentityMismatch;
  }
  return BlockRecordCheck::kOk;
}

BlockRecordCheck check_block_record(const BlockRecordIdentity& id, const BlockRecordKey& key,
                                    std::span<const int32_t> expected_tokens,
                                    const uint8_t* header) {
  const BlockRecordCheck c = check_block_record_header(id, header);
  if (c != BlockRecordCheck::kOk) return c;
  const BlockRecordHeader h = read_record_header(header);
  if (h.ns_digest != key.ns_digest || h.hash != key.hash || h.group != key.group) {
    return BlockRecordCheck::kKeyMismatch;
  }
  if (!expected_tokens.empty() &&
      (static_cast<int64_t>(expected_tokens.size()) != h.block_size ||
       std::memcmp(expected_tokens.data(), header + sizeof(h), 4 * expected_tokens.size()) != 0)) {
    return BlockRecordCheck::kKeyMismatch;
  }
  return BlockRecordCheck::kOk;
}

BlockRecordCheck check_block_payload(const uint8_t* header, std::span<const uint8_t> payload) {
  const BlockRecordHeader h = read_record_header(header);
  if (static_cast<int64_t>(payload.size()) != h.payload_bytes ||
      block_payload_checksum(payload) != h.payload_checksum) {
    return BlockRecordCheck::kPayloadChecksum;
  }
  return BlockRecordCheck::kOk;
}

}  // namespace kvstack

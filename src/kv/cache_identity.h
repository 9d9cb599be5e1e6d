// Cache identity (kv-cache-spec.md sections 5 and 6): everything besides the
// token ids that determines a block's K/V, hashed into the root digest of a
// prefix-index namespace. Two requests share cached blocks only when every
// field is equal; the namespace field (a request's cache_salt, or the
// deployment default) keeps tenants apart even for equal prompts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"
#include "kv/layout.h"
#include "kv/prefix_index.h"

namespace kvstack {

struct CacheIdentity {
  Hash128 weights_digest;             // XXH3-128 of the model file's bytes
  std::string arch_revision;          // architecture + engine forward revision + shapes
  std::vector<std::string> adapters;  // adapter digests, in application order (none yet)
  std::string kv_format;              // kv_format_key(layout)
  std::string kv_transform;           // kv_rotation_key() of --kv-rotate ("" = none)
  std::string position;               // RoPE / position rules
  std::string attention;              // attention visibility rules (window, sinks)
  std::string ns;                     // namespace: cache salt or deployment default

  // XXH3-128 over every field, each length-prefixed (no two different
  // identities serialize alike).
  Hash128 digest() const;
  // The same identity in another namespace.
  CacheIdentity with_namespace(std::string name) const;
};

// The namespace name of the public (deployment-wide) prefixes. Not a valid
// cache salt: salts are user strings and this name holds a NUL byte.
std::string public_namespace_name();

// A canonical description of a KV layout's storage format from its public
// API: block size, block bytes, and per layer kind, heads, dims, dtype,
// window and region placement.
std::string kv_format_key(const KvLayout& layout);

// The weights digest of a model file: XXH3-128 of its bytes. Computed once
// per file identity (device, inode, size, modification time) and process;
// when cache_dir is not empty the result is also kept in
// cache_dir/weights-digests (one "dev ino size mtime_ns hex" line per file)
// and reused across processes. Errors (kIo) name the file.
Result<Hash128> weights_digest(const std::string& path, const std::string& cache_dir = "");

}  // namespace kvstack

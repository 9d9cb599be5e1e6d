// RedisStore: the remote KV tier (kv-cache-spec.md section 9), a Redis
// server shared by several kvstack instances of the same model
// (--kv-redis redis://HOST:PORT[/DB]; client: hiredis).
//
// Keys name a block's identity, never a location:
//   kvstack:blk:<model digest>:<KV format digest>:<namespace digest>:<chained hash>:<group>
// (32 hex digits each; the namespace digest hashes the cache salt, so two
// salts never share a key). A value is one block record (block_record.h):
// header, token ids, then the payload; a reader checks identity, key,
// tokens and both checksums, so a corrupt, truncated or foreign value is a
// miss (and is deleted). Eviction is Redis's own (maxmemory policy).
//
// Faults: every command runs under a bounded timeout (connect and I/O,
// KvTierConfig::redis_timeout_ms); a failed or timed-out command is a miss
// (or a skipped store), counted, and the connection is dropped; the next
// attempt reconnects at most once per second, so a server that is down
// costs a request at most one timeout.
//
// Thread-safety: not thread-safe; the KV manager's owner thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "kv/block_record.h"
#include "kv/tier_store.h"

struct redisContext;

namespace kvstack {

class RedisStore {
 public:
  // Parses the URL (kInvalidArgument naming --kv-redis) and tries to
  // connect; a server that is down at start is not an error (misses until
  // it is up).
  static Result<std::unique_ptr<RedisStore>> open(const BlockRecordIdentity& id,
                                                  const std::string& url, int timeout_ms);
  ~RedisStore();
  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;

  // One EXISTS round trip (false on any error).
  bool contains(const TierKey& key, const Hash128& ns_digest);
  // SET of the record (skipped and counted on error).
  void put(const TierKey& key, const TierRecord& rec);
  // GET, full check against identity, ns digest and tokens, payload copied
  // into dst; a bad value is deleted. False on a miss or an error.
  bool fetch(const TierKey& key, const Hash128& ns_digest, std::span<const int32_t> tokens,
             uint8_t* dst);
  bool connected() const { return ctx_ != nullptr; }
  TierStoreStats stats() const {
    TierStoreStats s = stats_;
    s.n_errors = n_errors_;
    return s;
  }
  // Start-up probe: seconds of a PING (t0) and of a GET of a payload-sized
  // value ({0, 0} when the server is not reachable).
  std::pair<double, double> probe_seconds();
  void add_fetch_latency(double seconds) { record_fetch_latency(stats_, seconds); }
  // Commands that failed or timed out (server down, slow, or gone).
  int64_t n_errors() const { return n_errors_; }

 private:
  RedisStore(const BlockRecordIdentity& id, std::string host, int port, int db, int timeout_ms);
  bool ensure_connected();
  void drop_connection();
  std::string key_name(const TierKey& key, const Hash128& ns_digest) const;

  BlockRecordIdentity id_;
  std::string host_;
  int port_ = 6379;
  int db_ = 0;
  int timeout_ms_ = 200;
  redisContext* ctx_ = nullptr;
  double next_connect_ = 0;  // steady-clock seconds before which no reconnect is tried
  std::vector<uint8_t> buf_;
  TierStoreStats stats_;
  int64_t n_errors_ = 0;
};

}  // namespace kvstack

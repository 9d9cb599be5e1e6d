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
// Round trips: lookups and transfers are pipelined (hiredis
// redisAppendCommand, replies read in order): the existence checks of a
// chain walk are one batch, the GETs of a promotion's run of blocks are one
// stream with at most kRedisPipelineBytes of values in flight (the next GET
// is queued as each reply arrives), and a publish's SETs are one batch after
// one batch of EXISTS. A run of n blocks therefore costs about two round
// trips, not 2 n.
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

// Values in flight in one pipelined GET stream (at least 2: one being read
// while the next is sent). Small on purpose: with 360 KiB values a deeper
// pipeline was measured slower here (window 2: 2.1-3.6 GB/s, 8: 1.1-1.2,
// 90: 0.9), as redis-benchmark -P 16 is slower than -P 1 on such values.
inline constexpr int64_t kRedisPipelineBytes = int64_t{1} << 20;
// Values sent in one pipelined batch of SETs (one round trip each batch).
inline constexpr int64_t kRedisStoreBatchBytes = int64_t{32} << 20;

// A key of the remote tier: block identity plus the namespace digest.
struct RedisKey {
  TierKey key;
  Hash128 ns_digest;
};

// One block to fetch: its key, the tokens it must hold, its pool bytes.
struct RedisFetch {
  TierKey key;
  std::span<const int32_t> tokens;
  uint8_t* dst = nullptr;  // payload_bytes writable
};

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
  // Pipelined EXISTS, one round trip: out[i] = keys[i] is present. On an
  // error the rest are false (a miss).
  std::vector<uint8_t> contains_many(std::span<const RedisKey> keys);
  // SET of the record (skipped and counted on error).
  void put(const TierKey& key, const TierRecord& rec);
  // Stores records[i] under keys[i] where not present yet: one pipelined
  // EXISTS batch, then one pipelined batch of SETs (each failure skipped and
  // counted in n_write_failed; a connection error skips the rest).
  void put_many(std::span<const TierKey> keys, std::span<const TierRecord> records);
  // GET, full check against identity, ns digest and tokens, payload read
  // into dst; a bad value is deleted. False on a miss or an error (dst's
  // bytes are then undefined).
  bool fetch(const TierKey& key, const Hash128& ns_digest, std::span<const int32_t> tokens,
             uint8_t* dst);
  // Pipelined GETs of items (one stream, kRedisPipelineBytes in flight),
  // each checked like fetch(): ok[i] = items[i].dst holds its payload (the
  // replies are parsed here, not by hiredis, so that a value is read from
  // the socket straight into its pool block; dst is undefined where ok[i]
  // is 0). Bad
  // values are deleted (one more pipelined batch). A connection error or a
  // timeout fails the item it hit and every later one (each read is bounded
  // by the timeout). seconds[i], when not null: the time from the start to
  // item i's reply.
  std::vector<uint8_t> fetch_many(std::span<const RedisFetch> items, const Hash128& ns_digest,
                                  std::vector<double>* seconds = nullptr);
  bool connected() const { return ctx_ != nullptr; }
  TierStoreStats stats() const {
    TierStoreStats s = stats_;
    s.n_errors = n_errors_;
    s.n_round_trips = n_round_trips_;
    return s;
  }
  // Start-up probe: seconds of a PING (t0) and of a GET of a payload-sized
  // value ({0, 0} when the server is not reachable).
  std::pair<double, double> probe_seconds();
  void add_fetch_latency(double seconds) { record_fetch_latency(stats_, seconds); }
  // Commands that failed or timed out (server down, slow, or gone).
  int64_t n_errors() const { return n_errors_; }
  // The Redis key of a block (tests and tools).
  std::string key_name(const TierKey& key, const Hash128& ns_digest) const;

 private:
  RedisStore(const BlockRecordIdentity& id, std::string host, int port, int db, int timeout_ms);
  bool ensure_connected();
  void drop_connection();
  // Pipelined DEL of bad values (their check counted by the caller).
  void delete_keys(std::span<const std::string> names);

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
  int64_t n_round_trips_ = 0;  // commands or pipelined batches sent
};

}  // namespace kvstack

// KvTiers: the storage tiers below the pool (kv-cache-spec.md sections 9 and
// 12) for one PrefixIndex. A cached block's identity is (namespace digest,
// chained hash, cache identity: block_record.h) plus its KV group; its
// location is a tier and a slot there. Only the pool is readable by
// kernels: a block found in another tier is copied into a pool block
// ("promoted") before a sequence adopts it.
//
// Data flow.
//   pool --evict--> host (write-back; --kv-host-mem)        [exclusive]
//   host --LRU overflow--> disk (--kv-disk)                  [inclusive]
//   pool --evict--> disk, when there is no host tier
//   publish --copy--> host (write-through, --kv-host-write-through)
//   host / disk --hit--> pool (promotion; the record is checked first)
//   pool + host --shutdown (persist)--> disk, index written (warm restart)
//   publish --copy--> Redis (--kv-redis: shared by instances of one model;
//                     a publish's blocks go as one pipelined batch)
// Write-back keeps a block in at most one of pool and host: publishing (or
// promoting) a block erases its host copy. Write-through keeps the host
// copy while the block is in the pool, so an eviction costs nothing. The
// disk tier keeps its copy after a hit (it is what survives a restart).
//
// Hybrid models: a node's companions (window-group checkpoints) are
// records of their own group (TierKey::group), evicted, demoted and
// promoted like nodes; a hit of length L needs every group's blocks the
// rule of prefix_index.h asks for, from the pool or a tier.
//
// Matching across tiers (extend_match): after PrefixIndex::match, the chain
// is continued block by block with the hash publish() would give the next
// block (PrefixIndex::chain_hash) looked up in host then disk; the longest
// length every group can serve is promoted into newly allocated pool blocks
// (all or nothing: a failed read drops that entry and the plan is redone
// without it; a full pool keeps the pool-only match). Promoted blocks enter
// the match unpublished; the sequence that adopts them publishes them.
// Dropping the match instead (a cancelled fetch) frees them and leaves the
// tiers as they were.
//
// Thread-safety: single owner (the KV manager's thread), like the index.
// Lifetime: installs the index's tier hooks on creation and removes them on
// destruction. REQUIRES: the index outlives this.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "kv/block_record.h"
#include "kv/cache_identity.h"
#include "kv/host_format.h"
#include "kv/prefix_index.h"
#include "kv/redis_store.h"
#include "kv/tier_store.h"

namespace kvstack {

struct KvTierConfig {
  int64_t host_bytes = 0;      // --kv-host-mem (0 = no host tier)
  bool write_through = false;  // --kv-host-write-through: copy blocks to host at publish
  std::string disk_dir;        // --kv-disk ("" = no disk tier)
  int64_t disk_bytes = 0;      // --kv-disk-size (REQUIRED > 0 with disk_dir)
  bool disk_direct_io = true;  // O_DIRECT where the file system allows it (benchmarks turn it off)
  std::string redis_url;       // --kv-redis redis://HOST:PORT[/DB] ("" = no remote tier)
  int redis_timeout_ms = 200;  // bound on every Redis connect and command
  // --kv-host-format: how host and disk hold blocks (host_format.h); int8
  // needs an f16 pool. Redis always holds the pool's own bytes (shared).
  HostFormat host_format = HostFormat::kPool;
  bool enabled() const { return host_bytes > 0 || !disk_dir.empty() || !redis_url.empty(); }
};

// Fetch-or-recompute inputs (spec section 9): per tier, a fixed cost per
// block t0 (seconds) and a bandwidth beta (bytes/s), measured at creation
// with a probe and updated (moving average) by every fetch; and the
// engine's prefill rate (tokens/s; 0 = unknown: always fetch). A run of n
// blocks whose records come from tiers costs
//   T_fetch = sum over its blocks (t0 + bytes / beta + t_convert)
// (that block's tier; bytes: the stored form; t_convert: host and disk in a
// colder --kv-host-format)
// against T_recompute = n P / prefill rate; the faster one is taken. The
// Redis blocks of a run are one pipelined stream, so their t0 is paid once
// per run, not per block.
struct TierCost {
  double t0_s = 0;
  double bytes_per_s = 0;
};
struct KvTierCostModel {
  TierCost host;
  TierCost disk;
  TierCost redis;
  // t_convert: seconds to decode one block from the host format (host and
  // disk fetches; 0 for the pool format), measured at creation, then a
  // moving average of real decodes.
  double convert_s = 0;
  double prefill_tokens_per_s = 0;
};

struct KvTiersStats {
  bool enabled = false;
  bool write_through = false;
  std::vector<TierStoreStats> tiers;  // host, disk, redis: those configured
  int64_t n_promoted = 0;             // blocks copied from a tier into the pool
  int64_t n_promote_failed = 0;       // promotions given up (pool full)
  int64_t n_hit_tokens = 0;           // prefix tokens served from tiers
  int64_t n_demoted = 0;              // host entries written down to disk on overflow
  int64_t n_dropped = 0;              // blocks evicted from the last tier (cache lost)
  int64_t n_persisted = 0;            // blocks written to disk at persist()
  int64_t n_prefetched = 0;           // blocks promoted ahead of admission (queued requests)
  int64_t n_partial_hits = 0;         // partial tail blocks served from tiers (find_partial)
  std::string host_format = "pool";   // --kv-host-format of host and disk
  int64_t pool_block_bytes = 0;       // bytes of one pool block
  int64_t stored_block_bytes = 0;     // bytes one host/disk record's payload holds
  int64_t n_encoded = 0;              // blocks converted pool -> host format
  int64_t n_decoded = 0;              // blocks converted host format -> pool
  double encode_seconds = 0;          // time spent converting down
  double decode_seconds = 0;          // time spent converting up (t_convert, summed)
  KvTierCostModel cost;               // current fetch-or-recompute inputs
  int64_t n_decide_fetch = 0;         // block runs fetched (T_fetch <= T_recompute)
  int64_t n_decide_recompute = 0;     // block runs recomputed instead (T_recompute < T_fetch)
  double last_fetch_s = 0;            // the last decision's estimates
  double last_recompute_s = 0;
};

// JSON object of the figures (keys are the field names without n_).
std::string kv_tiers_stats_json(const KvTiersStats& s);
// Prometheus text lines (kvstack_kv_tier_*), a histogram per tier.
// `labels` (e.g. model_name="x") go into every sample's label set.
std::string kv_tiers_prometheus(const KvTiersStats& s, const std::string& labels);
// A human table for `run --kv-stats`.
std::string format_kv_tiers_stats(const KvTiersStats& s);

class KvTiers {
 public:
  // Errors name the flag at fault (--kv-host-mem, --kv-disk, --kv-disk-size).
  static Result<std::unique_ptr<KvTiers>> create(PrefixIndex& index, const CacheIdentity& identity,
                                                 const KvTierConfig& config);
  ~KvTiers();
  KvTiers(const KvTiers&) = delete;
  KvTiers& operator=(const KvTiers&) = delete;

  const KvTierConfig& config() const { return config_; }
  const BlockRecordIdentity& record_identity() const { return id_; }

  // Extends `m` (the result of index.match(ns, tokens, max_tokens, ...))
  // with blocks held by the tiers; returns the tokens added (0: unchanged).
  // First writes the disk tier's queued write-backs (one batch per lookup).
  // A partial-block candidate is given up when full blocks replace it.
  // count_stats = false: not a query (prefetch); the index's hit counters
  // are left alone.
  // find_partial (single-group pools): when the match then covers every full
  // block below max_tokens, the next block is looked for too: by its hash
  // in every tier when `tokens` holds all of it, else among the host tier's
  // children of the last block's hash (the record whose tokens share the
  // longest start with the request's; disk and Redis keep no such index).
  // Found (and fetching beats recomputing), it is promoted into an
  // unpublished pool block set as m.partial with n_partial_tokens = the
  // tokens it shares, at most max_tokens % P (what the pool's partial-block
  // reuse gives: BlockTable::adopt_partial_copy).
  int64_t extend_match(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                       PrefixMatch& m, bool count_stats = true, bool find_partial = false);

  // Writes every published pool block and every host entry not yet on disk
  // to disk, then the disk index (warm restart). No-op without a disk tier.
  void persist();

  KvTiersStats stats() const;
  // The engine's measured prefill rate (tokens/s) for fetch-or-recompute.
  void count_prefetch(int64_t n_blocks) { n_prefetched_ += n_blocks; }
  void set_prefill_rate(double tokens_per_s) { cost_.prefill_tokens_per_s = tokens_per_s; }
  // Replaces the measured bandwidths (tests; bandwidth sweeps). Fetches
  // keep updating them unless frozen.
  void set_cost_model(const KvTierCostModel& cost, bool frozen) {
    cost_ = cost;
    cost_frozen_ = frozen;
  }
  const KvTierCostModel& cost_model() const { return cost_; }
  // Benchmarks: every fetch takes at least bytes / bytes_per_s (0 = off),
  // emulating a slower tier (kv-tiers-bench --sweep).
  void set_throttle(double bytes_per_s) { throttle_bytes_per_s_ = bytes_per_s; }
  // Stores' bookkeeping, and (write-back) no block both in the pool and on
  // the host. KV_CHECK on violation. O(pool blocks + entries).
  void check_invariants() const;

  // Where a block is (tests): host / disk membership of (hash, group).
  bool in_host(const TierKey& k) const { return host_ && host_->contains(k); }
  bool in_disk(const TierKey& k) const { return disk_ && disk_->contains(k); }
  HostStore* host() const { return host_.get(); }
  DiskStore* disk() const { return disk_.get(); }
  RedisStore* redis() const { return redis_.get(); }

 private:
  KvTiers(PrefixIndex& index, KvTierConfig config, BlockRecordIdentity id);
  void on_evict(int32_t block);
  void on_publish(int32_t block);
  // Sends the blocks published since the last call to Redis (one batch).
  void flush_redis_stores();
  // The record of a published pool block in the host format (host and
  // disk; header in hdr_, payload in conv_ unless the format is the pool's).
  TierRecord local_record(int32_t block);
  // Estimated seconds to bring key's block in from the tier that holds it
  // (host, disk, else Redis): [t0 +] bytes / beta [+ t_convert].
  double block_transfer_s(const TierKey& key, bool with_t0) const;
  // Header + payload view of a published pool block (header built in
  // `hdr`, block_record_header_bytes(P) bytes; default hdr_).
  TierRecord pool_record(int32_t block, uint8_t* hdr = nullptr);
  void to_disk(const TierKey& key, const TierRecord& rec);
  // Copies key's payload into pool block dst (host, then disk). False when
  // neither has a valid record.
  bool fetch(const TierKey& key, const Hash128& ns_digest, std::span<const int32_t> tokens,
             int32_t dst);

  // extend_match's parts: full blocks, then the partial tail.
  int64_t extend_full(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                      PrefixMatch& m, bool count_stats);
  int64_t extend_partial(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                         PrefixMatch& m, bool count_stats);
  // Reads items from Redis as one pipelined stream (throttled like
  // fetch()); true when every one arrived checked.
  bool fetch_remote(std::span<const RedisFetch> items, const Hash128& ns_digest);

  // Start-up probes of the host copy and disk read path (t0, beta).
  void measure_costs();
  void note_fetch(TierCost& c, int64_t bytes, double seconds);

  PrefixIndex& index_;
  KvTierCostModel cost_;
  bool cost_frozen_ = false;
  double throttle_bytes_per_s_ = 0;
  int64_t n_decide_fetch_ = 0;
  int64_t n_decide_recompute_ = 0;
  double last_fetch_s_ = 0;
  double last_recompute_s_ = 0;
  KvTierConfig config_;
  BlockRecordIdentity id_;        // records of the pool's bytes (Redis)
  BlockRecordIdentity local_id_;  // records of host and disk (the host format)
  std::unique_ptr<HostStore> host_;
  std::unique_ptr<DiskStore> disk_;
  std::unique_ptr<RedisStore> redis_;
  std::vector<uint8_t> hdr_;   // scratch header
  std::vector<uint8_t> conv_;  // scratch payload in the host format
  int64_t n_encoded_ = 0;
  int64_t n_decoded_ = 0;
  double encode_seconds_ = 0;
  double decode_seconds_ = 0;
  std::vector<int32_t> redis_staged_;  // published blocks not yet sent (inside one publish)
  int64_t n_promoted_ = 0;
  int64_t n_promote_failed_ = 0;
  int64_t n_hit_tokens_ = 0;
  int64_t n_demoted_ = 0;
  int64_t n_dropped_ = 0;
  int64_t n_persisted_ = 0;
  int64_t n_prefetched_ = 0;
  int64_t n_partial_hits_ = 0;
};

}  // namespace kvstack

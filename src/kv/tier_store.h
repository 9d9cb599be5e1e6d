// Tier stores: where cached KV blocks live outside the pool (kv-cache-spec.md
// sections 9 and 12). A store maps a block's identity (TierKey: chained
// hash + KV group; the hash already covers the namespace and the cache
// identity) to a slot holding one block record (block_record.h): header
// (identity, tokens, checksums) and the pool block's bytes. Stores never
// hold kernel-readable data: a hit is copied into a pool block first.
//
//   HostStore  a bounded RAM slab (--kv-host-mem): n_slots fixed slots in one
//              lazily committed anonymous mapping, LRU order.
//   DiskStore  a bounded file of fixed slots (--kv-disk DIR, --kv-disk-size):
//              DIR/blocks.kvs holds slot i at offset i * slot_bytes (header
//              in the first 4 KiB, payload from 4 KiB on, both 4 KiB aligned
//              for O_DIRECT); DIR/index.kvs lists (slot, key, namespace
//              digest, last use) with the identity of the process that wrote
//              it and a checksum, so the cache survives a restart; between
//              two rewrites of the index, DIR/journal.kvs gets one
//              checksummed entry per record written (appended after each
//              batch), so a crash (kill -9) loses no written record either. Writes are
//              gathered into batches (kDiskWriteBatchBytes) written with one
//              pwritev per run of consecutive slots; reads are one pread per
//              slot, both O_DIRECT where the file system allows it (else
//              buffered). Every read checks the record's identity, key,
//              tokens and checksums: a torn, truncated, corrupt or foreign
//              record is a miss and its entry is dropped. A failed write
//              (disk full: ENOSPC/EFBIG, or any I/O error) drops the entry
//              and is counted; nothing else changes.
//
// Both keep per-store counters (TierStoreStats) and a latency histogram of
// fetches. Thread-safety: not thread-safe; the KV manager's owner thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/result.h"
#include "kv/block_record.h"

namespace kvstack {

struct TierKey {
  Hash128 hash;
  int32_t group = 0;
  bool operator==(const TierKey&) const = default;
};
struct TierKeyHash {
  size_t operator()(const TierKey& k) const {
    return static_cast<size_t>(k.hash.lo ^ (k.hash.hi * 31) ^ static_cast<uint64_t>(k.group));
  }
};

// Fetch latency buckets (upper bounds, microseconds; the last is +Inf).
inline constexpr std::array<double, 10> kTierFetchBucketsUs = {10,  25,   50,   100,   250,
                                                               500, 1000, 2500, 10000, 1e300};

struct TierStoreStats {
  std::string name;            // "host" or "disk"
  int64_t capacity_bytes = 0;  // n_slots * slot_bytes
  int64_t slot_bytes = 0;
  int64_t n_slots = 0;
  int64_t n_blocks = 0;             // entries held now
  int64_t n_stored = 0;             // records written in (lifetime)
  int64_t bytes_in = 0;             // record bytes written in
  int64_t n_hits = 0;               // records fetched back into the pool
  int64_t bytes_out = 0;            // payload bytes fetched back
  int64_t n_evicted = 0;            // entries pushed out (LRU) to make room
  int64_t n_erased = 0;             // entries dropped because the pool holds the block again
  int64_t n_corrupt = 0;            // reads refused: bad header/payload checksum, torn or short
  int64_t n_identity_mismatch = 0;  // entries of another model/format/layout dropped
  int64_t n_write_failed = 0;       // writes that failed (disk full or I/O error), entry dropped
  int64_t n_errors = 0;             // remote: commands failed or timed out (server down or slow)
  int64_t n_round_trips = 0;        // remote: commands or pipelined batches sent
  std::array<int64_t, kTierFetchBucketsUs.size()> fetch_hist{};  // per bucket (not cumulative)
  double fetch_seconds = 0;                                      // sum of fetch latencies
  bool direct_io = false;                                        // disk: O_DIRECT in use
};

// Adds one fetch of `seconds` to a store's histogram.
void record_fetch_latency(TierStoreStats& s, double seconds);

// A record handed to a store: header bytes (block_record_header_bytes(P))
// and the payload (BlockRecordIdentity::payload_bytes).
struct TierRecord {
  const uint8_t* header = nullptr;
  const uint8_t* payload = nullptr;
};

// Entry bookkeeping shared by the stores: key <-> slot, LRU order, free slots.
class SlotMap {
 public:
  explicit SlotMap(int64_t n_slots);
  int64_t n_slots() const { return static_cast<int64_t>(keys_.size()); }
  int64_t size() const { return static_cast<int64_t>(by_key_.size()); }
  // Slot of key, or -1.
  int64_t find(const TierKey& key) const;
  // A free slot for key (most recently used), or -1 when all are taken.
  // REQUIRES: key not present.
  int64_t insert(const TierKey& key);
  void touch(int64_t slot);
  void erase(int64_t slot);
  // Least recently used slot, or -1 when empty.
  int64_t lru() const { return head_; }
  const TierKey& key(int64_t slot) const { return keys_[static_cast<size_t>(slot)]; }
  bool used(int64_t slot) const { return used_[static_cast<size_t>(slot)] != 0; }
  // Replaces an empty map's contents with (slot, key) entries, least
  // recently used first; invalid or repeated slots and keys are skipped.
  void restore(std::span<const std::pair<int64_t, TierKey>> entries);
  // Used slots, least recently used first.
  std::vector<int64_t> slots_lru_order() const;
  void check_invariants() const;

 private:
  void unlink(int64_t s);
  void push_back(int64_t s);
  std::vector<TierKey> keys_;
  std::vector<uint8_t> used_;
  std::vector<int64_t> prev_, next_;
  std::vector<int64_t> free_;  // LIFO
  int64_t head_ = -1, tail_ = -1;
  std::unordered_map<TierKey, int64_t, TierKeyHash> by_key_;
};

class HostStore {
 public:
  // n_slots = capacity_bytes / slot_bytes (header padded to 64 bytes +
  // payload); kInvalidArgument when that is 0 (names --kv-host-mem).
  static Result<std::unique_ptr<HostStore>> create(const BlockRecordIdentity& id,
                                                   int64_t capacity_bytes);
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  bool contains(const TierKey& key) const { return map_.find(key) >= 0; }
  // Stores a copy of `rec` under key (touching it when present). When full,
  // the LRU entry is handed to `evicted` (before its slot is reused) and
  // dropped. Returns false when nothing could be stored (0 slots).
  template <class OnEvicted>
  bool put(const TierKey& key, const TierRecord& rec, OnEvicted&& evicted) {
    const int64_t have = map_.find(key);
    if (have >= 0) {
      map_.touch(have);
      return true;
    }
    if (map_.size() == map_.n_slots()) {
      const int64_t victim = map_.lru();
      evicted(map_.key(victim), record(victim));
      unlink_parent(victim);
      map_.erase(victim);
      ++stats_.n_evicted;
    }
    store(map_.insert(key), rec);
    return true;
  }
  // The stored record of key, or {null, null}.
  TierRecord peek(const TierKey& key) const;
  // Copies key's payload into dst (payload_bytes); false when absent.
  bool fetch(const TierKey& key, uint8_t* dst);
  bool erase(const TierKey& key);
  // Every entry, least recently used first.
  std::vector<TierKey> keys() const;
  // Group-0 entries whose record's parent hash is `parent` (candidates for
  // a partial-block hit; the caller checks namespace and tokens).
  std::vector<TierKey> children(const Hash128& parent) const;
  TierStoreStats stats() const;
  void add_fetch_latency(double seconds) { record_fetch_latency(stats_, seconds); }
  void check_invariants() const;

 private:
  HostStore(const BlockRecordIdentity& id, int64_t n_slots, int64_t slot_bytes, uint8_t* base,
            int64_t map_bytes);
  TierRecord record(int64_t slot) const;
  void store(int64_t slot, const TierRecord& rec);
  void unlink_parent(int64_t slot);
  struct HashOf {
    size_t operator()(const Hash128& h) const { return static_cast<size_t>(h.lo ^ (h.hi * 31)); }
  };
  BlockRecordIdentity id_;
  int64_t header_bytes_ = 0;  // padded to 64
  int64_t slot_bytes_ = 0;
  uint8_t* base_ = nullptr;
  int64_t map_bytes_ = 0;
  SlotMap map_;
  // parent hash -> group-0 slots holding its children (parent_of_[slot]).
  std::unordered_map<Hash128, std::vector<int64_t>, HashOf> children_;
  std::vector<Hash128> parent_of_;
  TierStoreStats stats_;
};

// Bytes gathered before the disk store writes a batch.
inline constexpr int64_t kDiskWriteBatchBytes = int64_t{8} << 20;
// Records written between two index rewrites (besides flush()).
inline constexpr int64_t kDiskIndexEvery = 256;

class DiskStore {
 public:
  // Opens (creating) DIR/blocks.kvs and loads DIR/index.kvs when present:
  // entries of another identity or slot geometry are dropped
  // (n_identity_mismatch), a corrupt index is ignored (n_corrupt += 1).
  // kInvalidArgument when capacity_bytes holds no slot (names
  // --kv-disk-size); kIo naming the path when DIR or the file cannot be
  // created or opened, or another process holds DIR (DIR/lock, flock).
  // direct_io = false: buffered I/O even where O_DIRECT works.
  static Result<std::unique_ptr<DiskStore>> open(const BlockRecordIdentity& id,
                                                 const std::string& dir, int64_t capacity_bytes,
                                                 bool direct_io = true);
  ~DiskStore();  // flush()
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  bool contains(const TierKey& key) const { return map_.find(key) >= 0; }
  // Queues a copy of `rec` under key (no-op touch when present); the LRU
  // entry is dropped when full. Writes go out in batches.
  void put(const TierKey& key, const TierRecord& rec);
  // Reads key's record, verifies it against the identity, `ns_digest` and
  // `tokens`, and copies the payload into dst. On any failure the entry is
  // dropped and false returned.
  bool fetch(const TierKey& key, const Hash128& ns_digest, std::span<const int32_t> tokens,
             uint8_t* dst);
  bool erase(const TierKey& key);
  // Writes every queued record (one batch; the index is rewritten every
  // kDiskIndexEvery records written).
  void write_batch() { write_pending(); }
  // Writes every queued record, then the index (atomically: a temporary file
  // renamed over the old one). Failures are counted, never fatal.
  void flush();
  TierStoreStats stats() const;
  void add_fetch_latency(double seconds) { record_fetch_latency(stats_, seconds); }
  // Start-up probe on DIR/probe.kvs (written first, removed after), read
  // the way fetch() reads: seconds of one 4 KiB read (the fixed cost) and
  // of one read of 4 slots (bandwidth); {0, 0} when it fails.
  std::pair<double, double> probe_read_seconds();
  int64_t n_pending() const { return static_cast<int64_t>(pending_.size()); }
  void check_invariants() const { map_.check_invariants(); }
  const std::string& data_path() const { return data_path_; }

 private:
  DiskStore(const BlockRecordIdentity& id, std::string dir, int64_t n_slots, int64_t slot_bytes);
  Status open_files(bool direct_io);
  void load_index();
  // Replays DIR/journal.kvs over the loaded index (entries of this identity
  // up to the first torn or bad one; a later entry for a slot or key wins).
  void load_journal();
  void write_index();
  // Empties the journal and writes its header (after an index rewrite).
  void reset_journal();
  // Appends entries for `slots` (just written) to the journal.
  void journal(std::span<const int64_t> slots);
  void write_pending();
  void reopen_buffered();
  struct AlignedFree {
    void operator()(uint8_t* p) const;
  };
  using Buffer = std::unique_ptr<uint8_t, AlignedFree>;
  Buffer new_buffer() const;

  BlockRecordIdentity id_;
  std::string dir_, data_path_, index_path_, journal_path_;
  int64_t header_region_ = 4096;
  int64_t slot_bytes_ = 0;
  int fd_ = -1;
  int lock_fd_ = -1;     // DIR/lock, held (flock) for the store's lifetime
  int journal_fd_ = -1;  // DIR/journal.kvs, appended to (O_APPEND)
  bool direct_ = false;
  SlotMap map_;
  std::vector<Hash128> ns_of_;                   // [n_slots] namespace digest of each entry
  std::unordered_map<int64_t, Buffer> pending_;  // slot -> record not yet written
  std::vector<Buffer> spare_;                    // recycled write buffers
  Buffer read_buf_;
  int64_t n_since_index_ = 0;
  TierStoreStats stats_;
};

}  // namespace kvstack

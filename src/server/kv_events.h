// KvEventPublisher: the prefix cache's block events (kv/prefix_index.h) in
// vLLM's KV-events wire format over ZeroMQ (`kvstack serve --kv-events
// tcp://*:PORT`), for routers that index where blocks are (llm-d, Dynamo,
// vllm-router's kv_aware).
//
// Wire format (vLLM vllm/distributed/kv_events.py, msgspec array_like
// structs with tag=True, msgpack):
//   PUB multipart message  [topic, seq (8-byte big-endian), payload]
//   payload  EventBatch    [ts (float64 s since the epoch), [event...], data_parallel_rank (0)]
//   event    BlockStored   ["BlockStored", [hash], parent_hash | nil, [token ids],
//                           block_size, lora_id (nil), medium ("CPU"), lora_name (nil),
//                           extra_keys [[namespace digest]]]
//            BlockRemoved  ["BlockRemoved", [hash], medium ("CPU")]
//            AllBlocksCleared ["AllBlocksCleared"]  (a cache clear left nothing
//                          cached: POST /flush_cache, /reset_prefix_cache)
// seq counts batches from 0 and never repeats. Mapping of kvstack's identity:
//   hash / parent_hash  the 128-bit chained block hash as 16 bytes (hi then
//                       lo, big-endian; vLLM's ExternalBlockHash may be
//                       bytes); parent nil at the top of a prefix.
//   extra_keys          per block one tuple holding the block's namespace
//                       (cache identity + cache_salt digest, section 5 of the
//                       spec) as 32 hex digits: a block is reusable only from
//                       that namespace. The salt itself is never sent.
//   medium              "CPU": the pool lives in host memory (and is the tier
//                       kernels read).
// Each event carries one block (every block of a prefix is its own event,
// parents first), so a consumer can rebuild the cached set exactly.
//
// Replay (optional ROUTER socket, --kv-events-replay): a request
// [identity, "", start_seq (8-byte big-endian)] is answered with
// [identity, "", seq, payload] for every buffered batch with seq >=
// start_seq, oldest first, then [identity, "", -1 (8 bytes), ""]. The buffer
// keeps the last `replay_batches` batches.
//
// Never blocks the engine: push() runs inside the prefix index's operation
// on the engine thread and only appends to a bounded queue under a mutex
// (held for the push); when the queue is full the event is dropped and
// counted. One publisher thread drains the queue (one batch per drain),
// encodes, sends (non-blocking: a slow subscriber loses messages at the PUB
// high-water mark, ZeroMQ's rule) and answers replay requests.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/result.h"
#include "kv/prefix_index.h"

namespace kvstack::server {

struct KvEventPublisherConfig {
  std::string endpoint;              // PUB address, e.g. tcp://*:5557 (bound)
  std::string replay_endpoint;       // ROUTER address, empty = no replay
  std::string topic;                 // first frame of every message
  int64_t queue_capacity = 1 << 16;  // events pending for the publisher thread
  int64_t replay_batches = 10000;    // batches kept for replay
  int block_size = 16;               // tokens per block (BlockStored.block_size)
  // false: events as positional arrays (vLLM's array_like structs, above);
  // true: events as maps tagged by "type" ({"type": "BlockStored",
  // "block_hashes": ..., ...}; vLLM without array_like, and what vllm-router
  // 0.1.17's kv_index decoder requires). The batch stays [ts, events, rank].
  bool map_events = false;
};

struct KvEventPublisherStats {
  int64_t n_events = 0;           // events published
  int64_t n_batches = 0;          // messages published (= next seq)
  int64_t n_dropped = 0;          // events dropped because the queue was full
  int64_t n_replay_requests = 0;  // replay requests answered
  int64_t n_replayed_batches = 0;
};

class KvEventPublisher {
 public:
  // Binds the sockets; kIo naming the endpoint when ZeroMQ refuses it.
  static Result<std::unique_ptr<KvEventPublisher>> create(KvEventPublisherConfig config);
  ~KvEventPublisher();  // stops the thread after publishing what is queued
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // One event from the prefix index's sink. `ns_digest` is the block's
  // namespace digest. Thread-safe; never blocks beyond a short mutex.
  void push(const KvEvent& e, const Hash128& ns_digest);

  KvEventPublisherStats stats() const;

 private:
  struct Pending {
    KvEvent::Kind kind;
    Hash128 hash;
    Hash128 parent;
    Hash128 ns_digest;
    std::vector<int32_t> tokens;
  };
  explicit KvEventPublisher(KvEventPublisherConfig config);
  void run();
  std::string encode(const std::vector<Pending>& batch) const;
  void serve_replay();

  KvEventPublisherConfig config_;
  struct Sockets;
  std::unique_ptr<Sockets> zmq_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Pending> queue_;
  bool stop_ = false;
  std::deque<std::pair<uint64_t, std::string>> replay_;  // publisher thread only
  std::atomic<int64_t> n_events_{0}, n_batches_{0}, n_dropped_{0}, n_replay_{0}, n_replayed_{0};
};

}  // namespace kvstack::server

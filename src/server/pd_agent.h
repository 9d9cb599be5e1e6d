// PdAgent: prefill/decode disaggregation behind vllm-router (issue 21 item
// 1; kv-cache-spec.md section 10). `kvstack serve --role prefill|decode`
// creates one; `--role both` (the default) has none and computes every
// request locally, ignoring kv_transfer_params.
//
// Flow (vllm-router --vllm-pd-disaggregation; see docs/architecture.md):
//   1. the router sends the request to a prefill worker with max_tokens 1
//      and kv_transfer_params {do_remote_decode: true}. The worker runs it
//      as usual (its prompt's full blocks are published in its prefix
//      cache), then offer(): it pins the published blocks covering the
//      first floor((T - 1) / P) * P prompt tokens under a lease
//      (transfer/lease_table.h; ends on a verified pull, on cancellation or
//      after --kv-lease-timeout) and answers with kv_transfer_params:
//      {do_remote_prefill: true, remote_engine_id, remote_host,
//       remote_port (the transfer control port), remote_transfer_id,
//       remote_block_ids, remote_block_hashes, n_tokens, block_size,
//       block_bytes, kv_format, model_digest, format_digest, ...}.
//   2. the router copies that object into the decode request. A decode
//      worker's pull() checks the cache identity and layout against its
//      own (another block size or float KV dtype is converted on arrival,
//      pd_convert.cpp; any other mismatch is a clear error), adopts
//      whatever prefix it already caches, lets
//      its own pool allocate blocks for the rest (producer block ids mean
//      nothing here), reads them over UCX (transfer/ucx_transfer.h),
//      verifies every block record (block_record.h: identity, chained hash
//      of the expected tokens, payload checksum) and publishes the blocks
//      in its prefix cache as a local prefill would. Only then is the
//      request submitted: the scheduler's prefix lookup hits the pulled
//      blocks, computes the remaining < P + 1 prompt tokens itself (the
//      last prompt token always, for its logits) and decodes.
//   A failed pull (peer gone, lease ended, timeout, bad record) releases
//   every block it allocated and fails the request with an error (HTTP
//   502, code kv_transfer_failed): never tokens from unverified K/V.
//
// KV groups (hybrid window models): the offer carries, after the n nodes,
// each other group's blocks [group_first, n) (the prefix index's rule for
// a hit of n P tokens); the decode worker reserves blocks in every group,
// fills those, drops the window blocks no query can see and publishes the
// rest as checkpoints. KIVI formats: only converted blocks are published,
// and they are whole (codes and per-block metadata), so they move like any
// block and are committed as converted (BlockTable::commit_final); the f16
// residual of the newest tokens is not sent (the decode worker computes
// those tokens, as after a local prefix hit). Limits: the whole prefix
// moves after the prefill, unless the decode worker streams it.
//
// Layer-wise streaming (decode-initiated, opt-in; pd_stream.cpp): a
// decode request whose kv_transfer_params hold {do_remote_prefill: true,
// remote_stream_host, remote_stream_port} (the prefill worker's transfer
// control endpoint, --kv-transfer-host/--kv-transfer-port) needs no prior
// prefill request: the decode worker sends STREAM(salt, prompt tokens);
// the prefill worker submits the prefill (max_tokens 1) with a watch id
// (SeqRequest::watch_id -> StepSeq::watch), and its layer hook, at the
// final prefill chunk, takes references to the sequence's first
// floor((T - 1) / P) blocks (so they cannot be reused mid-stream) and
// counts layers done; the connection thread sends their addresses, then
// LAYER_READY(l) as layers finish. The decode worker reserves its blocks
// and reads layer l of every block as soon as it is ready. After the last
// layer and the request's end, the prefill worker leases the published
// blocks (offer()) and sends the usual OFFER (addresses, record headers
// with checksums, length); the decode worker reads again any block whose
// published address differs from the streamed one, verifies every record
// and publishes as in pull(). One-group layouts of the same format only.
// Any failure (peer gone, timeout, bad record) releases both sides' blocks,
// references and leases and fails the request (HTTP 502).
//
// Thread-safety: offer() and pull() run on HTTP handler threads; they touch
// the engine only through Scheduler::inspect. A reaper thread ends expired
// leases and drops ended leases' block references on the engine thread.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/result.h"
#include "engine/scheduler.h"
#include "kv/block_record.h"
#include "transfer/lease_table.h"
#include "transfer/ucx_transfer.h"

namespace kvstack::server {

enum class PdRole : uint8_t { kBoth, kPrefill, kDecode };
const char* pd_role_name(PdRole r);
// "prefill" / "decode" / "both"; kInvalidArgument naming --role otherwise.
Result<PdRole> parse_pd_role(const std::string& s);

struct PdConfig {
  PdRole role = PdRole::kBoth;
  std::string transfer_host;  // prefill: address advertised and listened on (numeric IPv4)
  int transfer_port = 0;      // prefill: control port (0 = any free)
  std::chrono::milliseconds lease_timeout{30000};     // --kv-lease-timeout
  std::chrono::milliseconds transfer_timeout{10000};  // --kv-transfer-timeout: connect + read
  // Tests (KVSTACK_TEST_PULL_STALL_MS, read at start-up): decode waits this
  // long between the offer and the reads, so a test can kill the prefill
  // worker mid-transfer.
  std::chrono::milliseconds test_pull_stall{0};
  // Decode: pulls that may run at once (--kv-max-pulls), each on its own
  // UCX worker ("lane"); more wait for a lane within the transfer timeout.
  int max_pulls = 4;
  // Decode (--kv-pull-by-layer): layer-major reads, each layer timed
  // (PullSession::set_layer_ranges); one-group layouts without conversion.
  bool pull_by_layer = false;
};

// Counters of /metrics and /v1/kv/stats ("transfer"). Units: bytes, seconds.
struct PdStats {
  PdRole role = PdRole::kBoth;
  std::string transports;
  // prefill
  transfer::LeaseStats leases;
  transfer::TransferServerStats server;
  int64_t n_offers = 0;        // kv_transfer_params with do_remote_prefill returned
  int64_t n_offers_empty = 0;  // prompt shorter than a block + 1: nothing to pin
  int64_t n_streams = 0;       // layer-wise streams served (STREAM frames answered with blocks)
  int64_t n_streams_ok = 0;    // of which ended with a lease handed over
  // decode
  int64_t n_pulls = 0;  // pulls started
  int64_t n_pulls_ok = 0;
  int64_t n_pulls_failed = 0;
  int64_t n_stream_pulls = 0;       // of the pulls, layer-wise streams (remote_stream_host)
  int64_t n_stream_rereads = 0;     // streamed blocks read again: published elsewhere
  int64_t max_pulls = 0;            // --kv-max-pulls (decode)
  int64_t pulls_in_flight = 0;      // pulls holding a lane now
  int64_t pulls_in_flight_max = 0;  // most at once so far (<= max_pulls)
  double pull_wait_seconds = 0;     // summed wait for a free lane (queueing)
  int64_t n_blocks_pulled = 0;
  int64_t n_blocks_local = 0;  // offered blocks this worker already cached (not pulled)
  int64_t n_bytes_pulled = 0;
  int64_t n_layout_mismatches = 0;   // refused: another model, or a layout not converted
  int64_t n_layout_conversions = 0;  // pulls converted from another block size / KV dtype
  int64_t n_blocks_converted = 0;    // producer blocks converted (read into staging)
  double pull_seconds = 0;           // sum over successful pulls (offer + read + verify + publish)
  double read_seconds = 0;           // of which UCX reads
  double last_pull_s = 0;
  double last_read_s = 0;
  double last_wireup_s = 0;   // endpoint connection of the last read
  double last_get_s = 0;      // the gets alone (no worker / endpoint set-up)
  int64_t last_n_gets = 0;    // get operations of the last read (contiguous runs)
  int64_t last_bytes = 0;     // payload bytes of the last read
  double last_bandwidth = 0;  // bytes/s of the last read's gets
  // decode, --kv-pull-by-layer: per model layer, the last read's get time
  // of that layer's bytes of every block (t_x per layer), else empty.
  std::vector<double> last_layer_get_s;
  // prefill: per model layer, seconds spent in that layer summed over every
  // forward step of two or more tokens (prefill chunks; Forward's layer
  // hook), and the number of those steps: t_p per layer of one prefill is
  // the difference of two readings around it on an otherwise idle worker.
  std::vector<double> prefill_layer_s;
  int64_t n_prefill_steps = 0;
};
nlohmann::json pd_stats_json(const PdStats& s);
std::string pd_prometheus(const PdStats& s, const std::string& labels);

// The decode side's hold on pulled blocks between their publish and the
// request's admission (which takes its own references): released on the
// engine thread by the destructor.
class PulledPrefix {
 public:
  PulledPrefix(Scheduler& s, Sequence seq) : s_(&s), seq_(std::move(seq)) {}
  ~PulledPrefix();
  PulledPrefix(const PulledPrefix&) = delete;
  PulledPrefix& operator=(const PulledPrefix&) = delete;
  int64_t n_tokens() const { return seq_ ? seq_->length() : 0; }
  // Engine thread: commits the reserved blocks [k, n) (their bytes in
  // place; window group g holds only [group_first[g], n): the rest is
  // dropped first) and publishes them as the continuation of prompt[0, k P).
  Status commit(const std::vector<int32_t>& prompt, size_t k, size_t n,
                const std::vector<size_t>& group_first);

 private:
  Scheduler* s_;
  std::optional<Sequence> seq_;
};

// Engine thread: a new sequence in `cache_salt`'s namespace for the first
// n blocks (P tokens each) of `prompt` as the decode side receives them.
// What this worker caches already is adopted (`adopted` whole blocks; 0
// when the cached match does not end on a block boundary), blocks for the
// rest are reserved (`reserved` says whether that worked).
struct PrefixReservation {
  Sequence seq;
  size_t adopted = 0;
  Status reserved;
  NamespaceId ns = kNoNamespace;
};
PrefixReservation reserve_prefix(Engine& e, const std::string& cache_salt,
                                 const std::vector<int32_t>& prompt, size_t n, int64_t P);
// The chained hashes the first n block records of `prompt` must carry in
// namespace ns (this worker's block size P).
std::vector<Hash128> expected_block_hashes(const PrefixIndex& idx, NamespaceId ns,
                                           const std::vector<int32_t>& prompt, size_t n, int64_t P);

struct StreamWatches;  // pd_stream.h

class PdAgent {
 public:
  using Clock = std::chrono::steady_clock;
  // REQUIRES: called before the engine thread starts (registers the pool;
  // decode: writes every pool page once, so that pulls do not page-fault);
  // the engine outlives the agent.
  static Result<std::unique_ptr<PdAgent>> create(Engine& engine, const PdConfig& config);
  ~PdAgent();  // stop() first
  PdAgent(const PdAgent&) = delete;
  PdAgent& operator=(const PdAgent&) = delete;

  // Starts the reaper (prefill). REQUIRES: s outlives stop().
  void start(Scheduler& s);
  // Ends every lease and drops their references (through s, or directly
  // when the engine thread has returned). Idempotent.
  void stop();

  PdRole role() const { return config_.role; }
  const std::string& engine_id() const { return engine_id_; }
  // "host:port" of the transfer control listener (prefill), else "".
  std::string stats_endpoint() const {
    return server_ ? server_->host() + ":" + std::to_string(server_->port()) : std::string();
  }

  // Prefill: pins the published prefix of `prompt` in the namespace of
  // `cache_salt` (SeqRequest::cache_salt) and returns the response's
  // kv_transfer_params.
  Result<nlohmann::json> offer(Scheduler& s, const std::vector<int32_t>& prompt,
                               const std::string& cache_salt);

  // Decode: pulls and publishes the prefix `params` describes. Errors:
  // kInvalidArgument (params malformed, or identity/layout mismatch),
  // kIo / kNotFound / kBusy / kCorruptFile (transfer failed).
  Result<std::unique_ptr<PulledPrefix>> pull(Scheduler& s, const nlohmann::json& params,
                                             const std::vector<int32_t>& prompt,
                                             const std::string& cache_salt);

  PdStats stats() const;

 private:
  explicit PdAgent(Engine& engine, PdConfig config) : engine_(engine), config_(std::move(config)) {}
  void reap_loop();
  // Drops ended leases' references (pool owner's thread), children first.
  static void release(std::vector<transfer::Lease> ended);
  Status check_offer(const nlohmann::json& params) const;
  // What a decode worker needs to convert another layout's blocks
  // (transfer/kv_convert.h): the producer's layout and record identity.
  struct Conversion {
    KvLayout src;
    CacheIdentity identity;  // the producer's: this worker's with its kv_format
    BlockRecordIdentity record_id;
  };
  // The conversion of the offer `params` describes, or why there is none
  // (kUnsupported, naming the pair; pd_convert.cpp).
  Result<Conversion> plan_conversion(const nlohmann::json& params) const;
  // pull() for an offer in another layout: reads the producer's records
  // into a staging buffer, checks them under the producer's identity,
  // rewrites the tokens into this worker's own blocks and publishes them.
  // Counts a verified pull of n_pulled blocks (n_local found cached here)
  // that started at t0, with the session's timings. REQUIRES: mu_ held.
  void count_pull_ok(const transfer::PullTimings& t, Clock::time_point t0, int64_t n_pulled,
                     int64_t n_local);
  Result<std::unique_ptr<PulledPrefix>> pull_converted(Scheduler& s, transfer::PullSession& session,
                                                       const Conversion& conv,
                                                       const std::vector<int32_t>& prompt,
                                                       const std::string& cache_salt,
                                                       Clock::time_point t0);

  // Layer-wise streaming (pd_stream.cpp). Prefill: the streamed prefills
  // the layer hook follows (shared with the hook, like layer_timer_).
  std::shared_ptr<StreamWatches> watches_;
  // Connection thread of a STREAM frame: runs the prefill, sends the
  // reserved blocks' addresses, LAYER_READY per layer, then the lease.
  void serve_stream(transfer::Socket& conn, const std::vector<uint8_t>& payload);
  // Decode: pull() for kv_transfer_params naming remote_stream_host/port.
  Result<std::unique_ptr<PulledPrefix>> pull_stream(Scheduler& s, const nlohmann::json& params,
                                                    const std::vector<int32_t>& prompt,
                                                    const std::string& cache_salt);

  // Prefill: per-layer times of the forward's prefill steps (shared with
  // the hook the engine's Forward holds, so it outlives the agent there).
  struct LayerTimer;
  std::shared_ptr<LayerTimer> layer_timer_;
  Engine& engine_;
  PdConfig config_;
  std::string engine_id_;
  BlockRecordIdentity record_id_;
  std::unique_ptr<transfer::UcxContext> ucx_;
  transfer::LeaseTable leases_;
  std::unique_ptr<transfer::TransferServer> server_;
  // Decode: config_.max_pulls pullers (one UCX worker each, with one
  // endpoint per prefill worker); a pull holds one for its whole read.
  class Lane;
  std::unique_ptr<Lane> acquire_lane(Clock::time_point deadline);
  std::vector<std::unique_ptr<transfer::UcxPuller>> pullers_;
  std::vector<transfer::UcxPuller*> free_pullers_;  // guarded by mu_
  std::condition_variable lane_cv_;
  Scheduler* sched_ = nullptr;
  std::thread reaper_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;  // stats_
  PdStats stats_;
};

}  // namespace kvstack::server

// KV block transfer over UCX (issue 21 item 2): one-sided reads of pinned
// pool blocks from a prefill worker into a decode worker's own blocks.
//
// Prefill side (TransferServer):
//   - registers the whole pool mapping once (ucp_mem_map) and packs its
//     remote key; creates one UCX worker (its address is what pullers
//     connect to) driven by a progress thread (UCX's TCP transport
//     emulates RMA in software, so the target must progress);
//   - listens on a TCP control port (control_channel.h). A puller sends
//     PULL(transfer id); the server takes the lease (LeaseTable::begin_pull)
//     and answers OFFER: worker address, rkey, per-block remote addresses
//     and the block records' headers. The puller reads every block with
//     ucp_get_nbx, verifies the records and sends DONE; the lease ends
//     completed (DONE ok), else cancelled (DONE failed, the connection lost,
//     or no DONE within the I/O timeout) or expired (its deadline passed:
//     the server drops the connection, the puller fails).
// Decode side (PullSession): connect + offer, then read() into the blocks
// the caller allocated, then finish(). Every wait is bounded; destruction
// releases the endpoint, the unpacked rkey and the worker on every path.
//
// Transports: whatever UCX selects from UCX_TLS (tcp between network
// namespaces; shared memory is also possible on one machine). Read from the
// environment once, when the context is created.
//
// Thread-safety: UcxContext is shared (workers are created from several
// threads: mt_workers_shared). TransferServer's methods are safe from any
// thread. A PullSession belongs to one thread.
// Lifetime: the pool mapping registered by a TransferServer must outlive it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/result.h"
#include "transfer/control_channel.h"
#include "transfer/lease_table.h"

namespace kvstack::transfer {

class UcxContext {
 public:
  // ucp_init with RMA + wakeup features; errors name the UCX status.
  static Result<std::unique_ptr<UcxContext>> create();
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  void* handle() const { return ctx_; }  // ucp_context_h
  // Transports UCX would use (UCX_TLS as read at creation, "all" when unset).
  const std::string& transports() const { return tls_; }

 private:
  UcxContext() = default;
  void* ctx_ = nullptr;
  std::string tls_;
};

struct TransferServerConfig {
  std::string host = "127.0.0.1";               // control listener address (numeric IPv4)
  int port = 0;                                 // 0 = any free port
  std::chrono::milliseconds io_timeout{10000};  // bound on every control read/write and the pull
};

struct TransferServerStats {
  int64_t n_pulls = 0;          // offers made
  int64_t n_pulls_ok = 0;       // DONE ok received
  int64_t n_pulls_failed = 0;   // refused, DONE failed, lost or timed out
  int64_t n_bytes_offered = 0;  // payload bytes of the offers answered with DONE ok
};

class TransferServer {
 public:
  // Registers [pool_base, pool_base + pool_bytes) and starts the worker,
  // the progress thread and the control listener.
  static Result<std::unique_ptr<TransferServer>> create(UcxContext& ucx, LeaseTable& leases,
                                                        void* pool_base, size_t pool_bytes,
                                                        const TransferServerConfig& config);
  ~TransferServer();  // stops the threads, unregisters, destroys the worker
  TransferServer(const TransferServer&) = delete;
  TransferServer& operator=(const TransferServer&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return config_.host; }
  TransferServerStats stats() const;
  // What a puller needs to read this worker's pool: the UCX worker address
  // and the pool's packed remote key.
  const std::vector<uint8_t>& worker_address() const { return worker_addr_; }
  const std::vector<uint8_t>& rkey() const { return rkey_; }

  // Layer-wise streaming: a connection whose first frame is STREAM is
  // handed to `h` (its payload; on the connection's thread), which owns the
  // conversation and must return within its own bounded timeouts. Set
  // before any puller connects; unset: STREAM is refused.
  using StreamHandler = std::function<void(Socket& conn, const std::vector<uint8_t>& payload)>;
  void set_stream_handler(StreamHandler h) { stream_handler_ = std::move(h); }
  // Answers a pull of lease `id` on `conn` (OFFER, then waits for DONE and
  // ends the lease), as for a PULL frame; within io_timeout.
  void answer_pull(Socket& conn, uint64_t id);
  // Sends an error answer (an OFFER frame with a non-zero status).
  static void send_refusal(Socket& conn, Errc code, const std::string& message,
                           Clock::time_point deadline);

 private:
  TransferServer(UcxContext& ucx, LeaseTable& leases, TransferServerConfig config)
      : ucx_(ucx), leases_(leases), config_(std::move(config)) {}
  void progress_loop();
  void accept_loop();
  void serve(Socket conn);

  UcxContext& ucx_;
  LeaseTable& leases_;
  TransferServerConfig config_;
  void* worker_ = nullptr;  // ucp_worker_h
  void* memh_ = nullptr;    // ucp_mem_h of the pool
  std::vector<uint8_t> worker_addr_;
  std::vector<uint8_t> rkey_;
  int event_fd_ = -1;
  Socket listener_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread progress_;
  std::thread acceptor_;
  mutable std::mutex mu_;        // stats_
  std::atomic<int> n_conns_{0};  // detached connection threads running
  TransferServerStats stats_;
  StreamHandler stream_handler_;
};

// What a puller learned from the offer. Units: bytes.
struct Offer {
  uint64_t transfer_id = 0;
  int64_t n_blocks = 0;
  int64_t header_bytes = 0;  // per block (block_record_header_bytes)
  int64_t block_bytes = 0;   // payload per block
  int64_t n_tokens = 0;
  std::vector<uint8_t> headers;  // [n_blocks, header_bytes]
  std::vector<uint64_t> addrs;   // [n_blocks] remote addresses
};

struct PullTimings {
  double connect_s = 0;  // control connect + PULL/OFFER
  double read_s = 0;     // UCX worker + endpoint + rkey + every get completed
  double wireup_s = 0;   // of which the endpoint's connection (a 1-byte get + flush)
  double get_s = 0;      // of which the data gets: first issued .. flush completed
  int64_t n_gets = 0;    // get operations (contiguous blocks are coalesced)
  int64_t n_bytes = 0;
  // Layer-major reads (PullSession::set_layer_ranges): per layer range, the
  // time from its first get issued to its last get completed; the ranges
  // are read one after another, so these add up to about get_s.
  std::vector<double> layer_get_s;
};

// Decode side: one UCX worker and, per prefill worker (its worker address),
// an endpoint and the unpacked rkey, kept across pulls so that a pull does
// not pay a worker, a TCP connection and a wireup each time. Pulls through
// one puller run one at a time (its mutex is held for a whole read; PdAgent
// keeps several pullers for concurrent pulls). An
// endpoint whose peer failed, or whose read failed, is dropped (the next
// pull connects again); at most kMaxPeers are kept.
// Thread-safety: safe from any thread. Lifetime: outlives its sessions.
class UcxPuller {
 public:
  static constexpr size_t kMaxPeers = 64;
  static Result<std::unique_ptr<UcxPuller>> create(UcxContext& ucx);
  ~UcxPuller();  // closes every endpoint, destroys the worker
  UcxPuller(const UcxPuller&) = delete;
  UcxPuller& operator=(const UcxPuller&) = delete;
  int64_t n_endpoints_created() const;
  size_t n_peers() const;

 private:
  friend class PullSession;
  struct Peer {
    void* ep = nullptr;    // ucp_ep_h
    void* rkey = nullptr;  // ucp_rkey_h
    std::vector<uint8_t> rkey_buf;
    std::atomic<int> error{0};  // ucs_status_t from the endpoint's error handler
  };
  UcxPuller() = default;
  void drop_locked(const std::string& addr);
  mutable std::mutex mu_;
  void* worker_ = nullptr;                              // ucp_worker_h
  std::map<std::string, std::unique_ptr<Peer>> peers_;  // by worker address bytes
  int64_t n_created_ = 0;
};

class PullSession {
 public:
  // Connects to the server's control port and asks for `transfer_id`.
  // Errors: kIo (unreachable, timed out, closed), kNotFound (the lease is
  // unknown or ended), kBusy (already pulled), kCorruptFile (bad frames).
  // With `puller`, read() uses its worker and cached endpoint; without, a
  // worker and an endpoint of its own (released by the session).
  static Result<std::unique_ptr<PullSession>> open(UcxContext& ucx, const std::string& host,
                                                   int port, uint64_t transfer_id,
                                                   std::chrono::milliseconds timeout,
                                                   UcxPuller* puller = nullptr);
  ~PullSession();  // releases rkey, endpoint, worker; closes the connection
  PullSession(const PullSession&) = delete;
  PullSession& operator=(const PullSession&) = delete;

  const Offer& offer() const { return offer_; }
  // Reads blocks [first, n_blocks) of the offer, block first + i into
  // dst[i] (offer().block_bytes bytes each), with one-sided gets, all
  // within `timeout`. On error nothing in dst may be trusted.
  Status read(std::span<uint8_t* const> dst, std::chrono::milliseconds timeout, size_t first = 0);
  // The same for the offer's records `records` (ascending), record
  // records[i] into dst[i].
  Status read_records(std::span<const size_t> records, std::span<uint8_t* const> dst,
                      std::chrono::milliseconds timeout);
  // Layer-major reads: each block's payload is `ranges` (byte offset,
  // length; ascending, contiguous from 0 to offer().block_bytes), one per
  // model layer. read()/read_records() then read range 0 of every block,
  // wait for it, then range 1, ..., timing each (timings().layer_get_s):
  // what a decode worker pulling layer l as soon as it is ready does.
  // Empty (the default): whole blocks, contiguous runs coalesced.
  // kInvalidArgument unless the ranges tile the block.
  Status set_layer_ranges(std::vector<std::pair<uint64_t, uint64_t>> ranges);
  // Layer-wise streaming (control_channel.h kStream): connects, sends
  // STREAM(`request`) and waits for STREAM_BLOCKS, whose addresses become
  // the offer's (no headers yet); its agent-defined `meta` bytes are
  // stream_meta(). Errors as open().
  static Result<std::unique_ptr<PullSession>> open_stream(UcxContext& ucx, const std::string& host,
                                                          int port,
                                                          const std::vector<uint8_t>& request,
                                                          std::chrono::milliseconds timeout,
                                                          UcxPuller* puller = nullptr);
  const std::vector<uint8_t>& stream_meta() const { return stream_meta_; }
  // Waits for the next LAYER_READY frame: the number of layers computed.
  // kIo when the server went away or `deadline` passed; the server's error.
  Result<uint32_t> wait_layer_ready(std::chrono::steady_clock::time_point deadline);
  // Reads bytes [off, off + len) of each record into dst[i] + off (gets
  // completed before it returns); timed into timings().layer_get_s.
  Status read_range(std::span<const size_t> records, std::span<uint8_t* const> dst, uint64_t off,
                    uint64_t len, std::chrono::milliseconds timeout);
  // Waits for the final OFFER (the published blocks' lease: addresses and
  // record headers) that replaces the streamed offer.
  Status recv_offer(std::chrono::steady_clock::time_point deadline);
  // Tells the server the pull ended (ok: verified); the lease ends.
  Status finish(bool ok);
  const PullTimings& timings() const { return timings_; }

 private:
  using Frame = std::pair<FrameType, std::vector<uint8_t>>;
  PullSession() = default;
  // The opening open() and open_stream() share: a session bound to `ucx`
  // and `puller` that connected to host:port, sent `kind` with `payload`
  // and received the first reply frame (*reply). Errors name `what`
  // ("KV transfer", "KV stream") and the peer.
  static Result<std::unique_ptr<PullSession>> start(UcxContext& ucx, const std::string& host,
                                                    int port, std::chrono::milliseconds timeout,
                                                    UcxPuller* puller, const char* what,
                                                    FrameType kind,
                                                    const std::vector<uint8_t>& payload,
                                                    Frame* reply);
  void close_ucx();
  // Parses an OFFER frame's payload into offer_ (and the worker address
  // and rkey); errors as open(), naming `where`.
  Status parse_offer(const std::vector<uint8_t>& payload, const std::string& where);
  // The gets of read() on a connected endpoint (handles are ucp_*_h).
  Status read_data(void* worker, void* ep, void* rkey, std::atomic<int>* ep_error,
                   std::span<const size_t> records, std::span<uint8_t* const> dst,
                   Clock::time_point deadline);
  Socket conn_;
  Offer offer_;
  std::vector<uint8_t> worker_addr_;
  std::vector<uint8_t> rkey_buf_;
  UcxContext* ucx_ = nullptr;
  UcxPuller* puller_ = nullptr;
  void* worker_ = nullptr;  // ucp_worker_h
  void* ep_ = nullptr;      // ucp_ep_h
  void* rkey_ = nullptr;    // ucp_rkey_h
  std::chrono::milliseconds timeout_{10000};
  std::vector<std::pair<uint64_t, uint64_t>> layer_ranges_;
  std::vector<uint8_t> stream_meta_;
  bool stream_ = false;  // opened by open_stream()
  bool probed_ = false;  // the endpoint's connection was probed (streams: once)
  std::string where_;
  PullTimings timings_;
  bool finished_ = false;

 public:
  std::atomic<int> ep_error_{0};  // ucs_status_t reported by the endpoint's error handler
};

}  // namespace kvstack::transfer

#include "transfer/ucx_transfer.h"

#include "transfer/ucx_api.h"

#include <poll.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace kvstack::transfer {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxGetBytes = 4u << 20;

Error ucx_error(const std::string& what, ucs_status_t st) {
  return make_error(Errc::kIo, what + ": " + ucx_api().ucs_status_string(st));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Waits for a non-blocking UCX request (nullptr = completed inline) by
// progressing `worker` until it completes or `deadline` passes; a request
// still pending then is cancelled and its status is UCS_ERR_TIMED_OUT.
ucs_status_t wait_request(ucp_worker_h worker, ucs_status_ptr_t req, Clock::time_point deadline) {
  if (req == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  ucs_status_t st = UCS_INPROGRESS;
  while ((st = ucx_api().ucp_request_check_status(req)) == UCS_INPROGRESS) {
    if (ucx_api().ucp_worker_progress(worker) == 0 && Clock::now() >= deadline) {
      ucx_api().ucp_request_cancel(worker, req);
      const auto give_up = Clock::now() + std::chrono::seconds(1);
      while (ucx_api().ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < give_up) {
        ucx_api().ucp_worker_progress(worker);
      }
      st = UCS_ERR_TIMED_OUT;
      break;
    }
  }
  ucx_api().ucp_request_free(req);
  return st;
}

// Largest single get (bytes); KVSTACK_TRANSFER_GET_BYTES overrides it for
// measurements (read once).
size_t get_chunk_bytes() {
  static const size_t v = [] {
    const char* e = std::getenv("KVSTACK_TRANSFER_GET_BYTES");
    const long long n = e != nullptr ? std::atoll(e) : 0;
    return n > 0 ? static_cast<size_t>(n) : kMaxGetBytes;
  }();
  return v;
}

bool same_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

}  // namespace

// ---- UcxContext ----

Result<std::unique_ptr<UcxContext>> UcxContext::create() {
  if (auto api = load_ucx(); !api) return api.error();
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucx_api().ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return ucx_error("UCX configuration (UCX_* environment)", st);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  auto out = std::unique_ptr<UcxContext>(new UcxContext());
  ucp_context_h ctx = nullptr;
  st = ucx_api().init(&params, config, &ctx);
  ucx_api().ucp_config_release(config);
  if (st != UCS_OK) return ucx_error("ucp_init", st);
  out->ctx_ = ctx;
  const char* tls = std::getenv("UCX_TLS");
  out->tls_ = tls != nullptr ? tls : "all";
  return out;
}

UcxContext::~UcxContext() {
  if (ctx_ != nullptr) ucx_api().ucp_cleanup(static_cast<ucp_context_h>(ctx_));
}

// ---- TransferServer ----

Result<std::unique_ptr<TransferServer>> TransferServer::create(UcxContext& ucx, LeaseTable& leases,
                                                               void* pool_base, size_t pool_bytes,
                                                               const TransferServerConfig& config) {
  auto s = std::unique_ptr<TransferServer>(new TransferServer(ucx, leases, config));
  auto ctx = static_cast<ucp_context_h>(ucx.handle());
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // the progress thread alone drives it
  ucp_worker_h worker = nullptr;
  ucs_status_t st = ucx_api().ucp_worker_create(ctx, &wp, &worker);
  if (st != UCS_OK) return ucx_error("ucp_worker_create", st);
  s->worker_ = worker;  // destroyed by ~TransferServer from here on
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucx_api().ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) return ucx_error("ucp_worker_get_address", st);
  s->worker_addr_.assign(reinterpret_cast<uint8_t*>(addr),
                         reinterpret_cast<uint8_t*>(addr) + addr_len);
  ucx_api().ucp_worker_release_address(worker, addr);
  st = ucx_api().ucp_worker_get_efd(worker, &s->event_fd_);
  if (st != UCS_OK) return ucx_error("ucp_worker_get_efd", st);

  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = pool_base;
  mp.length = pool_bytes;
  ucp_mem_h memh = nullptr;
  st = ucx_api().ucp_mem_map(ctx, &mp, &memh);
  if (st != UCS_OK) return ucx_error("ucp_mem_map of the KV pool", st);
  s->memh_ = memh;
  void* rkey = nullptr;
  size_t rkey_len = 0;
  st = ucx_api().ucp_rkey_pack(ctx, memh, &rkey, &rkey_len);
  if (st != UCS_OK) return ucx_error("ucp_rkey_pack", st);
  s->rkey_.assign(static_cast<uint8_t*>(rkey), static_cast<uint8_t*>(rkey) + rkey_len);
  ucx_api().ucp_rkey_buffer_release(rkey);

  auto l = Socket::listen(config.host, config.port);
  if (!l) {
    return make_error(l.error().code, "--kv-transfer-port: " + l.error().message);
  }
  s->listener_ = std::move(*l);
  s->port_ = s->listener_.local_port();
  s->progress_ = std::thread([p = s.get()] { p->progress_loop(); });
  s->acceptor_ = std::thread([p = s.get()] { p->accept_loop(); });
  return s;
}

TransferServer::~TransferServer() {
  stop_.store(true);
  if (acceptor_.joinable()) acceptor_.join();
  // Connection threads are detached; each ends within its I/O deadline.
  while (n_conns_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (progress_.joinable()) progress_.join();
  auto ctx = static_cast<ucp_context_h>(ucx_.handle());
  if (memh_ != nullptr) ucx_api().ucp_mem_unmap(ctx, static_cast<ucp_mem_h>(memh_));
  if (worker_ != nullptr) ucx_api().ucp_worker_destroy(static_cast<ucp_worker_h>(worker_));
}

TransferServerStats TransferServer::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void TransferServer::progress_loop() {
  auto w = static_cast<ucp_worker_h>(worker_);
  // UCX's TCP transport serves a get in fragments, each needing this
  // worker's progress: after activity, keep progressing for a short spin
  // before sleeping on the event fd (a sleep per fragment costs a wake-up).
  constexpr auto kSpin = std::chrono::microseconds(2000);
  auto last_active = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    if (ucx_api().ucp_worker_progress(w) != 0) {
      last_active = Clock::now();
      continue;
    }
    if (Clock::now() - last_active < kSpin) continue;
    const ucs_status_t st = ucx_api().ucp_worker_arm(w);
    if (st == UCS_ERR_BUSY) continue;  // more events arrived: progress again
    pollfd p{event_fd_, POLLIN, 0};
    if (::poll(&p, 1, 20) > 0) last_active = Clock::now();  // 20 ms bounds the stop latency
  }
}

void TransferServer::accept_loop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    auto c = listener_.accept(std::chrono::milliseconds(50));
    if (!c || !c->valid()) continue;
    n_conns_.fetch_add(1);
    std::thread([this, s = std::move(*c)]() mutable {
      serve(std::move(s));
      n_conns_.fetch_sub(1);
    }).detach();
  }
}

void TransferServer::send_refusal(Socket& conn, Errc code, const std::string& message,
                                  Clock::time_point deadline) {
  Writer w;
  w.put(static_cast<int32_t>(static_cast<int>(code) + 1));
  w.put(static_cast<uint32_t>(message.size()));
  w.bytes(message.data(), message.size());
  (void)conn.send_frame(FrameType::kOffer, w.buf, deadline);
}

void TransferServer::serve(Socket conn) {
  const auto deadline = Clock::now() + config_.io_timeout;
  auto req = conn.recv_frame(deadline);
  if (req && req->first == FrameType::kStream) {
    if (stream_handler_) {
      stream_handler_(conn, req->second);
    } else {
      send_refusal(conn, Errc::kUnsupported, "this worker does not stream prefills", deadline);
    }
    return;
  }
  auto fail = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_failed++;
  };
  if (!req || req->first != FrameType::kPull) return fail();
  Reader r(req->second);
  uint64_t id = 0;
  if (!r.get(&id) || !r.done()) return fail();
  answer_pull(conn, id);
}

void TransferServer::answer_pull(Socket& conn, uint64_t id) {
  const auto deadline = Clock::now() + config_.io_timeout;
  auto fail = [&](bool counted) {
    if (counted) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.n_pulls_failed++;
    }
  };
  auto view = leases_.begin_pull(id);
  Writer w;
  if (!view) {
    send_refusal(conn, view.error().code, view.error().message, deadline);
    return fail(true);
  }
  const LeaseView& v = *view;
  w.put(static_cast<int32_t>(0));
  w.put(v.id);
  w.put(static_cast<int64_t>(v.addrs.size()));
  w.put(v.header_bytes);
  w.put(v.block_bytes);
  w.put(v.n_tokens);
  w.put(static_cast<uint32_t>(worker_addr_.size()));
  w.bytes(worker_addr_.data(), worker_addr_.size());
  w.put(static_cast<uint32_t>(rkey_.size()));
  w.bytes(rkey_.data(), rkey_.size());
  for (uint64_t a : v.addrs) w.put(a);
  w.bytes(v.headers.data(), v.headers.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls++;
  }
  if (!conn.send_frame(FrameType::kOffer, w.buf, deadline).ok()) {
    leases_.end(id, LeaseEnd::kCancelled);
    return fail(true);
  }
  // Wait for DONE while the puller reads; give up when the lease ends
  // (expired) or the puller goes away or stays silent past the deadline.
  while (true) {
    if (stop_.load(std::memory_order_relaxed)) {
      leases_.end(id, LeaseEnd::kCancelled);
      return fail(true);
    }
    if (!leases_.is_open(id)) return fail(true);  // expired: dropping the connection fails the pull
    pollfd p{conn.fd(), POLLIN, 0};
    if (::poll(&p, 1, 20) > 0) break;
    if (Clock::now() >= deadline) {
      leases_.end(id, LeaseEnd::kCancelled);
      return fail(true);
    }
  }
  auto done = conn.recv_frame(deadline);
  uint8_t ok = 0;
  if (done && done->first == FrameType::kDone) {
    Reader d(done->second);
    if (!d.get(&ok)) ok = 0;
  }
  if (ok == 1 && leases_.end(id, LeaseEnd::kCompleted)) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_ok++;
    stats_.n_bytes_offered += v.block_bytes * static_cast<int64_t>(v.addrs.size());
    return;
  }
  leases_.end(id, LeaseEnd::kCancelled);
  fail(true);
}

// ---- UcxPuller ----

Result<std::unique_ptr<UcxPuller>> UcxPuller::create(UcxContext& ucx) {
  auto p = std::unique_ptr<UcxPuller>(new UcxPuller());
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // one pull at a time (mu_)
  ucp_worker_h worker = nullptr;
  const ucs_status_t st =
      ucx_api().ucp_worker_create(static_cast<ucp_context_h>(ucx.handle()), &wp, &worker);
  if (st != UCS_OK) return ucx_error("KV transfer: ucp_worker_create", st);
  p->worker_ = worker;
  return p;
}

void UcxPuller::drop_locked(const std::string& addr) {
  auto it = peers_.find(addr);
  if (it == peers_.end()) return;
  auto worker = static_cast<ucp_worker_h>(worker_);
  Peer& peer = *it->second;
  if (peer.rkey != nullptr) ucx_api().ucp_rkey_destroy(static_cast<ucp_rkey_h>(peer.rkey));
  if (peer.ep != nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    (void)wait_request(worker, ucx_api().ucp_ep_close_nbx(static_cast<ucp_ep_h>(peer.ep), &p),
                       Clock::now() + std::chrono::milliseconds(1000));
  }
  peers_.erase(it);
}

UcxPuller::~UcxPuller() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!peers_.empty()) {
    const std::string addr = peers_.begin()->first;
    drop_locked(addr);
  }
  if (worker_ != nullptr) ucx_api().ucp_worker_destroy(static_cast<ucp_worker_h>(worker_));
}

int64_t UcxPuller::n_endpoints_created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return n_created_;
}

size_t UcxPuller::n_peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peers_.size();
}

// ---- PullSession ----

Result<std::unique_ptr<PullSession>> PullSession::start(UcxContext& ucx, const std::string& host,
                                                        int port, std::chrono::milliseconds timeout,
                                                        UcxPuller* puller, const char* what,
                                                        FrameType kind,
                                                        const std::vector<uint8_t>& payload,
                                                        Frame* reply) {
  const auto deadline = Clock::now() + timeout;
  auto s = std::unique_ptr<PullSession>(new PullSession());
  s->ucx_ = &ucx;
  s->puller_ = puller;
  s->timeout_ = timeout;
  s->where_ = host + ":" + std::to_string(port);
  const std::string prefix = std::string(what) + " from " + s->where_ + ": ";
  auto c = Socket::connect(host, port, timeout);
  if (!c) return make_error(c.error().code, prefix + c.error().message);
  s->conn_ = std::move(*c);
  if (auto st = s->conn_.send_frame(kind, payload, deadline); !st.ok()) {
    return make_error(Errc::kIo, prefix + st.error().message);
  }
  auto f = s->conn_.recv_frame(deadline);
  if (!f) return make_error(f.error().code, prefix + f.error().message);
  *reply = std::move(*f);
  return s;
}

Result<std::unique_ptr<PullSession>> PullSession::open(UcxContext& ucx, const std::string& host,
                                                       int port, uint64_t transfer_id,
                                                       std::chrono::milliseconds timeout,
                                                       UcxPuller* puller) {
  const auto t0 = Clock::now();
  Writer w;
  w.put(transfer_id);
  Frame f;
  auto started =
      start(ucx, host, port, timeout, puller, "KV transfer", FrameType::kPull, w.buf, &f);
  if (!started) return started.error();
  std::unique_ptr<PullSession> s = std::move(*started);
  if (f.first != FrameType::kOffer) {
    return make_error(Errc::kCorruptFile, "KV transfer from " + s->where_ + ": unexpected frame");
  }
  KV_TRY_STATUS(s->parse_offer(f.second, s->where_));
  s->timings_.connect_s = seconds_since(t0);
  return s;
}

Status PullSession::parse_offer(const std::vector<uint8_t>& payload, const std::string& where) {
  Reader r(payload);
  int32_t status = -1;
  auto bad = [&] {
    return make_error(Errc::kCorruptFile, "KV transfer from " + where + ": malformed offer");
  };
  if (!r.get(&status)) return Status(bad());
  if (status != 0) {
    uint32_t n = 0;
    std::vector<uint8_t> msg;
    if (!r.get(&n) || !r.bytes(n, &msg)) return Status(bad());
    const Errc code = status - 1 >= 0 && status - 1 <= static_cast<int>(Errc::kInternal)
                          ? static_cast<Errc>(status - 1)
                          : Errc::kInternal;
    return Status(
        make_error(code, "KV transfer from " + where + ": " + std::string(msg.begin(), msg.end())));
  }
  Offer& o = offer_;
  uint32_t n_addr = 0;
  uint32_t n_rkey = 0;
  if (!r.get(&o.transfer_id) || !r.get(&o.n_blocks) || !r.get(&o.header_bytes) ||
      !r.get(&o.block_bytes) || !r.get(&o.n_tokens) || !r.get(&n_addr) ||
      !r.bytes(n_addr, &worker_addr_) || !r.get(&n_rkey) || !r.bytes(n_rkey, &rkey_buf_)) {
    return Status(bad());
  }
  if (o.n_blocks < 0 || o.n_blocks > (1 << 24) || o.header_bytes <= 0 || o.block_bytes <= 0) {
    return Status(bad());
  }
  o.addrs.resize(static_cast<size_t>(o.n_blocks));
  for (uint64_t& a : o.addrs) {
    if (!r.get(&a)) return Status(bad());
  }
  if (!r.bytes(static_cast<size_t>(o.n_blocks * o.header_bytes), &o.headers) || !r.done()) {
    return Status(bad());
  }
  return {};
}

Result<std::unique_ptr<PullSession>> PullSession::open_stream(UcxContext& ucx,
                                                              const std::string& host, int port,
                                                              const std::vector<uint8_t>& request,
                                                              std::chrono::milliseconds timeout,
                                                              UcxPuller* puller) {
  const auto t0 = Clock::now();
  Frame frame;
  auto started =
      start(ucx, host, port, timeout, puller, "KV stream", FrameType::kStream, request, &frame);
  if (!started) return started.error();
  std::unique_ptr<PullSession> s = std::move(*started);
  s->stream_ = true;
  const std::string& where = s->where_;
  if (frame.first == FrameType::kOffer) {  // a refusal (a lease is never offered first)
    KV_TRY_STATUS(s->parse_offer(frame.second, where));
    return make_error(Errc::kCorruptFile, "KV stream from " + where + ": offer before the blocks");
  }
  auto bad = [&] {
    return make_error(Errc::kCorruptFile, "KV stream from " + where + ": malformed stream blocks");
  };
  if (frame.first != FrameType::kStreamBlocks) return bad();
  Reader r(frame.second);
  Offer& o = s->offer_;
  uint32_t n_addr = 0;
  uint32_t n_rkey = 0;
  uint32_t n_meta = 0;
  if (!r.get(&n_addr) || !r.bytes(n_addr, &s->worker_addr_) || !r.get(&n_rkey) ||
      !r.bytes(n_rkey, &s->rkey_buf_) || !r.get(&o.n_blocks) || !r.get(&o.block_bytes) ||
      !r.get(&o.n_tokens) || !r.get(&n_meta) || !r.bytes(n_meta, &s->stream_meta_)) {
    return bad();
  }
  if (o.n_blocks <= 0 || o.n_blocks > (1 << 24) || o.block_bytes <= 0) return bad();
  o.addrs.resize(static_cast<size_t>(o.n_blocks));
  for (uint64_t& a : o.addrs) {
    if (!r.get(&a)) return bad();
  }
  if (!r.done()) return bad();
  s->timings_.connect_s = seconds_since(t0);
  return s;
}

Result<uint32_t> PullSession::wait_layer_ready(Clock::time_point deadline) {
  auto f = conn_.recv_frame(deadline);
  if (!f) return make_error(f.error().code, "KV stream from " + where_ + ": " + f.error().message);
  if (f->first == FrameType::kOffer) {
    KV_TRY_STATUS(parse_offer(f->second, where_));
    return make_error(Errc::kCorruptFile, "KV stream from " + where_ + ": offer before the layers");
  }
  Reader r(f->second);
  uint32_t n = 0;
  if (f->first != FrameType::kLayerReady || !r.get(&n) || !r.done()) {
    return make_error(Errc::kCorruptFile, "KV stream from " + where_ + ": malformed layer frame");
  }
  return n;
}

Status PullSession::read_range(std::span<const size_t> records, std::span<uint8_t* const> dst,
                               uint64_t off, uint64_t len, std::chrono::milliseconds timeout) {
  if (off + len > static_cast<uint64_t>(offer_.block_bytes) || len == 0) {
    return make_error(Errc::kInternal, "PullSession::read_range: range outside the block");
  }
  layer_ranges_ = {{off, len}};
  Status st = read_records(records, dst, timeout);
  layer_ranges_.clear();
  return st;
}

Status PullSession::recv_offer(Clock::time_point deadline) {
  auto f = conn_.recv_frame(deadline);
  if (!f) return make_error(f.error().code, "KV stream from " + where_ + ": " + f.error().message);
  if (f->first != FrameType::kOffer) {
    return make_error(Errc::kCorruptFile, "KV stream from " + where_ + ": expected the offer");
  }
  return parse_offer(f->second, where_);
}

namespace {
void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  static_cast<std::atomic<int>*>(arg)->store(static_cast<int>(status));
}
}  // namespace

Status PullSession::read(std::span<uint8_t* const> dst, std::chrono::milliseconds timeout,
                         size_t first) {
  if (first > static_cast<size_t>(offer_.n_blocks) ||
      static_cast<int64_t>(dst.size()) != offer_.n_blocks - static_cast<int64_t>(first)) {
    return make_error(Errc::kInternal,
                      "PullSession::read: destination count differs from the offer");
  }
  std::vector<size_t> records(dst.size());
  for (size_t i = 0; i < records.size(); ++i) records[i] = first + i;
  return read_records(records, dst, timeout);
}

Status PullSession::read_records(std::span<const size_t> records, std::span<uint8_t* const> dst,
                                 std::chrono::milliseconds timeout) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + timeout;
  if (records.size() != dst.size()) {
    return make_error(Errc::kInternal, "PullSession::read_records: one destination per record");
  }
  for (size_t i = 0; i < records.size(); ++i) {
    if (records[i] >= static_cast<size_t>(offer_.n_blocks) ||
        (i > 0 && records[i] <= records[i - 1])) {
      return make_error(Errc::kInternal,
                        "PullSession::read_records: records out of range or order");
    }
  }
  ucp_worker_h worker = nullptr;
  ucp_ep_h e = nullptr;
  ucp_rkey_h rkey = nullptr;
  std::atomic<int>* ep_error = &ep_error_;
  std::unique_lock<std::mutex> lock;
  const std::string peer_key(worker_addr_.begin(), worker_addr_.end());
  if (puller_ != nullptr) {
    lock = std::unique_lock<std::mutex>(puller_->mu_);
    worker = static_cast<ucp_worker_h>(puller_->worker_);
    auto it = puller_->peers_.find(peer_key);
    if (it != puller_->peers_.end() &&
        (it->second->error.load() != 0 || !same_bytes(it->second->rkey_buf, rkey_buf_))) {
      puller_->drop_locked(peer_key);  // its peer failed, or it restarted its pool
      it = puller_->peers_.end();
    }
    if (it == puller_->peers_.end()) {
      if (puller_->peers_.size() >= UcxPuller::kMaxPeers) {
        const std::string oldest = puller_->peers_.begin()->first;
        puller_->drop_locked(oldest);
      }
      auto peer = std::make_unique<UcxPuller::Peer>();
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(worker_addr_.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = on_ep_error;
      ep.err_handler.arg = &peer->error;
      ucp_ep_h pe = nullptr;
      ucs_status_t st = ucx_api().ucp_ep_create(worker, &ep, &pe);
      if (st != UCS_OK) return ucx_error("KV transfer: ucp_ep_create", st);
      peer->ep = pe;
      peer->rkey_buf = rkey_buf_;
      it = puller_->peers_.emplace(peer_key, std::move(peer)).first;
      puller_->n_created_++;
      ucp_rkey_h rk = nullptr;
      st = ucx_api().ucp_ep_rkey_unpack(pe, rkey_buf_.data(), &rk);
      if (st != UCS_OK) {
        puller_->drop_locked(peer_key);
        return ucx_error("KV transfer: ucp_ep_rkey_unpack", st);
      }
      it->second->rkey = rk;
    }
    e = static_cast<ucp_ep_h>(it->second->ep);
    rkey = static_cast<ucp_rkey_h>(it->second->rkey);
    ep_error = &it->second->error;
  } else {
    auto ctx = static_cast<ucp_context_h>(ucx_->handle());
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucs_status_t st = ucx_api().ucp_worker_create(ctx, &wp, &worker);
    if (st != UCS_OK) {
      // Seen once at start-up (UCS_ERR_NO_DEVICE from the TCP transport's
      // interface scan, not reproduced since): one more try before failing.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      st = ucx_api().ucp_worker_create(ctx, &wp, &worker);
    }
    if (st != UCS_OK) return ucx_error("KV transfer: ucp_worker_create", st);
    worker_ = worker;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(worker_addr_.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = on_ep_error;
    ep.err_handler.arg = &ep_error_;
    st = ucx_api().ucp_ep_create(worker, &ep, &e);
    if (st != UCS_OK) return ucx_error("KV transfer: ucp_ep_create", st);
    ep_ = e;
    st = ucx_api().ucp_ep_rkey_unpack(e, rkey_buf_.data(), &rkey);
    if (st != UCS_OK) return ucx_error("KV transfer: ucp_ep_rkey_unpack", st);
    rkey_ = rkey;
  }
  Status data = read_data(worker, e, rkey, ep_error, records, dst, deadline);
  if (!data.ok() && puller_ != nullptr) puller_->drop_locked(peer_key);
  if (data.ok()) timings_.read_s = seconds_since(t0);
  return data;
}

Status PullSession::read_data(void* worker_h, void* ep_h, void* rkey_h, std::atomic<int>* ep_error,
                              std::span<const size_t> records, std::span<uint8_t* const> dst,
                              Clock::time_point deadline) {
  auto worker = static_cast<ucp_worker_h>(worker_h);
  auto e = static_cast<ucp_ep_h>(ep_h);
  auto rkey = static_cast<ucp_rkey_h>(rkey_h);
  // Endpoints connect lazily (TCP: at the first operation): a one-byte get
  // and a flush first, so that the timed gets below measure the data path
  // and the connection set-up is reported apart (wireup_s).
  if (!dst.empty() && !probed_) {
    const auto t_w = Clock::now();
    uint8_t probe = 0;
    ucp_request_param_t p{};
    ucs_status_t ws = wait_request(
        worker, ucx_api().ucp_get_nbx(e, &probe, 1, offer_.addrs[records[0]], rkey, &p), deadline);
    if (ws == UCS_OK) ws = wait_request(worker, ucx_api().ucp_ep_flush_nbx(e, &p), deadline);
    if (ws != UCS_OK) return ucx_error("KV transfer: connecting to the prefill worker", ws);
    timings_.wireup_s = seconds_since(t_w);
    probed_ = stream_;  // a stream's later reads (one per layer) need no probe
  }
  const auto t_get = Clock::now();
  std::vector<ucs_status_ptr_t> reqs;
  const auto bb = static_cast<uint64_t>(offer_.block_bytes);
  int64_t n_bytes = 0;
  // Layer-major: range r of every block, all its gets completed, then r + 1.
  for (const auto& [off, len] : layer_ranges_) {
    const auto t_l = Clock::now();
    for (size_t b = 0; b < dst.size(); ++b) {
      ucp_request_param_t p{};
      ucs_status_ptr_t r =
          ucx_api().ucp_get_nbx(e, dst[b] + off, len, offer_.addrs[records[b]] + off, rkey, &p);
      if (UCS_PTR_IS_ERR(r)) {
        for (ucs_status_ptr_t q : reqs) (void)wait_request(worker, q, deadline);
        return ucx_error("KV transfer: ucp_get_nbx", UCS_PTR_STATUS(r));
      }
      if (r != nullptr) reqs.push_back(r);
      timings_.n_gets++;
      n_bytes += static_cast<int64_t>(len);
    }
    ucs_status_t err = UCS_OK;
    for (ucs_status_ptr_t q : reqs) {
      const ucs_status_t st = wait_request(worker, q, deadline);
      if (st != UCS_OK && err == UCS_OK) err = st;
    }
    reqs.clear();
    if (err == UCS_OK && ep_error->load() != 0) err = static_cast<ucs_status_t>(ep_error->load());
    if (err != UCS_OK) {
      return ucx_error("KV transfer: reading layer range " +
                           std::to_string(timings_.layer_get_s.size()) + " of " +
                           std::to_string(dst.size()) + " blocks",
                       err);
    }
    timings_.layer_get_s.push_back(seconds_since(t_l));
  }
  // Whole blocks: one get per run of blocks contiguous on both sides.
  size_t i = layer_ranges_.empty() ? 0 : dst.size();
  while (i < dst.size()) {
    size_t j = i + 1;
    while (j < dst.size() && records[j] == records[j - 1] + 1 &&
           offer_.addrs[records[j]] == offer_.addrs[records[j - 1]] + bb &&
           dst[j] == dst[j - 1] + bb) {
      ++j;
    }
    // Each run is cut into gets of at most kMaxGetBytes, all issued before
    // any is waited for (UCX pipelines them).
    const size_t len = (j - i) * bb;
    const size_t max_get = get_chunk_bytes();
    for (size_t off = 0; off < len; off += max_get) {
      ucp_request_param_t p{};
      const size_t n = std::min(max_get, len - off);
      ucs_status_ptr_t r =
          ucx_api().ucp_get_nbx(e, dst[i] + off, n, offer_.addrs[records[i]] + off, rkey, &p);
      if (UCS_PTR_IS_ERR(r)) {
        for (ucs_status_ptr_t q : reqs) (void)wait_request(worker, q, deadline);
        return ucx_error("KV transfer: ucp_get_nbx", UCS_PTR_STATUS(r));
      }
      if (r != nullptr) reqs.push_back(r);
      timings_.n_gets++;
    }
    n_bytes += static_cast<int64_t>(len);
    i = j;
  }
  // Completion of every get, then a flush so the data is in place.
  ucs_status_t first_err = UCS_OK;
  for (ucs_status_ptr_t q : reqs) {
    const ucs_status_t s = wait_request(worker, q, deadline);
    if (s != UCS_OK && first_err == UCS_OK) first_err = s;
  }
  // (Layer-major reads waited for every get already: a completed get's
  // bytes are in place, so no flush round trip per layer.)
  if (first_err == UCS_OK && layer_ranges_.empty()) {
    ucp_request_param_t p{};
    first_err = wait_request(worker, ucx_api().ucp_ep_flush_nbx(e, &p), deadline);
  }
  if (first_err == UCS_OK && ep_error->load() != 0) {
    first_err = static_cast<ucs_status_t>(ep_error->load());
  }
  if (first_err != UCS_OK) {
    return ucx_error("KV transfer: reading " + std::to_string(dst.size()) + " blocks", first_err);
  }
  timings_.get_s = seconds_since(t_get);
  timings_.n_bytes = n_bytes;
  return {};
}

Status PullSession::set_layer_ranges(std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  uint64_t at = 0;
  bool tiles = true;
  for (const auto& [off, len] : ranges) {
    tiles = tiles && off == at && len > 0;
    at = off + len;
  }
  if (!ranges.empty() && (!tiles || at != static_cast<uint64_t>(offer_.block_bytes))) {
    return make_error(Errc::kInvalidArgument, "KV transfer: layer ranges do not tile the offer's " +
                                                  std::to_string(offer_.block_bytes) +
                                                  "-byte blocks");
  }
  layer_ranges_ = std::move(ranges);
  return {};
}

Status PullSession::finish(bool ok) {
  finished_ = true;
  close_ucx();
  Writer w;
  w.put(static_cast<uint8_t>(ok ? 1 : 0));
  return conn_.send_frame(FrameType::kDone, w.buf, Clock::now() + timeout_);
}

void PullSession::close_ucx() {
  auto worker = static_cast<ucp_worker_h>(worker_);
  if (rkey_ != nullptr) ucx_api().ucp_rkey_destroy(static_cast<ucp_rkey_h>(rkey_));
  rkey_ = nullptr;
  if (ep_ != nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    (void)wait_request(worker, ucx_api().ucp_ep_close_nbx(static_cast<ucp_ep_h>(ep_), &p),
                       Clock::now() + std::chrono::milliseconds(1000));
    ep_ = nullptr;
  }
  if (worker != nullptr) ucx_api().ucp_worker_destroy(worker);
  worker_ = nullptr;
}

PullSession::~PullSession() {
  close_ucx();
}

}  // namespace kvstack::transfer

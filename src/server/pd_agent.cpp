#include "server/pd_agent.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>

#include "kv/prefix_index.h"
#include "server/pd_stream.h"

namespace kvstack::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const char* pd_role_name(PdRole r) {
  switch (r) {
    case PdRole::kPrefill:
      return "prefill";
    case PdRole::kDecode:
      return "decode";
    case PdRole::kBoth:
      return "both";
  }
  return "?";
}

Result<PdRole> parse_pd_role(const std::string& s) {
  if (s == "both") return PdRole::kBoth;
  if (s == "prefill") return PdRole::kPrefill;
  if (s == "decode") return PdRole::kDecode;
  return make_error(Errc::kInvalidArgument,
                    "--role: '" + s + "' is not a role (prefill, decode or both)");
}

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Hash128::hex() back to a value (32 hex digits, hi then lo).
bool parse_hash(const std::string& s, Hash128* out) {
  if (s.size() != 32) return false;
  auto half = [](const std::string& h, uint64_t* v) {
    *v = 0;
    for (char c : h) {
      int d = 0;
      if (c >= '0' && c <= '9') {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10;
      } else {
        return false;
      }
      *v = (*v << 4) | static_cast<uint64_t>(d);
    }
    return true;
  };
  return half(s.substr(0, 16), &out->hi) && half(s.substr(16), &out->lo);
}

}  // namespace

PrefixReservation reserve_prefix(Engine& e, const std::string& cache_salt,
                                 const std::vector<int32_t>& prompt, size_t n, int64_t P) {
  PrefixIndex* idx = e.kv().index();
  const NamespaceId ns = e.kv().namespace_for(cache_salt);
  PrefixReservation r{e.kv().new_sequence(ns), 0, {}, ns};
  const size_t local = n > 0 ? idx->chain(ns, prompt, static_cast<int64_t>(n) * P).size() : 0;
  if (local > 0) {
    // Not a client's query: the request's own lookup counts the hit.
    const int64_t a = r.seq.adopt_cached_prefix(
        std::span<const int32_t>(prompt.data(), local * static_cast<size_t>(P) + 1),
        /*count_stats=*/false);
    if (a % P != 0) {
      r.seq.release();
    } else {
      r.adopted = static_cast<size_t>(a / P);
    }
  }
  if (r.adopted < n) r.reserved = r.seq.table().reserve(static_cast<int64_t>(n - r.adopted) * P);
  return r;
}

std::vector<Hash128> expected_block_hashes(const PrefixIndex& idx, NamespaceId ns,
                                           const std::vector<int32_t>& prompt, size_t n,
                                           int64_t P) {
  std::vector<Hash128> expect(n);
  Hash128 parent;
  const auto p = static_cast<size_t>(P);
  for (size_t i = 0; i < n; ++i) {
    expect[i] = idx.chain_hash(parent, ns, std::span<const int32_t>(prompt).subspan(i * p, p));
    parent = expect[i];
  }
  return expect;
}

PulledPrefix::~PulledPrefix() {
  if (!seq_) return;
  // The engine thread owns the pool; once it has returned, nobody else
  // touches the pool and the release can run here.
  if (!s_->inspect([this](Engine&) { seq_.reset(); }).ok()) seq_.reset();
}

Status PulledPrefix::commit(const std::vector<int32_t>& prompt, size_t k, size_t n,
                            const std::vector<size_t>& group_first) {
  BlockTable& t = seq_->table();
  const auto P = static_cast<size_t>(t.pool().block_size());
  if (seq_->length() != static_cast<int64_t>(k * P)) {
    return make_error(Errc::kInternal, "PulledPrefix::commit: adopted length differs");
  }
  t.commit_final(static_cast<int64_t>((n - k) * P));  // KIVI: no residual pass
  // Window groups: the blocks before group_first were reserved but not
  // transferred (no query at n P sees them); drop them before publishing,
  // so that only transferred blocks become checkpoints.
  (void)t.drop_invisible();
  for (int g = 1; g < t.n_groups(); ++g) {
    const auto ids = t.group(g).ids();
    for (size_t i = k; i < group_first[static_cast<size_t>(g)] && i < ids.size(); ++i) {
      if (ids[i] != kNullBlock) {
        seq_->release();  // nothing was published
        return make_error(Errc::kInternal, "KV transfer: group " + std::to_string(g) +
                                               " still holds block " + std::to_string(i) +
                                               ", which was not transferred");
      }
    }
  }
  seq_->on_committed(std::span<const int32_t>(prompt).subspan(k * P, (n - k) * P));
  return {};
}

// Per-layer prefill timing. `t` is written by the engine thread only (the
// hook); the sums are read under `mu` by stats().
struct PdAgent::LayerTimer {
  std::vector<Clock::time_point> t;  // [L + 1]: step start, then each layer's end
  std::mutex mu;
  std::vector<double> sum;  // [L] seconds
  int64_t n_steps = 0;
  void on_layer(int n_done, int64_t n_tok) {
    if (n_tok < 2) return;  // a decode step: not prefill
    const auto i = static_cast<size_t>(n_done);
    if (i >= t.size()) return;
    t[i] = Clock::now();
    if (i + 1 != t.size()) return;
    std::lock_guard<std::mutex> lock(mu);
    for (size_t l = 0; l + 1 < t.size(); ++l) {
      sum[l] += std::chrono::duration<double>(t[l + 1] - t[l]).count();
    }
    n_steps++;
  }
};

Result<std::unique_ptr<PdAgent>> PdAgent::create(Engine& engine, const PdConfig& config) {
  if (config.role == PdRole::kBoth) {
    return make_error(Errc::kInternal, "PdAgent::create: role both needs no agent");
  }
  const char* flag = config.role == PdRole::kPrefill ? "--role prefill" : "--role decode";
  BlockPool& pool = engine.pool();
  if (engine.kv().index() == nullptr) {
    return make_error(Errc::kInvalidArgument,
                      std::string(flag) +
                          " needs the prefix cache (the transferred prefix is "
                          "published there): drop --no-prefix-cache");
  }
  auto a = std::unique_ptr<PdAgent>(new PdAgent(engine, config));
  a->record_id_ =
      block_record_identity(engine.kv().identity(), pool.block_size(), pool.block_bytes());
  std::random_device rd;
  char id[32];
  std::snprintf(id, sizeof(id), "%08x%08x", rd(), rd());
  a->engine_id_ = id;
  a->stats_.role = config.role;
  auto ucx = transfer::UcxContext::create();
  if (!ucx) return make_error(ucx.error().code, std::string(flag) + ": " + ucx.error().message);
  a->ucx_ = std::move(*ucx);
  a->stats_.transports = a->ucx_->transports();
  if (config.role == PdRole::kDecode) {
    if (config.max_pulls < 1) {
      return make_error(Errc::kInvalidArgument, "--kv-max-pulls: at least 1");
    }
    for (int i = 0; i < config.max_pulls; ++i) {
      auto puller = transfer::UcxPuller::create(*a->ucx_);
      if (!puller)
        return make_error(puller.error().code, std::string(flag) + ": " + puller.error().message);
      a->free_pullers_.push_back(puller->get());
      a->pullers_.push_back(std::move(*puller));
    }
    // Pulled blocks land in pool pages the decode worker has never written:
    // fault the whole (still free, contents meaningless) pool in now, not
    // page by page inside the transfer (measured in docs/benchmarks.md).
    std::memset(pool.block_data(BlockId{0}), 0,
                static_cast<size_t>(pool.n_blocks() * pool.block_bytes()));
  }
  if (config.role == PdRole::kPrefill) {
    if (config.transfer_host.empty() || config.transfer_host == "0.0.0.0") {
      return make_error(Errc::kInvalidArgument,
                        "--kv-transfer-host: the address decode workers reach this worker at "
                        "(numeric IPv4, not 0.0.0.0)");
    }
    transfer::TransferServerConfig tc;
    tc.host = config.transfer_host;
    tc.port = config.transfer_port;
    tc.io_timeout = config.transfer_timeout;
    auto srv = transfer::TransferServer::create(
        *a->ucx_, a->leases_, pool.block_data(BlockId{0}),
        static_cast<size_t>(pool.n_blocks() * pool.block_bytes()), tc);
    if (!srv) return srv.error();
    a->server_ = std::move(*srv);
    // Per-layer t_p (spec section 3): the forward reports each layer done.
    auto timer = std::make_shared<LayerTimer>();
    const auto n_layers = static_cast<size_t>(pool.layout().n_layers());
    timer->t.resize(n_layers + 1);
    timer->sum.assign(n_layers, 0.0);
    a->layer_timer_ = timer;
    a->watches_ = std::make_shared<StreamWatches>();
    a->server_->set_stream_handler(
        [p = a.get()](transfer::Socket& conn, const std::vector<uint8_t>& payload) {
          p->serve_stream(conn, payload);
        });
    engine.forward().set_layer_hook(
        [timer, w = a->watches_](int n_done, std::span<const StepSeq> batch) {
          int64_t n_tok = 0;
          for (const StepSeq& e : batch) n_tok += static_cast<int64_t>(e.tokens.size());
          timer->on_layer(n_done, n_tok);
          watches_on_layer(*w, n_done, batch);
        });
  }
  return a;
}

PdAgent::~PdAgent() {
  stop();
}

void PdAgent::release(std::vector<transfer::Lease> ended) {
  // Deepest block first, as a prefix match releases its chain.
  for (transfer::Lease& l : ended) {
    while (!l.refs.empty()) l.refs.pop_back();
  }
}

void PdAgent::start(Scheduler& s) {
  sched_ = &s;
  if (config_.role == PdRole::kPrefill) reaper_ = std::thread([this] { reap_loop(); });
}

void PdAgent::reap_loop() {
  while (!stop_.load()) {
    (void)leases_.expire();
    if (leases_.stats().n_pending_release > 0) {
      if (!sched_->inspect([this](Engine&) { release(leases_.drain_ended()); }).ok()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void PdAgent::stop() {
  if (stop_.exchange(true)) return;
  if (reaper_.joinable()) reaper_.join();
  leases_.end_all();
  server_.reset();  // no puller reads the pool past here
  {
    // Closes the decode side's endpoints once no pull holds a lane (each
    // ends within its transfer timeout).
    std::unique_lock<std::mutex> lock(mu_);
    lane_cv_.wait(lock, [this] { return free_pullers_.size() == pullers_.size(); });
    free_pullers_.clear();
  }
  pullers_.clear();
  if (sched_ == nullptr ||
      !sched_->inspect([this](Engine&) { release(leases_.drain_ended()); }).ok()) {
    release(leases_.drain_ended());  // the engine thread has returned
  }
}

std::unique_ptr<PdAgent::Lane> PdAgent::acquire_lane(Clock::time_point deadline) {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (!lane_cv_.wait_until(lock, deadline, [this] { return !free_pullers_.empty(); })) {
    stats_.pull_wait_seconds += seconds_since(t0);
    return nullptr;
  }
  transfer::UcxPuller* p = free_pullers_.back();
  free_pullers_.pop_back();
  stats_.pull_wait_seconds += seconds_since(t0);
  stats_.pulls_in_flight++;
  stats_.pulls_in_flight_max = std::max(stats_.pulls_in_flight_max, stats_.pulls_in_flight);
  lock.unlock();
  return std::make_unique<Lane>(*this, p);
}

Result<json> PdAgent::offer(Scheduler& s, const std::vector<int32_t>& prompt,
                            const std::string& cache_salt) {
  if (config_.role != PdRole::kPrefill || !server_) {
    return make_error(Errc::kInvalidArgument, "do_remote_decode needs --role prefill");
  }
  transfer::Lease lease;
  std::vector<std::string> hashes;
  std::vector<int> groups;
  const Status ran = s.inspect([&](Engine& e) {
    PrefixIndex* idx = e.kv().index();
    BlockPool& pool = e.pool();
    const int64_t P = pool.block_size();
    const int64_t max_tokens = (static_cast<int64_t>(prompt.size()) - 1) / P * P;
    if (max_tokens <= 0) return;
    const NamespaceId ns = e.kv().namespace_for(cache_salt);
    // The longest prefix every KV group can serve (hybrid models: window
    // groups' checkpoints too); records in transfer order: the n nodes, then
    // per group g >= 1 its blocks [group_first, n) (transfer_layout()).
    PrefixMatch m = idx->match(ns, prompt, max_tokens, /*find_partial=*/false, {},
                               /*count_stats=*/false);
    lease.header_bytes = block_record_header_bytes(static_cast<int32_t>(P));
    lease.block_bytes = pool.block_bytes();
    auto add = [&](BlockRef ref, int g) {
      const int32_t b = ref.id().value;
      uint8_t* data = pool.block_data(BlockId{b});
      const CachedBlockInfo info = idx->cached_block_info(b);
      const size_t at = lease.headers.size();
      lease.headers.resize(at + static_cast<size_t>(lease.header_bytes));
      write_block_record_header(
          record_id_, {info.ns_digest, info.hash, info.parent_hash, g}, info.tokens,
          std::span<const uint8_t>(data, static_cast<size_t>(lease.block_bytes)),
          lease.headers.data() + at);
      lease.refs.push_back(std::move(ref));
      lease.block_ids.push_back(b);
      lease.addrs.push_back(reinterpret_cast<uint64_t>(data));
      groups.push_back(g);
      if (g == 0) hashes.push_back(info.hash.hex());
    };
    const size_t n = m.blocks.size();
    for (BlockRef& r : m.blocks) add(std::move(r), 0);
    for (size_t g = 1; g <= m.group_blocks.size() && n > 0; ++g) {
      for (BlockRef& r : m.group_blocks[g - 1]) add(std::move(r), static_cast<int>(g));
    }
    m.blocks.clear();
    m.group_blocks.clear();
    lease.n_tokens = static_cast<int64_t>(n) * P;
  });
  if (!ran.ok()) return ran.error();
  if (lease.block_ids.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_offers_empty++;
    return json{{"do_remote_prefill", false},
                {"do_remote_decode", false},
                {"remote_engine_id", engine_id_},
                {"reason", "no full block of the prompt to transfer"}};
  }
  const std::vector<int32_t> ids = lease.block_ids;
  const int64_t n_tokens = lease.n_tokens;
  const uint64_t id = leases_.add(std::move(lease), config_.lease_timeout);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_offers++;
  }
  return json{{"do_remote_prefill", true},
              {"do_remote_decode", false},
              {"remote_engine_id", engine_id_},
              {"remote_host", server_->host()},
              {"remote_port", server_->port()},
              {"remote_transfer_id", id},
              {"remote_block_ids", ids},
              {"remote_block_hashes", hashes},
              {"remote_block_groups", groups},
              {"n_tokens", n_tokens},
              {"block_size", record_id_.block_size},
              {"block_bytes", record_id_.payload_bytes},
              {"kv_format", engine_.kv().identity().kv_format},
              {"model_digest", record_id_.model_digest.hex()},
              {"format_digest", record_id_.format_digest.hex()},
              {"lease_timeout_ms", config_.lease_timeout.count()},
              {"transport", "ucx"}};
}

Status PdAgent::check_offer(const json& p) const {
  auto bad = [](const std::string& m) {
    return Status(make_error(Errc::kInvalidArgument, "kv_transfer_params: " + m));
  };
  for (const char* k : {"remote_host", "model_digest", "format_digest"}) {
    if (!p.contains(k) || !p[k].is_string())
      return bad(std::string("'") + k + "' must be a string");
  }
  for (const char* k :
       {"remote_port", "remote_transfer_id", "n_tokens", "block_size", "block_bytes"}) {
    if (!p.contains(k) || !p[k].is_number_integer() || p[k].get<int64_t>() < 0) {
      return bad(std::string("'") + k + "' must be a non-negative integer");
    }
  }
  return {};
}

Result<std::unique_ptr<PulledPrefix>> PdAgent::pull(Scheduler& s, const json& params,
                                                    const std::vector<int32_t>& prompt,
                                                    const std::string& cache_salt) {
  const auto t0 = Clock::now();
  if (config_.role != PdRole::kDecode) {
    return make_error(Errc::kInvalidArgument, "do_remote_prefill needs --role decode");
  }
  if (params.contains("remote_stream_host")) return pull_stream(s, params, prompt, cache_salt);
  KV_TRY_STATUS(check_offer(params));
  const std::string host = params["remote_host"].get<std::string>();
  const int port = params["remote_port"].get<int>();
  const uint64_t id = params["remote_transfer_id"].get<uint64_t>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls++;
  }
  auto failed = [&](Error e) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_failed++;
    return e;
  };
  // Identity and layout: the prefill worker's blocks are this worker's bit
  // for bit (same weights, KV format, transform, block geometry), or another
  // block size / float KV dtype of the same model, converted on arrival
  // (pd_convert.cpp); anything else is refused.
  std::string mismatch;
  std::optional<Conversion> conv;
  Hash128 md;
  Hash128 fd;
  const bool md_ok = parse_hash(params["model_digest"].get<std::string>(), &md);
  const bool same_format =
      parse_hash(params["format_digest"].get<std::string>(), &fd) && fd == record_id_.format_digest;
  auto model_differs = [&](const Hash128& ours) {
    return "the prefill worker's model digest differs (another model, adapter or position/"
           "attention rule): " +
           params["model_digest"].get<std::string>() + " vs " + ours.hex();
  };
  if (same_format) {
    if (!md_ok || !(md == record_id_.model_digest)) {
      mismatch = model_differs(record_id_.model_digest);
    } else if (params["block_size"].get<int64_t>() != record_id_.block_size ||
               params["block_bytes"].get<int64_t>() != record_id_.payload_bytes) {
      mismatch =
          "the block geometry differs: " + std::to_string(params["block_size"].get<int64_t>()) +
          " tokens / " + std::to_string(params["block_bytes"].get<int64_t>()) +
          " bytes per block vs " + std::to_string(record_id_.block_size) + " / " +
          std::to_string(record_id_.payload_bytes) + " here";
    }
  } else {
    auto plan = plan_conversion(params);
    if (!plan) {
      mismatch = "the prefill worker's KV format differs: '" +
                 params.value("kv_format", std::string("?")) + "' vs '" +
                 engine_.kv().identity().kv_format +
                 "' and is not converted: " + plan.error().message;
    } else if (!md_ok || !(md == plan->record_id.model_digest)) {
      mismatch = model_differs(plan->record_id.model_digest);
    } else if (!(fd == plan->record_id.format_digest)) {
      mismatch = "the prefill worker's format digest does not match its kv_format";
    } else {
      conv = std::move(*plan);
    }
  }
  if (!mismatch.empty()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.n_layout_mismatches++;
    }
    // End the producer's lease now rather than at its timeout.
    if (auto sess = transfer::PullSession::open(*ucx_, host, port, id, config_.transfer_timeout)) {
      (void)(*sess)->finish(false);
    }
    return failed(make_error(Errc::kInvalidArgument, "kv_transfer_params: " + mismatch));
  }
  // A lane (UCX worker) for the whole pull; the session is destroyed first.
  std::unique_ptr<Lane> lane = acquire_lane(t0 + config_.transfer_timeout);
  if (!lane) {
    return failed(make_error(Errc::kBusy, "KV transfer: all " + std::to_string(config_.max_pulls) +
                                              " pulls (--kv-max-pulls) stayed busy for "
                                              "--kv-transfer-timeout"));
  }
  const auto left_open = config_.transfer_timeout -
                         std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  auto sess = transfer::PullSession::open(
      *ucx_, host, port, id, std::max(left_open, std::chrono::milliseconds(1)), lane->puller());
  if (!sess) return failed(sess.error());
  transfer::PullSession& session = **sess;
  if (conv) return pull_converted(s, session, *conv, prompt, cache_salt, t0);
  const transfer::Offer& o = session.offer();
  const int64_t P = record_id_.block_size;
  if (o.block_bytes != record_id_.payload_bytes ||
      o.header_bytes != block_record_header_bytes(static_cast<int32_t>(P)) || o.n_tokens % P != 0 ||
      o.n_tokens > static_cast<int64_t>(prompt.size()) - 1) {
    (void)session.finish(false);
    return failed(
        make_error(Errc::kCorruptFile, "KV transfer: the offer does not fit this request (" +
                                           std::to_string(o.n_tokens) + " tokens for a " +
                                           std::to_string(prompt.size()) + "-token prompt)"));
  }
  const auto n = static_cast<size_t>(o.n_tokens / P);
  // The records' order (offer()): the n nodes, then per KV group g >= 1 its
  // blocks [group_first[g], n), those a query at n P can see.
  const BlockPool& pool = engine_.pool();
  std::vector<size_t> group_first(static_cast<size_t>(pool.n_groups()), 0);
  std::vector<std::pair<int, size_t>> recs;  // (group, logical block) per record
  for (size_t i = 0; i < n; ++i) recs.emplace_back(0, i);
  for (int g = 1; g < pool.n_groups(); ++g) {
    const KvGroup& gr = pool.group(g);
    const auto L = static_cast<int64_t>(n) * P;
    const size_t f =
        gr.drops_blocks ? static_cast<size_t>(std::max<int64_t>(0, L - gr.window + 1) / P) : 0;
    group_first[static_cast<size_t>(g)] = f;
    for (size_t i = f; i < n; ++i) recs.emplace_back(g, i);
  }
  if (static_cast<int64_t>(recs.size()) != o.n_blocks) {
    (void)session.finish(false);
    return failed(
        make_error(Errc::kCorruptFile, "KV transfer: the offer has " + std::to_string(o.n_blocks) +
                                           " block records; this worker's KV groups need " +
                                           std::to_string(recs.size()) + " for " +
                                           std::to_string(o.n_tokens) + " tokens"));
  }
  // Engine thread: adopt what this worker already caches, reserve blocks
  // for the rest, compute the hashes the records must carry.
  std::unique_ptr<PulledPrefix> pin;
  std::vector<uint8_t*> dst(recs.size(), nullptr);
  std::vector<Hash128> expect;
  Hash128 ns_digest;
  size_t k = 0;
  Status reserved;
  const Status ran = s.inspect([&](Engine& e) {
    PrefixReservation res = reserve_prefix(e, cache_salt, prompt, n, P);
    Sequence& seq = res.seq;
    k = res.adopted;
    reserved = res.reserved;
    ns_digest = e.kv().index()->namespace_digest(res.ns);
    expect = expected_block_hashes(*e.kv().index(), res.ns, prompt, n, P);
    if (k < n) {
      if (reserved.ok()) {
        for (size_t r = 0; r < recs.size(); ++r) {
          const auto [g, i] = recs[r];
          if (i < k) continue;
          const int32_t b = seq.table().group(g).ids()[i];
          if (b == kNullBlock) {
            reserved = make_error(Errc::kInternal, "KV transfer: no block reserved for a record");
            break;
          }
          dst[r] = e.pool().block_data(BlockId{b});
        }
      }
    }
    pin = std::make_unique<PulledPrefix>(s, std::move(seq));
  });
  if (!ran.ok()) {
    (void)session.finish(false);
    return failed(ran.error());
  }
  if (!reserved.ok()) {
    (void)session.finish(false);
    return failed(reserved.error());
  }
  if (k == n) {  // every offered block is cached here already
    (void)session.finish(true);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_ok++;
    stats_.n_blocks_local += static_cast<int64_t>(n);
    return pin;
  }
  const auto left = config_.transfer_timeout -
                    std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  if (config_.test_pull_stall.count() > 0) std::this_thread::sleep_for(config_.test_pull_stall);
  std::vector<size_t> want_recs;
  std::vector<uint8_t*> want;
  for (size_t r = 0; r < recs.size(); ++r) {
    if (recs[r].second < k) continue;
    want_recs.push_back(r);
    want.push_back(dst[r]);
  }
  Status read;
  if (config_.pull_by_layer && pool.n_groups() == 1) {
    // Layer l's bytes of a block: [end of layer l - 1, end of layer l); the
    // last range runs to the block's end (padding included: the payload
    // checksum covers it).
    const KvLayout& lay = pool.group(0).layout;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    uint64_t at = 0;
    for (int l = 0; l < lay.n_layers(); ++l) {
      const auto end = l + 1 == lay.n_layers() ? static_cast<uint64_t>(o.block_bytes)
                                               : static_cast<uint64_t>(lay.placement(l).end_offset);
      ranges.emplace_back(at, end - at);
      at = end;
    }
    read = session.set_layer_ranges(std::move(ranges));
  }
  if (read.ok()) {
    read = session.read_records(want_recs, want, std::max(left, std::chrono::milliseconds(1)));
  }
  // Every record: identity, group, the hash this worker gives these tokens
  // in this namespace, the token ids, and the payload checksum.
  for (size_t j = 0; j < want_recs.size() && read.ok(); ++j) {
    const auto [g, i] = recs[want_recs[j]];
    const uint8_t* h = o.headers.data() + want_recs[j] * static_cast<size_t>(o.header_bytes);
    BlockRecordKey key{ns_digest, expect[i], i == 0 ? Hash128{} : expect[i - 1], g};
    BlockRecordCheck c =
        check_block_record(record_id_, key, std::span<const int32_t>(prompt).subspan(i * P, P), h);
    if (c == BlockRecordCheck::kOk) {
      c = check_block_payload(
          h, std::span<const uint8_t>(want[j], static_cast<size_t>(record_id_.payload_bytes)));
    }
    if (c != BlockRecordCheck::kOk) {
      read =
          make_error(Errc::kCorruptFile, "KV transfer: block " + std::to_string(i) + " of group " +
                                             std::to_string(g) + " failed its record check (" +
                                             block_record_check_name(c) + ")");
    }
  }
  if (!read.ok()) {
    (void)session.finish(false);
    pin.reset();  // frees the reserved blocks (engine thread)
    return failed(read.error());
  }
  // Publish like a local prefill: commit the slots, record the tokens.
  Status published;
  const Status ran2 =
      s.inspect([&](Engine&) { published = pin->commit(prompt, k, n, group_first); });
  if (!ran2.ok() || !published.ok()) {
    (void)session.finish(false);
    pin.reset();
    return failed(!ran2.ok() ? ran2.error() : published.error());
  }
  (void)session.finish(true);
  const transfer::PullTimings& t = session.timings();
  std::lock_guard<std::mutex> lock(mu_);
  count_pull_ok(t, t0, static_cast<int64_t>(want_recs.size()), static_cast<int64_t>(k));
  stats_.last_layer_get_s = t.layer_get_s;
  return pin;
}

void PdAgent::count_pull_ok(const transfer::PullTimings& t, Clock::time_point t0, int64_t n_pulled,
                            int64_t n_local) {
  stats_.n_pulls_ok++;
  stats_.n_blocks_pulled += n_pulled;
  stats_.n_blocks_local += n_local;
  stats_.n_bytes_pulled += t.n_bytes;
  stats_.last_pull_s = seconds_since(t0);
  stats_.last_read_s = t.read_s;
  stats_.pull_seconds += stats_.last_pull_s;
  stats_.read_seconds += t.read_s;
  stats_.last_get_s = t.get_s;
  stats_.last_wireup_s = t.wireup_s;
  stats_.last_n_gets = t.n_gets;
  stats_.last_bytes = t.n_bytes;
  stats_.last_bandwidth = t.get_s > 0 ? static_cast<double>(t.n_bytes) / t.get_s : 0;
}

PdStats PdAgent::stats() const {
  PdStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  s.leases = leases_.stats();
  s.max_pulls = config_.role == PdRole::kDecode ? config_.max_pulls : 0;
  if (server_) s.server = server_->stats();
  if (layer_timer_) {
    std::lock_guard<std::mutex> lock(layer_timer_->mu);
    s.prefill_layer_s = layer_timer_->sum;
    s.n_prefill_steps = layer_timer_->n_steps;
  }
  return s;
}

json pd_stats_json(const PdStats& s) {
  return json{{"role", pd_role_name(s.role)},
              {"transports", s.transports},
              {"offers", s.n_offers},
              {"offers_empty", s.n_offers_empty},
              {"streams", s.n_streams},
              {"streams_ok", s.n_streams_ok},
              {"stream_pulls", s.n_stream_pulls},
              {"stream_rereads", s.n_stream_rereads},
              {"leases_open", s.leases.n_open},
              {"leases_pinned_blocks", s.leases.n_pinned_blocks},
              {"leases_created", s.leases.n_created},
              {"leases_completed", s.leases.n_completed},
              {"leases_cancelled", s.leases.n_cancelled},
              {"leases_expired", s.leases.n_expired},
              {"leases_pending_release", s.leases.n_pending_release},
              {"pulls_refused", s.leases.n_refused},
              {"served_pulls", s.server.n_pulls},
              {"served_pulls_ok", s.server.n_pulls_ok},
              {"served_pulls_failed", s.server.n_pulls_failed},
              {"bytes_offered", s.server.n_bytes_offered},
              {"pulls", s.n_pulls},
              {"pulls_ok", s.n_pulls_ok},
              {"pulls_failed", s.n_pulls_failed},
              {"blocks_pulled", s.n_blocks_pulled},
              {"blocks_local", s.n_blocks_local},
              {"bytes_pulled", s.n_bytes_pulled},
              {"layout_mismatches", s.n_layout_mismatches},
              {"pulls_in_flight", s.pulls_in_flight},
              {"pulls_in_flight_max", s.pulls_in_flight_max},
              {"max_pulls", s.max_pulls},
              {"pull_wait_seconds", s.pull_wait_seconds},
              {"layout_conversions", s.n_layout_conversions},
              {"blocks_converted", s.n_blocks_converted},
              {"pull_seconds", s.pull_seconds},
              {"read_seconds", s.read_seconds},
              {"last_pull_seconds", s.last_pull_s},
              {"last_read_seconds", s.last_read_s},
              {"last_get_seconds", s.last_get_s},
              {"last_wireup_seconds", s.last_wireup_s},
              {"last_gets", s.last_n_gets},
              {"last_read_bytes", s.last_bytes},
              {"last_read_bytes_per_second", s.last_bandwidth},
              {"last_layer_get_seconds", s.last_layer_get_s},
              {"prefill_layer_seconds", s.prefill_layer_s},
              {"prefill_steps", s.n_prefill_steps}};
}

std::string pd_prometheus(const PdStats& s, const std::string& labels) {
  std::string out;
  auto line = [&](const char* name, const char* type, const char* help, double v) {
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "# HELP kvstack_kv_transfer_%s %s\n# TYPE kvstack_kv_transfer_%s "
                  "%s\nkvstack_kv_transfer_%s{%s} %.17g\n",
                  name, help, name, type, name, labels.c_str(), v);
    out += buf;
  };
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  line("leases_open", "gauge", "Prefill leases pinning blocks for a decode worker",
       d(s.leases.n_open));
  line("leases_pinned_blocks", "gauge", "Blocks pinned by open leases",
       d(s.leases.n_pinned_blocks));
  line("leases_completed_total", "counter", "Leases ended by a verified pull",
       d(s.leases.n_completed));
  line("leases_cancelled_total", "counter", "Leases ended by a lost or failed pull",
       d(s.leases.n_cancelled));
  line("leases_expired_total", "counter", "Leases ended by --kv-lease-timeout",
       d(s.leases.n_expired));
  line("bytes_offered_total", "counter",
       "Payload bytes of completed offers (decode workers read the blocks they do not cache)",
       d(s.server.n_bytes_offered));
  line("pulls_total", "counter", "Pulls started by this decode worker", d(s.n_pulls));
  line("pulls_failed_total", "counter", "Pulls that failed (the request got an error)",
       d(s.n_pulls_failed));
  line("blocks_pulled_total", "counter", "Blocks read from prefill workers", d(s.n_blocks_pulled));
  line("bytes_pulled_total", "counter", "Payload bytes read from prefill workers",
       d(s.n_bytes_pulled));
  line("layout_mismatches_total", "counter", "Offers refused for another model, format or geometry",
       d(s.n_layout_mismatches));
  line("layout_conversions_total", "counter",
       "Pulls converted from another block size or float KV dtype", d(s.n_layout_conversions));
  line("blocks_converted_total", "counter", "Producer blocks converted to this worker's layout",
       d(s.n_blocks_converted));
  line("pulls_in_flight", "gauge", "Pulls holding one of the --kv-max-pulls lanes",
       d(s.pulls_in_flight));
  line("pull_wait_seconds_total", "counter", "Time pulls waited for a free lane",
       s.pull_wait_seconds);
  line("pull_seconds_total", "counter", "Time in successful pulls (offer, read, verify, publish)",
       s.pull_seconds);
  line("read_seconds_total", "counter", "Time in UCX reads of successful pulls", s.read_seconds);
  return out;
}

}  // namespace kvstack::server

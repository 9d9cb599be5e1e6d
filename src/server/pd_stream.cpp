// PdAgent's layer-wise streaming (pd_agent.h, "Layer-wise streaming"):
// the prefill worker's STREAM handler and layer hook, and the decode
// worker's pull_stream().
#include "server/pd_stream.h"

#include <algorithm>
#include <thread>

#include "kv/prefix_index.h"
#include "server/pd_agent.h"

namespace kvstack::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr uint32_t kMaxStreamTokens = 1u << 22;

}  // namespace

void watches_on_layer(StreamWatches& w, int n_done, std::span<const StepSeq> batch) {
  if (w.n.load(std::memory_order_relaxed) == 0) return;
  for (const StepSeq& e : batch) {
    if (e.watch == 0) continue;
    std::shared_ptr<StreamWatch> sw;
    {
      std::lock_guard<std::mutex> lock(w.mu);
      auto it = w.by_id.find(e.watch);
      if (it == w.by_id.end()) continue;
      sw = it->second;
    }
    std::lock_guard<std::mutex> lock(sw->mu);
    if (n_done == 0) {
      // Only the final chunk streams: earlier chunks' layers are all done.
      if (sw->started ||
          e.table->length() + static_cast<int64_t>(e.tokens.size()) != sw->n_prompt) {
        continue;
      }
      const auto ids = e.table->ids();
      if (ids.size() < sw->n_blocks) continue;
      BlockPool& pool = e.table->pool();
      for (size_t i = 0; i < sw->n_blocks; ++i) {
        sw->refs.push_back(pool.ref_block(BlockId{ids[i]}));
        sw->addrs.push_back(reinterpret_cast<uint64_t>(pool.block_data(BlockId{ids[i]})));
      }
      sw->started = true;
    } else if (sw->started) {
      sw->layers_done = std::max(sw->layers_done, n_done);
    } else {
      continue;
    }
    sw->cv.notify_all();
  }
}

// ---- prefill side ----

void PdAgent::serve_stream(transfer::Socket& conn, const std::vector<uint8_t>& payload) {
  using transfer::TransferServer;
  const auto t0 = Clock::now();
  auto deadline = [&] { return Clock::now() + config_.transfer_timeout; };
  auto refuse = [&](Errc code, const std::string& m) {
    TransferServer::send_refusal(conn, code, "layer-wise stream: " + m, deadline());
  };
  transfer::Reader r(payload);
  uint32_t n_salt = 0;
  std::vector<uint8_t> salt;
  uint32_t n_tok = 0;
  if (!r.get(&n_salt) || !r.bytes(n_salt, &salt) || !r.get(&n_tok) || n_tok > kMaxStreamTokens) {
    return refuse(Errc::kInvalidArgument, "malformed request");
  }
  std::vector<int32_t> prompt(n_tok);
  for (int32_t& t : prompt) {
    if (!r.get(&t)) return refuse(Errc::kInvalidArgument, "malformed request");
  }
  if (!r.done()) return refuse(Errc::kInvalidArgument, "malformed request");
  Scheduler* s = sched_;
  if (s == nullptr || stop_.load()) return refuse(Errc::kCancelled, "the worker is stopping");
  const int64_t P = record_id_.block_size;
  const auto n_blocks = static_cast<size_t>((static_cast<int64_t>(prompt.size()) - 1) / P);
  // LAYER_READY(l) means KV layer l - 1 is written: one KV layer per model
  // layer, in order (not models whose layers share another layer's KV).
  if (engine_.pool().layout().n_layers() != engine_.model().config().n_layers) {
    return refuse(Errc::kUnsupported, "this model's KV layers are not one per model layer");
  }
  if (prompt.empty() || n_blocks == 0) {
    return refuse(Errc::kInvalidArgument, "no full block of the prompt to transfer");
  }
  auto w = std::make_shared<StreamWatch>();
  w->n_prompt = static_cast<int64_t>(prompt.size());
  w->n_blocks = n_blocks;
  const uint64_t wid = watches_->next_id.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(watches_->mu);
    watches_->by_id[wid] = w;
    watches_->n.fetch_add(1);
  }
  SeqRequest q;
  q.prompt = prompt;
  q.max_tokens = 1;
  q.sampling.temperature = 0;
  q.cache_salt = std::string(salt.begin(), salt.end());
  q.watch_id = wid;
  auto h = s->submit(q);
  // Every exit: unregister, cancel the request, drop the references.
  auto cleanup = [&] {
    {
      std::lock_guard<std::mutex> lock(watches_->mu);
      watches_->by_id.erase(wid);
      watches_->n.fetch_sub(1);
    }
    if (h) (*h)->cancel();
    std::vector<BlockRef> refs;
    {
      std::lock_guard<std::mutex> lock(w->mu);
      refs.swap(w->refs);
    }
    if (!s->inspect([&](Engine&) { refs.clear(); }).ok()) refs.clear();
  };
  if (!h) {
    cleanup();
    return refuse(h.error().code, h.error().message);
  }
  RequestHandle& handle = **h;
  // Waits (bounded) until pred() holds under w->mu; false on timeout, stop,
  // or the request ending first.
  auto wait_for = [&](const auto& pred) {
    const auto until = deadline();
    std::unique_lock<std::mutex> lock(w->mu);
    while (!pred()) {
      if (stop_.load() || Clock::now() >= until || handle.done()) return pred();
      w->cv.wait_for(lock, std::chrono::milliseconds(20));
    }
    return true;
  };
  if (!wait_for([&] { return w->started; })) {
    cleanup();
    return refuse(Errc::kIo, "the prefill did not start within --kv-transfer-timeout");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_streams++;
  }
  transfer::Writer b;
  b.put(static_cast<uint32_t>(server_->worker_address().size()));
  b.bytes(server_->worker_address().data(), server_->worker_address().size());
  b.put(static_cast<uint32_t>(server_->rkey().size()));
  b.bytes(server_->rkey().data(), server_->rkey().size());
  b.put(static_cast<int64_t>(n_blocks));
  b.put(record_id_.payload_bytes);
  b.put(static_cast<int64_t>(n_blocks) * P);
  // meta: the identity the decode worker checks (no conversion when streaming)
  b.put(static_cast<uint32_t>(4 * sizeof(uint64_t) + 2 * sizeof(int64_t)));
  b.put(record_id_.model_digest.hi);
  b.put(record_id_.model_digest.lo);
  b.put(record_id_.format_digest.hi);
  b.put(record_id_.format_digest.lo);
  b.put(static_cast<int64_t>(P));
  b.put(static_cast<int64_t>(engine_.pool().layout().n_layers()));
  {
    std::lock_guard<std::mutex> lock(w->mu);
    for (uint64_t a : w->addrs) b.put(a);
  }
  if (!conn.send_frame(transfer::FrameType::kStreamBlocks, b.buf, deadline()).ok()) {
    return cleanup();
  }
  const int L = engine_.pool().layout().n_layers();
  for (int sent = 0; sent < L;) {
    int done = 0;
    if (!wait_for([&] { return w->layers_done > sent; })) {
      cleanup();
      return refuse(Errc::kIo, "the prefill failed or stalled at layer " + std::to_string(sent));
    }
    {
      std::lock_guard<std::mutex> lock(w->mu);
      done = std::min(w->layers_done, L);
    }
    for (; sent < done; ++sent) {
      transfer::Writer lw;
      lw.put(static_cast<uint32_t>(sent + 1));
      if (!conn.send_frame(transfer::FrameType::kLayerReady, lw.buf, deadline()).ok()) {
        return cleanup();  // the decode worker went away
      }
    }
  }
  // The request's end: its prompt's blocks are published now.
  bool ok = false;
  std::string why = "the prefill did not finish within --kv-transfer-timeout";
  for (const auto until = deadline(); Clock::now() < until && !stop_.load();) {
    std::vector<SeqEvent> evs;
    if (!handle.wait(&evs, std::chrono::milliseconds(20))) continue;
    bool end = false;
    for (const SeqEvent& e : evs) {
      if (e.kind == SeqEvent::Kind::kError) why = "the prefill failed: " + e.error.error().message;
      if (e.request_done) {
        end = true;
        ok = e.kind != SeqEvent::Kind::kError;
      }
    }
    if (end) break;
  }
  if (!ok) {
    cleanup();
    return refuse(Errc::kIo, why);
  }
  auto kp = offer(*s, prompt, q.cache_salt);
  cleanup();  // the lease holds its own references now
  if (!kp || !kp->contains("remote_transfer_id")) {
    return refuse(Errc::kNotFound,
                  kp ? kp->value("reason", std::string("nothing to lease")) : kp.error().message);
  }
  server_->answer_pull(conn, (*kp)["remote_transfer_id"].get<uint64_t>());
  std::lock_guard<std::mutex> lock(mu_);
  stats_.n_streams_ok++;
  (void)t0;
}

// ---- decode side ----

Result<std::unique_ptr<PulledPrefix>> PdAgent::pull_stream(Scheduler& s, const json& params,
                                                           const std::vector<int32_t>& prompt,
                                                           const std::string& cache_salt) {
  const auto t0 = Clock::now();
  auto bad = [](const std::string& m) {
    return make_error(Errc::kInvalidArgument, "kv_transfer_params: " + m);
  };
  if (!params["remote_stream_host"].is_string())
    return bad("'remote_stream_host' must be a string");
  if (!params.contains("remote_stream_port") || !params["remote_stream_port"].is_number_integer() ||
      params["remote_stream_port"].get<int64_t>() <= 0 ||
      params["remote_stream_port"].get<int64_t>() > 65535) {
    return bad("'remote_stream_port' must be a port number");
  }
  const BlockPool& pool = engine_.pool();
  if (pool.n_groups() != 1) {
    return bad("layer-wise streaming needs a one-group KV layout (this model's has " +
               std::to_string(pool.n_groups()) + " groups)");
  }
  const int64_t P = record_id_.block_size;
  if (static_cast<int64_t>(prompt.size()) <= P) {
    return bad("layer-wise streaming needs a prompt longer than one block (" + std::to_string(P) +
               " tokens)");
  }
  const std::string host = params["remote_stream_host"].get<std::string>();
  const int port = params["remote_stream_port"].get<int>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls++;
    stats_.n_stream_pulls++;
  }
  auto failed = [&](Error e) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_failed++;
    return e;
  };
  std::unique_ptr<Lane> lane = acquire_lane(t0 + config_.transfer_timeout);
  if (!lane) {
    return failed(make_error(Errc::kBusy, "KV transfer: all " + std::to_string(config_.max_pulls) +
                                              " pulls (--kv-max-pulls) stayed busy for "
                                              "--kv-transfer-timeout"));
  }
  transfer::Writer req;
  req.put(static_cast<uint32_t>(cache_salt.size()));
  req.bytes(cache_salt.data(), cache_salt.size());
  req.put(static_cast<uint32_t>(prompt.size()));
  for (int32_t t : prompt) req.put(t);
  auto sess = transfer::PullSession::open_stream(*ucx_, host, port, req.buf,
                                                 config_.transfer_timeout, lane->puller());
  if (!sess) return failed(sess.error());
  transfer::PullSession& session = **sess;
  const transfer::Offer& o = session.offer();
  // The producer's identity and geometry: the same, bit for bit.
  {
    std::vector<uint8_t> meta = session.stream_meta();
    transfer::Reader mr(meta);
    Hash128 md;
    Hash128 fd;
    int64_t bs = 0;
    int64_t nl = 0;
    if (!mr.get(&md.hi) || !mr.get(&md.lo) || !mr.get(&fd.hi) || !mr.get(&fd.lo) || !mr.get(&bs) ||
        !mr.get(&nl)) {
      return failed(make_error(Errc::kCorruptFile, "KV stream: malformed identity"));
    }
    if (!(md == record_id_.model_digest) || !(fd == record_id_.format_digest) || bs != P ||
        o.block_bytes != record_id_.payload_bytes || nl != pool.layout().n_layers()) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.n_layout_mismatches++;
      stats_.n_pulls_failed++;
      return bad(
          "layer-wise streaming needs the prefill worker's model, KV format and block geometry "
          "(no conversion): they differ");
    }
  }
  const auto n = static_cast<size_t>(o.n_blocks);
  if (o.n_tokens != static_cast<int64_t>(n) * P ||
      o.n_tokens > static_cast<int64_t>(prompt.size()) - 1) {
    return failed(make_error(Errc::kCorruptFile, "KV stream: the blocks do not fit the prompt"));
  }
  // Engine thread: adopt what this worker caches, reserve the rest.
  std::unique_ptr<PulledPrefix> pin;
  std::vector<uint8_t*> dst(n, nullptr);
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
      for (size_t i = k; i < n && reserved.ok(); ++i) {
        dst[i] = e.pool().block_data(BlockId{seq.table().ids()[i]});
      }
    }
    pin = std::make_unique<PulledPrefix>(s, std::move(seq));
  });
  auto fail_with = [&](Error e) {
    (void)session.finish(false);
    pin.reset();  // frees the reserved blocks (engine thread)
    return failed(std::move(e));
  };
  if (!ran.ok()) return fail_with(ran.error());
  if (!reserved.ok()) return fail_with(reserved.error());
  std::vector<size_t> want_recs;
  std::vector<uint8_t*> want;
  for (size_t i = k; i < n; ++i) {
    want_recs.push_back(i);
    want.push_back(dst[i]);
  }
  // Layer l's bytes of a block (as --kv-pull-by-layer), read once ready.
  const KvLayout& lay = pool.group(0).layout;
  const int L = lay.n_layers();
  // Each wait (the next layer, a read, the final offer) is bounded by
  // --kv-transfer-timeout on its own: the prefill itself runs meanwhile.
  auto deadline = [&] { return Clock::now() + config_.transfer_timeout; };
  auto left = [&] { return config_.transfer_timeout; };
  std::vector<double> layer_s;
  uint32_t ready = 0;
  uint64_t at = 0;
  for (int l = 0; l < L; ++l) {
    while (ready <= static_cast<uint32_t>(l)) {
      auto got = session.wait_layer_ready(deadline());
      if (!got) return fail_with(got.error());
      ready = *got;
    }
    if (l == 1 && config_.test_pull_stall.count() > 0) {
      std::this_thread::sleep_for(config_.test_pull_stall);  // tests: kill the prefill now
    }
    const auto end = l + 1 == L ? static_cast<uint64_t>(o.block_bytes)
                                : static_cast<uint64_t>(lay.placement(l).end_offset);
    const auto t_l = Clock::now();
    if (!want.empty()) {
      if (Status st = session.read_range(want_recs, want, at, end - at, left()); !st.ok()) {
        return fail_with(st.error());
      }
    }
    layer_s.push_back(seconds_since(t_l));
    at = end;
  }
  const std::vector<uint64_t> streamed = o.addrs;
  if (Status st = session.recv_offer(deadline()); !st.ok()) return fail_with(st.error());
  const transfer::Offer& fin = session.offer();
  if (fin.n_blocks != static_cast<int64_t>(n) || fin.n_tokens != o.n_tokens ||
      fin.header_bytes != block_record_header_bytes(static_cast<int32_t>(P)) ||
      fin.block_bytes != record_id_.payload_bytes) {
    return fail_with(make_error(Errc::kCorruptFile,
                                "KV stream: the final offer differs from the streamed blocks"));
  }
  // A block published at another address than the one streamed (the prefill
  // was redone, or its block deduplicated): read it again, whole.
  std::vector<size_t> again_recs;
  std::vector<uint8_t*> again;
  for (size_t j = 0; j < want_recs.size(); ++j) {
    if (fin.addrs[want_recs[j]] != streamed[want_recs[j]]) {
      again_recs.push_back(want_recs[j]);
      again.push_back(want[j]);
    }
  }
  if (!again.empty()) {
    if (Status st = session.read_records(again_recs, again, left()); !st.ok()) {
      return fail_with(st.error());
    }
  }
  // Every record: identity, the chained hash, the tokens, the payload checksum.
  for (size_t j = 0; j < want_recs.size(); ++j) {
    const size_t i = want_recs[j];
    const uint8_t* hd = fin.headers.data() + i * static_cast<size_t>(fin.header_bytes);
    BlockRecordKey key{ns_digest, expect[i], i == 0 ? Hash128{} : expect[i - 1], 0};
    BlockRecordCheck c =
        check_block_record(record_id_, key, std::span<const int32_t>(prompt).subspan(i * P, P), hd);
    if (c == BlockRecordCheck::kOk) {
      c = check_block_payload(
          hd, std::span<const uint8_t>(want[j], static_cast<size_t>(record_id_.payload_bytes)));
    }
    if (c != BlockRecordCheck::kOk) {
      return fail_with(make_error(Errc::kCorruptFile, "KV stream: block " + std::to_string(i) +
                                                          " failed its record check (" +
                                                          block_record_check_name(c) + ")"));
    }
  }
  Status published;
  const std::vector<size_t> group_first(1, 0);
  const Status ran2 =
      s.inspect([&](Engine&) { published = pin->commit(prompt, k, n, group_first); });
  if (!ran2.ok() || !published.ok())
    return fail_with(!ran2.ok() ? ran2.error() : published.error());
  (void)session.finish(true);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.n_pulls_ok++;
  stats_.n_blocks_pulled += static_cast<int64_t>(want_recs.size());
  stats_.n_blocks_local += static_cast<int64_t>(k);
  stats_.n_bytes_pulled += static_cast<int64_t>(want_recs.size()) * o.block_bytes;
  stats_.n_stream_rereads += static_cast<int64_t>(again.size());
  stats_.last_pull_s = seconds_since(t0);
  stats_.pull_seconds += stats_.last_pull_s;
  stats_.last_layer_get_s = layer_s;
  stats_.last_get_s = 0;
  for (double v : layer_s) stats_.last_get_s += v;
  stats_.last_bytes = static_cast<int64_t>(want_recs.size()) * o.block_bytes;
  stats_.last_bandwidth =
      stats_.last_get_s > 0 ? static_cast<double>(stats_.last_bytes) / stats_.last_get_s : 0;
  return pin;
}

}  // namespace kvstack::server

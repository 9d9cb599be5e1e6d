#include "server/kv_events.h"

#include <chrono>
#include <msgpack.hpp>
#include <zmq.hpp>

namespace kvstack::server {

struct KvEventPublisher::Sockets {
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  zmq::socket_t replay{ctx, zmq::socket_type::router};
  bool has_replay = false;
};

namespace {

// 8-byte big-endian sequence number (vLLM's seq frame).
std::string seq_bytes(int64_t seq) {
  std::string out(8, '\0');
  const auto u = static_cast<uint64_t>(seq);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xff);
  return out;
}

int64_t parse_seq(const zmq::message_t& m) {
  uint64_t u = 0;
  const auto* p = static_cast<const unsigned char*>(m.data());
  for (size_t i = 0; i < 8 && i < m.size(); ++i) u = (u << 8) | p[i];
  return static_cast<int64_t>(u);
}

void pack_hash(msgpack::packer<msgpack::sbuffer>& pk, const Hash128& h) {
  char b[16];
  for (int i = 0; i < 8; ++i) {
    b[i] = static_cast<char>((h.hi >> (56 - 8 * i)) & 0xff);
    b[8 + i] = static_cast<char>((h.lo >> (56 - 8 * i)) & 0xff);
  }
  pk.pack_bin(16);
  pk.pack_bin_body(b, 16);
}

void pack_str(msgpack::packer<msgpack::sbuffer>& pk, const std::string& s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

}  // namespace

KvEventPublisher::KvEventPublisher(KvEventPublisherConfig config)
    : config_(std::move(config)), zmq_(std::make_unique<Sockets>()) {}

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::create(KvEventPublisherConfig config) {
  std::unique_ptr<KvEventPublisher> p(new KvEventPublisher(std::move(config)));
  const KvEventPublisherConfig& c = p->config_;
  try {
    p->zmq_->pub.set(zmq::sockopt::linger, 0);
    p->zmq_->pub.set(zmq::sockopt::sndhwm, 100000);
    p->zmq_->pub.bind(c.endpoint);
  } catch (const zmq::error_t& e) {
    return make_error(Errc::kIo, "--kv-events " + c.endpoint + ": " + e.what());
  }
  if (!c.replay_endpoint.empty()) {
    try {
      p->zmq_->replay.set(zmq::sockopt::linger, 0);
      p->zmq_->replay.bind(c.replay_endpoint);
      p->zmq_->has_replay = true;
    } catch (const zmq::error_t& e) {
      return make_error(Errc::kIo, "--kv-events-replay " + c.replay_endpoint + ": " + e.what());
    }
  }
  p->thread_ = std::thread([raw = p.get()] { raw->run(); });
  return p;
}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void KvEventPublisher::push(const KvEvent& e, const Hash128& ns_digest) {
  Pending p{e.kind, e.hash, e.parent_hash, ns_digest, {}};
  if (e.kind == KvEvent::Kind::kStored && e.tokens != nullptr) {
    p.tokens.assign(e.tokens, e.tokens + e.n_tokens);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(queue_.size()) >= config_.queue_capacity) {
      n_dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queue_.push_back(std::move(p));
  }
  cv_.notify_one();
}

KvEventPublisherStats KvEventPublisher::stats() const {
  return {n_events_.load(), n_batches_.load(), n_dropped_.load(), n_replay_.load(),
          n_replayed_.load()};
}

std::string KvEventPublisher::encode(const std::vector<Pending>& batch) const {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  const double ts =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(batch.size()));
  const bool map = config_.map_events;
  // One field: its name first when events are maps.
  auto key = [&](const char* name) {
    if (map) pack_str(pk, name);
  };
  for (const Pending& p : batch) {
    if (p.kind == KvEvent::Kind::kAllCleared) {  // the tag alone
      if (map) {
        pk.pack_map(1);
      } else {
        pk.pack_array(1);
      }
      key("type");
      pack_str(pk, "AllBlocksCleared");
      continue;
    }
    const bool stored = p.kind == KvEvent::Kind::kStored;
    const uint32_t n_fields = stored ? 9 : 3;  // tag included
    if (map) {
      pk.pack_map(n_fields);
    } else {
      pk.pack_array(n_fields);
    }
    key("type");
    pack_str(pk, stored ? "BlockStored" : "BlockRemoved");
    key("block_hashes");
    pk.pack_array(1);
    pack_hash(pk, p.hash);
    if (stored) {
      key("parent_block_hash");
      if (p.parent == Hash128{}) {
        pk.pack_nil();
      } else {
        pack_hash(pk, p.parent);
      }
      key("token_ids");
      pk.pack_array(static_cast<uint32_t>(p.tokens.size()));
      for (int32_t t : p.tokens) pk.pack_int32(t);
      key("block_size");
      pk.pack_int32(config_.block_size);
      key("lora_id");
      pk.pack_nil();
      key("medium");
      pack_str(pk, "CPU");
      key("lora_name");
      pk.pack_nil();
      key("extra_keys");
      pk.pack_array(1);  // one tuple per block
      pk.pack_array(1);
      pack_str(pk, p.ns_digest.hex());
    } else {
      key("medium");
      pack_str(pk, "CPU");
    }
  }
  pk.pack_uint32(0);  // data_parallel_rank
  return std::string(buf.data(), buf.size());
}

void KvEventPublisher::serve_replay() {
  std::vector<zmq::message_t> frames;
  while (true) {
    frames.clear();
    zmq::message_t m;
    auto r = zmq_->replay.recv(m, zmq::recv_flags::dontwait);
    if (!r) return;
    frames.push_back(std::move(m));
    while (frames.back().more()) {
      zmq::message_t part;
      if (!zmq_->replay.recv(part, zmq::recv_flags::none)) break;
      frames.push_back(std::move(part));
    }
    if (frames.size() != 3 || frames[2].size() != 8) continue;  // not a replay request
    n_replay_.fetch_add(1, std::memory_order_relaxed);
    const int64_t start = parse_seq(frames[2]);
    const std::string id(static_cast<const char*>(frames[0].data()), frames[0].size());
    auto send4 = [&](const std::string& seq, const std::string& payload) {
      zmq_->replay.send(zmq::buffer(id), zmq::send_flags::sndmore);
      zmq_->replay.send(zmq::message_t(), zmq::send_flags::sndmore);
      zmq_->replay.send(zmq::buffer(seq), zmq::send_flags::sndmore);
      zmq_->replay.send(zmq::buffer(payload), zmq::send_flags::none);
    };
    for (const auto& [seq, payload] : replay_) {
      if (static_cast<int64_t>(seq) < start) continue;
      send4(seq_bytes(static_cast<int64_t>(seq)), payload);
      n_replayed_.fetch_add(1, std::memory_order_relaxed);
    }
    send4(seq_bytes(-1), "");
  }
}

void KvEventPublisher::run() {
  std::vector<Pending> batch;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stop_ || !queue_.empty(); });
      batch.swap(queue_);
      if (batch.empty() && stop_) return;
    }
    try {
      if (zmq_->has_replay) serve_replay();
      if (batch.empty()) continue;
      const int64_t seq = n_batches_.load();
      std::string payload = encode(batch);
      zmq_->pub.send(zmq::buffer(config_.topic), zmq::send_flags::sndmore);
      zmq_->pub.send(zmq::buffer(seq_bytes(seq)), zmq::send_flags::sndmore);
      zmq_->pub.send(zmq::buffer(payload), zmq::send_flags::dontwait);
      n_events_.fetch_add(static_cast<int64_t>(batch.size()), std::memory_order_relaxed);
      n_batches_.store(seq + 1);
      if (zmq_->has_replay) {
        replay_.emplace_back(static_cast<uint64_t>(seq), std::move(payload));
        while (static_cast<int64_t>(replay_.size()) > config_.replay_batches) replay_.pop_front();
      }
    } catch (const zmq::error_t&) {
      // A send refused (e.g. interrupted): the batch is lost and counted as
      // dropped; seq is not advanced (no gap a subscriber could replay).
      n_dropped_.fetch_add(static_cast<int64_t>(batch.size()), std::memory_order_relaxed);
    }
    batch.clear();
  }
}

}  // namespace kvstack::server

#include "kv/redis_store.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace kvstack {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

}  // namespace

Result<std::unique_ptr<RedisStore>> RedisStore::open(const BlockRecordIdentity& id,
                                                     const std::string& url, int timeout_ms) {
  const std::string prefix = "redis://";
  auto bad = [&](const std::string& why) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-redis: '" + url + "' " + why + " (expected redis://HOST:PORT[/DB])");
  };
  if (url.rfind(prefix, 0) != 0) return bad("does not start with redis://");
  std::string rest = url.substr(prefix.size());
  int db = 0;
  if (const size_t slash = rest.find('/'); slash != std::string::npos) {
    const std::string d = rest.substr(slash + 1);
    char* end = nullptr;
    const long v = std::strtol(d.c_str(), &end, 10);
    if (d.empty() || *end != '\0' || v < 0 || v > 1 << 16) return bad("has a bad database number");
    db = static_cast<int>(v);
    rest = rest.substr(0, slash);
  }
  int port = 6379;
  if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    const std::string p = rest.substr(colon + 1);
    char* end = nullptr;
    const long v = std::strtol(p.c_str(), &end, 10);
    if (p.empty() || *end != '\0' || v <= 0 || v > 65535) return bad("has a bad port");
    port = static_cast<int>(v);
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) return bad("has no host");
  std::unique_ptr<RedisStore> r(new RedisStore(id, rest, port, db, timeout_ms));
  (void)r->ensure_connected();
  return r;
}

RedisStore::RedisStore(const BlockRecordIdentity& id, std::string host, int port, int db,
                       int timeout_ms)
    : id_(id), host_(std::move(host)), port_(port), db_(db), timeout_ms_(timeout_ms) {
  stats_.name = "redis";
  stats_.slot_bytes = static_cast<int64_t>(4096 + id.payload_bytes);
}

RedisStore::~RedisStore() {
  drop_connection();
}

void RedisStore::drop_connection() {
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
}

bool RedisStore::ensure_connected() {
  if (ctx_ != nullptr) return true;
  const double now = now_seconds();
  if (now < next_connect_) return false;
  next_connect_ = now + 1.0;
  timeval tv{.tv_sec = timeout_ms_ / 1000, .tv_usec = (timeout_ms_ % 1000) * 1000};
  redisContext* c = redisConnectWithTimeout(host_.c_str(), port_, tv);
  if (c == nullptr || c->err != 0) {
    if (c != nullptr) redisFree(c);
    ++n_errors_;
    return false;
  }
  redisSetTimeout(c, tv);
  ctx_ = c;
  if (db_ != 0) {
    Reply r(static_cast<redisReply*>(redisCommand(ctx_, "SELECT %d", db_)));
    if (!r || r->type == REDIS_REPLY_ERROR) {
      ++n_errors_;
      drop_connection();
      return false;
    }
  }
  return true;
}

std::string RedisStore::key_name(const TierKey& key, const Hash128& ns_digest) const {
  return "kvstack:blk:" + id_.model_digest.hex() + ":" + id_.format_digest.hex() + ":" +
         ns_digest.hex() + ":" + key.hash.hex() + ":" + std::to_string(key.group);
}

std::pair<double, double> RedisStore::probe_seconds() {
  if (!ensure_connected()) return {0, 0};
  const std::string k = "kvstack:probe:" + id_.model_digest.hex();
  std::vector<uint8_t> v(static_cast<size_t>(id_.payload_bytes), 0x5a);
  Reply s(static_cast<redisReply*>(
      redisCommand(ctx_, "SET %b %b EX 10", k.data(), k.size(), v.data(), v.size())));
  if (!s || s->type == REDIS_REPLY_ERROR) {
    if (!s) drop_connection();
    return {0, 0};
  }
  double t_ping = 1e30, t_get = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    double t = now_seconds();
    Reply p(static_cast<redisReply*>(redisCommand(ctx_, "PING")));
    t_ping = std::min(t_ping, now_seconds() - t);
    t = now_seconds();
    Reply g(static_cast<redisReply*>(redisCommand(ctx_, "GET %b", k.data(), k.size())));
    t_get = std::min(t_get, now_seconds() - t);
    if (!p || !g) {
      drop_connection();
      return {0, 0};
    }
  }
  Reply d(static_cast<redisReply*>(redisCommand(ctx_, "DEL %b", k.data(), k.size())));
  return {t_ping, t_get};
}

bool RedisStore::contains(const TierKey& key, const Hash128& ns_digest) {
  if (!ensure_connected()) return false;
  const std::string k = key_name(key, ns_digest);
  Reply r(static_cast<redisReply*>(redisCommand(ctx_, "EXISTS %b", k.data(), k.size())));
  if (!r || r->type != REDIS_REPLY_INTEGER) {
    ++n_errors_;
    drop_connection();
    return false;
  }
  return r->integer > 0;
}

void RedisStore::put(const TierKey& key, const TierRecord& rec) {
  if (!ensure_connected()) {
    ++stats_.n_write_failed;
    return;
  }
  const auto hb = static_cast<size_t>(block_record_header_bytes(id_.block_size));
  buf_.resize(hb + static_cast<size_t>(id_.payload_bytes));
  std::memcpy(buf_.data(), rec.header, hb);
  std::memcpy(buf_.data() + hb, rec.payload, static_cast<size_t>(id_.payload_bytes));
  const std::string k = key_name(key, read_record_header(rec.header).ns_digest);
  Reply r(static_cast<redisReply*>(
      redisCommand(ctx_, "SET %b %b", k.data(), k.size(), buf_.data(), buf_.size())));
  if (!r || r->type == REDIS_REPLY_ERROR) {
    // Down, slow, or out of memory under a noeviction policy.
    ++stats_.n_write_failed;
    ++n_errors_;
    if (!r) drop_connection();
    return;
  }
  ++stats_.n_stored;
  stats_.bytes_in += static_cast<int64_t>(buf_.size());
}

bool RedisStore::fetch(const TierKey& key, const Hash128& ns_digest,
                       std::span<const int32_t> tokens, uint8_t* dst) {
  if (!ensure_connected()) return false;
  const std::string k = key_name(key, ns_digest);
  Reply r(static_cast<redisReply*>(redisCommand(ctx_, "GET %b", k.data(), k.size())));
  if (!r) {
    ++n_errors_;
    drop_connection();
    return false;
  }
  if (r->type != REDIS_REPLY_STRING) return false;  // gone meanwhile (Redis evicted it)
  const auto hb = static_cast<size_t>(block_record_header_bytes(id_.block_size));
  BlockRecordCheck c = BlockRecordCheck::kCorrupt;
  if (r->len == hb + static_cast<size_t>(id_.payload_bytes)) {
    const auto* v = reinterpret_cast<const uint8_t*>(r->str);
    const BlockRecordKey want{
        .ns_digest = ns_digest, .hash = key.hash, .parent_hash = {}, .group = key.group};
    c = check_block_record(id_, want, tokens, v);
    if (c == BlockRecordCheck::kOk) {
      c = check_block_payload(
          v, std::span<const uint8_t>(v + hb, static_cast<size_t>(id_.payload_bytes)));
    }
    if (c == BlockRecordCheck::kOk) {
      std::memcpy(dst, v + hb, static_cast<size_t>(id_.payload_bytes));
      ++stats_.n_hits;
      stats_.bytes_out += id_.payload_bytes;
      return true;
    }
  }
  if (c == BlockRecordCheck::kIdentityMismatch) {
    ++stats_.n_identity_mismatch;
  } else {
    ++stats_.n_corrupt;
  }
  Reply d(static_cast<redisReply*>(redisCommand(ctx_, "DEL %b", k.data(), k.size())));
  if (!d) drop_connection();
  return false;
}

}  // namespace kvstack

#include "kv/redis_store.h"

#include <hiredis/hiredis.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/check.h"

namespace kvstack {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

// Writes all of s to a blocking socket (bounded by its SO_SNDTIMEO; a
// closed peer is an error, not a SIGPIPE).
bool write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t w = ::send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL);
    if (w > 0) {
      done += static_cast<size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else {
      return false;  // error or timeout
    }
  }
  return true;
}

// The reply stream of pipelined GETs, read from a blocking socket (each
// read bounded by its SO_RCVTIMEO): protocol lines through a small buffer,
// large values straight into their destination (one copy, the kernel's).
class RespStream {
 public:
  explicit RespStream(int fd) : fd_(fd), buf_(64 << 10) {}
  // The next line without its CRLF.
  bool line(std::string& out) {
    for (;;) {
      const auto* b = buf_.data() + pos_;
      const auto* nl = static_cast<const uint8_t*>(std::memchr(b, '\n', len_ - pos_));
      if (nl != nullptr) {
        const auto n = static_cast<size_t>(nl - b);
        if (n == 0 || b[n - 1] != '\r') return false;
        out.assign(reinterpret_cast<const char*>(b), n - 1);
        pos_ += n + 1;
        return true;
      }
      if (len_ - pos_ >= 4096) return false;  // no reply line is this long
      if (!fill()) return false;
    }
  }
  // The next n bytes into dst.
  bool bytes(uint8_t* dst, size_t n) {
    const size_t take = std::min(n, len_ - pos_);
    std::memcpy(dst, buf_.data() + pos_, take);
    pos_ += take;
    dst += take;
    n -= take;
    while (n >= buf_.size() / 4) {
      const ssize_t r = read_fd(dst, n);
      if (r <= 0) return false;
      dst += r;
      n -= static_cast<size_t>(r);
    }
    while (n > 0) {
      if (pos_ == len_ && !fill()) return false;
      const size_t t = std::min(n, len_ - pos_);
      std::memcpy(dst, buf_.data() + pos_, t);
      pos_ += t;
      dst += t;
      n -= t;
    }
    return true;
  }
  // Discards the next n bytes.
  bool skip(size_t n) {
    std::vector<uint8_t> junk(std::min<size_t>(n, 1 << 20));
    while (n > 0) {
      const size_t t = std::min(n, junk.size());
      if (!bytes(junk.data(), t)) return false;
      n -= t;
    }
    return true;
  }
  bool empty() const { return pos_ == len_; }

 private:
  ssize_t read_fd(uint8_t* dst, size_t n) {
    for (;;) {
      const ssize_t r = ::read(fd_, dst, n);
      if (r < 0 && errno == EINTR) continue;
      return r;  // 0: closed; < 0: error or timeout
    }
  }
  bool fill() {
    if (pos_ > 0) {
      std::memmove(buf_.data(), buf_.data() + pos_, len_ - pos_);
      len_ -= pos_;
      pos_ = 0;
    }
    const ssize_t r = read_fd(buf_.data() + len_, buf_.size() - len_);
    if (r <= 0) return false;
    len_ += static_cast<size_t>(r);
    return true;
  }
  int fd_;
  std::vector<uint8_t> buf_;
  size_t pos_ = 0, len_ = 0;
};

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
  ++n_round_trips_;
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
  const RedisKey k{.key = key, .ns_digest = ns_digest};
  return contains_many(std::span<const RedisKey>(&k, 1))[0] != 0;
}

std::vector<uint8_t> RedisStore::contains_many(std::span<const RedisKey> keys) {
  std::vector<uint8_t> out(keys.size(), 0);
  if (keys.empty() || !ensure_connected()) return out;
  for (const RedisKey& k : keys) {
    const std::string name = key_name(k.key, k.ns_digest);
    if (redisAppendCommand(ctx_, "EXISTS %b", name.data(), name.size()) != REDIS_OK) {
      ++n_errors_;
      drop_connection();
      return out;
    }
  }
  ++n_round_trips_;
  for (size_t i = 0; i < keys.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
      ++n_errors_;
      drop_connection();
      std::fill(out.begin(), out.end(), 0);
      return out;
    }
    const Reply r(static_cast<redisReply*>(raw));
    out[i] = r->type == REDIS_REPLY_INTEGER && r->integer > 0 ? 1 : 0;
  }
  return out;
}

void RedisStore::put(const TierKey& key, const TierRecord& rec) {
  put_many(std::span<const TierKey>(&key, 1), std::span<const TierRecord>(&rec, 1));
}

void RedisStore::put_many(std::span<const TierKey> keys, std::span<const TierRecord> records) {
  KV_CHECK(keys.size() == records.size(), "RedisStore::put_many: keys and records differ");
  if (keys.empty()) return;
  if (!ensure_connected()) {
    stats_.n_write_failed += static_cast<int64_t>(keys.size());
    return;
  }
  const auto hb = static_cast<size_t>(block_record_header_bytes(id_.block_size));
  const auto pb = static_cast<size_t>(id_.payload_bytes);
  std::vector<RedisKey> rk(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    rk[i] = {.key = keys[i], .ns_digest = read_record_header(records[i].header).ns_digest};
  }
  // Blocks another instance (or this one) stored already are not sent again.
  const std::vector<uint8_t> have = contains_many(rk);
  if (!connected()) {
    stats_.n_write_failed += static_cast<int64_t>(keys.size());
    return;
  }
  std::vector<size_t> todo;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (have[i] == 0) todo.push_back(i);
  }
  // SETs in batches of kRedisStoreBatchBytes: each batch one round trip.
  const size_t window = std::max<size_t>(1, static_cast<size_t>(kRedisStoreBatchBytes) / (hb + pb));
  for (size_t w = 0; w < todo.size(); w += window) {
    const size_t end = std::min(todo.size(), w + window);
    for (size_t t = w; t < end; ++t) {
      const size_t i = todo[t];
      // The command in Redis's protocol, built once here (header and
      // payload copied straight in) and copied once more by hiredis.
      const std::string k = key_name(rk[i].key, rk[i].ns_digest);
      const std::string head = "*3\r\n$3\r\nSET\r\n$" + std::to_string(k.size()) + "\r\n" + k +
                               "\r\n$" + std::to_string(hb + pb) + "\r\n";
      buf_.resize(head.size() + hb + pb + 2);
      uint8_t* o = buf_.data();
      std::memcpy(o, head.data(), head.size());
      std::memcpy(o + head.size(), records[i].header, hb);
      std::memcpy(o + head.size() + hb, records[i].payload, pb);
      std::memcpy(o + head.size() + hb + pb, "\r\n", 2);
      if (redisAppendFormattedCommand(ctx_, reinterpret_cast<const char*>(o), buf_.size()) !=
          REDIS_OK) {
        ++n_errors_;
        drop_connection();
        stats_.n_write_failed += static_cast<int64_t>(todo.size() - w);
        return;
      }
    }
    ++n_round_trips_;
    for (size_t t = w; t < end; ++t) {
      void* raw = nullptr;
      if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
        ++n_errors_;
        drop_connection();
        stats_.n_write_failed += static_cast<int64_t>(todo.size() - t);
        return;
      }
      const Reply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_ERROR) {
        // Out of memory under a noeviction policy.
        ++stats_.n_write_failed;
        ++n_errors_;
        continue;
      }
      ++stats_.n_stored;
      stats_.bytes_in += static_cast<int64_t>(hb + pb);
    }
  }
}

void RedisStore::delete_keys(std::span<const std::string> names) {
  if (names.empty() || ctx_ == nullptr) return;
  for (const std::string& k : names) {
    if (redisAppendCommand(ctx_, "DEL %b", k.data(), k.size()) != REDIS_OK) {
      drop_connection();
      return;
    }
  }
  ++n_round_trips_;
  for (size_t i = 0; i < names.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
      ++n_errors_;
      drop_connection();
      return;
    }
    freeReplyObject(raw);
  }
}

bool RedisStore::fetch(const TierKey& key, const Hash128& ns_digest,
                       std::span<const int32_t> tokens, uint8_t* dst) {
  const RedisFetch f{.key = key, .tokens = tokens, .dst = dst};
  return fetch_many(std::span<const RedisFetch>(&f, 1), ns_digest)[0] != 0;
}

std::vector<uint8_t> RedisStore::fetch_many(std::span<const RedisFetch> items,
                                            const Hash128& ns_digest,
                                            std::vector<double>* seconds) {
  std::vector<uint8_t> ok(items.size(), 0);
  if (seconds != nullptr) seconds->assign(items.size(), 0.0);
  if (items.empty() || !ensure_connected()) return ok;
  // hiredis has read every reply of the earlier commands (each call reads
  // all it sent); anything left would be a protocol slip: start afresh.
  if (ctx_->reader->pos != ctx_->reader->len) {
    drop_connection();
    next_connect_ = 0;
    if (!ensure_connected()) return ok;
  }
  const double t_start = now_seconds();
  const auto hb = static_cast<size_t>(block_record_header_bytes(id_.block_size));
  const auto pb = static_cast<size_t>(id_.payload_bytes);
  const size_t window = std::max<size_t>(2, static_cast<size_t>(kRedisPipelineBytes) / (hb + pb));
  std::vector<std::string> names(items.size());
  for (size_t i = 0; i < items.size(); ++i) names[i] = key_name(items[i].key, ns_digest);
  auto command = [&](size_t i) {
    return "*2\r\n$3\r\nGET\r\n$" + std::to_string(names[i].size()) + "\r\n" + names[i] + "\r\n";
  };
  auto fail = [&] {
    ++n_errors_;
    drop_connection();
    return ok;
  };
  const int fd = ctx_->fd;
  size_t sent = 0;
  {
    std::string first;
    for (; sent < std::min(window, items.size()); ++sent) first += command(sent);
    if (!write_all(fd, first)) return fail();
  }
  ++n_round_trips_;
  RespStream in(fd);
  std::vector<uint8_t> header(hb);
  std::vector<std::string> bad;
  std::string line;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!in.line(line)) return fail();
    // Keep the window full: the next GET goes out as each reply starts.
    if (sent < items.size() && !write_all(fd, command(sent++))) return fail();
    if (line.empty() || line[0] != '$') {
      if (!line.empty() && line[0] == '-') {
        ++n_errors_;  // an error reply (a key of another type): a miss
        continue;
      }
      return fail();  // not a reply to GET
    }
    char* end = nullptr;
    const long long n = std::strtoll(line.c_str() + 1, &end, 10);
    if (end == line.c_str() + 1 || *end != '\0') return fail();
    if (seconds != nullptr) (*seconds)[i] = now_seconds() - t_start;
    if (n < 0) continue;  // nil: gone meanwhile (Redis evicted it)
    const RedisFetch& f = items[i];
    BlockRecordCheck c = BlockRecordCheck::kCorrupt;
    if (static_cast<size_t>(n) == hb + pb) {
      // Header into a buffer, payload straight into the pool block.
      if (!in.bytes(header.data(), hb) || !in.bytes(f.dst, pb)) return fail();
      const BlockRecordKey want{
          .ns_digest = ns_digest, .hash = f.key.hash, .parent_hash = {}, .group = f.key.group};
      c = check_block_record(id_, want, f.tokens, header.data());
      if (c == BlockRecordCheck::kOk) {
        c = check_block_payload(header.data(), std::span<const uint8_t>(f.dst, pb));
      }
    } else if (!in.skip(static_cast<size_t>(n))) {
      return fail();
    }
    uint8_t crlf[2];
    if (!in.bytes(crlf, 2) || crlf[0] != '\r' || crlf[1] != '\n') return fail();
    if (seconds != nullptr) (*seconds)[i] = now_seconds() - t_start;
    if (c == BlockRecordCheck::kOk) {
      ok[i] = 1;
      ++stats_.n_hits;
      stats_.bytes_out += id_.payload_bytes;
      continue;
    }
    if (c == BlockRecordCheck::kIdentityMismatch) {
      ++stats_.n_identity_mismatch;
    } else {
      ++stats_.n_corrupt;
    }
    bad.push_back(names[i]);
  }
  if (!in.empty()) return fail();  // bytes past the last reply
  delete_keys(bad);
  return ok;
}

}  // namespace kvstack

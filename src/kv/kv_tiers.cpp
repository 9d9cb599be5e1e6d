#include "kv/kv_tiers.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <unordered_map>
#include <utility>

#include "kv/block_pool.h"
#include "kv/host_format.h"

namespace kvstack {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The identity of records stored in `f` (host_format.h): the pool's, with
// the format digest and payload size of the stored form, so that a record
// written in one format is an identity mismatch (a miss) for another.
BlockRecordIdentity local_identity(const BlockRecordIdentity& id, HostFormat f) {
  if (f == HostFormat::kPool) return id;
  BlockRecordIdentity l = id;
  const std::string s =
      "kvstack-host-format-v1\n" + id.format_digest.hex() + "\nint8-g32-f16-scale";
  l.format_digest = hash128(s.data(), s.size());
  l.payload_bytes = int8_block_bytes(id.payload_bytes);
  return l;
}

}  // namespace

Result<std::unique_ptr<KvTiers>> KvTiers::create(PrefixIndex& index, const CacheIdentity& identity,
                                                 const KvTierConfig& config) {
  BlockPool& pool = index.pool();
  const BlockRecordIdentity id =
      block_record_identity(identity, pool.block_size(), pool.block_bytes());
  if (config.host_format == HostFormat::kInt8) {
    const KvLayout& layout = pool.layout();
    for (int l = 0; l < layout.n_layers(); ++l) {
      const KvLayerSpec& spec = layout.layer(l);
      if (spec.dtype != KvDtype::kF16 || spec.value_dtype() != KvDtype::kF16) {
        return make_error(Errc::kInvalidArgument,
                          "--kv-host-format int8 needs an f16 KV pool (layer " + std::to_string(l) +
                              " is not f16; see --kv-dtype)");
      }
    }
    if (pool.block_bytes() % 64 != 0) {
      return make_error(Errc::kInvalidArgument,
                        "--kv-host-format int8: block bytes not a multiple of 64");
    }
    if (config.host_bytes <= 0 && config.disk_dir.empty()) {
      return make_error(Errc::kInvalidArgument,
                        "--kv-host-format int8 needs --kv-host-mem or --kv-disk");
    }
  }
  std::unique_ptr<KvTiers> t(new KvTiers(index, config, id));
  // Host and disk hold records in the host format; Redis the pool's own.
  const BlockRecordIdentity lid = t->local_id_;
  if (config.host_bytes > 0) {
    auto h = HostStore::create(lid, config.host_bytes);
    if (!h) return h.error();
    t->host_ = std::move(*h);
  }
  if (!config.disk_dir.empty()) {
    if (config.disk_bytes <= 0) {
      return make_error(Errc::kInvalidArgument, "--kv-disk needs --kv-disk-size SIZE (> 0)");
    }
    auto d = DiskStore::open(lid, config.disk_dir, config.disk_bytes, config.disk_direct_io);
    if (!d) return d.error();
    t->disk_ = std::move(*d);
  } else if (config.disk_bytes > 0) {
    return make_error(Errc::kInvalidArgument, "--kv-disk-size needs --kv-disk DIR");
  }
  if (!config.redis_url.empty()) {
    auto r = RedisStore::open(id, config.redis_url, config.redis_timeout_ms);
    if (!r) return r.error();
    t->redis_ = std::move(*r);
  }
  if (config.write_through && !t->host_) {
    return make_error(Errc::kInvalidArgument, "--kv-host-write-through needs --kv-host-mem");
  }
  t->measure_costs();
  KvTiers* self = t.get();
  index.set_tier_hooks({.on_evict = [self](int32_t b) { self->on_evict(b); },
                        .on_publish = [self](int32_t b) { self->on_publish(b); },
                        .on_publish_end = [self] { self->flush_redis_stores(); }});
  return t;
}

KvTiers::KvTiers(PrefixIndex& index, KvTierConfig config, BlockRecordIdentity id)
    : index_(index),
      config_(std::move(config)),
      id_(id),
      local_id_(local_identity(id, config_.host_format)),
      hdr_(static_cast<size_t>(block_record_header_bytes(id.block_size))),
      conv_(static_cast<size_t>(local_id_.payload_bytes)) {}

KvTiers::~KvTiers() {
  index_.set_tier_hooks({});
}

TierRecord KvTiers::pool_record(int32_t block, uint8_t* hdr) {
  if (hdr == nullptr) hdr = hdr_.data();
  const CachedBlockInfo info = index_.cached_block_info(block);
  const uint8_t* payload = index_.pool().block_data(BlockId{block});
  write_block_record_header(
      id_,
      {.ns_digest = info.ns_digest,
       .hash = info.hash,
       .parent_hash = info.parent_hash,
       .group = info.group},
      info.tokens, std::span<const uint8_t>(payload, static_cast<size_t>(id_.payload_bytes)), hdr);
  return {.header = hdr, .payload = payload};
}

TierRecord KvTiers::local_record(int32_t block) {
  if (config_.host_format == HostFormat::kPool) return pool_record(block);
  const CachedBlockInfo info = index_.cached_block_info(block);
  const uint8_t* payload = index_.pool().block_data(BlockId{block});
  const double t0 = now_seconds();
  encode_int8_block(payload, id_.payload_bytes, conv_.data());
  encode_seconds_ += now_seconds() - t0;
  ++n_encoded_;
  write_block_record_header(local_id_,
                            {.ns_digest = info.ns_digest,
                             .hash = info.hash,
                             .parent_hash = info.parent_hash,
                             .group = info.group},
                            info.tokens, conv_, hdr_.data());
  return {.header = hdr_.data(), .payload = conv_.data()};
}

void KvTiers::to_disk(const TierKey& key, const TierRecord& rec) {
  if (!disk_) {
    ++n_dropped_;
    return;
  }
  if (disk_->contains(key)) return;
  disk_->put(key, rec);
}

void KvTiers::on_evict(int32_t block) {
  if (!redis_staged_.empty()) flush_redis_stores();  // before any block leaves the pool
  const CachedBlockInfo info = index_.cached_block_info(block);
  if (info.has_extra) return;
  const TierKey key{.hash = info.hash, .group = info.group};
  if (host_) {
    if (host_->contains(key)) {
      // Write-through: the copy is already there.
      host_->put(key, {}, [](const TierKey&, const TierRecord&) {});
      return;
    }
    const TierRecord rec = local_record(block);
    host_->put(key, rec, [&](const TierKey& k, const TierRecord& r) {
      if (disk_ && !disk_->contains(k)) ++n_demoted_;
      to_disk(k, r);
    });
    return;
  }
  if (disk_ && !disk_->contains(key)) disk_->put(key, local_record(block));
}

void KvTiers::on_publish(int32_t block) {
  const CachedBlockInfo info = index_.cached_block_info(block);
  if (info.has_extra) return;
  const TierKey key{.hash = info.hash, .group = info.group};
  // The shared store gets every published block (other instances may want
  // it now, not when this one evicts it), batched per publish.
  if (redis_) redis_staged_.push_back(block);
  if (!host_) return;
  if (!config_.write_through) {
    // Write-back: the pool holds the block again; its host copy goes.
    host_->erase(key);
    return;
  }
  if (host_->contains(key)) return;
  const TierRecord rec = local_record(block);
  host_->put(key, rec, [&](const TierKey& k, const TierRecord& r) {
    if (disk_ && !disk_->contains(k)) ++n_demoted_;
    to_disk(k, r);
  });
}

void KvTiers::flush_redis_stores() {
  if (redis_staged_.empty()) return;
  const auto hb = static_cast<size_t>(block_record_header_bytes(id_.block_size));
  std::vector<uint8_t> headers(hb * redis_staged_.size());
  std::vector<TierKey> keys;
  std::vector<TierRecord> recs;
  keys.reserve(redis_staged_.size());
  recs.reserve(redis_staged_.size());
  for (size_t i = 0; i < redis_staged_.size(); ++i) {
    const int32_t b = redis_staged_[i];
    const CachedBlockInfo info = index_.cached_block_info(b);
    keys.push_back({.hash = info.hash, .group = info.group});
    recs.push_back(pool_record(b, headers.data() + i * hb));
  }
  redis_staged_.clear();
  redis_->put_many(keys, recs);
}

void KvTiers::measure_costs() {
  // Host: copies of 1 and 4 blocks (beta from the difference, t0 from the
  // single one). Disk: DiskStore::probe_read_seconds (a 4 KiB read for
  // t0, a 4-slot read for beta).
  const int64_t bb = local_id_.payload_bytes;
  auto fit = [&](double t1, double t4) {
    TierCost c;
    const double dt = std::max(t4 - t1, 1e-9);
    c.bytes_per_s = 3.0 * static_cast<double>(bb) / dt;
    c.t0_s = std::max(0.0, t1 - static_cast<double>(bb) / c.bytes_per_s);
    return c;
  };
  std::vector<uint8_t> src(static_cast<size_t>(4 * bb), 1);
  std::vector<uint8_t> dst(static_cast<size_t>(4 * bb), 0);
  if (host_) {
    double best1 = 1e30, best4 = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      double t0 = now_seconds();
      std::memcpy(dst.data(), src.data(), static_cast<size_t>(bb));
      best1 = std::min(best1, now_seconds() - t0);
      t0 = now_seconds();
      std::memcpy(dst.data(), src.data(), static_cast<size_t>(4 * bb));
      best4 = std::min(best4, now_seconds() - t0);
    }
    cost_.host = fit(best1, best4);
  }
  if (config_.host_format != HostFormat::kPool) {
    // t_convert: decoding one block from the host format (best of 3).
    std::vector<uint8_t> block(static_cast<size_t>(id_.payload_bytes), 0x3c);
    encode_int8_block(block.data(), id_.payload_bytes, conv_.data());
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const double t0 = now_seconds();
      decode_int8_block(conv_.data(), id_.payload_bytes, block.data());
      best = std::min(best, now_seconds() - t0);
    }
    cost_.convert_s = best;
  }
  if (disk_) {
    const auto [t_small, t_big] = disk_->probe_read_seconds();
    if (t_big > 0) {
      const double slot = static_cast<double>(disk_->stats().slot_bytes);
      cost_.disk.t0_s = t_small;
      // The transfer part of the big read (at least half of it: the two
      // timings are noisy on a shared machine).
      cost_.disk.bytes_per_s = 4 * slot / std::max(t_big - t_small, 0.5 * t_big);
    }
  }
  if (redis_) {
    const auto [t_ping, t_get] = redis_->probe_seconds();
    if (t_get > 0) {
      cost_.redis.t0_s = t_ping;
      cost_.redis.bytes_per_s =
          static_cast<double>(id_.payload_bytes) / std::max(t_get - t_ping, 0.5 * t_get);
    }
  }
}

double KvTiers::block_transfer_s(const TierKey& key, bool with_t0) const {
  const bool host = in_host(key), local = host || in_disk(key);
  const TierCost& c = host ? cost_.host : local ? cost_.disk : cost_.redis;
  // Local tiers move the stored form, then decode it (t_convert).
  const double bytes = static_cast<double>(local ? local_id_.payload_bytes : id_.payload_bytes);
  return (with_t0 ? c.t0_s : 0.0) + (c.bytes_per_s > 0 ? bytes / c.bytes_per_s : 0.0) +
         (local ? cost_.convert_s : 0.0);
}

void KvTiers::note_fetch(TierCost& c, int64_t bytes, double seconds) {
  if (cost_frozen_ || c.bytes_per_s <= 0) return;
  const double transfer = std::max(seconds - c.t0_s, 1e-9);
  c.bytes_per_s = 0.8 * c.bytes_per_s + 0.2 * static_cast<double>(bytes) / transfer;
}

bool KvTiers::fetch(const TierKey& key, const Hash128& ns_digest, std::span<const int32_t> tokens,
                    int32_t dst) {
  const double t0 = now_seconds();
  uint8_t* out = index_.pool().block_data(BlockId{dst});
  // Host and disk records in the host format are read into conv_ and
  // decoded into the pool block; the conversion's time is kept apart.
  const bool convert = config_.host_format != HostFormat::kPool;
  uint8_t* local_out = convert ? conv_.data() : out;
  double t_convert = 0;
  auto decode = [&] {
    if (!convert) return;
    const double c0 = now_seconds();
    decode_int8_block(conv_.data(), id_.payload_bytes, out);
    t_convert = now_seconds() - c0;
    decode_seconds_ += t_convert;
    ++n_decoded_;
    if (!cost_frozen_) {
      cost_.convert_s = cost_.convert_s > 0 ? 0.8 * cost_.convert_s + 0.2 * t_convert : t_convert;
    }
  };
  auto throttle = [&] {
    if (throttle_bytes_per_s_ <= 0) return;
    const double until = t0 + static_cast<double>(id_.payload_bytes) / throttle_bytes_per_s_;
    const double left = until - now_seconds();
    if (left > 0) std::this_thread::sleep_for(std::chrono::duration<double>(left));
  };
  if (host_) {
    const TierRecord r = host_->peek(key);
    if (r.header != nullptr) {
      const BlockRecordKey want{
          .ns_digest = ns_digest, .hash = key.hash, .parent_hash = {}, .group = key.group};
      if (check_block_record(local_id_, want, tokens, r.header) == BlockRecordCheck::kOk &&
          host_->fetch(key, local_out)) {
        decode();
        throttle();
        const double dt = now_seconds() - t0;
        host_->add_fetch_latency(dt);
        note_fetch(cost_.host, local_id_.payload_bytes, dt - t_convert);
        return true;
      }
      host_->erase(key);
    }
  }
  if (disk_ && disk_->fetch(key, ns_digest, tokens, local_out)) {
    decode();
    throttle();
    const double dt = now_seconds() - t0;
    disk_->add_fetch_latency(dt);
    note_fetch(cost_.disk, local_id_.payload_bytes, dt - t_convert);
    return true;
  }
  if (redis_ && redis_->fetch(key, ns_digest, tokens, out)) {
    throttle();
    const double dt = now_seconds() - t0;
    redis_->add_fetch_latency(dt);
    note_fetch(cost_.redis, id_.payload_bytes, dt);
    return true;
  }
  return false;
}

bool KvTiers::fetch_remote(std::span<const RedisFetch> items, const Hash128& ns_digest) {
  const double t0 = now_seconds();
  std::vector<double> at;
  const std::vector<uint8_t> ok = redis_->fetch_many(items, ns_digest, &at);
  const auto n = static_cast<int64_t>(items.size());
  if (throttle_bytes_per_s_ > 0) {
    const double until = t0 + static_cast<double>(n * id_.payload_bytes) / throttle_bytes_per_s_;
    const double left = until - now_seconds();
    if (left > 0) std::this_thread::sleep_for(std::chrono::duration<double>(left));
  }
  const double dt = now_seconds() - t0;
  // Per block: the time between its reply and the previous one (the
  // pipeline's share of each block; the first carries the round trip).
  double prev = 0;
  int64_t n_ok = 0;
  for (size_t i = 0; i < ok.size(); ++i) {
    if (ok[i] == 0) continue;
    redis_->add_fetch_latency(std::max(0.0, at[i] - prev));
    prev = at[i];
    ++n_ok;
  }
  if (n_ok == n) note_fetch(cost_.redis, n * id_.payload_bytes, dt);
  return n_ok == n;
}

int64_t KvTiers::extend_match(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                              PrefixMatch& m, bool count_stats, bool find_partial) {
  const int64_t added = extend_full(ns, tokens, max_tokens, m, count_stats);
  return find_partial ? added + extend_partial(ns, tokens, max_tokens, m, count_stats) : added;
}

int64_t KvTiers::extend_partial(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                                PrefixMatch& m, bool count_stats) {
  BlockPool& pool = index_.pool();
  const int64_t p = pool.block_size();
  // Single-group tables only (BlockTable::adopt_partial_copy).
  if (pool.n_groups() != 1 || ns == kNoNamespace || m.partial.valid()) return 0;
  max_tokens = std::clamp<int64_t>(max_tokens, 0, static_cast<int64_t>(tokens.size()));
  const int64_t n = max_tokens / p;
  const int64_t r = max_tokens - n * p;
  // The tail block must be the next block of the match.
  if (r == 0 || static_cast<int64_t>(m.blocks.size()) != n) return 0;
  auto block_tokens = [&](int64_t i) { return tokens.subspan(static_cast<size_t>(i * p), p); };
  // The chain hash of block n - 1 (zero at the top).
  const std::vector<int32_t> nodes = index_.chain(ns, tokens, max_tokens);
  Hash128 parent{};
  int64_t i = 0;
  if (!nodes.empty()) {
    parent = index_.block_hash(nodes.back());
    i = static_cast<int64_t>(nodes.size());
  }
  for (; i < n; ++i) parent = index_.chain_hash(parent, ns, block_tokens(i));
  const Hash128 ns_digest = index_.namespace_digest(ns);
  // 1. The request holds the whole tail block: look it up by its hash in
  // every tier.
  TierKey key{};
  bool found = false, local = false;
  std::vector<int32_t> stored;  // the candidate record's P tokens
  if (static_cast<int64_t>(tokens.size()) >= (n + 1) * p) {
    key = {.hash = index_.chain_hash(parent, ns, block_tokens(n)), .group = 0};
    local = in_host(key) || in_disk(key);
    found = local || (redis_ && redis_->contains(key, ns_digest));
    if (found) stored.assign(block_tokens(n).begin(), block_tokens(n).end());
  }
  // 2. Otherwise a host block under the same parent whose first tokens are
  // the request's (its tail completed by tokens this request does not
  // have, e.g. a previous answer), the longest such, as the pool's
  // partial-block search picks.
  int64_t take = r;
  if (!found && host_) {
    int64_t best = 0;
    for (const TierKey& c : host_->children(parent)) {
      const TierRecord rec = host_->peek(c);
      const BlockRecordKey want{
          .ns_digest = ns_digest, .hash = c.hash, .parent_hash = parent, .group = 0};
      if (check_block_record(local_id_, want, {}, rec.header) != BlockRecordCheck::kOk) continue;
      std::vector<int32_t> t = record_tokens(rec.header);
      int64_t common = 0;
      while (common < r &&
             t[static_cast<size_t>(common)] == tokens[static_cast<size_t>(n * p + common)]) {
        ++common;
      }
      if (common > best) {
        best = common;
        key = c;
        stored = std::move(t);
      }
    }
    found = local = best > 0;
    take = best;
  }
  if (!found) return 0;
  // Fetch or recompute: one block's fetch against prefilling its tokens.
  if (cost_.prefill_tokens_per_s > 0) {
    const double t_fetch = block_transfer_s(key, true);
    const double t_recompute = static_cast<double>(take) / cost_.prefill_tokens_per_s;
    last_fetch_s_ = t_fetch;
    last_recompute_s_ = t_recompute;
    if (t_recompute < t_fetch) {
      ++n_decide_recompute_;
      return 0;
    }
  }
  auto b = pool.allocate(0);
  if (!b) {
    ++n_promote_failed_;
    return 0;
  }
  bool ok = false;
  if (local) {
    ok = fetch(key, ns_digest, stored, b->id().value);
  } else {
    const RedisFetch f{.key = key, .tokens = stored, .dst = pool.block_data(b->id())};
    ok = fetch_remote(std::span<const RedisFetch>(&f, 1), ns_digest);
  }
  if (!ok) return 0;  // entry dropped; the tokens are recomputed
  // An unpublished private block: the sequence copies its first `take` slots.
  m.partial = std::move(*b);
  m.n_partial_tokens = take;
  ++n_promoted_;
  ++n_partial_hits_;
  ++n_decide_fetch_;
  n_hit_tokens_ += take;
  if (count_stats) index_.count_tier_hit(ns, 0, take);
  return take;
}

int64_t KvTiers::extend_full(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                             PrefixMatch& m, bool count_stats) {
  BlockPool& pool = index_.pool();
  const int64_t p = pool.block_size();
  const int n_groups = pool.n_groups();
  max_tokens = std::clamp<int64_t>(max_tokens, 0, static_cast<int64_t>(tokens.size()));
  const int64_t n_max = max_tokens / p;
  const auto k0 = static_cast<int64_t>(m.blocks.size());
  // Write-backs queued since the last lookup go out as one batch first.
  if (disk_) disk_->write_batch();
  if (k0 >= n_max || ns == kNoNamespace) return 0;
  const Hash128 ns_digest = index_.namespace_digest(ns);
  auto first_of = [&](int g, int64_t k) -> int64_t {
    const KvGroup& gr = pool.group(g);
    return gr.drops_blocks ? std::max<int64_t>(0, k * p - gr.window + 1) / p : 0;
  };
  auto block_tokens = [&](int64_t i) { return tokens.subspan(static_cast<size_t>(i * p), p); };
  // Each failed read drops its entry, so a retry sees a smaller plan.
  for (int attempt = 0; attempt < 16; ++attempt) {
    const std::vector<int32_t> nodes = index_.chain(ns, tokens, max_tokens);
    const auto j = static_cast<int64_t>(nodes.size());
    std::vector<Hash128> hashes;
    hashes.reserve(static_cast<size_t>(n_max));
    for (int32_t b : nodes) hashes.push_back(index_.block_hash(b));
    // Chain hashes of the blocks past the pool's chain (what publish()
    // would give them), computed as far as they are asked for.
    std::vector<Hash128> cand;
    auto cand_hash = [&](int64_t i) -> const Hash128& {
      while (j + static_cast<int64_t>(cand.size()) <= i) {
        const int64_t c = j + static_cast<int64_t>(cand.size());
        const Hash128 parent = c == 0   ? Hash128{}
                               : c <= j ? hashes[static_cast<size_t>(c - 1)]
                                        : cand[static_cast<size_t>(c - 1 - j)];
        cand.push_back(index_.chain_hash(parent, ns, block_tokens(c)));
      }
      return cand[static_cast<size_t>(i - j)];
    };
    // Redis presence, asked in pipelined batches (one round trip each) and
    // remembered for this attempt.
    std::unordered_map<TierKey, uint8_t, TierKeyHash> remote;
    auto ask_remote = [&](const std::vector<TierKey>& keys) {
      std::vector<RedisKey> ask;
      for (const TierKey& k : keys) {
        if (!remote.contains(k)) ask.push_back({.key = k, .ns_digest = ns_digest});
      }
      if (ask.empty()) return;
      const std::vector<uint8_t> have = redis_->contains_many(ask);
      for (size_t i = 0; i < ask.size(); ++i) remote[ask[i].key] = have[i];
    };
    auto local_has = [&](const TierKey& k) { return in_host(k) || in_disk(k); };
    auto has = [&](const TierKey& k) {
      if (local_has(k)) return true;
      if (!redis_) return false;
      if (!remote.contains(k)) ask_remote({k});
      return remote[k] != 0;
    };
    // The chain walk: a block missing locally asks Redis for it and the
    // next batch - 1 candidates at once (8, 16, ... 512: a long hit costs
    // a few round trips, a miss one small one).
    int64_t batch = 8;
    for (int64_t i = j; i < n_max; ++i) {
      const TierKey key{.hash = cand_hash(i), .group = 0};
      if (redis_ && !local_has(key) && !remote.contains(key)) {
        std::vector<TierKey> ask;
        for (int64_t a = i; a < std::min(n_max, i + batch); ++a) {
          const TierKey ka{.hash = cand_hash(a), .group = 0};
          if (!local_has(ka)) ask.push_back(ka);
        }
        ask_remote(ask);
        batch = std::min<int64_t>(2 * batch, 512);
      }
      if (!has(key)) break;
      hashes.push_back(key.hash);
    }
    auto pool_companion = [&](int64_t i, int g) {
      return i < j ? index_.companion(nodes[static_cast<size_t>(i)], g) : kNullBlock;
    };
    // Group g's blocks [from, to) not in the pool nor local: one batch.
    auto ask_group = [&](int g, int64_t from, int64_t to) {
      if (!redis_) return;
      std::vector<TierKey> ask;
      for (int64_t i = from; i < to; ++i) {
        const TierKey k{.hash = hashes[static_cast<size_t>(i)], .group = g};
        if (pool_companion(i, g) == kNullBlock && !local_has(k)) ask.push_back(k);
      }
      ask_remote(ask);
    };
    auto available = [&](int64_t i, int g) {
      return pool_companion(i, g) != kNullBlock ||
             has({.hash = hashes[static_cast<size_t>(i)], .group = g});
    };
    auto k = static_cast<int64_t>(hashes.size());
    for (; k > 0; --k) {
      bool ok = true;
      for (int g = 1; g < n_groups && ok; ++g) {
        ask_group(g, first_of(g, k), k);
        for (int64_t b = first_of(g, k); b < k && ok; ++b) ok = available(b, g);
      }
      if (ok) break;
    }
    if (k <= k0) return 0;
    // Every pool block first (references keep them from eviction while the
    // promoted blocks are allocated), then the tier blocks.
    std::vector<BlockRef> blocks;
    std::vector<std::vector<BlockRef>> group_blocks(static_cast<size_t>(n_groups - 1));
    std::vector<int64_t> group_first(static_cast<size_t>(n_groups - 1), 0);
    struct Promote {
      int64_t i;
      int g;
      BlockRef* slot;
    };
    blocks.resize(static_cast<size_t>(k - k0));
    std::vector<Promote> todo;
    for (int64_t i = k0; i < k; ++i) {
      BlockRef& r = blocks[static_cast<size_t>(i - k0)];
      if (i < j) {
        r = pool.ref_block(BlockId{nodes[static_cast<size_t>(i)]});
      } else {
        todo.push_back({i, 0, &r});
      }
    }
    for (int g = 1; g < n_groups; ++g) {
      const int64_t first = first_of(g, k);
      auto& gb = group_blocks[static_cast<size_t>(g - 1)];
      group_first[static_cast<size_t>(g - 1)] = first;
      gb.resize(static_cast<size_t>(k - first));
      for (int64_t i = first; i < k; ++i) {
        const int32_t c = pool_companion(i, g);
        BlockRef& r = gb[static_cast<size_t>(i - first)];
        if (c != kNullBlock) {
          r = pool.ref_block(BlockId{c});
        } else {
          todo.push_back({i, g, &r});
        }
      }
    }
    // Releases what this attempt took, deepest first (the chain rule:
    // children before parents).
    auto drop_all = [&] {
      for (auto& gb : group_blocks) {
        while (!gb.empty()) gb.pop_back();
      }
      while (!blocks.empty()) blocks.pop_back();
    };
    // Fetch or recompute (spec section 9): the estimated time to bring the
    // tier blocks in against prefilling the tokens they add.
    if (cost_.prefill_tokens_per_s > 0 && !todo.empty()) {
      double t_fetch = 0;
      bool any_remote = false;
      for (const Promote& t : todo) {
        const TierKey key{.hash = hashes[static_cast<size_t>(t.i)], .group = t.g};
        const bool remote_block = !in_host(key) && !in_disk(key);
        // Redis blocks are one pipelined stream: one t0 for all of them.
        t_fetch += block_transfer_s(key, !remote_block || !any_remote);
        any_remote |= remote_block;
      }
      const double t_recompute = static_cast<double>((k - k0) * p) / cost_.prefill_tokens_per_s;
      last_fetch_s_ = t_fetch;
      last_recompute_s_ = t_recompute;
      if (t_recompute < t_fetch) {
        ++n_decide_recompute_;
        drop_all();
        return 0;
      }
    }
    // Host and disk blocks are read as their pool blocks are allocated;
    // Redis blocks are gathered and read as one pipelined stream after.
    bool failed = false;
    std::vector<RedisFetch> remote_todo;
    std::vector<BlockRef*> remote_slots;
    std::vector<BlockRef> remote_refs;
    remote_refs.reserve(todo.size());
    for (const Promote& t : todo) {
      auto r = pool.allocate(t.g);
      if (!r) {
        ++n_promote_failed_;
        remote_refs.clear();
        drop_all();
        return 0;  // pool full: keep the pool-only match
      }
      const TierKey key{.hash = hashes[static_cast<size_t>(t.i)], .group = t.g};
      if (redis_ && !in_host(key) && !in_disk(key)) {
        remote_todo.push_back(
            {.key = key, .tokens = block_tokens(t.i), .dst = pool.block_data(r->id())});
        remote_slots.push_back(t.slot);
        remote_refs.push_back(std::move(*r));
        continue;
      }
      if (!fetch(key, ns_digest, block_tokens(t.i), r->id().value)) {
        failed = true;  // entry dropped (corrupt, foreign or evicted meanwhile)
        break;
      }
      *t.slot = std::move(*r);
    }
    if (!failed && !remote_todo.empty()) {
      failed = !fetch_remote(remote_todo, ns_digest);
      for (size_t i = 0; i < remote_refs.size() && !failed; ++i) {
        *remote_slots[i] = std::move(remote_refs[i]);
      }
    }
    if (failed) {
      remote_refs.clear();
      drop_all();
      continue;
    }
    const int64_t before = m.n_tokens();
    m.partial.reset();
    m.n_partial_tokens = 0;
    for (BlockRef& r : blocks) m.blocks.push_back(std::move(r));
    if (n_groups > 1) {
      for (auto& gb : m.group_blocks) {
        while (!gb.empty()) gb.pop_back();
      }
      m.group_blocks = std::move(group_blocks);
      m.group_first = std::move(group_first);
    }
    n_promoted_ += static_cast<int64_t>(todo.size());
    ++n_decide_fetch_;
    const int64_t added = m.n_tokens() - before;
    n_hit_tokens_ += added;
    if (count_stats) index_.count_tier_hit(ns, k - k0, added);
    return added;
  }
  return 0;
}

void KvTiers::persist() {
  if (!disk_) return;
  const BlockPool& pool = index_.pool();
  for (int32_t b = 0; b < pool.n_blocks(); ++b) {
    if (pool.state(BlockId{b}) == BlockState::kFree || !index_.is_published(b)) continue;
    const CachedBlockInfo info = index_.cached_block_info(b);
    if (info.has_extra) continue;
    const TierKey key{.hash = info.hash, .group = info.group};
    if (disk_->contains(key)) continue;
    disk_->put(key, local_record(b));
    ++n_persisted_;
  }
  if (host_) {
    for (const TierKey& k : host_->keys()) {
      if (disk_->contains(k)) continue;
      disk_->put(k, host_->peek(k));
      ++n_persisted_;
    }
  }
  disk_->flush();
}

KvTiersStats KvTiers::stats() const {
  KvTiersStats s;
  s.enabled = true;
  s.write_through = config_.write_through;
  if (host_) s.tiers.push_back(host_->stats());
  if (disk_) s.tiers.push_back(disk_->stats());
  if (redis_) s.tiers.push_back(redis_->stats());
  s.n_promoted = n_promoted_;
  s.n_promote_failed = n_promote_failed_;
  s.n_hit_tokens = n_hit_tokens_;
  s.n_demoted = n_demoted_;
  s.n_dropped = n_dropped_;
  s.n_persisted = n_persisted_;
  s.n_prefetched = n_prefetched_;
  s.n_partial_hits = n_partial_hits_;
  s.host_format = host_format_name(config_.host_format);
  s.pool_block_bytes = id_.payload_bytes;
  s.stored_block_bytes = local_id_.payload_bytes;
  s.n_encoded = n_encoded_;
  s.n_decoded = n_decoded_;
  s.encode_seconds = encode_seconds_;
  s.decode_seconds = decode_seconds_;
  s.cost = cost_;
  s.n_decide_fetch = n_decide_fetch_;
  s.n_decide_recompute = n_decide_recompute_;
  s.last_fetch_s = last_fetch_s_;
  s.last_recompute_s = last_recompute_s_;
  return s;
}

void KvTiers::check_invariants() const {
  if (host_) host_->check_invariants();
  if (disk_) disk_->check_invariants();
  if (!host_ || config_.write_through) return;
  const BlockPool& pool = index_.pool();
  for (int32_t b = 0; b < pool.n_blocks(); ++b) {
    if (pool.state(BlockId{b}) == BlockState::kFree || !index_.is_published(b)) continue;
    const CachedBlockInfo info = index_.cached_block_info(b);
    KV_CHECK(!host_->contains({.hash = info.hash, .group = info.group}),
             "KvTiers: a block is both in the pool and on the host (write-back)");
  }
}

}  // namespace kvstack

// Output of the tier statistics (kv_tiers.h): /v1/kv/stats JSON, /metrics
// Prometheus text and the `run --kv-stats` table.
#include <array>
#include <cstdio>
#include <span>
#include <string>

#include "core/prometheus_text.h"
#include "kv/kv_tiers.h"

namespace kvstack {

std::string kv_tiers_stats_json(const KvTiersStats& s) {
  std::string out = "{\"enabled\": ";
  out += s.enabled ? "true" : "false";
  out += ", \"write_through\": ";
  out += s.write_through ? "true" : "false";
  auto field = [&](std::string& o, const char* k, int64_t v) {
    o += ", \"";
    o += k;
    o += "\": " + std::to_string(v);
  };
  field(out, "promoted", s.n_promoted);
  field(out, "promote_failed", s.n_promote_failed);
  field(out, "hit_tokens", s.n_hit_tokens);
  field(out, "demoted", s.n_demoted);
  field(out, "dropped", s.n_dropped);
  field(out, "persisted", s.n_persisted);
  field(out, "prefetched", s.n_prefetched);
  field(out, "partial_hits", s.n_partial_hits);
  out += ", \"host_format\": \"" + s.host_format + "\"";
  field(out, "pool_block_bytes", s.pool_block_bytes);
  field(out, "stored_block_bytes", s.stored_block_bytes);
  field(out, "encoded", s.n_encoded);
  field(out, "decoded", s.n_decoded);
  {
    char buf[128];
    std::snprintf(buf, sizeof(buf), ", \"encode_seconds\": %.6f, \"decode_seconds\": %.6f",
                  s.encode_seconds, s.decode_seconds);
    out += buf;
  }
  field(out, "decide_fetch", s.n_decide_fetch);
  field(out, "decide_recompute", s.n_decide_recompute);
  {
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  ", \"cost\": {\"host_t0_s\": %.3g, \"host_bytes_per_s\": %.4g, "
                  "\"disk_t0_s\": %.3g, \"disk_bytes_per_s\": %.4g, "
                  "\"redis_t0_s\": %.3g, \"redis_bytes_per_s\": %.4g, "
                  "\"convert_s\": %.3g, \"prefill_tokens_per_s\": %.4g, \"last_fetch_s\": %.4g, "
                  "\"last_recompute_s\": %.4g}",
                  s.cost.host.t0_s, s.cost.host.bytes_per_s, s.cost.disk.t0_s,
                  s.cost.disk.bytes_per_s, s.cost.redis.t0_s, s.cost.redis.bytes_per_s,
                  s.cost.convert_s, s.cost.prefill_tokens_per_s, s.last_fetch_s,
                  s.last_recompute_s);
    out += buf;
  }
  out += ", \"tiers\": [";
  for (size_t i = 0; i < s.tiers.size(); ++i) {
    const TierStoreStats& t = s.tiers[i];
    std::string o = "{\"name\": \"" + t.name + "\"";
    field(o, "capacity_bytes", t.capacity_bytes);
    field(o, "slot_bytes", t.slot_bytes);
    field(o, "slots", t.n_slots);
    field(o, "blocks", t.n_blocks);
    field(o, "used_bytes", t.n_blocks * t.slot_bytes);
    field(o, "stored", t.n_stored);
    field(o, "bytes_in", t.bytes_in);
    field(o, "hits", t.n_hits);
    field(o, "bytes_out", t.bytes_out);
    field(o, "evicted", t.n_evicted);
    field(o, "erased", t.n_erased);
    field(o, "corrupt", t.n_corrupt);
    field(o, "identity_mismatch", t.n_identity_mismatch);
    field(o, "write_failed", t.n_write_failed);
    field(o, "errors", t.n_errors);
    field(o, "round_trips", t.n_round_trips);
    char buf[64];
    std::snprintf(buf, sizeof(buf), ", \"fetch_seconds\": %.6f", t.fetch_seconds);
    o += buf;
    o += ", \"direct_io\": ";
    o += t.direct_io ? "true" : "false";
    o += ", \"fetch_hist_us\": [";
    for (size_t b = 0; b < t.fetch_hist.size(); ++b) {
      const double le = kTierFetchBucketsUs[b];
      std::snprintf(buf, sizeof(buf), "%s{\"le\": %s, \"count\": %lld}", b ? ", " : "",
                    b + 1 == t.fetch_hist.size() ? "null" : std::to_string(le).c_str(),
                    static_cast<long long>(t.fetch_hist[b]));
      o += buf;
    }
    o += "]}";
    out += (i ? ", " : "") + o;
  }
  out += "]}";
  return out;
}

std::string kv_tiers_prometheus(const KvTiersStats& s, const std::string& labels) {
  if (!s.enabled) return "";
  PromText out(labels);
  auto tier = [](const TierStoreStats& t) { return "tier=\"" + t.name + "\""; };
  auto metric = [&](const char* name, const char* type, const char* help, auto field) {
    out.family(name, type, help);
    for (const TierStoreStats& t : s.tiers) out.sample(name, field(t), tier(t));
  };
  metric("kvstack:kv_tier_blocks", "gauge", "KV blocks held by this storage tier.",
         [](const TierStoreStats& t) { return t.n_blocks; });
  metric("kvstack:kv_tier_capacity_bytes", "gauge", "Bytes this tier may hold.",
         [](const TierStoreStats& t) { return t.capacity_bytes; });
  metric("kvstack:kv_tier_used_bytes", "gauge", "Bytes of this tier's slots in use.",
         [](const TierStoreStats& t) { return t.n_blocks * t.slot_bytes; });
  metric("kvstack:kv_tier_hits_total", "counter", "Blocks fetched from this tier into the pool.",
         [](const TierStoreStats& t) { return t.n_hits; });
  metric("kvstack:kv_tier_stored_total", "counter", "Blocks written into this tier.",
         [](const TierStoreStats& t) { return t.n_stored; });
  metric("kvstack:kv_tier_bytes_in_total", "counter", "Bytes written into this tier.",
         [](const TierStoreStats& t) { return t.bytes_in; });
  metric("kvstack:kv_tier_bytes_out_total", "counter", "Bytes fetched from this tier.",
         [](const TierStoreStats& t) { return t.bytes_out; });
  metric("kvstack:kv_tier_evicted_total", "counter", "Entries pushed out of this tier for room.",
         [](const TierStoreStats& t) { return t.n_evicted; });
  metric("kvstack:kv_tier_corrupt_total", "counter",
         "Reads refused by a checksum or a short read (entry dropped).",
         [](const TierStoreStats& t) { return t.n_corrupt; });
  metric("kvstack:kv_tier_identity_mismatch_total", "counter",
         "Entries of another model, KV format or layout dropped.",
         [](const TierStoreStats& t) { return t.n_identity_mismatch; });
  metric("kvstack:kv_tier_write_failed_total", "counter",
         "Writes that failed (disk full or I/O error); the block was not stored.",
         [](const TierStoreStats& t) { return t.n_write_failed; });
  metric("kvstack:kv_tier_errors_total", "counter",
         "Remote tier commands that failed or timed out (each a miss or a skipped store).",
         [](const TierStoreStats& t) { return t.n_errors; });
  // Fetch latency: the last bucket of kTierFetchBucketsUs is +Inf.
  std::array<double, kTierFetchBucketsUs.size() - 1> bounds{};
  for (size_t b = 0; b < bounds.size(); ++b) bounds[b] = kTierFetchBucketsUs[b] * 1e-6;
  const char* h = "kvstack:kv_tier_fetch_seconds";
  out.family(h, "histogram", "Latency of one block fetch from this tier into the pool.");
  for (const TierStoreStats& t : s.tiers) {
    int64_t n = 0;
    for (int64_t c : t.fetch_hist) n += c;
    out.histogram(h, std::span<const double>(bounds), std::span<const int64_t>(t.fetch_hist),
                  t.fetch_seconds, static_cast<uint64_t>(n), tier(t));
  }
  out.metric("kvstack:kv_tier_promoted_total", "counter",
             "Blocks promoted from a tier into the pool.", s.n_promoted);
  out.metric("kvstack:kv_tier_hit_tokens_total", "counter",
             "Prefix tokens served from storage tiers.", s.n_hit_tokens);
  const char* d = "kvstack:kv_tier_decisions_total";
  out.family(d, "counter", "Fetch-or-recompute decisions on tier block runs.");
  out.sample(d, s.n_decide_fetch, "decision=\"fetch\"");
  out.sample(d, s.n_decide_recompute, "decision=\"recompute\"");
  // The host format (--kv-host-format): bytes stored per block against the
  // pool's, and the conversions' counts and time.
  const char* bb = "kvstack:kv_tier_block_bytes";
  out.family(bb, "gauge",
             "Bytes of one block: in the pool, and as host/disk store it (format=\"pool\" or "
             "\"int8\").");
  out.sample(bb, s.pool_block_bytes, "where=\"pool\"");
  out.sample(bb, s.stored_block_bytes, "where=\"stored\",format=\"" + s.host_format + "\"");
  const char* cb = "kvstack:kv_tier_converted_blocks_total";
  out.family(cb, "counter", "Blocks converted to (down) or from (up) the host format.");
  out.sample(cb, s.n_encoded, "direction=\"down\"");
  out.sample(cb, s.n_decoded, "direction=\"up\"");
  const char* cs = "kvstack:kv_tier_convert_seconds_total";
  out.family(cs, "counter", "Time spent converting blocks to or from the host format.");
  out.sample_f(cs, s.encode_seconds, "direction=\"down\"");
  out.sample_f(cs, s.decode_seconds, "direction=\"up\"");
  const char* bw = "kvstack:kv_tier_bandwidth_bytes_per_second";
  out.family(bw, "gauge", "Measured fetch bandwidth per tier.");
  for (const TierStoreStats& t : s.tiers) {
    const TierCost& c = t.name == "host"   ? s.cost.host
                        : t.name == "disk" ? s.cost.disk
                                           : s.cost.redis;
    out.sample_f(bw, c.bytes_per_s, tier(t));
  }
  return out.take();
}

std::string format_kv_tiers_stats(const KvTiersStats& s) {
  if (!s.enabled) return "";
  std::string out = "kv tiers (" + std::string(s.write_through ? "write-through" : "write-back") +
                    "): promoted " + std::to_string(s.n_promoted) + " blocks (" +
                    std::to_string(s.n_partial_hits) + " partial tails), " +
                    std::to_string(s.n_hit_tokens) + " tokens served from tiers, " +
                    std::to_string(s.n_demoted) + " demoted host->disk, " +
                    std::to_string(s.n_dropped) + " dropped; host format " + s.host_format + " (" +
                    std::to_string(s.stored_block_bytes) + " of " +
                    std::to_string(s.pool_block_bytes) + " bytes per block, " +
                    std::to_string(s.n_encoded) + " down / " + std::to_string(s.n_decoded) +
                    " up); fetch-or-recompute: " + std::to_string(s.n_decide_fetch) + " fetched, " +
                    std::to_string(s.n_decide_recompute) + " recomputed\n";
  for (const TierStoreStats& t : s.tiers) {
    char buf[512];
    std::snprintf(
        buf, sizeof(buf),
        "  %-4s %lld/%lld blocks (%.1f MiB of %.1f MiB), stored %lld, hits %lld "
        "(%.1f MiB, %.3f ms total), evicted %lld, corrupt %lld, identity mismatch "
        "%lld, write failed %lld%s\n",
        t.name.c_str(), static_cast<long long>(t.n_blocks), static_cast<long long>(t.n_slots),
        static_cast<double>(t.n_blocks * t.slot_bytes) / (1 << 20),
        static_cast<double>(t.capacity_bytes) / (1 << 20), static_cast<long long>(t.n_stored),
        static_cast<long long>(t.n_hits), static_cast<double>(t.bytes_out) / (1 << 20),
        t.fetch_seconds * 1e3, static_cast<long long>(t.n_evicted),
        static_cast<long long>(t.n_corrupt), static_cast<long long>(t.n_identity_mismatch),
        static_cast<long long>(t.n_write_failed),
        t.name == "disk" ? (t.direct_io ? ", O_DIRECT" : ", buffered") : "");
    out += buf;
  }
  return out;
}

}  // namespace kvstack

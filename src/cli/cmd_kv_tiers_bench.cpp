// `kvstack kv-tiers-bench`: bandwidth of the storage tiers below the KV pool
// (kv_tiers.h; docs/benchmarks.md "Storage tiers"). No model: a pool shaped
// like SmolLM2-135M's f16 KV (30 layers x 3 KV heads x 64 dims, P = 16:
// 360 KiB blocks) holds a published chain of N blocks filled with random
// bytes. It measures
//   memcpy     N blocks from one buffer into the pool (the host tier's bound)
//   (--kv-host-format int8: host and disk hold int8 records; GB/s are of
//   pool bytes, the decode included)
//   host       promotion of the chain from the host tier (the real path:
//              lookup hashes, record checks, pool allocation, copy)
//   disk       the write-back batch to disk, and promotion of the chain
//              from disk (checked reads), O_DIRECT or buffered (--buffered;
//              the file's page cache is dropped first with
//              posix_fadvise(DONTNEED), so reads come from the device)
//   redis      (--redis URL) the store at publish (pipelined EXISTS + SETs)
//              and promotion of the chain from Redis alone (pipelined
//              EXISTS batches, one pipelined GET stream, checks, copy);
//              --redis-only skips the other tiers (bench/redis_tier_bench.py
//              runs it against redis-benchmark on a private server)
// each the best of --repeat runs, in GB/s (1e9 bytes per second).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "cli/args.h"
#include "cli/engine_options.h"
#include "engine/engine.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/cache_identity.h"
#include "kv/kv_tiers.h"
#include "kv/prefix_index.h"

namespace kvstack::cli {
namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Bench {
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<PrefixIndex> index;
  std::unique_ptr<KvTiers> tiers;
  NamespaceId ns = kNoNamespace;
  std::vector<int32_t> tokens;
};

Result<Bench> make_bench(const KvLayout& layout, int64_t n_blocks, const KvTierConfig& cfg) {
  Bench b;
  auto pool = BlockPool::create(
      layout, {.mem_bytes = (n_blocks + 2) * layout.block_bytes(), .populate = true});
  if (!pool) return pool.error();
  b.pool = std::move(*pool);
  b.index = std::make_unique<PrefixIndex>(*b.pool);
  CacheIdentity id;
  id.weights_digest = Hash128{42, 42};
  id.arch_revision = "kv-tiers-bench";
  id.kv_format = kv_format_key(layout);
  auto t = KvTiers::create(*b.index, id, cfg);
  if (!t) return t.error();
  b.tiers = std::move(*t);
  b.ns = b.index->intern_namespace(id.digest());
  b.index->acquire_namespace(b.ns);
  // One published chain of n_blocks random blocks (+ 1 token so that the
  // lookup's "all but the last token" covers every block).
  const int p = layout.block_size();
  b.tokens.resize(static_cast<size_t>(n_blocks * p + 1));
  std::mt19937 rng(1);
  for (auto& tok : b.tokens) tok = static_cast<int32_t>(rng() % 49152);
  BlockTable table(*b.pool);
  KV_TRY_STATUS(table.reserve(n_blocks * p));
  std::mt19937_64 bytes(2);
  for (int32_t id_b : table.ids()) {
    auto* d = b.pool->block_data(BlockId{id_b});
    for (int64_t i = 0; i + 8 <= b.pool->block_bytes(); i += 8) {
      const uint64_t v = bytes();
      std::memcpy(d + i, &v, 8);
    }
  }
  table.commit(n_blocks * p);
  b.index->publish(b.ns, table, b.tokens, 0);
  table.release();
  return b;
}

// Promotes the whole chain (then drops it: a cancelled fetch, so the tier
// keeps its entries); returns seconds, or -1 when the hit was short.
double promote_once(Bench& b, int64_t n_blocks) {
  const auto max_tokens = static_cast<int64_t>(b.tokens.size()) - 1;
  const auto t0 = Clock::now();
  PrefixMatch m = b.index->match(b.ns, b.tokens, max_tokens, false);
  const int64_t got = b.tiers->extend_match(b.ns, b.tokens, max_tokens, m);
  const double s = secs(t0, Clock::now());
  return got == n_blocks * b.pool->block_size() ? s : -1;
}

void drop_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// --sweep: is the fetch-or-recompute choice the faster one? For prefix
// lengths L and host-tier bandwidths throttled to beta, it measures the real
// recompute time (prefill of L tokens) and the real fetch time (promotion of
// the L / P blocks), asks the engine's cost model which it would pick, and
// counts the picks that were the faster path.
int run_sweep(const Args& args) {
  auto engine = load_engine(args);
  if (!engine) return fail("kv-tiers-bench", engine.error().message);
  Engine& e = **engine;
  KvTiers* tiers = e.kv().tiers();
  if (tiers == nullptr || tiers->host() == nullptr) {
    return fail("kv-tiers-bench", "--sweep needs --kv-host-mem SIZE");
  }
  const double rate = tiers->cost_model().prefill_tokens_per_s;
  const int p = e.pool().block_size();
  const int n_vocab = e.model().config().n_vocab;
  std::mt19937 rng(11);
  int n_cases = 0, n_right = 0;
  std::printf("fetch-or-recompute sweep (prefill rate %.0f tokens/s measured at start-up)\n", rate);
  std::printf(
      "| beta (throttle) | L | recompute | fetch | model picks | faster |\n"
      "|---|---|---|---|---|---|\n");
  for (double beta : {0.0, 1e9, 1e8, 3e7, 1e7, 3e6}) {
    tiers->set_throttle(beta);
    for (int64_t L : {32, 64, 128, 256}) {
      std::vector<int32_t> tokens(static_cast<size_t>(L + 1));
      for (auto& t : tokens) t = 1000 + static_cast<int32_t>(rng() % (n_vocab - 1000));
      const std::span<const int32_t> prefix(tokens.data(), static_cast<size_t>(L));
      // Recompute: a cold prefill of the L tokens (publishes them).
      Sequence seq = e.new_sequence();
      auto t0 = Clock::now();
      if (!e.prefill(seq, prefix, LogitsMode::kNone, nullptr).ok()) {
        return fail("kv-tiers-bench", "prefill failed (pool too small?)");
      }
      const double t_recompute = secs(t0, Clock::now());
      seq.release();
      e.kv().index()->evict(e.pool().n_cached());  // everything to the host tier
      // The model's pick (a fetch it picks also updates its bandwidth).
      int64_t got = 0;
      for (int warm = 0; warm < 3; ++warm) {
        // Let the moving average see this bandwidth (it keeps updating).
        tiers->set_prefill_rate(0);
        {
          PrefixMatch m = e.kv().index()->match(seq.ns(), tokens, L, false);
          (void)tiers->extend_match(seq.ns(), tokens, L, m);
        }
        tiers->set_prefill_rate(rate);
      }
      const int64_t decided_before = tiers->stats().n_decide_fetch;
      {
        PrefixMatch m = e.kv().index()->match(seq.ns(), tokens, L, false);
        (void)tiers->extend_match(seq.ns(), tokens, L, m);
      }
      const bool picks_fetch = tiers->stats().n_decide_fetch > decided_before;
      // Fetch, forced and timed.
      tiers->set_prefill_rate(0);
      Sequence again = e.new_sequence();
      t0 = Clock::now();
      got = again.adopt_cached_prefix(tokens);
      const double t_fetch = secs(t0, Clock::now());
      tiers->set_prefill_rate(rate);
      again.release();
      e.kv().index()->evict(e.pool().n_cached());
      if (got != L - L % p) return fail("kv-tiers-bench", "sweep: the prefix did not come back");
      const bool fetch_faster = t_fetch <= t_recompute;
      ++n_cases;
      n_right += picks_fetch == fetch_faster;
      char b[32];
      std::snprintf(b, sizeof(b), beta > 0 ? "%.0f MB/s" : "unthrottled", beta / 1e6);
      std::printf("| %s | %lld | %.1f ms | %.1f ms | %s | %s |\n", b, static_cast<long long>(L),
                  t_recompute * 1e3, t_fetch * 1e3, picks_fetch ? "fetch" : "recompute",
                  fetch_faster ? "fetch" : "recompute");
    }
  }
  std::printf("model picked the faster path in %d of %d cases (%.0f%%)\n", n_right, n_cases,
              100.0 * n_right / std::max(1, n_cases));
  return 0;
}

int run_kv_tiers_bench(const std::vector<std::string>& argv) {
  std::vector<OptionSpec> specs = engine_options();
  const std::vector<OptionSpec> own = {
      {"sweep", 0, "",
       "fetch-or-recompute sweep over prefix lengths and throttled host bandwidths (loads the "
       "model; needs --kv-host-mem)"},
      {"blocks", 0, "N", "blocks in the chain (default 512: 180 MiB)"},
      {"repeat", 0, "N", "runs per measurement, best kept (default 5)"},
      {"dir", 0, "DIR", "disk tier directory (default: a new one under /tmp, removed after)"},
      {"buffered", 0, "", "disk tier without O_DIRECT (page cache dropped before each read)"},
      {"keep", 0, "", "keep the disk tier's files (e.g. for dd on the same file)"},
      {"redis", 0, "URL", "also measure the Redis tier at redis://HOST:PORT (its keys are left)"},
      {"redis-only", 0, "", "with --redis: measure the Redis tier only"},
      help_option(),
  };
  specs.insert(specs.end(), own.begin(), own.end());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("kv-tiers-bench", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack kv-tiers-bench [--blocks N] [--repeat N] [--dir DIR] "
                           "[--buffered] [--keep] [--redis URL [--redis-only]]",
                           "Bandwidth of the host and disk KV tiers against memcpy.", specs)
                   .c_str(),
               stdout);
    return 0;
  }
  if (args->flag("sweep")) return run_sweep(*args);
  auto n_blocks_r = args->get_int("blocks", 512, 1, 1 << 20);
  auto repeat_r = args->get_int("repeat", 5, 1, 1000);
  if (!n_blocks_r) return fail("kv-tiers-bench", n_blocks_r.error().message);
  if (!repeat_r) return fail("kv-tiers-bench", repeat_r.error().message);
  const int64_t n = *n_blocks_r;
  const int64_t repeat = *repeat_r;
  auto layout = KvLayout::uniform(30, 3, 64, KvDtype::kF16, 16);
  if (!layout) return fail("kv-tiers-bench", layout.error().message);
  const int64_t bb = layout->block_bytes();
  const double total = static_cast<double>(n * bb);
  std::printf("kv-tiers-bench: %lld blocks x %lld bytes (%.1f MiB), best of %lld\n",
              static_cast<long long>(n), static_cast<long long>(bb), total / (1 << 20),
              static_cast<long long>(repeat));

  const bool local = !(args->flag("redis-only") && args->get("redis"));
  // --kv-host-format: the host and disk tiers' stored form (host_format.h).
  HostFormat host_format = HostFormat::kPool;
  if (auto f = args->get("kv-host-format")) {
    auto hf = parse_host_format(*f);
    if (!hf) return fail("kv-tiers-bench", hf.error().message);
    host_format = *hf;
  }
  double memcpy_like = 0;
  // memcpy: the same bytes into the same pool blocks.
  if (local) {
    auto b = make_bench(*layout, n, {});
    if (!b) return fail("kv-tiers-bench", b.error().message);
    std::vector<uint8_t> src(static_cast<size_t>(n * bb), 1);
    double best = 1e30;
    for (int64_t r = 0; r < repeat; ++r) {
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(b->pool->block_data(BlockId{static_cast<int32_t>(i)}), src.data() + i * bb,
                    static_cast<size_t>(bb));
      }
      best = std::min(best, secs(t0, Clock::now()));
    }
    std::printf("  memcpy            %7.2f GB/s  (%.1f us per block)\n", total / best / 1e9,
                best / static_cast<double>(n) * 1e6);
    b->index->release_namespace(b->ns);
    b->tiers.reset();
    b->index.reset();
  }

  // Host tier.
  if (local) {
    const int64_t slot = (bb + 64 + block_record_header_bytes(16) + 63) / 64 * 64;
    KvTierConfig cfg;
    cfg.host_bytes = (n + 2) * slot;
    cfg.host_format = host_format;
    auto b = make_bench(*layout, n, cfg);
    if (!b) return fail("kv-tiers-bench", b.error().message);
    const auto t0 = Clock::now();
    b->index->evict(n);
    const double demote = secs(t0, Clock::now());
    double best = 1e30;
    for (int64_t r = 0; r < repeat; ++r) {
      const double s = promote_once(*b, n);
      if (s < 0) return fail("kv-tiers-bench", "host tier: the chain did not come back whole");
      best = std::min(best, s);
    }
    memcpy_like = total / best / 1e9;
    const KvTiersStats hs = b->tiers->stats();
    std::printf("  host format       %s (%lld of %lld bytes per block)\n", hs.host_format.c_str(),
                static_cast<long long>(hs.stored_block_bytes),
                static_cast<long long>(hs.pool_block_bytes));
    std::printf("  host demote       %7.2f GB/s  (pool -> host, checksummed record)\n",
                total / demote / 1e9);
    std::printf("  host fetch        %7.2f GB/s  (%.1f us per block; lookup + check + copy)\n",
                memcpy_like, best / static_cast<double>(n) * 1e6);
    b->index->release_namespace(b->ns);
    b->tiers.reset();
    b->index.reset();
  }

  // Disk tier.
  const bool keep = args->flag("keep");
  std::string dir = args->get_or("dir", "");
  const bool own_dir = dir.empty();
  if (own_dir) dir = "/tmp/kvstack-tiers-bench-" + std::to_string(::getpid());
  if (local) {
    std::filesystem::remove(dir + "/index.kvs");
    const bool direct = !args->flag("buffered");
    KvTierConfig cfg;
    cfg.disk_dir = dir;
    cfg.disk_bytes = (n + 2) * (bb + 8192);
    cfg.disk_direct_io = direct;
    cfg.host_format = host_format;
    auto b = make_bench(*layout, n, cfg);
    if (!b) return fail("kv-tiers-bench", b.error().message);
    const auto t0 = Clock::now();
    b->index->evict(n);
    b->tiers->disk()->flush();
    const double write = secs(t0, Clock::now());
    const TierStoreStats ds = b->tiers->disk()->stats();
    double best = 1e30;
    for (int64_t r = 0; r < repeat; ++r) {
      if (!ds.direct_io) drop_page_cache(b->tiers->disk()->data_path());
      const double s = promote_once(*b, n);
      if (s < 0) return fail("kv-tiers-bench", "disk tier: the chain did not come back whole");
      best = std::min(best, s);
    }
    std::printf("  disk write-back   %7.2f GB/s  (%s, batches of %lld MiB, fdatasync)\n",
                static_cast<double>(n * ds.slot_bytes) / write / 1e9,
                ds.direct_io ? "O_DIRECT pwritev" : "buffered pwritev",
                static_cast<long long>(kDiskWriteBatchBytes >> 20));
    std::printf("  disk fetch        %7.2f GB/s  (%.1f us per block; %s pread + checks + copy)\n",
                total / best / 1e9, best / static_cast<double>(n) * 1e6,
                ds.direct_io ? "O_DIRECT" : "buffered, cold page cache");
    std::printf("  disk file         %s (%lld bytes)\n", b->tiers->disk()->data_path().c_str(),
                static_cast<long long>(n) * static_cast<long long>(ds.slot_bytes));
    b->index->release_namespace(b->ns);
    b->tiers.reset();
    b->index.reset();
  }
  if (local && own_dir && !keep) std::filesystem::remove_all(dir);

  // Redis tier: the chain is stored at publish (one pipelined batch), then
  // promoted from Redis alone (pipelined EXISTS and GETs + checks + copy).
  if (auto url = args->get("redis")) {
    KvTierConfig cfg;
    cfg.redis_url = *url;
    cfg.redis_timeout_ms = 2000;
    const auto t0 = Clock::now();
    auto b = make_bench(*layout, n, cfg);
    if (!b) return fail("kv-tiers-bench", b.error().message);
    const double store = secs(t0, Clock::now());
    b->index->evict(n);
    double best = 1e30;
    for (int64_t r = 0; r < repeat; ++r) {
      const double s = promote_once(*b, n);
      if (s < 0) return fail("kv-tiers-bench", "redis tier: the chain did not come back whole");
      best = std::min(best, s);
    }
    const TierStoreStats rs = b->tiers->redis()->stats();
    std::printf(
        "  redis store       %7.2f GB/s  (pipelined EXISTS + SETs at publish; incl. setup)\n",
        total / store / 1e9);
    std::printf(
        "  redis fetch       %7.2f GB/s  (%.1f us per block; pipelined EXISTS + GETs + checks + "
        "copy)\n",
        total / best / 1e9, best / static_cast<double>(n) * 1e6);
    const int64_t value_bytes = block_record_header_bytes(16) + bb;
    std::printf("  redis value       %lld bytes; %lld round trips in all\n",
                static_cast<long long>(value_bytes), static_cast<long long>(rs.n_round_trips));
    if (!local) memcpy_like = total / best / 1e9;
    b->index->release_namespace(b->ns);
    b->tiers.reset();
    b->index.reset();
  }
  return memcpy_like > 0 ? 0 : 1;
}

}  // namespace

KVSTACK_COMMAND(g_kv_tiers_bench, "kv-tiers-bench",
                "bandwidth of the host and disk KV tiers against memcpy", run_kv_tiers_bench);

}  // namespace kvstack::cli

// PdAgent's layout conversion (pd_agent.h, transfer/kv_convert.h): a decode
// worker pulls blocks of another block size or float KV dtype through a
// staging buffer and rewrites them into its own layout.
#include <cstdlib>
#include <cstring>

#include "server/pd_agent.h"
#include "transfer/kv_convert.h"

namespace kvstack::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

Result<PdAgent::Conversion> PdAgent::plan_conversion(const json& params) const {
  const BlockPool& pool = engine_.pool();
  if (pool.n_groups() != 1) {
    return make_error(Errc::kUnsupported,
                      "no layout conversion for models with several KV groups (hybrid window "
                      "models): run both sides with the same --block-size and --kv-dtype");
  }
  if (!params.contains("kv_format") || !params["kv_format"].is_string()) {
    return make_error(Errc::kUnsupported, "the offer names no kv_format");
  }
  const std::string fmt = params["kv_format"].get<std::string>();
  auto src = transfer::producer_layout(pool.layout(), fmt);
  if (!src) return src.error();
  KV_TRY_STATUS(transfer::check_convertible(*src, pool.layout()));
  if (params["block_size"].get<int64_t>() != src->block_size() ||
      params["block_bytes"].get<int64_t>() != src->block_bytes()) {
    return make_error(Errc::kUnsupported,
                      "block_size / block_bytes do not match the offered kv_format");
  }
  Conversion c{std::move(*src), engine_.kv().identity(), {}};
  c.identity.kv_format = fmt;
  c.record_id = block_record_identity(c.identity, c.src.block_size(), c.src.block_bytes());
  return c;
}

Result<std::unique_ptr<PulledPrefix>> PdAgent::pull_converted(
    Scheduler& s, transfer::PullSession& session, const Conversion& conv,
    const std::vector<int32_t>& prompt, const std::string& cache_salt, Clock::time_point t0) {
  auto failed = [&](Error e) {
    (void)session.finish(false);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_failed++;
    return e;
  };
  const transfer::Offer& o = session.offer();
  const int64_t Pp = conv.src.block_size();
  const int64_t bbp = conv.src.block_bytes();
  if (o.block_bytes != bbp ||
      o.header_bytes != block_record_header_bytes(static_cast<int32_t>(Pp)) ||
      o.n_tokens % Pp != 0 || o.n_tokens > static_cast<int64_t>(prompt.size()) - 1 ||
      o.n_blocks != o.n_tokens / Pp) {
    return failed(
        make_error(Errc::kCorruptFile, "KV transfer: the offer does not fit this request (" +
                                           std::to_string(o.n_blocks) + " blocks of " +
                                           std::to_string(Pp) + " tokens for a " +
                                           std::to_string(prompt.size()) + "-token prompt)"));
  }
  const BlockPool& pool = engine_.pool();
  const int64_t Pc = pool.block_size();
  const auto n_src = static_cast<size_t>(o.n_blocks);
  const auto n = static_cast<size_t>(o.n_tokens / Pc);  // this worker's full blocks
  // Producer hashes: its block size, its namespace root (its identity).
  const Hash128 ns_src =
      conv.identity.with_namespace(engine_.kv().namespace_name(cache_salt)).digest();
  std::vector<Hash128> expect(n_src);
  for (size_t i = 0; i < n_src; ++i) {
    expect[i] =
        transfer::block_chain_hash(i == 0 ? Hash128{} : expect[i - 1], ns_src,
                                   std::span<const int32_t>(prompt).subspan(
                                       i * static_cast<size_t>(Pp), static_cast<size_t>(Pp)));
  }
  // Engine thread: adopt what this worker caches, reserve the rest.
  std::unique_ptr<PulledPrefix> pin;
  std::vector<int32_t> dst_table;
  size_t k = 0;
  Status reserved;
  const Status ran = s.inspect([&](Engine& e) {
    PrefixReservation res = reserve_prefix(e, cache_salt, prompt, n, Pc);
    Sequence& seq = res.seq;
    k = res.adopted;
    reserved = res.reserved;
    if (k < n) {
      if (reserved.ok()) {
        const auto ids = seq.table().group(0).ids();
        dst_table.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n));
      }
    }
    pin = std::make_unique<PulledPrefix>(s, std::move(seq));
  });
  if (!ran.ok()) return failed(ran.error());
  if (!reserved.ok()) {
    pin.reset();
    return failed(reserved.error());
  }
  if (k == n) {  // every usable block is cached here already (or none fits)
    (void)session.finish(true);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.n_pulls_ok++;
    stats_.n_blocks_local += static_cast<int64_t>(k);
    return pin;
  }
  // The producer records covering tokens [k Pc, n Pc).
  const auto r0 = static_cast<size_t>(static_cast<int64_t>(k) * Pc / Pp);
  const auto r1 = static_cast<size_t>((static_cast<int64_t>(n) * Pc + Pp - 1) / Pp);
  const size_t n_read = r1 - r0;
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> staging(
      static_cast<uint8_t*>(std::aligned_alloc(64, n_read * static_cast<size_t>(bbp))));
  if (!staging) {
    pin.reset();
    return failed(make_error(Errc::kOutOfBlocks, "KV transfer: no memory for the staging buffer"));
  }
  std::vector<size_t> recs(n_read);
  std::vector<uint8_t*> dst(n_read);
  for (size_t j = 0; j < n_read; ++j) {
    recs[j] = r0 + j;
    dst[j] = staging.get() + j * static_cast<size_t>(bbp);
  }
  const auto left = config_.transfer_timeout -
                    std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  Status read = session.read_records(recs, dst, std::max(left, std::chrono::milliseconds(1)));
  for (size_t j = 0; j < n_read && read.ok(); ++j) {
    const size_t i = recs[j];
    const uint8_t* h = o.headers.data() + i * static_cast<size_t>(o.header_bytes);
    const BlockRecordKey key{ns_src, expect[i], i == 0 ? Hash128{} : expect[i - 1], 0};
    BlockRecordCheck c =
        check_block_record(conv.record_id, key,
                           std::span<const int32_t>(prompt).subspan(i * static_cast<size_t>(Pp),
                                                                    static_cast<size_t>(Pp)),
                           h);
    if (c == BlockRecordCheck::kOk) {
      c = check_block_payload(h, std::span<const uint8_t>(dst[j], static_cast<size_t>(bbp)));
    }
    if (c != BlockRecordCheck::kOk) {
      read = make_error(Errc::kCorruptFile, "KV transfer: block " + std::to_string(i) +
                                                " failed its record check (" +
                                                block_record_check_name(c) + ")");
    }
  }
  if (!read.ok()) {
    pin.reset();
    return failed(read.error());
  }
  // Rewrite tokens [k Pc, n Pc) into this worker's reserved blocks (only
  // this pull's sequence holds them; nothing reads them before the commit).
  std::vector<int32_t> src_table(r1, 0);
  for (size_t i = r0; i < r1; ++i) src_table[i] = static_cast<int32_t>(i - r0);
  transfer::convert_kv_blocks(conv.src, staging.get(), src_table, pool.layout(),
                              engine_.pool().block_data(BlockId{0}), dst_table,
                              static_cast<int64_t>(k) * Pc, static_cast<int64_t>(n - k) * Pc);
  Status published;
  const Status ran2 =
      s.inspect([&](Engine&) { published = pin->commit(prompt, k, n, std::vector<size_t>(1, 0)); });
  if (!ran2.ok() || !published.ok()) {
    pin.reset();
    return failed(!ran2.ok() ? ran2.error() : published.error());
  }
  (void)session.finish(true);
  const transfer::PullTimings& t = session.timings();
  std::lock_guard<std::mutex> lock(mu_);
  count_pull_ok(t, t0, static_cast<int64_t>(n - k), static_cast<int64_t>(k));
  stats_.n_layout_conversions++;
  stats_.n_blocks_converted += static_cast<int64_t>(n_read);
  return pin;
}

}  // namespace kvstack::server

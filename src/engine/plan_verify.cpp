// `kvstack plan --verify`: runs the real engine on a synthetic workload of
// exactly the planned shape and reports what the pool measured.
#include <unistd.h>

#include <cstdio>
#include <random>

#include "core/proc_stats.h"
#include "engine/engine.h"
#include "kv/capacity.h"
#include "model/gguf.h"

namespace kvstack::capacity {

Result<VerifyReport> run_plan_verify(const VerifyRequest& request) {
  if (request.seq_tokens.empty()) {
    return make_error(Errc::kInvalidArgument,
                      "--verify needs a workload (--batch/--ctx or --lengths)");
  }
  auto dtype = parse_kv_dtype(request.kv_dtype);
  if (!dtype) {
    return make_error(Errc::kUnsupported, "the engine has no KV dtype '" + request.kv_dtype +
                                              "' (" + dtype.error().message + ")");
  }
  EngineConfig cfg;
  cfg.model_path = request.model_path;
  cfg.block_size = static_cast<int>(request.block_size);
  cfg.kv_dtype = *dtype;
  for (const std::string* side : {&request.kv_dtype_k, &request.kv_dtype_v}) {
    if (side->empty()) continue;
    auto t = parse_kv_dtype(*side);
    if (!t) return make_error(Errc::kUnsupported, "the engine has no KV dtype '" + *side + "'");
    (side == &request.kv_dtype_k ? cfg.kv_dtype_k : cfg.kv_dtype_v) = *t;
  }
  cfg.kv_residual = static_cast<int>(request.kv_residual);
  // The planner counts an MLA model's layers as latent rows (d_c + d_R per
  // token): run the engine's latent cache for it (--kv-mla latent).
  if (auto file = GgufFile::open(request.model_path); file.ok()) {
    if (auto arch = file->get_string("general.architecture"); arch.ok()) {
      cfg.kv_mla_latent = *arch == "deepseek2";
    }
  }
  // Pool: exactly the blocks the workload needs (plus nothing), so running
  // out would itself be a planner/engine disagreement.
  int64_t n_blocks = 0;
  for (int64_t t : request.seq_tokens) {
    if (t < 1) return make_error(Errc::kInvalidArgument, "--verify: sequence lengths must be >= 1");
    n_blocks += (t + request.block_size - 1) / request.block_size;
  }
  cfg.kv_cache_tokens = n_blocks * request.block_size;
  auto engine = Engine::create(cfg);
  if (!engine) return engine.error();
  if ((*engine)->pool().n_groups() > 1) {
    // KV groups: a window group holds more blocks within a step than after
    // it, so the pool gets each sequence's peak (KvGroups::peak_blocks), all
    // at once: still nothing the workload cannot use.
    const KvGroups& groups = (*engine)->pool().groups();
    int64_t peak = 0;
    for (int64_t t : request.seq_tokens)
      peak += groups.peak_blocks_for_sequence(t, cfg.prefill_chunk);
    cfg.kv_cache_tokens = 0;
    cfg.kv_cache_mem = static_cast<uint64_t>(peak * groups.block_bytes());
    engine.value().reset();
    engine = Engine::create(cfg);
    if (!engine) return engine.error();
  }
  Engine& e = **engine;
  const int n_ctx = e.model().config().n_ctx_train;
  for (int64_t t : request.seq_tokens) {
    if (t > n_ctx) {
      return make_error(Errc::kInvalidArgument, "--verify: a sequence of " + std::to_string(t) +
                                                    " tokens exceeds the model's context length " +
                                                    std::to_string(n_ctx));
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, e.model().config().n_vocab - 1);
  // RSS attributable to the KV pool: resident pages of the pool's mapping
  // (mincore), before and after; the whole-process RSS delta also includes
  // the model weights paged in by the first forward and the activations.
  const int64_t pool_resident_before = e.pool().stats().resident_bytes;
  const int64_t rss_before = process_rss_bytes();
  std::vector<BlockTable> tables;
  tables.reserve(request.seq_tokens.size());
  int64_t done = 0, total = 0;
  for (int64_t t : request.seq_tokens) total += t;
  for (int64_t t : request.seq_tokens) {
    std::vector<int32_t> tokens(static_cast<size_t>(t));
    for (auto& x : tokens) x = tok(rng);
    tables.push_back(e.new_table());
    KV_TRY_STATUS(e.prefill(tables.back(), tokens, LogitsMode::kNone, nullptr));
    // The state between steps: window groups release what no coming query
    // sees (the next reserve would do it first); a no-op without them.
    tables.back().drop_invisible();
    done += t;
    // In place on a terminal; on a pipe only the last count, on its own line.
    if (isatty(STDERR_FILENO) != 0) {
      std::fprintf(stderr, "\rplan --verify: ran %lld/%lld tokens through the engine",
                   static_cast<long long>(done), static_cast<long long>(total));
    } else if (done == total) {
      std::fprintf(stderr, "plan --verify: ran %lld tokens through the engine\n",
                   static_cast<long long>(total));
    }
  }
  const int64_t rss_after = process_rss_bytes();
  e.pool().check_invariants();
  const BlockPoolStats st = e.pool().stats();
  VerifyReport r;
  r.payload_bytes = static_cast<uint64_t>(st.payload_bytes);
  r.allocated_bytes = static_cast<uint64_t>(st.allocated_bytes);
  r.block_count = static_cast<uint64_t>(st.n_blocks_used + st.n_blocks_cached);
  r.block_bytes = static_cast<uint64_t>(st.block_bytes);
  r.rss_growth_bytes = st.resident_bytes - pool_resident_before;
  if (isatty(STDERR_FILENO) != 0) std::fputc('\n', stderr);
  std::fprintf(stderr,
               "plan --verify: KV pool resident growth %lld bytes; whole-process RSS growth %lld "
               "bytes (includes weights paged in and activation buffers)\n",
               static_cast<long long>(r.rss_growth_bytes),
               static_cast<long long>(rss_after - rss_before));
  r.pool_bytes = static_cast<uint64_t>(st.pool_bytes);
  // Per KV group: the pool's figures, and the payload of the tokens whose
  // blocks the tables still hold (their resident bytes).
  for (int g = 0; g < e.pool().n_groups(); ++g) {
    const BlockPoolGroupStats& gs = st.groups[static_cast<size_t>(g)];
    VerifyReport::Group rg;
    rg.window = gs.window;
    rg.payload_bytes = static_cast<uint64_t>(gs.payload_bytes);
    rg.allocated_bytes = static_cast<uint64_t>(gs.allocated_bytes);
    for (const BlockTable& t : tables) {
      const GroupTable& gt = t.group(g);
      const int64_t resident = gt.length() - gt.n_dropped() * request.block_size;
      rg.resident_bytes += static_cast<uint64_t>(gt.layout().payload_bytes(resident));
    }
    r.groups.push_back(rg);
  }
  // KIVI residual rows live in the tables, outside the pool.
  // Payload: converted tokens in the blocks plus the f16 residual rows.
  if (e.layout().has_kivi()) {
    r.payload_bytes = 0;
    for (const BlockTable& t : tables) {
      r.residual_bytes += static_cast<uint64_t>(t.residual_bytes());
      r.payload_bytes += static_cast<uint64_t>(e.layout().payload_bytes(t.converted()));
    }
    r.payload_bytes += r.residual_bytes;
    r.allocated_bytes += r.residual_bytes;
  }
  return r;
}

}  // namespace kvstack::capacity

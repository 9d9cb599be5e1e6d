#include "cli/engine_options.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention/mla_attention.h"
#include "attention/paged_attention.h"
#include "cli/text_input.h"
#include "core/units.h"
#include "engine/deepseek2.h"
#include "engine/model.h"
#include "kv/rotation.h"
#include "model/config.h"
#include "model/gguf.h"
#include "ops/matmul.h"

namespace kvstack::cli {

std::vector<OptionSpec> engine_options() {
  return {
      model_option(),
      {"threads", 't', "N", "worker threads (default: all cores)"},
      {"load-mode", 0, "MODE",
       "how the model file gets into memory: copy (read once into anonymous memory on "
       "transparent huge pages: faster decode, a private copy of the file's size; the "
       "default) or mmap (map the file's page cache: nothing read until used, shared "
       "between processes)"},
      {"block-size", 0, "P", "tokens per KV block, a power of two 1..256 (default 16)"},
      {"kv-cache-mem", 0, "SIZE", "KV pool size in bytes, e.g. 512MiB, 2GiB (default: see tokens)"},
      {"kv-cache-tokens", 0, "N", "KV pool size in tokens (default: the model's context length)"},
      {"kv-dtype", 0, "TYPE",
       "KV cache format: f32, f16, bf16, fp8 (E4M3, per-block scale), int8 (per-token scale) or "
       "int4 (groups of 32), kivi2/kivi4 (KIVI: keys per channel, values per token, newest "
       "tokens in f16) (default f16); fp8/int8/int4 turn on --kv-rotate, int8/int4 keys "
       "also --kv-center (see --no-kv-rotate, --no-kv-center)"},
      {"kv-dtype-k", 0, "TYPE", "K's format when it differs from --kv-dtype"},
      {"kv-dtype-v", 0, "TYPE", "V's format when it differs from --kv-dtype"},
      {"kv-residual", 0, "R",
       "KIVI: newest tokens per sequence kept in f16, a multiple of the key group (default 128)"},
      {"kv-mla", 0, "MODE",
       "deepseek2 KV cache: expanded (per-head K/V, the default) or latent (one row of "
       "kv_lora_rank + rope dims per layer and token, attention with absorbed up-projections; "
       "f32/f16/bf16/int8)"},
      {"kv-rotate", 0, "",
       "rotate queries, keys and values per head (normalized Walsh-Hadamard with fixed random "
       "signs) before K/V are stored, and each attention output back: spreads outlier channels "
       "for quantized caches; exact for float caches (default: on when K or V is fp8, int8 or "
       "int4 and the head dimension is a power of two)"},
      {"no-kv-rotate", 0, "", "do not rotate, also for fp8/int8/int4 (opt out of the default)"},
      {"kv-center", 0, "",
       "subtract a per-layer, per-channel key mean (taken at start-up over a built-in "
       "calibration text) from every key before it is stored: removes the keys' channel "
       "offsets for quantized caches (int4: about a third less KL divergence); exact for "
       "float caches (default: on when K is int8 or int4)"},
      {"no-kv-center", 0, "",
       "do not centre the keys, also for int8/int4 (opt out of the default)"},
      {"kv-center-text", 0, "FILE", "calibrate --kv-center on this text instead (implies it)"},
      {"prefill-chunk", 0, "N", "max tokens per prefill step (default 512)"},
      {"layer-windows", 0, "W,W,...",
       "run the model with these per-layer attention windows (0 = full attention), the list "
       "repeating over the layers (512,512,512,512,512,0: Gemma 3's pattern); window layers "
       "keep only the blocks their window can see"},
      {"kv-retention", 0, "POLICY",
       "keep fewer tokens resident (approximate; compaction frees whole blocks): none "
       "(default), streamingllm:sinks=S,window=W[,slack=N] (the first S tokens plus each "
       "query's last W; compacts when N tokens are droppable, default the block size) or "
       "snapkv:budget=B[,window=W][,kernel=K][,gqa=union|mean] (at the end of each prefill the "
       "last W prompt queries (32) vote, max-pooled over K (7); each KV head keeps its top B "
       "prompt tokens plus the window; a KV head's query heads union (default) or average), "
       "pyramidkv:budget=B[,beta=X] and snapkv's keys (B is the mean per layer: layer 0 "
       "keeps 2B - B/X, the last B/X, linear in between; beta 20), "
       "h2o:budget=B,window=W[,slack=N][,obs=O] (before each decode step every layer keeps "
       "its last W tokens plus the B older ones of highest accumulated attention probability, "
       "summed over its query heads and every decode query, seeded by the prompt's last O "
       "queries (32); compacts when N tokens are droppable), "
       "topk:k=K[,sink=S][,recent=R] (nothing dropped: each decode query reads K blocks per "
       "layer: its own, the first S (1) and the last R (1) before it, and the rest by an "
       "upper bound on q.k from per-block key min/max); "
       "serve: the default for requests without \"kv_retention\""},
      {"no-prefix-cache", 0, "", "do not share KV between requests (no prefix cache)"},
      {"kv-host-mem", 0, "SIZE",
       "host-memory tier: keep up to SIZE bytes of KV blocks evicted from the pool (e.g. 2GiB) "
       "and bring them back on a prefix hit"},
      {"kv-host-format", 0, "FMT",
       "how the host and disk tiers store blocks: pool (the pool's bytes, default) or int8 "
       "(int8 of an f16 pool, 53% of the bytes, converted on the way down and back)"},
      {"kv-host-write-through", 0, "",
       "copy blocks to the host tier when published, not when evicted (needs --kv-host-mem)"},
      {"kv-disk", 0, "DIR",
       "disk tier: keep KV blocks evicted from the pool (or the host tier) in DIR, checksummed, "
       "with an index that survives a restart (needs --kv-disk-size)"},
      {"kv-disk-size", 0, "SIZE", "bytes the disk tier may use in --kv-disk DIR"},
      {"kv-redis", 0, "URL",
       "remote tier: share KV blocks with other instances of the same model through a Redis "
       "server, redis://HOST:PORT[/DB] (published blocks are stored; Redis's maxmemory policy "
       "evicts)"},
      {"kv-redis-timeout", 0, "MS", "bound on each Redis connect and command (default 200)"},
      {"public-prefix", 0, "FILE",
       "pre-compute and pin the KV of this text (e.g. a system prompt) for every namespace; "
       "repeatable",
       true},
  };
}

std::string kv_dtype_choices(const char* sep) {
  std::string out;
  for (KvDtype t : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kFp8, KvDtype::kInt8,
                    KvDtype::kInt4, kKvDtypeKivi2, kKvDtypeKivi4}) {
    if (!out.empty()) out += sep;
    out += kv_dtype_name(t);
  }
  return out;
}

KvQualityDefaults kv_quality_defaults(KvDtype k, KvDtype v) {
  auto per_token_quantized = [](KvDtype t) {
    return t == KvDtype::kFp8 || t == KvDtype::kInt8 || t == KvDtype::kInt4;
  };
  return {.rotate = per_token_quantized(k) || per_token_quantized(v),
          .center = k == KvDtype::kInt4 || k == KvDtype::kInt8};
}

bool model_supports_rotation(const std::string& model_path) {
  auto file = GgufFile::open(model_path);
  if (!file) return false;
  auto mc = load_model_config(*file);
  return mc && kv_rotation_check(KvRotation::kHadamard, mc->head_dim).ok();
}

std::string kv_dtype_label(const EngineConfig& c) {
  std::string s = kv_dtype_name(c.key_dtype());
  if (c.value_dtype() != c.key_dtype()) s += std::string("/") + kv_dtype_name(c.value_dtype());
  return s;
}

Result<EngineConfig> engine_config_from(const Args& args) {
  EngineConfig c;
  c.model_path = resolve_model_path(args);
  auto threads = args.get_int("threads", 0, 1, 1024);
  if (!threads) return threads.error();
  c.n_threads = static_cast<int>(*threads);
  auto bs = args.get_int("block-size", 16, 1, 256);
  if (!bs) return bs.error();
  if ((*bs & (*bs - 1)) != 0) {
    return make_error(Errc::kInvalidArgument,
                      "--block-size: " + std::to_string(*bs) + " is not a power of two");
  }
  c.block_size = static_cast<int>(*bs);
  if (args.has("kv-cache-mem") && args.has("kv-cache-tokens")) {
    return make_error(Errc::kInvalidArgument,
                      "give either --kv-cache-mem or --kv-cache-tokens, not both");
  }
  auto mem = args.get_bytes("kv-cache-mem", 0);
  if (!mem) return mem.error();
  if (args.has("kv-cache-mem") && *mem == 0) {
    return make_error(Errc::kInvalidArgument, "--kv-cache-mem must be greater than 0");
  }
  c.kv_cache_mem = *mem;
  auto tokens = args.get_int("kv-cache-tokens", 0, 1, int64_t{1} << 40);
  if (!tokens) return tokens.error();
  c.kv_cache_tokens = *tokens;
  auto dtype = parse_kv_dtype(args.get_or("kv-dtype", "f16"));
  if (!dtype) return make_error(Errc::kInvalidArgument, "--kv-dtype: " + dtype.error().message);
  c.kv_dtype = *dtype;
  for (const char* side : {"kv-dtype-k", "kv-dtype-v"}) {
    if (!args.has(side)) continue;
    auto t = parse_kv_dtype(args.get_or(side, ""));
    if (!t)
      return make_error(Errc::kInvalidArgument,
                        std::string("--") + side + ": " + t.error().message);
    (side[9] == 'k' ? c.kv_dtype_k : c.kv_dtype_v) = *t;
  }
  if (auto lm = args.get("load-mode")) {  // the default is EngineConfig's
    auto load_mode = parse_load_mode(*lm);
    if (!load_mode)
      return make_error(Errc::kInvalidArgument, "--load-mode: " + load_mode.error().message);
    c.load_mode = *load_mode;
  }
  auto residual = args.get_int("kv-residual", 128, 0, 1 << 20);
  if (!residual) return residual.error();
  c.kv_residual = static_cast<int>(*residual);
  const std::string mla = args.get_or("kv-mla", "expanded");
  if (mla != "expanded" && mla != "latent") {
    return make_error(Errc::kInvalidArgument,
                      "--kv-mla: '" + mla + "' is not one of expanded, latent");
  }
  c.kv_mla_latent = mla == "latent";
  if (args.flag("kv-rotate") && args.flag("no-kv-rotate")) {
    return make_error(Errc::kInvalidArgument, "give --kv-rotate or --no-kv-rotate, not both");
  }
  if ((args.flag("kv-center") || args.has("kv-center-text")) && args.flag("no-kv-center")) {
    return make_error(Errc::kInvalidArgument,
                      "give --kv-center (or --kv-center-text) or --no-kv-center, not both");
  }
  // An MLA latent cache (--kv-mla latent) is neither rotated nor centred: no
  // defaults for it (an explicit --kv-rotate / --kv-center is an error).
  const KvQualityDefaults q =
      c.kv_mla_latent ? KvQualityDefaults{} : kv_quality_defaults(c.key_dtype(), c.value_dtype());
  // The rotation default applies only where the model allows it; an explicit
  // --kv-rotate on such a model is an error from Engine::create.
  const bool rotate = args.flag("kv-rotate") || (q.rotate && !args.flag("no-kv-rotate") &&
                                                 model_supports_rotation(c.model_path));
  if (rotate) c.kv_rotation = KvRotation::kHadamard;
  c.kv_center = args.flag("kv-center") || args.has("kv-center-text") ||
                (q.center && !args.flag("no-kv-center"));
  if (args.has("kv-center-text")) {
    auto text = read_file(args.get_or("kv-center-text", ""));
    if (!text) return make_error(text.error().code, "--kv-center-text: " + text.error().message);
    if (text->empty()) {
      return make_error(Errc::kInvalidArgument,
                        "--kv-center-text: " + args.get_or("kv-center-text", "") + " is empty");
    }
    c.kv_center_text = std::move(*text);
  }
  auto chunk = args.get_int("prefill-chunk", 512, 1, 1 << 20);
  if (!chunk) return chunk.error();
  c.prefill_chunk = static_cast<int>(*chunk);
  if (auto lw = args.get("layer-windows")) {
    size_t at = 0;
    while (at <= lw->size()) {
      const size_t comma = std::min(lw->find(',', at), lw->size());
      const std::string item = lw->substr(at, comma - at);
      char* end = nullptr;
      const long w = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || end == nullptr || *end != '\0' || w < 0 || w > (1L << 24)) {
        return make_error(Errc::kInvalidArgument,
                          "--layer-windows: '" + item + "' is not a window in [0, 16777216]");
      }
      c.layer_windows.push_back(static_cast<int>(w));
      at = comma + 1;
    }
  }
  if (auto kr = args.get("kv-retention")) {
    auto r = parse_retention(*kr);
    if (!r) return r.error();
    c.kv_retention = *r;
  }
  c.prefix_cache = !args.flag("no-prefix-cache");
  if (!c.prefix_cache && args.has("public-prefix")) {
    return make_error(Errc::kInvalidArgument,
                      "--public-prefix needs the prefix cache (drop --no-prefix-cache)");
  }
  auto host_mem = args.get_bytes("kv-host-mem", 0);
  if (!host_mem) return host_mem.error();
  if (args.has("kv-host-mem") && *host_mem == 0) {
    return make_error(Errc::kInvalidArgument, "--kv-host-mem must be greater than 0");
  }
  c.kv_tiers.host_bytes = static_cast<int64_t>(*host_mem);
  c.kv_tiers.write_through = args.flag("kv-host-write-through");
  if (auto f = args.get("kv-host-format")) {
    auto hf = parse_host_format(*f);
    if (!hf) return hf.error();
    c.kv_tiers.host_format = *hf;
  }
  auto disk_size = args.get_bytes("kv-disk-size", 0);
  if (!disk_size) return disk_size.error();
  c.kv_tiers.disk_dir = args.get_or("kv-disk", "");
  if (args.has("kv-disk") && c.kv_tiers.disk_dir.empty()) {
    return make_error(Errc::kInvalidArgument, "--kv-disk needs a directory");
  }
  c.kv_tiers.disk_bytes = static_cast<int64_t>(*disk_size);
  c.kv_tiers.redis_url = args.get_or("kv-redis", "");
  auto redis_timeout = args.get_int("kv-redis-timeout", 200, 1, 60000);
  if (!redis_timeout) return redis_timeout.error();
  c.kv_tiers.redis_timeout_ms = static_cast<int>(*redis_timeout);
  if (!c.prefix_cache && c.kv_tiers.enabled()) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-host-mem / --kv-disk / --kv-redis need the prefix cache (drop "
                      "--no-prefix-cache)");
  }
  // Weights digests persist per user (the one place the cache dir is read).
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    c.digest_cache_dir = std::string(xdg) + "/kvstack";
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    c.digest_cache_dir = std::string(home) + "/.cache/kvstack";
  }
  return c;
}

Result<std::unique_ptr<Engine>> load_engine(const Args& args, bool quiet) {
  auto cfg = engine_config_from(args);
  if (!cfg) return cfg.error();
  const auto t0 = std::chrono::steady_clock::now();
  auto engine = Engine::create(*cfg);
  if (!engine) return engine.error();
  int64_t n_pinned = 0;
  for (const std::string& path : args.all("public-prefix")) {
    auto text = read_file(path);
    if (!text) return text.error();
    const std::vector<int32_t> tokens =
        (*engine)->tokenizer().tokenize(*text, {.add_special = true, .parse_special = true});
    auto pinned = (*engine)->add_public_prefix(tokens);
    if (!pinned)
      return make_error(pinned.error().code,
                        "--public-prefix " + path + ": " + pinned.error().message);
    n_pinned += *pinned;
  }
  if (!quiet) {
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const auto st = (*engine)->pool().stats();
    // The kernels that really run: matmul per weight format and attention
    // per KV format, each named by the function that dispatches them.
    const Model& model = (*engine)->model();
    std::vector<const WeightView*> views;
    for (const LayerWeights& l : model.layers()) {
      for (const WeightView* wv : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down,
                                   &l.mla.wq_a, &l.mla.wq_b, &l.mla.wkv_a, &l.mla.wkv_b,
                                   &l.moe.router, &l.moe.sh_gate, &l.moe.sh_up, &l.moe.sh_down}) {
        if (wv->data != nullptr) views.push_back(wv);
      }
      for (const auto* ex : {&l.moe.gate, &l.moe.up, &l.moe.down}) {
        if (!ex->empty()) views.push_back(&ex->front());
      }
    }
    views.push_back(&model.output());
    // An MLA latent deployment names mla_attention's kernel ("mla-latent
    // f16 avx512"); every other layout what attention's own selection picks.
    std::string kernels =
        "matmul: " + matmul_kernel_summary(views) + "; attention: " +
        (cfg->kv_mla_latent ? "mla-latent " + mla_attention_kernel_name(cfg->key_dtype())
                            : attention_kernel_summary((*engine)->layout()));
    if (model.config().arch == "deepseek2")
      kernels += "; " + deepseek2_kernel_summary(model.config(), cfg->kv_mla_latent);
    // --load-mode copy: how much of the copy the kernel put on huge pages.
    const MappedFile& map = model.file().mapping();
    // And how much of it was packed into 16-column panels (kPanels16).
    std::string load = map.mode() == LoadMode::kCopy
                           ? "copied, " + format_bytes(static_cast<double>(map.huge_page_bytes())) +
                                 " in huge pages"
                           : std::string("mmap");
    if (model.packed_bytes() > 0) {
      load += ", " + format_bytes(static_cast<double>(model.packed_bytes())) + " in panels";
    }
    std::fprintf(stderr,
                 "kvstack: loaded %s (%s weights, %s) in %.0f ms; %d threads, kernels (%s); KV "
                 "pool %lld blocks x %d tokens (%s, %s)\n",
                 cfg->model_path.c_str(),
                 format_bytes(static_cast<double>((*engine)->model().weight_bytes())).c_str(),
                 load.c_str(), ms, (*engine)->threads().n_threads(), kernels.c_str(),
                 static_cast<long long>(st.n_blocks_total), cfg->block_size,
                 (std::string(kv_dtype_name(cfg->key_dtype())) +
                  (cfg->value_dtype() != cfg->key_dtype()
                       ? std::string("/") + kv_dtype_name(cfg->value_dtype())
                       : std::string()))
                     .c_str(),
                 format_bytes(static_cast<double>(st.pool_bytes)).c_str());
    if (cfg->kv_rotation != KvRotation::kNone) {
      std::fprintf(stderr, "kvstack: --kv-rotate: Q/K/V rotated per head (%s)%s\n",
                   kv_rotation_name(cfg->kv_rotation),
                   args.flag("kv-rotate") ? ""
                                          : "; the default for this KV format, --no-kv-rotate "
                                            "turns it off");
    }
    if (const KeyCenter* kc = (*engine)->key_center(); kc != nullptr) {
      std::fprintf(
          stderr, "kvstack: --kv-center: key means over %lld calibration tokens (%s)%s\n",
          static_cast<long long>(kc->n_tokens),
          args.has("kv-center-text") ? args.get_or("kv-center-text", "").c_str() : "built-in text",
          args.flag("kv-center") || args.has("kv-center-text")
              ? ""
              : "; the default for int8/int4 keys, --no-kv-center turns it off");
    }
    if (const KvTiers* t = (*engine)->kv().tiers(); t != nullptr) {
      for (const TierStoreStats& ts : t->stats().tiers) {
        std::fprintf(stderr, "kvstack: KV %s tier %lld blocks (%s)%s%s\n", ts.name.c_str(),
                     static_cast<long long>(ts.n_slots),
                     format_bytes(static_cast<double>(ts.capacity_bytes)).c_str(),
                     ts.name == "disk" ? (", " + cfg->kv_tiers.disk_dir + ", " +
                                          std::to_string(ts.n_blocks) + " blocks cached")
                                             .c_str()
                                       : "",
                     ts.n_identity_mismatch > 0 ? (", " + std::to_string(ts.n_identity_mismatch) +
                                                   " entries of another model/format dropped")
                                                      .c_str()
                                                : "");
      }
    }
    if (!cfg->prefix_cache) {
      std::fprintf(stderr, "kvstack: prefix cache off\n");
    } else if (n_pinned > 0) {
      std::fprintf(stderr, "kvstack: %lld public prefix blocks pinned\n",
                   static_cast<long long>(n_pinned));
    }
  }
  return engine;
}

}  // namespace kvstack::cli

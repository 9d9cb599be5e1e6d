#include "engine/engine.h"

#include <algorithm>
#include <chrono>

#include "attention/mla_attention.h"
#include "core/check.h"

namespace kvstack {

Engine::~Engine() = default;

namespace {

// Revision of the forward pass's K/V semantics: bump when a change makes
// newly computed K/V differ from what an older build cached.
constexpr const char* kForwardRevision = "forward-r1";

Result<CacheIdentity> engine_cache_identity(const Model& model, const EngineConfig& config,
                                            const KvLayout& layout, const KeyCenter* center) {
  CacheIdentity id;
  if (config.prefix_cache) {
    auto digest = weights_digest(config.model_path, config.digest_cache_dir);
    if (!digest) return digest.error();
    id.weights_digest = *digest;
  }
  const ModelConfig& c = model.config();
  id.arch_revision =
      c.arch + ";" + kForwardRevision + ";L=" + std::to_string(c.n_layers) +
      ";E=" + std::to_string(c.n_embd) + ";H=" + std::to_string(c.n_heads) +
      ";Hkv=" + std::to_string(c.n_kv_heads) + ";d=" + std::to_string(c.head_dim) +
      ";eps=" + std::to_string(c.norm_eps) + ";bias=" + std::to_string(c.qkv_bias) +
      (c.shared_kv_layers > 0 ? ";shared=" + std::to_string(c.shared_kv_layers) : std::string());
  id.kv_format = kv_format_key(layout);
  id.kv_transform = kv_rotation_key(config.kv_rotation);
  if (center != nullptr) {
    if (!id.kv_transform.empty()) id.kv_transform.push_back(';');
    id.kv_transform.append(center->key());
  }
  id.position = "rope;n_rot=" + std::to_string(c.n_rot) + ";neox=" + std::to_string(c.rope_neox) +
                ";base=" + std::to_string(c.rope_freq_base) +
                ";scale=" + std::to_string(c.rope_freq_scale) + ";type=" + c.rope_scaling_type;
  id.attention = "causal;window=";
  for (size_t l = 0; l < c.layer_window.size(); ++l) {
    if (l > 0) id.attention.push_back(',');
    id.attention.append(std::to_string(c.layer_window[l]));
  }
  id.attention.append(";sinks=0");
  return id;
}

}  // namespace

int64_t prefill_chunk_end(int64_t from, int64_t n_end, int64_t chunk) {
  KV_DCHECK(0 <= from && from < n_end && chunk >= 1, "prefill_chunk_end: bad arguments");
  int64_t end = std::min(n_end, (from / chunk + 1) * chunk);
  if (chunk < 2) return end;
  // Moving the boundary would leave fewer than two tokens in this entry (it
  // starts at n_end - 3 or later: chunk 2, or just after a prefix hit): the
  // entry runs to the end of the prompt instead, 3 tokens at most.
  if (end == n_end - 1) end = end - 1 - from >= 2 ? end - 1 : n_end;
  // A start one token before a boundary (after a prefix hit): that token
  // joins the next entry rather than run alone.
  if (end - from == 1 && end < n_end) end = prefill_chunk_end(end, n_end, chunk);
  return end;
}

Result<KvLayout> engine_kv_layout(const ModelConfig& c, const EngineConfig& config) {
  // One standard layer per model layer, each with its own window: the pool
  // groups them (kv_groups.h).
  std::vector<KvLayerSpec> layers(static_cast<size_t>(c.n_layers));
  if (config.kv_mla_latent) {
    if (c.arch != "deepseek2") {
      return make_error(Errc::kInvalidArgument, "--kv-mla latent: the model (" + c.arch +
                                                    ") has no latent attention (deepseek2 only)");
    }
    if (!mla_latent_dtype_supported(config.key_dtype()) ||
        config.value_dtype() != config.key_dtype() || config.kv_rotation != KvRotation::kNone ||
        config.kv_center) {
      return make_error(Errc::kUnsupported,
                        "--kv-mla latent: supports one KV dtype (f32, f16, bf16, int8) and no "
                        "--kv-rotate / --kv-center");
    }
    // Cross-layer sharing: the shared layers (the last ones) store nothing.
    layers.resize(static_cast<size_t>(c.n_kv_layers()));
    for (int l = 0; l < c.n_kv_layers(); ++l) {
      layers[static_cast<size_t>(l)] = KvLayerSpec{.kind = KvLayerKind::kMlaLatent,
                                                   .latent_dim = c.mla.kv_lora_rank,
                                                   .rope_dim = c.mla.qk_rope,
                                                   .dtype = config.key_dtype()};
    }
    return KvLayout::create(std::move(layers), config.block_size);
  }
  // Cross-layer KV sharing: the shared layers (the last ones) store nothing.
  layers.resize(static_cast<size_t>(c.n_kv_layers()));
  for (int l = 0; l < c.n_kv_layers(); ++l) {
    layers[static_cast<size_t>(l)] = KvLayerSpec{.kind = KvLayerKind::kStandard,
                                                 .n_kv_heads = c.n_kv_heads,
                                                 .head_dim_k = c.head_dim,
                                                 .head_dim_v = c.head_dim,
                                                 .dtype = config.key_dtype(),
                                                 .window = c.window(l),
                                                 .dtype_v = config.value_dtype()};
  }
  return KvLayout::create(std::move(layers), config.block_size,
                          KvLayoutOptions{.kivi_residual = config.kv_residual});
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  std::unique_ptr<Engine> e(new Engine());
  e->config_ = config;
  if (config.prefill_chunk < 1) {
    return make_error(Errc::kInvalidArgument, "prefill chunk must be at least 1 token");
  }
  auto model = Model::load(config.model_path, config.load_mode);
  if (!model) return model.error();
  e->model_ = std::move(*model);
  if (!config.layer_windows.empty()) {
    // The list repeats over the layers (a pattern such as 512 x 5, 0).
    std::vector<int> windows(static_cast<size_t>(e->model_->config().n_layers));
    for (size_t l = 0; l < windows.size(); ++l) {
      windows[l] = config.layer_windows[l % config.layer_windows.size()];
    }
    KV_TRY_STATUS(e->model_->set_layer_windows(std::move(windows)));
  }
  const ModelConfig& c = e->model_->config();
  auto tokenizer = Tokenizer::load_from_gguf(e->model_->file());
  if (!tokenizer) return tokenizer.error();
  if (tokenizer->n_vocab() != c.n_vocab) {
    return make_error(Errc::kCorruptFile, config.model_path + ": tokenizer has " +
                                              std::to_string(tokenizer->n_vocab()) +
                                              " tokens but the model's vocabulary is " +
                                              std::to_string(c.n_vocab));
  }
  e->tokenizer_ = std::make_unique<Tokenizer>(std::move(*tokenizer));
  auto layout = engine_kv_layout(c, config);
  if (!layout) return layout.error();
  if (config.kv_retention.active()) {
    KV_TRY_STATUS(validate_retention(config.kv_retention));
    KV_TRY_STATUS(retention_supported(*layout));
  }
  BlockPoolConfig pc;
  if (config.kv_cache_mem > 0) {
    pc.mem_bytes = static_cast<int64_t>(config.kv_cache_mem);
  } else {
    pc.n_tokens = config.kv_cache_tokens > 0 ? config.kv_cache_tokens : c.n_ctx_train;
    pc.prefill_chunk = config.prefill_chunk;
  }
  // SnapKV chooses per layer: one slot map per layer frees what each chose.
  pc.one_layer_per_group = config.kv_retention.per_layer_groups();
  auto pool = BlockPool::create(*layout, pc);
  if (!pool) return pool.error();
  e->pool_ = std::move(*pool);
  e->threads_ = std::make_unique<ThreadPool>(config.n_threads > 0 ? config.n_threads
                                                                  : default_thread_count());
  e->pool_->set_threads(e->threads_.get());
  KV_TRY_STATUS(kv_rotation_check(config.kv_rotation, c.head_dim));
  e->forward_ = std::make_unique<Forward>(*e->model_, *e->threads_, config.kv_rotation);
  if (config.kv_center) {
    const std::string_view text =
        config.kv_center_text.empty() ? key_center_builtin_text() : config.kv_center_text;
    const std::vector<int32_t> tokens =
        e->tokenizer_->tokenize(text, {.add_special = true, .parse_special = false});
    auto center = calibrate_key_center(*e->model_, *e->threads_, tokens, config.prefill_chunk);
    if (!center) return make_error(center.error().code, "--kv-center: " + center.error().message);
    e->key_center_ = std::make_unique<KeyCenter>(std::move(*center));
    e->forward_->set_key_center(e->key_center_.get());
  }
  auto identity =
      engine_cache_identity(*e->model_, config, e->pool_->layout(), e->key_center_.get());
  if (!identity) return identity.error();
  e->kv_ =
      std::make_unique<KvManager>(*e->pool_, std::move(*identity),
                                  KvManagerConfig{.prefix_cache = config.prefix_cache,
                                                  .default_namespace = config.default_namespace,
                                                  .partial_reuse = true,
                                                  .event_capacity = config.kv_event_capacity});
  KV_TRY_STATUS(e->kv_->enable_tiers(config.kv_tiers));
  if (KvTiers* tiers = e->kv_->tiers(); tiers != nullptr) {
    // Fetch-or-recompute needs the prefill rate: a short calibration
    // prefill on a private table (nothing is published; ~0.1-0.3 s).
    constexpr int64_t kCalibrationTokens = 64;
    std::vector<int32_t> tokens(kCalibrationTokens);
    for (int64_t i = 0; i < kCalibrationTokens; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>((1000 + 7 * i) % c.n_vocab);
    }
    BlockTable table(*e->pool_);
    // A first short run pages the weights in; the second is timed.
    const std::span<const int32_t> warm(tokens.data(), 16);
    bool ok = e->prefill(table, warm, LogitsMode::kNone, nullptr).ok();
    table.release();
    const auto t0 = std::chrono::steady_clock::now();
    if (ok && e->prefill(table, tokens, LogitsMode::kNone, nullptr).ok()) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      tiers->set_prefill_rate(static_cast<double>(kCalibrationTokens) / std::max(s, 1e-9));
    }
  }
  return e;
}

Status Engine::prefill(BlockTable& table, std::span<const int32_t> tokens, LogitsMode mode,
                       std::vector<float>* logits) {
  return prefill_chunks(table, tokens, mode, logits, {});
}

Status Engine::prefill(Sequence& seq, std::span<const int32_t> tokens, LogitsMode mode,
                       std::vector<float>* logits) {
  Status s = prefill_chunks(seq.table(), tokens, mode, logits,
                            [&](std::span<const int32_t> chunk) { seq.on_committed(chunk); });
  if (!s.ok()) seq.rollback();
  return s;
}

Result<int64_t> Engine::add_public_prefix(std::span<const int32_t> tokens) {
  if (kv_->index() == nullptr) {
    return make_error(Errc::kInvalidArgument,
                      "public prefixes need the prefix cache (drop --no-prefix-cache)");
  }
  if (tokens.empty()) return make_error(Errc::kInvalidArgument, "public prefix has no tokens");
  Sequence seq = kv_->new_sequence(kv_->public_namespace());
  // An equal public prefix (or a prefix of it) may already be pinned: reuse
  // it, so a repeated --public-prefix costs nothing.
  const int64_t n_adopted = seq.adopt_cached_prefix(tokens);
  if (n_adopted < static_cast<int64_t>(tokens.size())) {
    KV_TRY_STATUS(prefill(seq, tokens.subspan(n_adopted), LogitsMode::kNone, nullptr));
  }
  return kv_->pin_public(std::move(seq));
}

Status Engine::prefill_chunks(BlockTable& table, std::span<const int32_t> tokens, LogitsMode mode,
                              std::vector<float>* logits,
                              const std::function<void(std::span<const int32_t>)>& on_chunk) {
  if (tokens.empty()) return make_error(Errc::kInvalidArgument, "nothing to prefill");
  std::vector<float> chunk_logits;
  const auto n = static_cast<int64_t>(tokens.size());
  // Chunks are cut at absolute positions: tokens[i] lands at position0 + i.
  const int64_t position0 = table.length();
  if (logits != nullptr && mode != LogitsMode::kLast) logits->clear();
  for (int64_t b = 0, e = 0; b < n; b = e) {
    e = prefill_chunk_end(position0 + b, position0 + n, config_.prefill_chunk) - position0;
    const bool last = e == n;
    LogitsMode m = LogitsMode::kNone;
    if (mode == LogitsMode::kAll) m = LogitsMode::kAll;
    if (mode == LogitsMode::kLast && last) m = LogitsMode::kLast;
    const StepSeq s{.table = &table, .tokens = tokens.subspan(b, e - b), .logits = m};
    KV_TRY_STATUS(forward_->step(std::span<const StepSeq>(&s, 1),
                                 m == LogitsMode::kNone ? nullptr : &chunk_logits));
    if (on_chunk) on_chunk(s.tokens);
    if (logits == nullptr || m == LogitsMode::kNone) continue;
    if (mode == LogitsMode::kAll) {
      logits->insert(logits->end(), chunk_logits.begin(), chunk_logits.end());
    } else {
      // kLast: only the final chunk asks for logits. A swap (not a move)
      // leaves chunk_logits a valid vector, which step() overwrites.
      logits->swap(chunk_logits);
    }
  }
  return {};
}

}  // namespace kvstack

#include "engine/engine.h"

#include <algorithm>

namespace kvstack {

Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  std::unique_ptr<Engine> e(new Engine());
  e->config_ = config;
  if (config.prefill_chunk < 1) {
    return make_error(Errc::kInvalidArgument, "prefill chunk must be at least 1 token");
  }
  auto model = Model::load(config.model_path);
  if (!model) return model.error();
  e->model_ = std::move(*model);
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
  auto layout =
      KvLayout::uniform(c.n_layers, c.n_kv_heads, c.head_dim, config.kv_dtype, config.block_size);
  if (!layout) return layout.error();
  BlockPoolConfig pc;
  if (config.kv_cache_mem > 0) {
    pc.mem_bytes = static_cast<int64_t>(config.kv_cache_mem);
  } else {
    pc.n_tokens = config.kv_cache_tokens > 0 ? config.kv_cache_tokens : c.n_ctx_train;
  }
  auto pool = BlockPool::create(*layout, pc);
  if (!pool) return pool.error();
  e->pool_ = std::move(*pool);
  e->threads_ =
      std::make_unique<ThreadPool>(config.n_threads > 0 ? config.n_threads : default_thread_count());
  e->forward_ = std::make_unique<Forward>(*e->model_, *e->threads_);
  return e;
}

Status Engine::prefill(BlockTable& table, std::span<const int32_t> tokens, LogitsMode mode,
                       std::vector<float>* logits) {
  if (tokens.empty()) return make_error(Errc::kInvalidArgument, "nothing to prefill");
  std::vector<float> chunk_logits;
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t chunk = config_.prefill_chunk;
  if (logits != nullptr && mode != LogitsMode::kLast) logits->clear();
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t e = std::min(n, b + chunk);
    const bool last = e == n;
    LogitsMode m = LogitsMode::kNone;
    if (mode == LogitsMode::kAll) m = LogitsMode::kAll;
    if (mode == LogitsMode::kLast && last) m = LogitsMode::kLast;
    const StepSeq s{.table = &table, .tokens = tokens.subspan(b, e - b), .logits = m};
    KV_TRY_STATUS(forward_->step(std::span<const StepSeq>(&s, 1),
                                 m == LogitsMode::kNone ? nullptr : &chunk_logits));
    if (logits == nullptr || m == LogitsMode::kNone) continue;
    if (mode == LogitsMode::kAll) {
      logits->insert(logits->end(), chunk_logits.begin(), chunk_logits.end());
    } else {
      *logits = std::move(chunk_logits);
    }
  }
  return {};
}

}  // namespace kvstack

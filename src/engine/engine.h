// Engine: one model, one KV block pool, one thread pool, and the forward
// pass over them. The CLI commands and (later) the scheduler drive it.
//
// Thread-safety: single owner thread; internal parallelism via the pool.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/thread_pool.h"
#include "engine/forward.h"
#include "engine/key_center.h"
#include "engine/model.h"
#include "engine/sequence.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/layout.h"
#include "tokenizer/tokenizer.h"

namespace kvstack {

struct EngineConfig {
  std::string model_path;
  // How the GGUF gets into memory (--load-mode): copied into huge pages by
  // default (faster decode), or memory-mapped (mapped_file.h).
  LoadMode load_mode = LoadMode::kCopy;
  int n_threads = 0;    // 0 = all cores
  int block_size = 16;  // tokens per KV block (power of two, 1..256)
  KvDtype kv_dtype = KvDtype::kF16;
  // K's and V's formats when they differ from kv_dtype (--kv-dtype-k/-v).
  std::optional<KvDtype> kv_dtype_k;
  std::optional<KvDtype> kv_dtype_v;
  // KIVI formats: newest tokens per sequence kept in f16 (--kv-residual R, a
  // multiple of the key group G, kivi_codec.h); ignored by other formats.
  int kv_residual = 128;
  // deepseek2 (--kv-mla latent): cache one latent row [c ; k_R] per layer and
  // token (KvLayerKind::kMlaLatent) instead of the expanded per-head K/V.
  bool kv_mla_latent = false;
  KvDtype key_dtype() const { return kv_dtype_k.value_or(kv_dtype); }
  KvDtype value_dtype() const { return kv_dtype_v.value_or(kv_dtype); }
  KvRotation kv_rotation = KvRotation::kNone;  // --kv-rotate: Q/K/V rotation before K/V are stored
  // --kv-center (key_center.h): subtract a calibrated per-channel key mean
  // before K is stored; calibrated at create() on kv_center_text, or on the
  // built-in text when that is empty.
  bool kv_center = false;
  std::string kv_center_text;
  uint64_t kv_cache_mem = 0;    // bytes for the pool (0 = use kv_cache_tokens)
  int64_t kv_cache_tokens = 0;  // tokens for the pool (0 = the model's context length)
  int prefill_chunk = 512;      // max tokens per prefill step
  // Per-layer attention windows replacing the model's (--layer-windows,
  // Model::set_layer_windows; empty = the model's own), repeated over the
  // layers when shorter: runs a model as a hybrid sliding-window one.
  std::vector<int> layer_windows;
  // --kv-retention (kv/retention.h): the policy of every new table and
  // sequence (new_table / new_sequence); kNone keeps every token.
  RetentionConfig kv_retention;
  // Prefix cache (sequence.h): off = every request computes its own K/V.
  bool prefix_cache = true;
  std::string default_namespace = "default";  // namespace of requests without a cache salt
  std::string digest_cache_dir;   // where weights digests persist ("" = this process only)
  int64_t kv_event_capacity = 0;  // pending KV events kept (0 = off)
  // Storage tiers below the pool (--kv-host-mem, --kv-disk, kv_tiers.h).
  KvTierConfig kv_tiers;
};

// End (exclusive) of the prefill entry that starts at absolute position
// `from` of a sequence whose known prompt ends at `n_end`, for chunk length
// `chunk`. Boundaries sit at the multiples of `chunk`, except that the one at
// n_end - 1 moves to n_end - 2: the last prompt token is never an entry of
// its own, because a one-token entry takes the attention kernel's decode
// path, which rounds differently from the same row inside a chunk (unless
// `chunk` is 1, or only one token is left: then the entry is that token).
// The split is therefore a function of the positions and `chunk` alone, the
// same for Engine::prefill() and the Scheduler whatever else runs beside it.
// Where moving it would leave a one-token entry, the entry runs to n_end;
// an entry that starts one token before a boundary (after a prefix hit)
// runs to the next one. REQUIRES: 0 <= from < n_end, chunk >= 1. The entry
// holds at least 2 tokens when chunk >= 2 and from < n_end - 1, at most
// `chunk` when `from` is a multiple of it (3 when chunk is 2: an odd rest
// cannot be cut into pairs), and `chunk` + 1 (4) otherwise.
int64_t prefill_chunk_end(int64_t from, int64_t n_end, int64_t chunk);

// The KV layout an engine with `config` uses for a model of config `c`: one
// standard layer per model layer with that layer's window.
Result<KvLayout> engine_kv_layout(const ModelConfig& c, const EngineConfig& config);

class Engine {
 public:
  // Loads the model and creates the pool; errors name the file or flag at fault.
  static Result<std::unique_ptr<Engine>> create(const EngineConfig& config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  const EngineConfig& config() const { return config_; }
  const Model& model() const { return *model_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  BlockPool& pool() { return *pool_; }
  ThreadPool& threads() { return *threads_; }
  Forward& forward() { return *forward_; }
  // The key means subtracted under --kv-center (nullptr when off).
  const KeyCenter* key_center() const { return key_center_.get(); }
  const KvLayout& layout() const { return pool_->layout(); }

  KvManager& kv() { return *kv_; }

  // A new, empty sequence table in this engine's pool (no prefix cache),
  // under config().kv_retention (checked against the layout at create()).
  BlockTable new_table() {
    BlockTable t(*pool_);
    KV_CHECK(t.set_retention(config_.kv_retention).ok(), "retention checked at create()");
    return t;
  }

  // A new, empty sequence in the namespace of `cache_salt` (empty: the
  // deployment default). Use prefill(Sequence&) / generate(Sequence&) to run
  // it through the prefix cache.
  Sequence new_sequence(std::string_view cache_salt = "") {
    Sequence s = kv_->new_sequence(kv_->namespace_for(cache_salt));
    KV_CHECK(s.table().set_retention(config_.kv_retention).ok(), "retention checked at create()");
    return s;
  }

  // Runs `tokens` through the model on top of `table` in chunks of at most
  // config().prefill_chunk tokens, cut at the absolute positions
  // prefill_chunk_end() gives (as the Scheduler cuts them, so a prompt is
  // computed in the same entry shapes here and in `kvstack serve`; the first
  // chunk after a prefix-cache hit runs up to the next boundary). kAll
  // appends logits for every token to
  // *logits, kLast writes only the last token's row, kNone none. On error
  // the table keeps the chunks that completed (each committed) and nothing
  // of the failed chunk.
  Status prefill(BlockTable& table, std::span<const int32_t> tokens, LogitsMode mode,
                 std::vector<float>* logits);

  // The same on a sequence: each committed chunk is recorded and its full
  // blocks published. On error the failed chunk's reservation is rolled back
  // and nothing of it is published.
  Status prefill(Sequence& seq, std::span<const int32_t> tokens, LogitsMode mode,
                 std::vector<float>* logits);

  // Computes `tokens` in the public namespace and pins the result: its full
  // blocks are shared by every namespace and never evicted. Returns the
  // number of pinned blocks (tokens past the last full block are not
  // shareable). kInvalidArgument when the prefix cache is disabled.
  Result<int64_t> add_public_prefix(std::span<const int32_t> tokens);

 private:
  Engine() = default;
  EngineConfig config_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ThreadPool> threads_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<KvManager> kv_;          // destroyed before pool_
  std::unique_ptr<KeyCenter> key_center_;  // outlives forward_'s use of it
  std::unique_ptr<Forward> forward_;

  Status prefill_chunks(BlockTable& table, std::span<const int32_t> tokens, LogitsMode mode,
                        std::vector<float>* logits,
                        const std::function<void(std::span<const int32_t>)>& on_chunk);
};

}  // namespace kvstack

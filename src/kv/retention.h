// Token retention policies (kv-cache-spec.md sections 8 and 12): which
// logical positions of a sequence stay resident, and when the block table
// compacts the survivors into dense blocks (GroupTable::compact) so that the
// dropped tokens' blocks really return to the pool.
//
// Policies are approximate execution modes, opt-in per request or deployment
// (--kv-retention, the server's "kv_retention" field). Implemented:
//   streamingllm  S attention-sink tokens (positions [0, S)) plus the recent
//                 window: a query at logical position t sees the sinks and
//                 positions [t - W + 1, t] (itself included), evaluated at
//                 the start of every step (a prefill chunk's rows also see
//                 the chunk's earlier rows, as in causal attention).
//   snapkv        once at the end of each prefill (the step before the first
//                 one-token step): the last w_obs prompt queries vote; per
//                 query head, vote[j] = sum over the w_obs queries of their
//                 softmax probability on prefix key j (keys before the
//                 observation window); votes are max-pooled over a kernel
//                 of k neighbours (1-D, stride 1, padding k / 2); each KV
//                 head keeps the `budget` prefix tokens of highest pooled
//                 vote (ties: the earlier token), plus the observation window.
//                 GQA rule: `union` (default) keeps the union of the top
//                 `budget` of each query head of the KV head; `mean` ranks
//                 the mean of the KV head's query heads' votes (before
//                 pooling). One slot map serves every layer and KV head of a
//                 KV group (kv_groups.h: one block holds all of them), so the
//                 group keeps the union over its layers and KV heads: resident
//                 tokens are at least budget + w_obs and grow with how much
//                 the heads disagree (measured in docs/benchmarks.md).
//                 Tokens decoded afterwards all stay (as in the paper).
//                 The engine gives every layer its own group under snapkv and
//                 pyramidkv (BlockPoolConfig::one_layer_per_group), so the
//                 union only spans one layer's KV heads.
//   pyramidkv     SnapKV's selection with a budget per layer decreasing
//                 linearly with depth (PyramidKV): with mean budget B over L
//                 layers, the last layer keeps k_{L-1} = max(1, B / beta),
//                 the first k_0 = 2B - k_{L-1}, layer l
//                 k_0 - (k_0 - k_{L-1}) l / (L - 1) (rounded down; beta 20).
//                 A sequence that never decodes (perplexity) is never
//                 compacted.
//   h2o           Heavy-Hitter Oracle: before every one-token step, each
//                 full-attention KV group keeps its `window` most recent
//                 resident tokens and, among the older ones, the `budget`
//                 of highest accumulated attention mass (ties: the earlier
//                 token); the new token then attends to those budget +
//                 window plus itself. Mass of slot t = the sum, over every
//                 decode query so far and over all query heads of the
//                 group's layers, of its softmax probability on t (the
//                 decode kernels accumulate it as they attend:
//                 AttnSeq::key_mass), plus, at the end of each prefill, the
//                 same sum over the prompt's last `obs` queries (32; 0:
//                 decode queries only; the paper sums every prompt query,
//                 obs = the prompt length does that at O(obs n) cost).
//                 GQA rule: the group's query heads' masses are summed and
//                 ranked (the `mean` rule; one slot map serves the whole
//                 KV group). Multi-token steps (prompts) never compact: the
//                 prompt is resident until the first decode step. The
//                 engine gives every layer its own group under h2o too.
//   topk          per-query top-k block reads (Quest): nothing is dropped
//                 and nothing compacts (the full history stays resident and
//                 publishable: the stored K/V are exact). Each table keeps,
//                 per layer and block, every KV head's per-channel min and
//                 max of the stored keys in f16, the minimum rounded down and
//                 the maximum up (f16_bound_down/up), so the interval still
//                 holds every key (BlockTable::key_summary); a decode query
//                 reads only k blocks of each full-attention layer: its own
//                 (last, partial) block, the first `sink` full blocks (the
//                 attention sinks, default 1) and the `recent` full blocks
//                 before its own (default 1), as far as k allows (own, then
//                 sink, then recent), and fills the rest of k with the full
//                 blocks of highest upper bound on q.k, ub(block) = max over
//                 q heads of sum_c max(q_c min_c, q_c max_c) (topk_blocks).
//                 Prompt rows read everything. Saves bandwidth, not memory.
//                 With k covering every block the output is the exact
//                 cache's.
//
// Positions. Survivors keep their ORIGINAL logical positions: keys are stored
// already rotated, new tokens get position = logical length (not the
// resident count). The paper's rolling cache re-assigns positions inside
// the cache; kvstack does not (spec section 8: re-rotating by slot index is
// a bug), so a compacted cache attends exactly as the full cache would with
// the dropped tokens masked.
//
// Compaction policy (when selection becomes freed memory). Before each step
// the table drops what the policy no longer keeps, but only once at least
// `slack` resident tokens are droppable (default: the block size P), so each
// compaction frees at least one whole block and moves the survivors after
// the first dropped slot once per `slack` tokens (bytes moved are counted).
// Between compactions a query sees up to slack - 1 more recent tokens than
// W: slack=1 compacts every step (exactly S + W visible, the most bytes
// moved). Only full-attention groups (KvGroup::window == 0) are compacted:
// sliding-window groups already keep only their window and stay exact.
//
// Identity. A compacted table's blocks are private: a sequence stops
// publishing to the prefix index at its first compaction (blocks published
// before it hold exact K/V computed with the whole history), so a compacted
// sequence never serves a prefix hit to an exact request (or to any other).
//
// Formats. Compaction moves single token rows with their per-row metadata;
// fp8 (one scale per block) and KIVI (keys quantized per channel over groups
// of tokens) cannot move single tokens and are refused (retention_supported).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "kv/layout.h"

namespace kvstack {

enum class RetentionPolicy : uint8_t {
  kNone = 0,  // exact: every token stays resident
  kStreamingLlm = 1,
  kSnapKv = 2,
  kPyramidKv = 3,
  kH2o = 4,
  kTopK = 5,  // per-query top-k block reads (Quest); nothing is dropped
};

// SnapKV's rule for the query heads of one KV head (GQA).
enum class GqaRule : uint8_t {
  kUnion = 0,  // union of each query head's top-budget choice
  kMean = 1,   // top budget of the mean vote
};

struct RetentionConfig {
  RetentionPolicy policy = RetentionPolicy::kNone;
  int64_t sinks = 4;  // streamingllm: S, the first positions always kept
  // streamingllm: W >= 1, recent positions a query sees (itself included);
  // snapkv: w_obs >= 1, the observation window (default 32).
  int64_t window = 0;
  int64_t slack = 0;   // streamingllm: droppable tokens that trigger a compaction (0 = P)
  int64_t budget = 0;  // snapkv: prefix tokens each KV head keeps (>= 1)
  int64_t kernel = 7;  // snapkv: max-pooling kernel, odd, >= 1
  GqaRule gqa = GqaRule::kUnion;  // snapkv, pyramidkv
  int64_t beta = 20;              // pyramidkv: first-to-last budget steepness (>= 1)
  // h2o: budget = heavy hitters kept (>= 1), window = recent tokens kept
  // (>= 1), slack as streamingllm's; obs = prompt queries whose attention
  // seeds the mass at the end of prefill (>= 0).
  int64_t obs = 32;
  // topk: blocks each decode query reads per full-attention layer (>= 1):
  // its own, then up to topk_sink first blocks and topk_recent blocks just
  // before its own (always, as far as k allows), then the best-bound rest.
  int64_t topk = 0;
  int64_t topk_sink = 1;
  int64_t topk_recent = 1;
  bool active() const { return policy != RetentionPolicy::kNone; }
  bool is_topk() const { return policy == RetentionPolicy::kTopK; }
  bool is_h2o() const { return policy == RetentionPolicy::kH2o; }
  // Query rows of the prompt's end the table keeps (BlockTable::observe_queries).
  int64_t observed_rows() const { return is_h2o() ? obs : selects_at_prefill_end() ? window : 0; }
  // Selection per layer: the engine gives each layer its own KV group.
  bool per_layer_groups() const { return selects_at_prefill_end() || is_h2o(); }
  // SnapKV-style selection at the end of prefill (snapkv, pyramidkv).
  bool selects_at_prefill_end() const {
    return policy == RetentionPolicy::kSnapKv || policy == RetentionPolicy::kPyramidKv;
  }
};

// Parses "none", "streamingllm:sinks=S,window=W[,slack=N]" (sinks defaults
// to 4, window is required) or "snapkv:budget=B[,window=W][,kernel=K]
// [,gqa=union|mean]" (window 32, kernel 7, gqa union by default) or
// "pyramidkv:budget=B[,beta=X]" plus snapkv's keys, or
// "h2o:budget=B,window=W[,slack=N][,obs=O]" or "topk:k=K[,sink=S][,recent=R]"
// (blocks; sink 1, recent 1 by default); keys in any order. Errors
// (kInvalidArgument) name the policy, key or value at fault.
Result<RetentionConfig> parse_retention(std::string_view spec);
// The canonical text of a config ("none", "streamingllm:sinks=4,window=1024,slack=16").
std::string retention_name(const RetentionConfig& config);
// kInvalidArgument when the config's values are out of range (what
// parse_retention checks; for configs built from other sources, e.g. JSON).
Status validate_retention(const RetentionConfig& config);
// kUnsupported naming the format when a layout's KV format cannot be
// compacted token by token (fp8, KIVI), or kInvalidArgument when no layer is
// full attention (nothing to compact).
Status retention_supported(const KvLayout& layout);

// Slots of a group to keep before a step that starts at logical length
// `length`, given `positions` ([n_slots] ascending logical positions of the
// resident slots), as ascending slot indices. kNone keeps every slot. The
// slack rule (whether dropping is worth a compaction now) is the caller's.
std::vector<int64_t> retention_keep_slots(const RetentionConfig& config,
                                          std::span<const int32_t> positions, int64_t length);

// H2O's choice for one KV group before a one-token step: `mass` holds the
// accumulated attention mass of its n resident slots (ascending positions).
// Keeps the last `window` slots and, among slots [0, n - window), the
// `budget` of highest mass (ties: the earlier slot); every slot when n <=
// budget + window. Returns ascending slot indices. REQUIRES config.is_h2o().
std::vector<int64_t> h2o_keep_slots(const RetentionConfig& config, std::span<const float> mass);

// Quest's choice for one decode query: `q` [n_q_heads, head_dim] (as the
// kernel sees it, before the scale), `summary` [n_full][n_kv_heads][2]
// [head_dim] per-channel key minima then maxima of each full block, f16
// bits (f16_bound_down / f16_bound_up). Returns `k_full` block indices,
// ascending: blocks [0, min(n_sink, k_full)), then up to n_recent of the
// last blocks before n_full within what k_full leaves, then the rest of
// highest upper bound (ties: the earlier block); every block when n_full <=
// k_full.
std::vector<int64_t> topk_blocks(std::span<const float> q, int n_q_heads, int n_kv_heads,
                                 int head_dim, std::span<const uint16_t> summary, int64_t n_full,
                                 int64_t k_full, int64_t n_sink = 0, int64_t n_recent = 0);
// The largest f16 value <= x, and the smallest >= x (f16 bits; +-inf past
// the f16 range on the open side), so that an f16 [min, max] interval still
// holds every float it was made from. REQUIRES: x is not NaN.
uint16_t f16_bound_down(float x);
uint16_t f16_bound_up(float x);

// Prompt tokens layer `layer` of `n_layers` keeps under `config`: budget
// for snapkv, the pyramid schedule above for pyramidkv.
int64_t retention_layer_budget(const RetentionConfig& config, int layer, int n_layers);

// Blocks a full-attention group of a table under `config` holds at most
// during a step of up to `chunk` tokens (streamingllm: compaction keeps
// fewer than sinks + window + slack tokens before each step), given the
// exact cache's `exact_blocks`; exact_blocks for other policies.
int64_t retention_peak_blocks(const RetentionConfig& config, int64_t exact_blocks,
                              int64_t block_size, int64_t chunk);

// SnapKV's choice for one KV group from the observation window's attention.
// attn: [n_units][group][n_obs][n_keys] probabilities, unit = one (layer, KV
// head) of the KV group, group = its query heads, row r = the observation
// query at key index n_keys - n_obs + r (its probabilities over keys beyond
// itself are 0). Returns the kept key indices, ascending: for each unit the
// policy's choice among the prefix [0, n_keys - n_obs) (every prefix key when
// it holds at most budget), their union over units, plus the window.
// REQUIRES: config.selects_at_prefill_end(), 0 < n_obs <= n_keys (config.budget
// is the budget used).
std::vector<int64_t> snapkv_select(const RetentionConfig& config, std::span<const float> attn,
                                   int64_t n_units, int group, int64_t n_obs, int64_t n_keys);
// The same for one unit ([group][n_obs][n_keys]): sets keep[j] = 1 for the
// unit's chosen prefix keys (keep: [n_keys]; the window is not marked).
void snapkv_mark_unit(const RetentionConfig& config, std::span<const float> attn, int group,
                      int64_t n_obs, int64_t n_keys, std::span<uint8_t> keep);

// Lifetime counters of compaction (per table and summed per pool).
struct RetentionStats {
  int64_t n_compactions = 0;     // compactions applied
  int64_t n_tokens_dropped = 0;  // resident tokens removed by compaction
  int64_t n_blocks_freed = 0;    // blocks compaction released from tables
  int64_t n_bytes_moved = 0;     // K/V bytes copied (rows moved + copy-on-write blocks)
  int64_t n_deferred = 0;        // compactions skipped: copy-on-write found no block
  // topk: blocks decode queries read / would have read (per layer, summed).
  int64_t n_topk_blocks_read = 0;
  int64_t n_topk_blocks_total = 0;
};

}  // namespace kvstack

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
};

struct RetentionConfig {
  RetentionPolicy policy = RetentionPolicy::kNone;
  int64_t sinks = 4;   // streamingllm: S, the first positions always kept
  int64_t window = 0;  // streamingllm: W >= 1, recent positions a query sees (itself included)
  int64_t slack = 0;   // droppable resident tokens that trigger a compaction (0 = block size)
  bool active() const { return policy != RetentionPolicy::kNone; }
  // Tokens the policy keeps resident at most (between compactions up to
  // slack - 1 more).
  int64_t budget() const { return sinks + window; }
};

// Parses "none" or "streamingllm:sinks=S,window=W[,slack=N]" (keys in any
// order; sinks defaults to 4, window is required). Errors (kInvalidArgument)
// name the policy, key or value at fault.
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

// Lifetime counters of compaction (per table and summed per pool).
struct RetentionStats {
  int64_t n_compactions = 0;     // compactions applied
  int64_t n_tokens_dropped = 0;  // resident tokens removed by compaction
  int64_t n_blocks_freed = 0;    // blocks compaction released from tables
  int64_t n_bytes_moved = 0;     // K/V bytes copied (rows moved + copy-on-write blocks)
  int64_t n_deferred = 0;        // compactions skipped: copy-on-write found no block
};

}  // namespace kvstack

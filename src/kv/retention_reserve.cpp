// What admission reserves for a table under a retention policy
// (BlockTable::retention_reserve_blocks, block_table.h): the blocks each
// group holds at most from now on, by what the policy really keeps
// (retention.h), not the exact cache's ceil(T / P).
//
// Per full-attention group of a compacting policy, with P the block size,
// N the prompt (multi-token steps), T the target logical length, L the
// table's logical length now and R the group's resident slots now:
//   streamingllm  retention_peak_blocks: it compacts before every step, also
//                 between prefill chunks (sinks + window + slack + a chunk).
//   h2o           while L <= N the whole prompt (it never compacts a
//                 multi-token step: the prompt stays until the first
//                 one-token step); from the first one-token step on, before
//                 each step the group keeps budget + window and compacts once
//                 slack more are droppable, so it holds at most
//                 ceil((budget + window + slack) / P) blocks after the step's
//                 token.
//   snapkv,       while L <= N the whole prompt and, for what follows, the
//   pyramidkv     selection's bound: per layer of the group each query head
//                 (union) or KV head (mean) keeps at most the group's budget,
//                 plus the observation window, so the prompt keeps at most
//                 K = min(N, layers x heads x budget + window) and then every
//                 decoded token stays: ceil((K + T - N) / P). Once selected
//                 (L > N) the kept count is known: ceil((R + T - L) / P).
// Each is capped by the exact peak. Groups the policy does not compact
// (windows, MLA under selection policies) and the non-compacting policies
// (none, topk) keep the exact figure.
#include <algorithm>

#include "kv/block_table.h"

namespace kvstack {

namespace {

int64_t ceil_blocks(int64_t tokens, int64_t p) {
  return (std::max<int64_t>(0, tokens) + p - 1) / p;
}

// Whether `config` compacts group g of `pool` (a full-attention group; the
// selection policies also need standard layers only).
bool policy_compacts(const BlockPool& pool, const RetentionConfig& config, int g) {
  const RetentionPolicy p = config.policy;
  if (p == RetentionPolicy::kNone || p == RetentionPolicy::kTopK) return false;
  if (pool.group(g).window > 0) return false;
  if (p == RetentionPolicy::kStreamingLlm) return true;
  // snapkv, pyramidkv, h2o select from attention: standard layers only.
  const KvLayout& layout = pool.group(g).layout;
  for (int i = 0; i < layout.n_layers(); ++i) {
    if (layout.layer(i).kind != KvLayerKind::kStandard) return false;
  }
  return true;
}

// What H2O keeps from its first one-token step on (see the top).
int64_t h2o_kept_blocks(const RetentionConfig& config, int64_t p) {
  const int64_t slack = config.slack > 0 ? config.slack : p;
  return ceil_blocks(config.budget + config.window + slack, p);
}

}  // namespace

bool BlockTable::retention_compacts(int g) const {
  return policy_compacts(*pool_, retention_, g);
}

int64_t BlockTable::retention_group_peak(int g, int64_t n_prompt, int64_t n_target,
                                         int64_t chunk) const {
  const KvGroups& groups = pool_->groups();
  const int64_t exact = groups.peak_blocks(g, n_target, chunk);
  if (!retention_compacts(g)) return exact;
  const int64_t p = pool_->block_size();
  const int64_t length = this->length();
  const GroupTable& gt = groups_[static_cast<size_t>(g)];
  // The whole prompt while it is being written (selection policies).
  const int64_t prompt = length <= n_prompt ? groups.peak_blocks(g, n_prompt, chunk) : 0;
  switch (retention_.policy) {
    case RetentionPolicy::kStreamingLlm:
      return retention_peak_blocks(retention_, exact, p, chunk);
    case RetentionPolicy::kH2o:
      return std::min(exact, std::max(prompt, h2o_kept_blocks(retention_, p)));
    case RetentionPolicy::kSnapKv:
    case RetentionPolicy::kPyramidKv: {
      if (length > n_prompt) {  // selected (or kept whole): the count is known
        return std::min(exact, ceil_blocks(gt.length() + n_target - length, p));
      }
      int64_t kept = n_prompt;
      if (obs_shape_.n_q_heads > 0) {  // the query heads are known once rows were observed
        const int64_t budget = retention_layer_budget(retention_, pool_->group(g).layers.front(),
                                                      pool_->groups().n_layers());
        int64_t heads = 0;
        for (int i = 0; i < gt.layout().n_layers(); ++i) {
          heads += retention_.gqa == GqaRule::kUnion ? obs_shape_.n_q_heads
                                                     : gt.layout().layer(i).n_kv_heads;
        }
        kept = std::min(n_prompt, heads * budget + retention_.window);
      }
      return std::min(
          exact,
          std::max(prompt, ceil_blocks(kept + std::max<int64_t>(0, n_target - n_prompt), p)));
    }
    default:
      return exact;
  }
}

int64_t BlockTable::retention_reserve_blocks(int64_t n_prompt, int64_t n_target, int64_t chunk,
                                             bool all_shared) const {
  int64_t n = 0;
  bool shared = false;
  for (int g = 0; g < n_groups(); ++g) {
    const GroupTable& gt = groups_[static_cast<size_t>(g)];
    const int64_t peak = retention_group_peak(g, n_prompt, n_target, chunk);
    if (!retention_compacts(g)) {
      n += std::max<int64_t>(0, peak - gt.n_resident_blocks());
      continue;
    }
    // Compaction copies shared destination blocks: only private blocks are
    // already paid for.
    const int64_t held = all_shared ? gt.n_resident_blocks() : gt.n_held_elsewhere();
    n += std::max<int64_t>(0, peak - (gt.n_resident_blocks() - held));
    // One block in flight while a compaction may still copy a published
    // block (before the group's first compaction: the prompt's blocks are
    // published as they fill) or a shared one.
    shared = shared || all_shared || !gt.compacted() || gt.any_shared();
  }
  return n + (shared ? 1 : 0);
}

int64_t BlockTable::fresh_reserve_blocks(const BlockPool& pool, const RetentionConfig& config,
                                         int64_t n_prompt, int64_t n_target, int64_t chunk) {
  const KvGroups& groups = pool.groups();
  const int64_t p = pool.block_size();
  int64_t n = 0;
  bool compacts = false;
  for (int g = 0; g < groups.n_groups(); ++g) {
    const int64_t exact = groups.peak_blocks(g, n_target, chunk);
    if (!policy_compacts(pool, config, g)) {
      n += exact;
      continue;
    }
    compacts = true;
    // retention_group_peak of an empty table: the selection policies know
    // no query heads yet, so they count the exact peak.
    if (config.policy == RetentionPolicy::kStreamingLlm) {
      n += retention_peak_blocks(config, exact, p, chunk);
    } else if (config.policy == RetentionPolicy::kH2o) {
      n += std::min(exact,
                    std::max(groups.peak_blocks(g, n_prompt, chunk), h2o_kept_blocks(config, p)));
    } else {
      n += exact;
    }
  }
  return n + (compacts ? 1 : 0);  // the block in flight before the first compaction
}

}  // namespace kvstack

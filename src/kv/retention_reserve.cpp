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
// Until a group's first compaction, with a prefix index, each adds
// ceil(kept / P) + 1 blocks: that compaction copies the published blocks it
// writes while the published ones past the survivors are still held
// (GroupTable::compact). Each is capped by the exact peak. Groups the policy does not compact
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

// What retention_group_peak reads of a table: its logical length, group g's
// resident slots, whether g was compacted, and the observed query heads (0
// before any row was observed). An empty table is all zero.
struct PeakState {
  int64_t length = 0;
  int64_t resident = 0;
  bool compacted = false;
  int n_q_heads = 0;
};

int64_t group_peak(const BlockPool& pool, const RetentionConfig& rc, int g, const PeakState& st,
                   int64_t n_prompt, int64_t n_target, int64_t chunk) {
  const KvGroups& groups = pool.groups();
  const int64_t exact = groups.peak_blocks(g, n_target, chunk);
  if (!policy_compacts(pool, rc, g)) return exact;
  const int64_t p = pool.block_size();
  // The whole prompt while it is being written (selection policies).
  const int64_t prompt = st.length <= n_prompt ? groups.peak_blocks(g, n_prompt, chunk) : 0;
  // Until its first compaction a group's full blocks may be published (the
  // prefix cache publishes them as they fill); that compaction copies each
  // published destination while the published blocks past the survivors
  // are still held (GroupTable::compact): one block per kept block on top
  // of what the group holds.
  const bool copies = pool.index() != nullptr && !st.compacted;
  auto with_copies = [&](int64_t held, int64_t kept_tokens) {
    return held + (copies ? ceil_blocks(kept_tokens, p) + 1 : 0);
  };
  switch (rc.policy) {
    case RetentionPolicy::kStreamingLlm:
      return std::min(
          exact, with_copies(retention_peak_blocks(rc, exact, p, chunk), rc.sinks + rc.window));
    case RetentionPolicy::kH2o: {
      const int64_t kept = h2o_kept_blocks(rc, p);
      const int64_t first = prompt > 0 ? prompt + (copies ? kept + 1 : 0) : 0;
      return std::min(exact, std::max(first, kept));
    }
    case RetentionPolicy::kSnapKv:
    case RetentionPolicy::kPyramidKv: {
      if (st.length > n_prompt) {  // selected (or kept whole): the count is known
        return std::min(exact, ceil_blocks(st.resident + n_target - st.length, p));
      }
      int64_t kept = n_prompt;
      if (st.n_q_heads > 0) {  // the query heads are known once rows were observed
        const int64_t budget =
            retention_layer_budget(rc, pool.group(g).layers.front(), groups.n_layers());
        const KvLayout& layout = pool.group(g).layout;
        int64_t heads = 0;
        for (int i = 0; i < layout.n_layers(); ++i) {
          heads += rc.gqa == GqaRule::kUnion ? st.n_q_heads : layout.layer(i).n_kv_heads;
        }
        kept = std::min(n_prompt, heads * budget + rc.window);
      }
      return std::min(exact,
                      std::max(with_copies(prompt, kept),
                               ceil_blocks(kept + std::max<int64_t>(0, n_target - n_prompt), p)));
    }
    default:
      return exact;
  }
}

}  // namespace

bool BlockTable::retention_compacts(int g) const {
  return policy_compacts(*pool_, retention_, g);
}

int64_t BlockTable::retention_group_peak(int g, int64_t n_prompt, int64_t n_target,
                                         int64_t chunk) const {
  const GroupTable& gt = groups_[static_cast<size_t>(g)];
  const PeakState st{.length = length(),
                     .resident = gt.length(),
                     .compacted = gt.compacted(),
                     .n_q_heads = obs_shape_.n_q_heads};
  return group_peak(*pool_, retention_, g, st, n_prompt, n_target, chunk);
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
  // retention_reserve_blocks of an empty table: nothing resident or shared,
  // one block in flight when a group compacts.
  int64_t n = 0;
  bool compacts = false;
  for (int g = 0; g < pool.n_groups(); ++g) {
    n += group_peak(pool, config, g, PeakState{}, n_prompt, n_target, chunk);
    compacts = compacts || policy_compacts(pool, config, g);
  }
  return n + (compacts ? 1 : 0);
}

}  // namespace kvstack

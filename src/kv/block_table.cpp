#include "kv/block_table.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "kv/kv_write.h"

namespace kvstack {

void BlockTable::make_groups() {
  groups_.clear();
  groups_.reserve(static_cast<size_t>(pool_->n_groups()));
  for (int g = 0; g < pool_->n_groups(); ++g) groups_.emplace_back(*pool_, g);
}

BlockTable::BlockTable(BlockPool& pool) : pool_(&pool) {
  make_groups();
}

BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_),
      retention_(other.retention_),
      retention_stats_(other.retention_stats_),
      obs_(std::move(other.obs_)),
      obs_shape_(other.obs_shape_),
      mass_(std::move(other.mass_)),
      mass_output_(other.mass_output_),
      summ_(std::move(other.summ_)),
      groups_(std::move(other.groups_)) {
  // The vector's buffer moved: the group tables keep their addresses (and
  // registrations). The moved-from table stays usable and empty.
  other.make_groups();
}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this == &other) return *this;
  groups_.clear();  // releases and unregisters this table's groups
  pool_ = other.pool_;
  retention_ = other.retention_;
  retention_stats_ = other.retention_stats_;
  obs_ = std::move(other.obs_);
  obs_shape_ = other.obs_shape_;
  mass_ = std::move(other.mass_);
  mass_output_ = other.mass_output_;
  summ_ = std::move(other.summ_);
  groups_ = std::move(other.groups_);
  other.make_groups();
  return *this;
}

int64_t BlockTable::converted() const {
  int64_t c = groups_[0].converted() + groups_[0].n_evicted();
  for (const GroupTable& g : groups_) c = std::min(c, g.converted() + g.n_evicted());
  return c;
}

bool BlockTable::compacted() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const GroupTable& g) { return g.compacted(); });
}

Status BlockTable::set_retention(const RetentionConfig& config) {
  if (config.active()) {
    KV_TRY_STATUS(validate_retention(config));
    KV_TRY_STATUS(retention_supported(pool_->layout()));
  }
  retention_ = config;
  mass_.clear();
  if (config.is_h2o()) mass_.resize(groups_.size());
  summ_.clear();
  if (config.is_topk()) summ_.resize(static_cast<size_t>(pool_->groups().n_layers()));
  return Status{};
}

void BlockTable::summarize(int l, int64_t b, int64_t n_valid) {
  KeySummary& ks = summ_[static_cast<size_t>(l)];
  const PagedKvLayerView view = pool_->layer_view(l);
  const int n_kv = view.n_kv_heads, d = view.head_dim;
  const int64_t per_block = int64_t{n_kv} * 2 * d;
  const auto nb = static_cast<size_t>(b + 1);
  if (ks.id.size() < nb) {
    ks.mm.resize(nb * static_cast<size_t>(per_block));
    ks.id.resize(nb, -1);
    ks.n.resize(nb, 0);
  }
  const std::span<const int32_t> ids = ids_for_layer(l);
  const int64_t P = pool_->block_size();
  std::vector<float> k(static_cast<size_t>(n_valid * n_kv * d)), v(k.size());
  read_kv(view, ids, b * P, n_valid, k.data(), v.data());
  uint16_t* mm = ks.mm.data() + b * per_block;
  std::vector<float> mn(static_cast<size_t>(d)), mx(static_cast<size_t>(d));
  for (int h = 0; h < n_kv; ++h) {
    std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
    std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n_valid; ++t) {
      const float* kt = k.data() + (t * n_kv + h) * d;
      for (int c = 0; c < d; ++c) {
        mn[c] = std::min(mn[c], kt[c]);
        mx[c] = std::max(mx[c], kt[c]);
      }
    }
    // f16, rounded outwards: the interval still holds every key.
    uint16_t* out = mm + int64_t{h} * 2 * d;
    for (int c = 0; c < d; ++c) {
      out[c] = f16_bound_down(mn[static_cast<size_t>(c)]);
      out[d + c] = f16_bound_up(mx[static_cast<size_t>(c)]);
    }
  }
  ks.id[static_cast<size_t>(b)] = ids[static_cast<size_t>(b)];
  ks.n[static_cast<size_t>(b)] = static_cast<int32_t>(n_valid);
}

std::span<const uint16_t> BlockTable::key_summary(int l, int64_t n_blocks) {
  KV_CHECK(topk_reads() && l >= 0 && static_cast<size_t>(l) < summ_.size(),
           "key_summary: the table is not topk");
  const std::span<const int32_t> ids = ids_for_layer(l);
  const int64_t P = pool_->block_size();
  KV_CHECK(n_blocks * P <= resident_length(l) + P, "key_summary: blocks past the keys");
  for (int64_t b = 0; b < n_blocks; ++b) {
    const KeySummary& ks = summ_[static_cast<size_t>(l)];
    const bool fresh = static_cast<size_t>(b) < ks.id.size() &&
                       ks.id[static_cast<size_t>(b)] == ids[static_cast<size_t>(b)] &&
                       ks.n[static_cast<size_t>(b)] == P;
    if (!fresh) summarize(l, b, P);
  }
  const KeySummary& ks = summ_[static_cast<size_t>(l)];
  const PagedKvLayerView view = pool_->layer_view(l);
  return std::span<const uint16_t>(ks.mm).first(
      static_cast<size_t>(n_blocks * view.n_kv_heads * 2 * view.head_dim));
}

void BlockTable::count_topk_reads(int64_t n_read, int64_t n_total) {
  retention_stats_.n_topk_blocks_read += n_read;
  retention_stats_.n_topk_blocks_total += n_total;
  pool_->retention_.n_topk_blocks_read += n_read;
  pool_->retention_.n_topk_blocks_total += n_total;
}

std::vector<int64_t>& BlockTable::topk_choice(int l) {
  KV_CHECK(topk_reads() && l >= 0 && static_cast<size_t>(l) < summ_.size(),
           "topk_choice: the table is not topk");
  return summ_[static_cast<size_t>(l)].last;
}

void BlockTable::trim_mass() {
  for (size_t g = 0; g < mass_.size(); ++g) {
    mass_[g].resize(static_cast<size_t>(groups_[g].length()), 0.0f);
  }
}

float* BlockTable::key_mass(int l, int64_t n_keys) {
  KV_CHECK(wants_mass() && mass_.size() == groups_.size(), "key_mass: the table is not h2o");
  std::vector<float>& m = mass_[static_cast<size_t>(pool_->groups().slot(l).group)];
  if (static_cast<int64_t>(m.size()) < n_keys) m.resize(static_cast<size_t>(n_keys), 0.0f);
  return m.data();
}

std::span<const float> BlockTable::group_mass(int g) const {
  if (static_cast<size_t>(g) >= mass_.size()) return {};
  return mass_[static_cast<size_t>(g)];
}

int64_t BlockTable::apply_retention() {
  const bool h2o = retention_.is_h2o();
  if (retention_.policy != RetentionPolicy::kStreamingLlm && !h2o) return 0;
  const int64_t length = this->length();
  const int64_t slack = retention_.slack > 0 ? retention_.slack : pool_->block_size();
  if (h2o) trim_mass();
  int64_t n_freed = 0;
  std::vector<int32_t> identity;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    GroupTable& g = groups_[gi];
    if (pool_->group(g.group()).window > 0) continue;  // windows are exact and bounded
    std::vector<int64_t> keep;
    if (h2o) {
      // MLA groups get no mass (their attention is another kernel): kept whole.
      bool standard = true;
      for (int i = 0; i < g.layout().n_layers(); ++i) {
        standard = standard && g.layout().layer(i).kind == KvLayerKind::kStandard;
      }
      if (!standard) continue;
      // h2o_keep_slots keeps min(n, budget + window) slots: skip the
      // selection (an nth_element over every slot) on the steps where the
      // slack rule below would not compact anyway.
      const int64_t n_keep = std::min(g.length(), retention_.budget + retention_.window);
      if (g.length() - n_keep < slack) continue;
      keep = h2o_keep_slots(retention_, mass_[gi]);
    } else {
      std::span<const int32_t> positions = g.positions();
      if (!g.compacted()) {
        identity.resize(static_cast<size_t>(g.length()));
        for (size_t i = 0; i < identity.size(); ++i) identity[i] = static_cast<int32_t>(i);
        positions = identity;
      }
      keep = retention_keep_slots(retention_, positions, length);
    }
    if (g.length() - static_cast<int64_t>(keep.size()) < slack) continue;
    const int64_t before = retention_stats_.n_blocks_freed;
    const Status st = g.compact(keep, &retention_stats_);
    if (!st.ok()) {
      KV_CHECK(st.error().code == Errc::kOutOfBlocks, "apply_retention: compaction refused");
      ++retention_stats_.n_deferred;
      ++pool_->retention_.n_deferred;
      continue;
    }
    if (h2o) {  // survivors carry their mass to their new slots
      std::vector<float>& m = mass_[gi];
      for (size_t i = 0; i < keep.size(); ++i) m[i] = m[static_cast<size_t>(keep[i])];
      m.resize(keep.size());
    }
    n_freed += retention_stats_.n_blocks_freed - before;
  }
  return n_freed;
}

KvResidualView BlockTable::residual_view(int l) const {
  const KvLayerSlot s = pool_->groups().slot(l);
  return groups_[static_cast<size_t>(s.group)].residual_view(s.index);
}

int64_t BlockTable::residual_bytes() const {
  int64_t n = 0;
  for (const GroupTable& g : groups_) n += g.residual_bytes();
  return n;
}

int64_t BlockTable::n_resident_blocks() const {
  int64_t n = 0;
  for (const GroupTable& g : groups_) n += g.n_resident_blocks();
  return n;
}

int64_t BlockTable::blocks_needed(int64_t n_new) const {
  int64_t n = 0;
  for (const GroupTable& g : groups_) n += g.blocks_needed(n_new);
  return n;
}

bool BlockTable::tail_shared() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const GroupTable& g) { return g.tail_shared(); });
}

int64_t BlockTable::drop_invisible() {
  int64_t n = 0;
  for (GroupTable& g : groups_) n += g.drop_invisible();
  // h2o compacts before one-token steps only (prepare_step).
  if (retention_.active() && !retention_.is_h2o()) n += apply_retention();
  return n;
}

int64_t BlockTable::prepare_step(int64_t n_new) {
  int64_t n = drop_invisible();
  if (retention_.is_h2o()) trim_mass();
  if (n_new == 1 && !obs_.empty()) n += apply_snapkv();
  if (n_new == 1 && retention_.is_h2o()) n += apply_retention();
  return n;
}

Status BlockTable::reserve(int64_t n_new) {
  KV_CHECK(n_new >= 0, "reserve: negative token count");
  prepare_step(n_new);
  if (groups_.size() == 1) return groups_[0].reserve(n_new);
  const int64_t need = blocks_needed(n_new);
  if (need > pool_->n_available()) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks,
                      "KV pool exhausted: " + std::to_string(n_new) + " tokens need " +
                          std::to_string(need) + " more blocks of " +
                          std::to_string(pool_->block_size()) + " tokens over " +
                          std::to_string(groups_.size()) + " KV groups, " +
                          std::to_string(pool_->n_available()) + " available");
  }
  for (GroupTable& g : groups_) {
    const Status s = g.reserve(n_new);
    KV_CHECK(s.ok(), "reserve: a group's reservation failed after a successful plan");
  }
  return Status{};
}

void BlockTable::write(int l, int64_t pos, const float* k_rows, const float* v_rows,
                       int64_t n_tokens) {
  KV_CHECK(l >= 0 && l < pool_->groups().n_layers(), "write: layer index out of range");
  const KvLayerSlot s = pool_->groups().slot(l);
  GroupTable& g = groups_[static_cast<size_t>(s.group)];
  g.write(s.index, pos - g.n_evicted(), k_rows, v_rows, n_tokens);
  // topk: refresh the touched blocks' key bounds (full-attention layers).
  if (!summ_.empty() && n_tokens > 0 && pool_->group(s.group).window == 0 &&
      pool_->layout().layer(l).kind == KvLayerKind::kStandard) {
    const int64_t P = pool_->block_size();
    for (int64_t b = pos / P; b <= (pos + n_tokens - 1) / P; ++b) {
      summarize(l, b, std::min(P, pos + n_tokens - b * P));
    }
  }
}

void BlockTable::commit(int64_t n_new) {
  for (GroupTable& g : groups_) g.commit(n_new);
}

void BlockTable::commit_final(int64_t n_new) {
  for (GroupTable& g : groups_) g.commit_final(n_new);
}

int64_t BlockTable::rollback() {
  int64_t n = 0;
  for (GroupTable& g : groups_) n += g.rollback();
  return n;
}

void BlockTable::release() {
  for (GroupTable& g : groups_) g.release();
  retention_stats_ = RetentionStats{};
  obs_.clear();
  for (std::vector<float>& m : mass_) m.clear();
  for (KeySummary& ks : summ_) ks = KeySummary{};
}

BlockRef BlockTable::share_block(int64_t i) const {
  KV_CHECK(groups_.size() == 1, "share_block: a multi-group table shares per group");
  return groups_[0].share_block(i);
}

void BlockTable::adopt_prefix(std::vector<BlockRef> refs) {
  KV_CHECK(groups_.size() == 1, "adopt_prefix: a multi-group table adopts per group");
  groups_[0].adopt_prefix(std::move(refs));
}

Status BlockTable::adopt_partial_copy(BlockRef src, int64_t n_tokens) {
  KV_CHECK(groups_.size() == 1, "adopt_partial_copy: single-group tables only");
  return groups_[0].adopt_partial_copy(std::move(src), n_tokens);
}

BlockTable BlockTable::fork() const {
  BlockTable t(*pool_);
  for (size_t g = 0; g < groups_.size(); ++g) t.groups_[g] = groups_[g].fork();
  t.retention_ = retention_;
  t.obs_ = obs_;  // a fork before the first decode step still applies SnapKV
  t.obs_shape_ = obs_shape_;
  t.mass_ = mass_;
  t.mass_output_ = mass_output_;
  t.trim_mass();
  t.summ_ = summ_;
  return t;
}

Result<BlockTable> BlockTable::clone_private() const {
  int64_t need = 0;
  for (const GroupTable& g : groups_) {
    const int64_t keep = (g.length() + pool_->block_size() - 1) / pool_->block_size();
    need += keep - g.n_dropped();
  }
  if (need > pool_->n_available()) {
    ++pool_->n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: cloning a sequence needs " +
                                              std::to_string(need) + " blocks, " +
                                              std::to_string(pool_->n_available()) + " available");
  }
  BlockTable t(*pool_);
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto c = groups_[g].clone_private();
    KV_CHECK(c.ok(), "clone_private: a group's copy failed after a successful plan");
    t.groups_[g] = std::move(*c);
  }
  t.retention_ = retention_;
  t.mass_ = mass_;
  t.mass_output_ = mass_output_;
  t.trim_mass();
  t.summ_ = summ_;  // block ids differ: key_summary() rebuilds them
  return t;
}

int64_t plan_reserve(std::span<BlockTable* const> tables, std::span<const int64_t> n_new) {
  KV_CHECK(tables.size() == n_new.size(), "plan_reserve: tables and n_new differ in size");
  int64_t total = 0;
  for (size_t i = 0; i < tables.size(); ++i) total += tables[i]->blocks_needed(n_new[i]);
  return total;
}

Status reserve_all(std::span<BlockTable* const> tables, std::span<const int64_t> n_new) {
  KV_CHECK(tables.size() == n_new.size(), "reserve_all: tables and n_new differ in size");
  if (tables.empty()) return Status{};
  BlockPool& pool = tables[0]->pool();
  for (size_t i = 0; i < tables.size(); ++i) {
    KV_CHECK(&tables[i]->pool() == &pool, "reserve_all: tables from different pools");
    for (size_t j = 0; j < i; ++j) KV_CHECK(tables[j] != tables[i], "reserve_all: duplicate table");
  }
  // Dropping invisible window blocks is always safe (no later step reads
  // them) and makes room for this step.
  for (size_t i = 0; i < tables.size(); ++i) tables[i]->prepare_step(n_new[i]);
  const int64_t need = plan_reserve(tables, n_new);
  if (need > pool.n_available()) {
    ++pool.n_out_of_blocks_;
    return make_error(Errc::kOutOfBlocks, "KV pool exhausted: batch of " +
                                              std::to_string(tables.size()) + " sequences needs " +
                                              std::to_string(need) + " blocks, " +
                                              std::to_string(pool.n_available()) + " available");
  }
  for (size_t i = 0; i < tables.size(); ++i) {
    Status s = tables[i]->reserve(n_new[i]);
    KV_CHECK(s.ok(), "reserve_all: reservation failed after a successful plan");
  }
  return Status{};
}

}  // namespace kvstack

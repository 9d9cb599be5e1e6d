#include "kv/prefix_index.h"

// Inlined: the lookup hashes short, fixed-size token rows on the match path.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace kvstack {

std::string Hash128::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

Hash128 hash128(const void* data, size_t n_bytes, uint64_t seed) {
  const XXH128_hash_t h = XXH3_128bits_withSeed(data, n_bytes, seed);
  return Hash128{h.low64, h.high64};
}

void PrefixMatch::reset() {
  partial.reset();
  for (auto& g : group_blocks) {
    while (!g.empty()) g.pop_back();
  }
  group_blocks.clear();
  group_first.clear();
  while (!blocks.empty()) blocks.pop_back();  // deepest first: children precede parents in LRU
  n_partial_tokens = 0;
}

PrefixIndex::PrefixIndex(BlockPool& pool, PrefixIndexConfig config)
    : pool_(pool),
      block_size_(pool.block_size()),
      nodes_(static_cast<size_t>(pool.n_blocks())),
      tokens_(static_cast<size_t>(pool.n_blocks()) * pool.block_size()),
      n_companions_(static_cast<size_t>(pool.n_groups() - 1)),
      companions_(static_cast<size_t>(pool.n_blocks()) * n_companions_, kNullBlock),
      owner_(static_cast<size_t>(pool.n_blocks()), kNullBlock) {
  KV_CHECK(pool.index_ == nullptr, "PrefixIndex: the pool already has an index");
  KV_CHECK(config.lookup_hash_bits >= 0 && config.lookup_hash_bits <= 64,
           "PrefixIndex: lookup_hash_bits must be in [0, 64]");
  key_mask_ =
      config.lookup_hash_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << config.lookup_hash_bits) - 1;
  // Load factor <= 1/2 at most n_blocks nodes: probes stay short and the
  // table never grows.
  size_t n_slots = 16;
  while (n_slots < 2 * nodes_.size()) n_slots *= 2;
  slots_.resize(n_slots);
  slot_mask_ = n_slots - 1;
  pool.index_ = this;
}

PrefixIndex::~PrefixIndex() {
  // Cached blocks go back to the free list; blocks in use become plain
  // private blocks of their holders (freed on their last release).
  while (lru_head_ != kNullBlock || pool_.n_cached() > 0) {
    if (evict(pool_.n_cached()) == 0) break;
  }
  KV_CHECK(pool_.n_cached() == 0, "PrefixIndex: cached blocks left at detach");
  for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i].published = false;
  std::fill(owner_.begin(), owner_.end(), kNullBlock);
  pool_.index_ = nullptr;
}

NamespaceId PrefixIndex::intern_namespace(const Hash128& identity_digest, bool is_public) {
  auto it = ns_by_digest_.find(identity_digest);
  if (it != ns_by_digest_.end()) {
    KV_CHECK(roots_[it->second].is_public == is_public,
             "intern_namespace: digest registered with a different visibility");
    return it->second;
  }
  KV_CHECK(!is_public || public_ns_ == kNoNamespace, "intern_namespace: second public namespace");
  Root r;
  r.digest = identity_digest;
  r.is_public = is_public;
  NamespaceId id = 0;
  if (!ns_free_.empty()) {
    id = ns_free_.back();
    ns_free_.pop_back();
    roots_[id] = r;
  } else {
    id = static_cast<NamespaceId>(roots_.size());
    roots_.push_back(r);
  }
  ns_by_digest_.emplace(identity_digest, id);
  if (is_public) public_ns_ = id;
  return id;
}

void PrefixIndex::acquire_namespace(NamespaceId ns) {
  KV_CHECK(ns >= 0 && static_cast<size_t>(ns) < roots_.size() && roots_[ns].live,
           "acquire_namespace: not a live namespace");
  ++roots_[ns].n_users;
}

void PrefixIndex::release_namespace(NamespaceId ns) {
  KV_CHECK(ns >= 0 && static_cast<size_t>(ns) < roots_.size() && roots_[ns].live &&
               roots_[ns].n_users > 0,
           "release_namespace: namespace not acquired");
  --roots_[ns].n_users;
  maybe_expire(ns);
}

void PrefixIndex::maybe_expire(NamespaceId ns) {
  Root& r = roots_[ns];
  if (!r.live || r.is_public || r.n_users > 0 || r.stats.n_nodes > 0) return;
  KV_DCHECK(r.first_child == kNullBlock, "a namespace without nodes has top-level children");
  ns_by_digest_.erase(r.digest);
  expired_stats_.n_queries += r.stats.n_queries;
  expired_stats_.n_query_tokens += r.stats.n_query_tokens;
  expired_stats_.n_hit_blocks += r.stats.n_hit_blocks;
  expired_stats_.n_hit_tokens += r.stats.n_hit_tokens;
  expired_stats_.n_published += r.stats.n_published;
  r = Root{};
  r.live = false;
  ns_free_.push_back(ns);
  ++n_ns_expired_;
}

std::span<const int32_t> PrefixIndex::block_tokens(int32_t block) const {
  return std::span<const int32_t>(tokens_.data() + static_cast<size_t>(block) * block_size_,
                                  static_cast<size_t>(block_size_));
}

Hash128 PrefixIndex::child_key(const Hash128& parent_hash, NamespaceId ns, const int32_t* tokens,
                               BlockExtraKeys extra) const {
  // Layout hashed: parent hash (16) | namespace digest (16) | tokens (4P) | extra (8 each).
  const size_t n = 32 + 4 * static_cast<size_t>(block_size_) + 8 * extra.size();
  uint8_t stack[32 + 4 * KvLayout::kMaxBlockSize + 8 * 8];
  std::vector<uint8_t> heap;
  uint8_t* buf = stack;
  if (n > sizeof(stack)) {
    heap.resize(n);
    buf = heap.data();
  }
  std::memcpy(buf, &parent_hash, 16);
  std::memcpy(buf + 16, &roots_[ns].digest, 16);
  std::memcpy(buf + 32, tokens, 4 * static_cast<size_t>(block_size_));
  if (!extra.empty()) std::memcpy(buf + 32 + 4 * block_size_, extra.data(), 8 * extra.size());
  return hash128(buf, n);
}

uint64_t PrefixIndex::lookup_key(int32_t parent, NamespaceId ns, const int32_t* tokens,
                                 BlockExtraKeys extra) const {
  const uint64_t seed =
      ((static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(ns)) *
      0x9E3779B97F4A7C15ull;
  uint64_t h = XXH3_64bits_withSeed(tokens, 4 * static_cast<size_t>(block_size_), seed);
  if (!extra.empty()) h = XXH3_64bits_withSeed(extra.data(), 8 * extra.size(), h ^ 0x5bd1e995);
  return h & key_mask_;
}

bool PrefixIndex::extra_equal(int32_t block, BlockExtraKeys extra) const {
  if (!nodes_[block].has_extra) return extra.empty();
  if (extra.empty()) return false;
  const std::vector<uint64_t>& stored = extra_.at(block);
  return stored.size() == extra.size() && std::equal(extra.begin(), extra.end(), stored.begin());
}

void PrefixIndex::slot_insert(uint64_t key, int32_t block) {
  size_t i = key & slot_mask_;
  while (slots_[i].block != kNullBlock) i = (i + 1) & slot_mask_;
  const Node& n = nodes_[block];
  slots_[i] =
      Slot{.tag = static_cast<uint32_t>(key >> 32), .block = block, .parent = n.parent, .ns = n.ns};
}

void PrefixIndex::slot_erase(uint64_t key, int32_t block) {
  size_t i = key & slot_mask_;
  while (slots_[i].block != block) {
    KV_DCHECK(slots_[i].block != kNullBlock, "slot_erase: block not in the child table");
    i = (i + 1) & slot_mask_;
  }
  // Backward-shift deletion: move later entries of the probe run into the
  // hole when the hole lies between their home slot and where they sit.
  size_t j = i;
  for (;;) {
    j = (j + 1) & slot_mask_;
    if (slots_[j].block == kNullBlock) break;
    const size_t home = nodes_[slots_[j].block].key & slot_mask_;
    if (((j - home) & slot_mask_) >= ((j - i) & slot_mask_)) {
      slots_[i] = slots_[j];
      i = j;
    }
  }
  slots_[i] = Slot{};
}

int32_t& PrefixIndex::child_head(int32_t parent, NamespaceId ns) {
  return parent == kNullBlock ? roots_[ns].first_child : nodes_[parent].first_child;
}

int32_t PrefixIndex::find_child(int32_t parent, NamespaceId ns, const int32_t* tokens,
                                BlockExtraKeys extra) {
  const uint64_t key = lookup_key(parent, ns, tokens, extra);
  const auto tag = static_cast<uint32_t>(key >> 32);
  const size_t row_bytes = 4 * static_cast<size_t>(block_size_);
  for (size_t i = key & slot_mask_;; i = (i + 1) & slot_mask_) {
    const Slot& s = slots_[i];
    if (s.block == kNullBlock) return kNullBlock;
    if (s.tag != tag || s.parent != parent || s.ns != ns) continue;
    const int32_t b = s.block;
    if (std::memcmp(tokens_.data() + static_cast<size_t>(b) * block_size_, tokens, row_bytes) ==
            0 &&
        ((n_extra_nodes_ == 0 && extra.empty()) || extra_equal(b, extra))) {
      return b;
    }
    ++n_collisions_;  // same key, different block: keep probing
  }
}

PrefixMatch PrefixIndex::match(NamespaceId ns, std::span<const int32_t> tokens, int64_t max_tokens,
                               bool find_partial, std::span<const BlockExtraKeys> extra,
                               bool count_stats) {
  KV_CHECK(ns_live(ns), "match: unknown namespace");
  PrefixMatch m;
  m.block_size = block_size_;
  max_tokens = std::clamp<int64_t>(max_tokens, 0, static_cast<int64_t>(tokens.size()));
  const int64_t p = block_size_;
  int32_t cur = kNullBlock;
  bool path_public = true;  // every matched block so far is public
  const bool try_public = public_ns_ != kNoNamespace && public_ns_ != ns;
  int64_t j = 0;
  const int64_t n_max_blocks = max_tokens / p;
  for (; j < n_max_blocks; ++j) {
    const int32_t* t = tokens.data() + j * p;
    const BlockExtraKeys ex = j < static_cast<int64_t>(extra.size()) ? extra[j] : BlockExtraKeys{};
    int32_t b = find_child(cur, ns, t, ex);
    if (b == kNullBlock && try_public && path_public) {
      b = find_child(cur, public_ns_, t, ex);
    }
    if (b == kNullBlock) break;
    if (path_public && nodes_[b].ns != public_ns_) path_public = false;
    if (m.blocks.empty()) m.blocks.reserve(static_cast<size_t>(n_max_blocks - j));
    m.blocks.push_back(pool_.ref_block(BlockId{b}));
    cur = b;
  }
  if (n_companions_ > 0) {
    // Hybrid: the longest k <= j whose companions cover what a query at
    // k P can see in every other group (no partial-block reuse).
    find_partial = false;
    int64_t k = j;
    std::vector<int64_t> first(n_companions_, 0);
    for (; k > 0; --k) {
      bool ok = true;
      for (size_t g = 1; g <= n_companions_ && ok; ++g) {
        const KvGroup& gr = pool_.group(static_cast<int>(g));
        first[g - 1] = gr.drops_blocks ? std::max<int64_t>(0, k * p - gr.window + 1) / p : 0;
        for (int64_t b = first[g - 1]; b < k && ok; ++b) {
          ok = companion(m.blocks[static_cast<size_t>(b)].id().value, static_cast<int>(g)) !=
               kNullBlock;
        }
      }
      if (ok) break;
    }
    while (static_cast<int64_t>(m.blocks.size()) > k) m.blocks.pop_back();
    j = k;
    m.group_blocks.resize(n_companions_);
    m.group_first.assign(n_companions_, 0);
    for (size_t g = 1; g <= n_companions_ && k > 0; ++g) {
      m.group_first[g - 1] = first[g - 1];
      for (int64_t b = first[g - 1]; b < k; ++b) {
        const int32_t c =
            companion(m.blocks[static_cast<size_t>(b)].id().value, static_cast<int>(g));
        m.group_blocks[g - 1].push_back(pool_.ref_block(BlockId{c}));
      }
    }
  }
  const int64_t n_full = j * p;
  if (find_partial && n_full < max_tokens) {
    int64_t n_common = 0;
    const int32_t b = best_partial(cur, ns, try_public && path_public, tokens.data() + n_full,
                                   std::min<int64_t>(p, max_tokens - n_full), &n_common);
    if (b != kNullBlock && n_common > 0) {
      m.partial = pool_.ref_block(BlockId{b});
      m.n_partial_tokens = n_common;
      if (count_stats) {
        ++n_partial_hits_;
        n_partial_tokens_ += n_common;
      }
    }
  }
  if (!count_stats) return m;
  NamespaceStats& st = roots_[ns].stats;
  ++st.n_queries;
  st.n_query_tokens += max_tokens;
  st.n_hit_blocks += j;
  st.n_hit_tokens += m.n_tokens();
  return m;
}

int32_t PrefixIndex::best_partial(int32_t parent, NamespaceId ns, bool allow_public,
                                  const int32_t* tokens, int64_t n, int64_t* n_common) const {
  int32_t best = kNullBlock;
  int64_t best_len = 0;
  int scanned = 0;
  auto scan = [&](int32_t head) {
    for (int32_t c = head; c != kNullBlock && scanned < kMaxPartialScan;
         c = nodes_[c].next_sibling) {
      const Node& node = nodes_[c];
      if (node.ns != ns && !(allow_public && node.ns == public_ns_)) continue;
      ++scanned;
      if (node.has_extra) continue;  // extra keys cover the whole block; no partial reuse
      const int32_t* t = tokens_.data() + static_cast<size_t>(c) * block_size_;
      int64_t k = 0;
      while (k < n && t[k] == tokens[k]) ++k;
      if (k > best_len) {
        best_len = k;
        best = c;
      }
    }
  };
  if (parent == kNullBlock) {
    scan(roots_[ns].first_child);
    if (allow_public) scan(roots_[public_ns_].first_child);
  } else {
    scan(nodes_[parent].first_child);
  }
  *n_common = best_len;
  return best;
}

int64_t PrefixIndex::publish(NamespaceId ns, const BlockTable& table,
                             std::span<const int32_t> tokens, int64_t n_published,
                             std::span<const BlockExtraKeys> extra) {
  KV_CHECK(ns_live(ns), "publish: unknown namespace");
  KV_CHECK(&table.pool() == &pool_, "publish: table from another pool");
  KV_CHECK(static_cast<int64_t>(tokens.size()) >= table.length(),
           "publish: fewer tokens than the table's committed length");
  const int64_t p = block_size_;
  // Only final blocks (converted, for KIVI) may be shared.
  const int64_t n_full = table.shareable_length() / p;
  const auto ids = table.ids();
  int64_t j = n_published;
  for (; j < n_full; ++j) {
    const int32_t b = ids[j];
    const int32_t parent = j == 0 ? kNullBlock : ids[j - 1];
    KV_DCHECK(parent == kNullBlock || nodes_[parent].published, "publish: broken chain");
    if (nodes_[b].published) {
      // Already a node (adopted from a match): it must sit on this chain.
      if (nodes_[b].parent != parent) break;
      continue;
    }
    // Only private blocks (one holder: this table) may become nodes: a block
    // shared by forks is still identical, but keep the rule simple and local.
    const int32_t* t = tokens.data() + j * p;
    const BlockExtraKeys ex = j < static_cast<int64_t>(extra.size()) ? extra[j] : BlockExtraKeys{};
    if (find_child(parent, ns, t, ex) != kNullBlock) {
      ++n_duplicates_;
      break;
    }
    const Hash128 parent_hash = parent == kNullBlock ? Hash128{} : nodes_[parent].hash;
    const Hash128 key = child_key(parent_hash, ns, t, ex);
    Node& n = nodes_[b];
    n = Node{};
    n.hash = key;
    n.key = lookup_key(parent, ns, t, ex);
    n.parent = parent;
    n.ns = ns;
    n.published = true;
    n.has_extra = !ex.empty();
    if (n.has_extra) {
      extra_[b].assign(ex.begin(), ex.end());
      ++n_extra_nodes_;
    }
    std::memcpy(tokens_.data() + static_cast<size_t>(b) * p, t, 4 * static_cast<size_t>(p));
    slot_insert(n.key, b);
    link_child(parent, ns, b);
    ++n_nodes_;
    ++roots_[ns].stats.n_published;
    ++roots_[ns].stats.n_nodes;
    emit({.kind = KvEvent::Kind::kStored,
          .hash = key,
          .parent_hash = parent_hash,
          .n_tokens = static_cast<int32_t>(p),
          .ns = ns,
          .tokens = tokens_.data() + static_cast<size_t>(b) * p});
    if (tier_hooks_.on_publish) tier_hooks_.on_publish(b);
  }
  if (j > n_published && tier_hooks_.on_publish_end) tier_hooks_.on_publish_end();
  return j;
}

bool PrefixIndex::attach_companion(int32_t node, int g, int32_t block) {
  KV_CHECK(g >= 1 && static_cast<size_t>(g) <= n_companions_, "attach_companion: bad group");
  KV_CHECK(nodes_[node].published, "attach_companion: not a node");
  KV_CHECK(
      pool_.state(BlockId{block}) == BlockState::kUsed && pool_.block_group(BlockId{block}) == g,
      "attach_companion: the block is not a used block of that group");
  KV_CHECK(!is_published(block), "attach_companion: the block is already published");
  int32_t& slot = companions_[static_cast<size_t>(node) * n_companions_ + (g - 1)];
  if (slot != kNullBlock) return false;
  slot = block;
  owner_[block] = node;
  if (tier_hooks_.on_publish) tier_hooks_.on_publish(block);
  if (tier_hooks_.on_publish_end) tier_hooks_.on_publish_end();
  return true;
}

void PrefixIndex::drop_companions(int32_t node) {
  for (size_t g = 0; g < n_companions_; ++g) {
    int32_t& slot = companions_[static_cast<size_t>(node) * n_companions_ + g];
    const int32_t c = slot;
    if (c == kNullBlock) continue;
    if (pool_.state(BlockId{c}) == BlockState::kCached && tier_hooks_.on_evict) {
      tier_hooks_.on_evict(c);
    }
    slot = kNullBlock;
    owner_[c] = kNullBlock;
    if (pool_.state(BlockId{c}) == BlockState::kCached) {
      lru_remove(c);
      pool_.reclaim(c);
      ++n_evictions_;
      ++n_companion_frees_;
    }
    // A companion still held by a table becomes its private block (freed on release).
  }
}

void PrefixIndex::link_child(int32_t parent, NamespaceId ns, int32_t block) {
  int32_t& head = child_head(parent, ns);
  Node& n = nodes_[block];
  n.prev_sibling = kNullBlock;
  n.next_sibling = head;
  if (head != kNullBlock) nodes_[head].prev_sibling = block;
  head = block;
  if (parent != kNullBlock) {
    Node& p = nodes_[parent];
    ++p.n_children;
    if (p.in_lru) {
      // A cached parent gaining a child (only through loose references)
      // leaves the list until its children are gone.
      lru_remove(parent);
      p.deferred = true;
    }
  }
}

void PrefixIndex::unlink_child(int32_t block) {
  Node& n = nodes_[block];
  if (n.prev_sibling != kNullBlock) {
    nodes_[n.prev_sibling].next_sibling = n.next_sibling;
  } else {
    child_head(n.parent, n.ns) = n.next_sibling;
  }
  if (n.next_sibling != kNullBlock) nodes_[n.next_sibling].prev_sibling = n.prev_sibling;
  n.prev_sibling = n.next_sibling = kNullBlock;
  if (n.parent != kNullBlock) --nodes_[n.parent].n_children;
}

void PrefixIndex::lru_push_back(int32_t b) {
  Node& n = nodes_[b];
  n.lru_prev = lru_tail_;
  n.lru_next = kNullBlock;
  if (lru_tail_ != kNullBlock) nodes_[lru_tail_].lru_next = b;
  lru_tail_ = b;
  if (lru_head_ == kNullBlock) lru_head_ = b;
  n.in_lru = true;
}

void PrefixIndex::lru_push_front(int32_t b) {
  Node& n = nodes_[b];
  n.lru_next = lru_head_;
  n.lru_prev = kNullBlock;
  if (lru_head_ != kNullBlock) nodes_[lru_head_].lru_prev = b;
  lru_head_ = b;
  if (lru_tail_ == kNullBlock) lru_tail_ = b;
  n.in_lru = true;
}

void PrefixIndex::lru_remove(int32_t b) {
  Node& n = nodes_[b];
  if (n.lru_prev != kNullBlock) {
    nodes_[n.lru_prev].lru_next = n.lru_next;
  } else {
    lru_head_ = n.lru_next;
  }
  if (n.lru_next != kNullBlock) {
    nodes_[n.lru_next].lru_prev = n.lru_prev;
  } else {
    lru_tail_ = n.lru_prev;
  }
  n.lru_prev = n.lru_next = kNullBlock;
  n.in_lru = false;
}

void PrefixIndex::on_unreferenced(int32_t block) {
  Node& n = nodes_[block];
  KV_DCHECK(is_published(block) && !n.in_lru, "on_unreferenced: not a published, unlisted block");
  n.deferred = false;
  lru_push_back(block);
}

void PrefixIndex::on_referenced(int32_t block) {
  Node& n = nodes_[block];
  if (n.in_lru) lru_remove(block);
  n.deferred = false;
}

void PrefixIndex::remove_node(int32_t block) {
  Node& n = nodes_[block];
  KV_CHECK(n.published && n.n_children == 0, "remove_node: not a published leaf");
  if (n_companions_ > 0) drop_companions(block);
  const int32_t parent = n.parent;
  const NamespaceId ns = n.ns;
  unlink_child(block);
  slot_erase(n.key, block);
  if (n.has_extra) {
    extra_.erase(block);
    --n_extra_nodes_;
  }
  emit({.kind = KvEvent::Kind::kRemoved,
        .hash = n.hash,
        .parent_hash = parent == kNullBlock ? Hash128{} : nodes_[parent].hash,
        .n_tokens = block_size_,
        .ns = ns});
  n = Node{};
  --n_nodes_;
  --roots_[ns].stats.n_nodes;
  if (parent != kNullBlock) {
    Node& p = nodes_[parent];
    if (p.deferred && p.n_children == 0) {
      // It was the least recently released node when it left the list.
      p.deferred = false;
      lru_push_front(parent);
    }
  }
  maybe_expire(ns);
}

int64_t PrefixIndex::evict(int64_t n) {
  int64_t done = 0;
  while (done < n && lru_head_ != kNullBlock) {
    const int32_t b = lru_head_;
    lru_remove(b);
    if (owner_[b] != kNullBlock) {
      // A cached checkpoint: only its node's slot empties.
      if (tier_hooks_.on_evict) tier_hooks_.on_evict(b);
      companions_[static_cast<size_t>(owner_[b]) * n_companions_ +
                  (pool_.block_group(BlockId{b}) - 1)] = kNullBlock;
      owner_[b] = kNullBlock;
      pool_.reclaim(b);
      ++n_evictions_;
      ++done;
      continue;
    }
    if (nodes_[b].n_children > 0) {
      nodes_[b].deferred = true;
      continue;
    }
    const int64_t freed_before = n_companion_frees_;
    if (tier_hooks_.on_evict) tier_hooks_.on_evict(b);
    remove_node(b);
    pool_.reclaim(b);
    ++n_evictions_;
    done += 1 + (n_companion_frees_ - freed_before);
  }
  return done;
}

PrefixIndex::ClearResult PrefixIndex::clear_cached() {
  std::vector<KvEvent> removed;
  held_events_ = &removed;
  ClearResult r;
  r.n_freed = evict(std::numeric_limits<int64_t>::max());
  held_events_ = nullptr;
  r.n_kept = n_nodes_;
  r.all_cleared = n_nodes_ == 0;
  if (r.all_cleared) {
    KvEvent cleared;
    cleared.kind = KvEvent::Kind::kAllCleared;
    emit(cleared);
  } else {
    for (const KvEvent& e : removed) emit(e);
  }
  return r;
}

std::vector<int32_t> PrefixIndex::chain(NamespaceId ns, std::span<const int32_t> tokens,
                                        int64_t max_tokens) {
  KV_CHECK(ns_live(ns), "chain: unknown namespace");
  std::vector<int32_t> out;
  max_tokens = std::clamp<int64_t>(max_tokens, 0, static_cast<int64_t>(tokens.size()));
  const int64_t p = block_size_;
  const bool try_public = public_ns_ != kNoNamespace && public_ns_ != ns;
  bool path_public = true;
  int32_t cur = kNullBlock;
  const int64_t saved_collisions = n_collisions_;
  for (int64_t j = 0; j < max_tokens / p; ++j) {
    const int32_t* t = tokens.data() + j * p;
    int32_t b = find_child(cur, ns, t, {});
    if (b == kNullBlock && try_public && path_public) b = find_child(cur, public_ns_, t, {});
    if (b == kNullBlock) break;
    if (path_public && nodes_[b].ns != public_ns_) path_public = false;
    out.push_back(b);
    cur = b;
  }
  n_collisions_ = saved_collisions;  // match() counts them
  return out;
}

CachedBlockInfo PrefixIndex::cached_block_info(int32_t block) const {
  KV_CHECK(is_published(block), "cached_block_info: not a published block");
  const int32_t node = nodes_[block].published ? block : owner_[block];
  const Node& n = nodes_[node];
  CachedBlockInfo info;
  info.hash = n.hash;
  info.parent_hash = n.parent == kNullBlock ? Hash128{} : nodes_[n.parent].hash;
  info.ns = n.ns;
  info.ns_digest = roots_[n.ns].digest;
  info.group = node == block ? 0 : pool_.block_group(BlockId{block});
  info.tokens = block_tokens(node);
  info.has_extra = n.has_extra;
  return info;
}

void PrefixIndex::count_tier_hit(NamespaceId ns, int64_t n_blocks, int64_t n_tokens) {
  KV_CHECK(ns_live(ns), "count_tier_hit: unknown namespace");
  roots_[ns].stats.n_hit_blocks += n_blocks;
  roots_[ns].stats.n_hit_tokens += n_tokens;
}

void PrefixIndex::emit(KvEvent e) {
  if (held_events_ != nullptr) {
    held_events_->push_back(e);  // removals only (clear_cached evicts, publishes nothing)
    return;
  }
  if (sink_) sink_(e);
  if (max_events_ <= 0) return;
  if (static_cast<int64_t>(events_.size()) >= max_events_) {
    events_.pop_front();
    ++n_events_dropped_;
  }
  e.tokens = nullptr;  // the queue outlives the block's token row
  events_.push_back(e);
}

std::vector<KvEvent> PrefixIndex::drain_events() {
  std::vector<KvEvent> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

void PrefixIndex::replay_stored(const KvEventSink& sink) const {
  std::vector<int32_t> stack;
  auto push_children = [&](int32_t head) {
    for (int32_t c = head; c != kNullBlock; c = nodes_[c].next_sibling) stack.push_back(c);
  };
  for (const Root& r : roots_) push_children(r.first_child);
  while (!stack.empty()) {
    const int32_t b = stack.back();
    stack.pop_back();
    const Node& n = nodes_[b];
    sink({.kind = KvEvent::Kind::kStored,
          .hash = n.hash,
          .parent_hash = n.parent == kNullBlock ? Hash128{} : nodes_[n.parent].hash,
          .n_tokens = block_size_,
          .ns = n.ns,
          .tokens = tokens_.data() + static_cast<size_t>(b) * block_size_});
    push_children(n.first_child);
  }
}

PrefixIndexStats PrefixIndex::stats() const {
  PrefixIndexStats s;
  s.total = expired_stats_;  // lifetime totals include expired namespaces
  for (size_t i = 0; i < roots_.size(); ++i) {
    const NamespaceStats& r = roots_[i].stats;
    if (!roots_[i].live) continue;
    s.per_namespace.emplace_back(static_cast<NamespaceId>(i), r);
    s.total.n_queries += r.n_queries;
    s.total.n_query_tokens += r.n_query_tokens;
    s.total.n_hit_blocks += r.n_hit_blocks;
    s.total.n_hit_tokens += r.n_hit_tokens;
    s.total.n_published += r.n_published;
    s.total.n_nodes += r.n_nodes;
  }
  s.n_partial_hits = n_partial_hits_;
  s.n_partial_tokens = n_partial_tokens_;
  s.n_cached_blocks = pool_.n_cached();
  s.n_nodes = n_nodes_;
  s.n_evictions = n_evictions_;
  s.n_collisions = n_collisions_;
  s.n_duplicates = n_duplicates_;
  s.n_events_dropped = n_events_dropped_;
  return s;
}

void PrefixIndex::check_invariants() const {
  const auto n_blocks = static_cast<int32_t>(nodes_.size());
  int64_t n_published = 0;
  std::vector<int64_t> per_ns(roots_.size(), 0);
  std::vector<int32_t> children(nodes_.size(), 0);
  for (int32_t b = 0; b < n_blocks; ++b) {
    const Node& n = nodes_[b];
    if (!n.published) {
      if (owner_[b] != kNullBlock) {
        // A companion: its node's slot names it, and it is cached exactly when listed.
        const int g = pool_.block_group(BlockId{b});
        KV_CHECK(g >= 1 && nodes_[owner_[b]].published && companion(owner_[b], g) == b,
                 "companion block not in its node's slot");
        const BlockState st = pool_.state(BlockId{b});
        KV_CHECK(st != BlockState::kFree, "published companion is free");
        KV_CHECK((st == BlockState::kCached) == n.in_lru && !n.deferred,
                 "a companion is on the LRU list exactly when cached");
        continue;
      }
      KV_CHECK(!n.in_lru && !n.deferred, "unpublished block on the LRU list");
      continue;
    }
    for (size_t g = 0; g < n_companions_; ++g) {
      const int32_t c = companions_[static_cast<size_t>(b) * n_companions_ + g];
      KV_CHECK(c == kNullBlock || owner_[c] == b, "node's companion slot names a stranger");
    }
    ++n_published;
    KV_CHECK(ns_live(n.ns), "node with an unknown namespace");
    ++per_ns[n.ns];
    const Hash128 parent_hash = n.parent == kNullBlock ? Hash128{} : nodes_[n.parent].hash;
    std::vector<uint64_t> ex;
    if (n.has_extra) ex = extra_.at(b);
    const int32_t* row = tokens_.data() + static_cast<size_t>(b) * block_size_;
    KV_CHECK(child_key(parent_hash, n.ns, row, ex) == n.hash,
             "node hash differs from hash(parent, namespace, tokens, extra)");
    KV_CHECK(lookup_key(n.parent, n.ns, row, ex) == n.key,
             "node lookup key differs from key(parent, namespace, tokens, extra)");
    // Reachable in the child table: every slot from its home to it is taken.
    bool found = false;
    for (size_t i = n.key & slot_mask_; slots_[i].block != kNullBlock; i = (i + 1) & slot_mask_) {
      if (slots_[i].block == b) {
        KV_CHECK(slots_[i].tag == static_cast<uint32_t>(n.key >> 32) &&
                     slots_[i].parent == n.parent && slots_[i].ns == n.ns,
                 "child-table slot differs from its node");
        found = true;
        break;
      }
    }
    KV_CHECK(found, "node not reachable in the child table");
    if (n.parent != kNullBlock) {
      KV_CHECK(nodes_[n.parent].published, "node's parent is not published");
      const NamespaceId pns = nodes_[n.parent].ns;
      KV_CHECK(pns == n.ns || pns == public_ns_, "node's parent is in another private namespace");
      ++children[n.parent];
    }
    if (n.ns == public_ns_ && n.parent != kNullBlock) {
      KV_CHECK(nodes_[n.parent].ns == public_ns_, "public node under a private parent");
    }
    const BlockState st = pool_.state(BlockId{b});
    KV_CHECK(st != BlockState::kFree, "published block is free");
    // Chain rule: whoever holds a published block holds its parent too, so
    // cached nodes only have cached descendants and every cached block is
    // evictable (leaf-first).
    if (st == BlockState::kUsed && n.parent != kNullBlock) {
      KV_CHECK(pool_.state(BlockId{n.parent}) == BlockState::kUsed,
               "a published block is referenced while its parent is not (chain rule)");
    }
    KV_CHECK((st == BlockState::kCached) == (n.in_lru || n.deferred),
             "a cached node must be on the LRU list or deferred, and only a cached one");
    KV_CHECK(!(n.in_lru && n.deferred), "node both listed and deferred");
    if (n.deferred) KV_CHECK(n.n_children > 0, "deferred node without children");
  }
  KV_CHECK(n_published == n_nodes_, "node count out of sync");
  int64_t n_slots_used = 0;
  int64_t n_with_extra = 0;
  for (const Slot& sl : slots_) {
    if (sl.block == kNullBlock) continue;
    ++n_slots_used;
    KV_CHECK(sl.block >= 0 && sl.block < n_blocks && nodes_[sl.block].published,
             "child-table slot names an unpublished block");
  }
  for (int32_t b = 0; b < n_blocks; ++b) n_with_extra += nodes_[b].published && nodes_[b].has_extra;
  KV_CHECK(n_slots_used == n_nodes_, "child-table size != node count");
  KV_CHECK(n_with_extra == n_extra_nodes_ && static_cast<int64_t>(extra_.size()) == n_extra_nodes_,
           "extra-key node count out of sync");
  for (size_t i = 0; i < roots_.size(); ++i) {
    KV_CHECK(per_ns[i] == roots_[i].stats.n_nodes, "per-namespace node count out of sync");
    KV_CHECK(roots_[i].live || (roots_[i].n_users == 0 && per_ns[i] == 0),
             "an expired namespace still has users or nodes");
  }
  for (int32_t b = 0; b < n_blocks; ++b) {
    if (!nodes_[b].published) continue;
    KV_CHECK(children[b] == nodes_[b].n_children, "child count out of sync");
    int64_t listed = 0;
    for (int32_t c = nodes_[b].first_child; c != kNullBlock; c = nodes_[c].next_sibling) {
      KV_CHECK(nodes_[c].published && nodes_[c].parent == b, "child list holds a stranger");
      ++listed;
    }
    KV_CHECK(listed == children[b], "child list length != child count");
  }
  int64_t n_listed = 0;
  int32_t prev = kNullBlock;
  for (int32_t b = lru_head_; b != kNullBlock; b = nodes_[b].lru_next) {
    KV_CHECK(nodes_[b].in_lru && nodes_[b].lru_prev == prev, "LRU list links corrupt");
    prev = b;
    ++n_listed;
    KV_CHECK(n_listed <= n_blocks, "LRU list has a cycle");
  }
  KV_CHECK(prev == lru_tail_, "LRU tail mismatch");
}

}  // namespace kvstack

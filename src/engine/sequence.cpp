#include "engine/sequence.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "core/json_string.h"

namespace kvstack {

// ------------------------------------------------------------ NamespaceUse

NamespaceUse::NamespaceUse(PrefixIndex* index, NamespaceId ns)
    : index_(ns == kNoNamespace ? nullptr : index), ns_(ns) {
  if (index_ != nullptr) index_->acquire_namespace(ns_);
}

NamespaceUse::NamespaceUse(NamespaceUse&& other) noexcept
    : index_(std::exchange(other.index_, nullptr)), ns_(std::exchange(other.ns_, kNoNamespace)) {}

NamespaceUse& NamespaceUse::operator=(NamespaceUse&& other) noexcept {
  if (this != &other) {
    reset();
    index_ = std::exchange(other.index_, nullptr);
    ns_ = std::exchange(other.ns_, kNoNamespace);
  }
  return *this;
}

void NamespaceUse::reset() {
  if (index_ != nullptr) index_->release_namespace(ns_);
  index_ = nullptr;
  ns_ = kNoNamespace;
}

// ---------------------------------------------------------------- Sequence

Sequence::Sequence(KvManager& kv, NamespaceId ns, BlockTable table)
    : kv_(&kv), ns_(ns), ns_use_(kv.index(), ns), table_(std::move(table)) {}

int64_t Sequence::adopt_cached_prefix(std::span<const int32_t> prompt, bool count_stats) {
  KV_CHECK(table_.length() == 0 && table_.n_blocks() == 0,
           "adopt_cached_prefix: the sequence is not empty");
  PrefixIndex* index = kv_->index();
  if (index == nullptr || ns_ == kNoNamespace || prompt.size() < 2) return 0;
  const auto max_tokens = static_cast<int64_t>(prompt.size()) - 1;
  PrefixMatch m =
      index->match(ns_, prompt, max_tokens, kv_->config().partial_reuse, {}, count_stats);
  // Blocks [0, n_nodes) are published nodes; a tier hit appends promoted,
  // unpublished blocks that publish() below turns into nodes.
  const auto n_nodes = static_cast<int64_t>(m.blocks.size());
  int64_t n_tier = 0;
  if (kv_->tiers() != nullptr)
    // A prefetch (count_stats false) releases the sequence at once: a
    // partial tail copy would be freed unused, so it takes full blocks only.
    n_tier = kv_->tiers()->extend_match(ns_, prompt, max_tokens, m, count_stats,
                                        kv_->config().partial_reuse && count_stats);
  const int64_t n_full = static_cast<int64_t>(m.blocks.size());
  if (table_.n_groups() > 1) {
    // Hybrid: nodes into the primary group; each other group takes its
    // checkpoints after null entries for the blocks its window cannot see.
    table_.group(0).adopt_prefix(std::move(m.blocks));
    m.blocks.clear();
    for (int g = 1; g < table_.n_groups() && n_full > 0; ++g) {
      table_.group(g).adopt_prefix_after(m.group_first[static_cast<size_t>(g - 1)],
                                         std::move(m.group_blocks[static_cast<size_t>(g - 1)]));
    }
    m.group_blocks.clear();
    n_published_ = std::min(n_nodes, n_full);
    // After a tier hit, promoted checkpoints may belong to pool nodes too.
    n_checkpointed_ = n_tier > 0 ? 0 : n_full;
    const int64_t adopted = n_full * table_.pool().block_size();
    tokens_.assign(prompt.begin(), prompt.begin() + adopted);
    if (n_tier > 0) publish();
    return adopted;
  }
  table_.adopt_prefix(std::move(m.blocks));
  m.blocks.clear();
  n_published_ = std::min(n_nodes, n_full);
  int64_t adopted = n_full * table_.pool().block_size();
  if (m.partial.valid() && m.n_partial_tokens > 0) {
    const int64_t n = m.n_partial_tokens;
    // A full pool makes the copy fail: the tokens are recomputed instead.
    if (table_.adopt_partial_copy(std::move(m.partial), n).ok()) adopted += n;
  }
  tokens_.assign(prompt.begin(), prompt.begin() + adopted);
  if (n_tier > 0) publish();
  return adopted;
}

void Sequence::on_committed(std::span<const int32_t> tokens) {
  KV_CHECK(static_cast<int64_t>(tokens_.size() + tokens.size()) == table_.length(),
           "on_committed: token count differs from the table's committed length");
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  publish();
}

void Sequence::publish() {
  PrefixIndex* index = kv_->index();
  if (index == nullptr || ns_ == kNoNamespace || publish_stopped_) return;
  if (table_.compacted()) {
    // Retention (retention.h): compacted blocks are private, never published.
    publish_stopped_ = true;
    return;
  }
  const int64_t n_full = table_.shareable_length() / table_.pool().block_size();
  if (n_published_ >= n_full && n_checkpointed_ >= n_published_) return;
  // Stops for good at the first block another sequence already published
  // (its duplicate stays private to this sequence).
  if (n_published_ < n_full) {
    n_published_ = index->publish(ns_, table_, tokens_, n_published_);
    if (n_published_ < n_full) publish_stopped_ = true;
  }
  // Hybrid: the other groups' blocks of the newly published nodes become
  // their checkpoints (companions), so that dropping them from a window
  // table leaves them cached for the next turn of the conversation.
  const std::span<const int32_t> nodes = table_.ids();
  for (; n_checkpointed_ < n_published_; ++n_checkpointed_) {
    for (int g = 1; g < table_.n_groups(); ++g) {
      const int32_t b = table_.group(g).ids()[static_cast<size_t>(n_checkpointed_)];
      if (b != kNullBlock && !index->is_published(b)) {
        (void)index->attach_companion(nodes[static_cast<size_t>(n_checkpointed_)], g, b);
      }
    }
  }
}

Sequence Sequence::fork() const {
  Sequence s(*kv_, ns_, table_.fork());
  s.tokens_ = tokens_;
  s.n_published_ = n_published_;
  s.n_checkpointed_ = n_checkpointed_;
  s.publish_stopped_ = publish_stopped_;
  return s;
}

Result<Sequence> Sequence::clone_private() const {
  auto t = table_.clone_private();
  if (!t) return t.error();
  Sequence s(*kv_, ns_, std::move(*t));
  s.tokens_ = tokens_;
  // The copies are private duplicates of this sequence's blocks: never published.
  s.publish_stopped_ = true;
  return s;
}

void Sequence::release() {
  table_.release();
  tokens_.clear();
  n_published_ = 0;
  n_checkpointed_ = 0;
  publish_stopped_ = false;
}

// --------------------------------------------------------------- KvManager

KvManager::KvManager(BlockPool& pool, CacheIdentity identity, KvManagerConfig config)
    : pool_(pool), identity_(std::move(identity)), config_(std::move(config)) {
  if (config_.prefix_cache) {
    index_ = std::make_unique<PrefixIndex>(pool_);
    index_->set_event_capacity(config_.event_capacity);
  }
}

KvManager::~KvManager() {
  // Everything cached goes to disk (a warm restart finds it), then the
  // tiers detach before the index evicts on teardown.
  if (tiers_) tiers_->persist();
  tiers_.reset();
  // Teardown evicts every cached block; a sink's owner may already be gone.
  if (index_) index_->set_event_sink({});
  pinned_.clear();
}

std::string KvManager::namespace_name(std::string_view cache_salt) const {
  return cache_salt.empty() ? config_.default_namespace : "salt:" + std::string(cache_salt);
}

NamespaceId KvManager::namespace_for(std::string_view cache_salt) {
  if (!index_) return kNoNamespace;
  const std::string name = namespace_name(cache_salt);
  const NamespaceId ns = index_->intern_namespace(identity_.with_namespace(name).digest());
  if (static_cast<size_t>(ns) >= ns_names_.size()) ns_names_.resize(ns + 1);
  ns_names_[ns] = name;
  return ns;
}

NamespaceId KvManager::public_namespace() {
  if (!index_) return kNoNamespace;
  const NamespaceId ns = index_->intern_namespace(
      identity_.with_namespace(public_namespace_name()).digest(), /*is_public=*/true);
  if (static_cast<size_t>(ns) >= ns_names_.size()) ns_names_.resize(ns + 1);
  ns_names_[ns] = "public";
  return ns;
}

Sequence KvManager::new_sequence(NamespaceId ns) {
  return Sequence(*this, ns, BlockTable(pool_));
}

int64_t KvManager::pin_public(Sequence seq) {
  KV_CHECK(seq.kv_ == this, "pin_public: sequence of another manager");
  const int64_t n = seq.n_published_blocks();
  seq.rollback();
  pinned_.push_back(std::move(seq));
  return n;
}

int64_t KvManager::n_pinned_blocks() const {
  int64_t n = 0;
  for (const Sequence& s : pinned_) n += s.n_published_blocks();
  return n;
}

}  // namespace kvstack

namespace kvstack {

KvPrefixStats KvManager::prefix_stats() const {
  KvPrefixStats s;
  s.block_size = pool_.block_size();
  const BlockPoolStats ps = pool_.stats();
  s.groups = ps.groups;
  s.retention = ps.retention;
  if (!index_) return s;
  s.enabled = true;
  const PrefixIndexStats is = index_->stats();
  s.n_queries = is.total.n_queries;
  s.n_query_tokens = is.total.n_query_tokens;
  s.n_hit_blocks = is.total.n_hit_blocks;
  s.n_hit_tokens = is.total.n_hit_tokens;
  s.hit_rate = is.total.hit_rate();
  s.n_partial_hits = is.n_partial_hits;
  s.n_published = is.total.n_published;
  s.n_nodes = is.n_nodes;
  s.n_cached_blocks = is.n_cached_blocks;
  s.n_pinned_blocks = n_pinned_blocks();
  s.n_evictions = is.n_evictions;
  s.n_cow_copies = ps.n_cow_copies;
  s.n_partial_copies = ps.n_partial_copies;
  s.n_collisions = is.n_collisions;
  s.n_duplicates = is.n_duplicates;
  s.n_events_dropped = is.n_events_dropped;
  s.n_namespaces = index_->n_namespaces();
  s.n_namespaces_expired = index_->n_namespaces_expired();
  for (const auto& [ns, counts] : is.per_namespace) {
    const std::string name = static_cast<size_t>(ns) < ns_names_.size() ? ns_names_[ns] : "";
    s.namespaces.push_back({.ns = ns, .name = name, .counts = counts});
  }
  return s;
}

Status KvManager::enable_tiers(const KvTierConfig& config) {
  if (!config.enabled()) return Status{};
  if (!index_) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-host-mem / --kv-disk need the prefix cache (drop --no-prefix-cache)");
  }
  auto t = KvTiers::create(*index_, identity_, config);
  if (!t) return t.error();
  tiers_ = std::move(*t);
  return Status{};
}

int64_t KvManager::prefetch(std::string_view cache_salt, std::span<const int32_t> prompt) {
  if (!tiers_ || prompt.size() < 2) return 0;
  // Room for the whole prompt in every group among free and cached blocks.
  // Prefetching may evict other cached blocks (to the tiers, LRU first);
  // it never takes blocks from running sequences, and what it promotes is
  // cached again (available to admission) once this lookup ends.
  const int64_t need = pool_.groups().blocks_for_sequence(static_cast<int64_t>(prompt.size()), 0);
  if (pool_.n_available() < need) return 0;
  const int64_t before = tiers_->stats().n_promoted;
  Sequence s = new_sequence(namespace_for(cache_salt));
  // Promotes and publishes (cached on release); not a query of the stats.
  (void)s.adopt_cached_prefix(prompt, /*count_stats=*/false);
  s.release();
  const int64_t n = tiers_->stats().n_promoted - before;
  tiers_->count_prefetch(n);
  return n;
}

KvTiersStats KvManager::tier_stats() const {
  return tiers_ ? tiers_->stats() : KvTiersStats{};
}

Status KvManager::set_event_sink(KvEventSink sink, bool replay_existing) {
  if (!index_) {
    return make_error(Errc::kInvalidArgument, "KV events need the prefix cache (it is disabled)");
  }
  if (sink && replay_existing) index_->replay_stored(sink);
  index_->set_event_sink(std::move(sink));
  return Status{};
}

namespace {

std::string counts_json(const NamespaceStats& c) {
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "\"queries\": %lld, \"query_tokens\": %lld, \"hit_blocks\": %lld, "
                "\"hit_tokens\": %lld, \"hit_rate\": %.6f, \"published\": %lld, \"nodes\": %lld",
                static_cast<long long>(c.n_queries), static_cast<long long>(c.n_query_tokens),
                static_cast<long long>(c.n_hit_blocks), static_cast<long long>(c.n_hit_tokens),
                c.hit_rate(), static_cast<long long>(c.n_published),
                static_cast<long long>(c.n_nodes));
  return buf;
}

}  // namespace

std::string prefix_stats_json(const KvPrefixStats& s) {
  std::string out = "{\"enabled\": ";
  out += s.enabled ? "true" : "false";
  auto field = [&](const char* k, int64_t v) {
    out += ", \"";
    out += k;
    out += "\": " + std::to_string(v);
  };
  field("block_size", s.block_size);
  field("queries", s.n_queries);
  field("query_tokens", s.n_query_tokens);
  field("hit_blocks", s.n_hit_blocks);
  field("hit_tokens", s.n_hit_tokens);
  char rate[48];
  std::snprintf(rate, sizeof(rate), ", \"hit_rate\": %.6f", s.hit_rate);
  out += rate;
  field("partial_hits", s.n_partial_hits);
  field("published", s.n_published);
  field("nodes", s.n_nodes);
  field("cached_blocks", s.n_cached_blocks);
  field("pinned_blocks", s.n_pinned_blocks);
  field("evictions", s.n_evictions);
  field("cow_copies", s.n_cow_copies);
  field("partial_copies", s.n_partial_copies);
  field("collisions", s.n_collisions);
  field("duplicates", s.n_duplicates);
  field("events_dropped", s.n_events_dropped);
  field("namespaces_live", s.n_namespaces);
  field("namespaces_expired", s.n_namespaces_expired);
  out += ", \"namespaces\": [";
  for (size_t i = 0; i < s.namespaces.size(); ++i) {
    const KvNamespaceStats& n = s.namespaces[i];
    if (i > 0) out += ", ";
    out += "{\"namespace\": " + std::to_string(n.ns) + ", \"name\": " + json_quote(n.name) + ", " +
           counts_json(n.counts) + "}";
  }
  out += "], \"groups\": [";
  for (size_t g = 0; g < s.groups.size(); ++g) {
    const BlockPoolGroupStats& gs = s.groups[g];
    char buf[320];
    std::snprintf(
        buf, sizeof(buf),
        "%s{\"group\": %zu, \"layers\": %lld, \"window\": %lld, \"blocks_used\": %lld, "
        "\"blocks_cached\": %lld, \"tokens_resident\": %lld, \"payload_bytes\": %lld, "
        "\"allocated_bytes\": %lld}",
        g > 0 ? ", " : "", g, static_cast<long long>(gs.n_layers),
        static_cast<long long>(gs.window), static_cast<long long>(gs.n_blocks_used),
        static_cast<long long>(gs.n_blocks_cached), static_cast<long long>(gs.n_tokens_resident),
        static_cast<long long>(gs.payload_bytes), static_cast<long long>(gs.allocated_bytes));
    out += buf;
  }
  out += "]";
  {
    const RetentionStats& r = s.retention;
    char buf[384];
    std::snprintf(
        buf, sizeof(buf),
        ", \"retention\": {\"compactions\": %lld, \"tokens_dropped\": %lld, "
        "\"blocks_freed\": %lld, \"bytes_moved\": %lld, \"deferred\": %lld, "
        "\"topk_blocks_read\": %lld, \"topk_blocks_total\": %lld}",
        static_cast<long long>(r.n_compactions), static_cast<long long>(r.n_tokens_dropped),
        static_cast<long long>(r.n_blocks_freed), static_cast<long long>(r.n_bytes_moved),
        static_cast<long long>(r.n_deferred), static_cast<long long>(r.n_topk_blocks_read),
        static_cast<long long>(r.n_topk_blocks_total));
    out += buf;
  }
  return out + "}";
}

// One line per KV group (kv_groups.h).
std::string format_group_stats(const std::vector<BlockPoolGroupStats>& groups) {
  std::string out =
      "  KV group  layers  window  blocks used  cached  tokens resident  payload bytes\n";
  char buf[200];
  for (size_t g = 0; g < groups.size(); ++g) {
    const BlockPoolGroupStats& gs = groups[g];
    std::snprintf(
        buf, sizeof(buf), "  %8zu %7lld %7lld %12lld %7lld %16lld %14lld\n", g,
        static_cast<long long>(gs.n_layers), static_cast<long long>(gs.window),
        static_cast<long long>(gs.n_blocks_used), static_cast<long long>(gs.n_blocks_cached),
        static_cast<long long>(gs.n_tokens_resident), static_cast<long long>(gs.payload_bytes));
    out += buf;
  }
  return out;
}

namespace {

// The retention line of format_prefix_stats (empty when nothing compacted).
std::string format_retention_stats(const RetentionStats& r) {
  std::string topk;
  if (r.n_topk_blocks_total > 0) {
    char b[160];
    std::snprintf(b, sizeof(b), "top-k reads: %lld of %lld blocks read (%.1f%%)\n",
                  static_cast<long long>(r.n_topk_blocks_read),
                  static_cast<long long>(r.n_topk_blocks_total),
                  100.0 * static_cast<double>(r.n_topk_blocks_read) /
                      static_cast<double>(r.n_topk_blocks_total));
    topk = b;
  }
  if (r.n_compactions == 0 && r.n_deferred == 0) return topk;
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "retention: %lld compactions dropped %lld tokens, freed %lld blocks, moved %lld "
                "bytes (%lld deferred: no block for copy-on-write)\n",
                static_cast<long long>(r.n_compactions), static_cast<long long>(r.n_tokens_dropped),
                static_cast<long long>(r.n_blocks_freed), static_cast<long long>(r.n_bytes_moved),
                static_cast<long long>(r.n_deferred));
  return buf + topk;
}

}  // namespace

std::string format_prefix_stats(const KvPrefixStats& s) {
  if (!s.enabled) {
    return "prefix cache: off\n" + format_group_stats(s.groups) +
           format_retention_stats(s.retention);
  }
  const auto ll = [](int64_t v) { return static_cast<long long>(v); };
  char buf[1600];
  std::snprintf(
      buf, sizeof(buf),
      "prefix cache (blocks of %lld tokens):\n"
      "  lookups          %lld queries, %lld tokens offered\n"
      "  hits             %lld tokens (%lld full blocks, %lld partial-block hits), "
      "hit rate %.1f%%\n"
      "  blocks           %lld published now (%lld cached and evictable, %lld pinned public), "
      "%lld published in total\n"
      "  evictions        %lld blocks\n"
      "  copies           %lld copy-on-write, %lld partial-block\n"
      "  verification     %lld lookup collisions rejected, %lld duplicate publishes refused\n",
      ll(s.block_size), ll(s.n_queries), ll(s.n_query_tokens), ll(s.n_hit_tokens),
      ll(s.n_hit_blocks), ll(s.n_partial_hits), 100.0 * s.hit_rate, ll(s.n_nodes),
      ll(s.n_cached_blocks), ll(s.n_pinned_blocks), ll(s.n_published), ll(s.n_evictions),
      ll(s.n_cow_copies), ll(s.n_partial_copies), ll(s.n_collisions), ll(s.n_duplicates));
  std::string out = buf;
  out += "  namespace                 queries  query tokens  hit tokens  hit rate  blocks now\n";
  for (const KvNamespaceStats& n : s.namespaces) {
    std::snprintf(buf, sizeof(buf), "  %-24.24s %8lld %13lld %11lld %8.1f%% %11lld\n",
                  n.name.c_str(), ll(n.counts.n_queries), ll(n.counts.n_query_tokens),
                  ll(n.counts.n_hit_tokens), 100.0 * n.counts.hit_rate(), ll(n.counts.n_nodes));
    out += buf;
  }
  return out + format_group_stats(s.groups) + format_retention_stats(s.retention);
}

KvEventFile::~KvEventFile() {
  if (kv_ != nullptr) (void)kv_->set_event_sink({});
  if (file_ != nullptr) std::fclose(file_);
}

Status KvEventFile::open(KvManager& kv, const std::string& path) {
  KV_CHECK(file_ == nullptr, "KvEventFile::open: already open");
  if (kv.index() == nullptr) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-events needs the prefix cache (drop --no-prefix-cache)");
  }
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    return make_error(Errc::kIo,
                      "--kv-events " + path + ": cannot open for writing: " + std::strerror(errno));
  }
  kv_ = &kv;
  return kv.set_event_sink([this](const KvEvent& e) {
    const std::string line = kv_event_json(e);
    std::fprintf(file_, "%s\n", line.c_str());
    std::fflush(file_);
    ++n_written_;
  });
}

std::string kv_event_json(const KvEvent& e) {
  return std::string("{\"event\":\"") + kv_event_name(e.kind) + "\",\"hash\":\"" + e.hash.hex() +
         "\",\"parent\":\"" + e.parent_hash.hex() +
         "\",\"n_tokens\":" + std::to_string(e.n_tokens) +
         ",\"namespace\":" + std::to_string(e.ns) + "}";
}

}  // namespace kvstack

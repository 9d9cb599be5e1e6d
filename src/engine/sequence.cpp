#include "engine/sequence.h"

#include <algorithm>

namespace kvstack {

// ---------------------------------------------------------------- Sequence

int64_t Sequence::adopt_cached_prefix(std::span<const int32_t> prompt) {
  KV_CHECK(table_.length() == 0 && table_.n_blocks() == 0,
           "adopt_cached_prefix: the sequence is not empty");
  PrefixIndex* index = kv_->index();
  if (index == nullptr || ns_ == kNoNamespace || prompt.size() < 2) return 0;
  const auto max_tokens = static_cast<int64_t>(prompt.size()) - 1;
  PrefixMatch m = index->match(ns_, prompt, max_tokens, kv_->config().partial_reuse);
  const int64_t n_full = static_cast<int64_t>(m.blocks.size());
  table_.adopt_prefix(std::move(m.blocks));
  m.blocks.clear();
  n_published_ = n_full;
  int64_t adopted = n_full * table_.pool().block_size();
  if (m.partial.valid() && m.n_partial_tokens > 0) {
    const int64_t n = m.n_partial_tokens;
    // A full pool makes the copy fail: the tokens are recomputed instead.
    if (table_.adopt_partial_copy(std::move(m.partial), n).ok()) adopted += n;
  }
  tokens_.assign(prompt.begin(), prompt.begin() + adopted);
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
  const int64_t n_full = table_.length() / table_.pool().block_size();
  if (n_published_ >= n_full) return;
  // Stops for good at the first block another sequence already published
  // (its duplicate stays private to this sequence).
  n_published_ = index->publish(ns_, table_, tokens_, n_published_);
  if (n_published_ < n_full) publish_stopped_ = true;
}

Sequence Sequence::fork() const {
  Sequence s(*kv_, ns_, table_.fork());
  s.tokens_ = tokens_;
  s.n_published_ = n_published_;
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
  pinned_.clear();
}

NamespaceId KvManager::namespace_for(std::string_view cache_salt) {
  if (!index_) return kNoNamespace;
  const std::string name =
      cache_salt.empty() ? config_.default_namespace : "salt:" + std::string(cache_salt);
  return index_->intern_namespace(identity_.with_namespace(name).digest());
}

NamespaceId KvManager::public_namespace() {
  if (!index_) return kNoNamespace;
  return index_->intern_namespace(identity_.with_namespace(public_namespace_name()).digest(),
                                  /*is_public=*/true);
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

#include "kv/tier_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace kvstack {

namespace {

int64_t round_up(int64_t n, int64_t a) {
  return (n + a - 1) / a * a;
}

}  // namespace

void record_fetch_latency(TierStoreStats& s, double seconds) {
  const double us = seconds * 1e6;
  size_t b = 0;
  while (b + 1 < kTierFetchBucketsUs.size() && us > kTierFetchBucketsUs[b]) ++b;
  ++s.fetch_hist[b];
  s.fetch_seconds += seconds;
}

// ----------------------------------------------------------------- SlotMap

SlotMap::SlotMap(int64_t n_slots)
    : keys_(static_cast<size_t>(n_slots)),
      used_(static_cast<size_t>(n_slots), 0),
      prev_(static_cast<size_t>(n_slots), -1),
      next_(static_cast<size_t>(n_slots), -1) {
  free_.reserve(static_cast<size_t>(n_slots));
  for (int64_t s = n_slots - 1; s >= 0; --s) free_.push_back(s);  // slot 0 first
}

int64_t SlotMap::find(const TierKey& key) const {
  auto it = by_key_.find(key);
  return it == by_key_.end() ? -1 : it->second;
}

int64_t SlotMap::insert(const TierKey& key) {
  KV_CHECK(find(key) < 0, "SlotMap::insert: key already present");
  if (free_.empty()) return -1;
  const int64_t s = free_.back();
  free_.pop_back();
  keys_[static_cast<size_t>(s)] = key;
  used_[static_cast<size_t>(s)] = 1;
  by_key_.emplace(key, s);
  push_back(s);
  return s;
}

void SlotMap::touch(int64_t s) {
  unlink(s);
  push_back(s);
}

void SlotMap::erase(int64_t s) {
  KV_CHECK(used(s), "SlotMap::erase: slot not used");
  unlink(s);
  by_key_.erase(keys_[static_cast<size_t>(s)]);
  used_[static_cast<size_t>(s)] = 0;
  free_.push_back(s);
}

void SlotMap::unlink(int64_t s) {
  const auto i = static_cast<size_t>(s);
  if (prev_[i] >= 0) {
    next_[static_cast<size_t>(prev_[i])] = next_[i];
  } else {
    head_ = next_[i];
  }
  if (next_[i] >= 0) {
    prev_[static_cast<size_t>(next_[i])] = prev_[i];
  } else {
    tail_ = prev_[i];
  }
  prev_[i] = next_[i] = -1;
}

void SlotMap::push_back(int64_t s) {
  const auto i = static_cast<size_t>(s);
  prev_[i] = tail_;
  next_[i] = -1;
  if (tail_ >= 0) next_[static_cast<size_t>(tail_)] = s;
  tail_ = s;
  if (head_ < 0) head_ = s;
}

void SlotMap::restore(std::span<const std::pair<int64_t, TierKey>> entries) {
  KV_CHECK(by_key_.empty(), "SlotMap::restore: the map is not empty");
  for (const auto& [s, key] : entries) {
    // Out-of-range slots and repeated slots or keys (a damaged index) are skipped.
    if (s < 0 || s >= n_slots() || used(s) || find(key) >= 0) continue;
    keys_[static_cast<size_t>(s)] = key;
    used_[static_cast<size_t>(s)] = 1;
    by_key_.emplace(key, s);
    push_back(s);
  }
  free_.clear();
  for (int64_t s = n_slots() - 1; s >= 0; --s) {
    if (!used(s)) free_.push_back(s);
  }
}

std::vector<int64_t> SlotMap::slots_lru_order() const {
  std::vector<int64_t> out;
  out.reserve(by_key_.size());
  for (int64_t s = head_; s >= 0; s = next_[static_cast<size_t>(s)]) out.push_back(s);
  return out;
}

void SlotMap::check_invariants() const {
  int64_t n = 0;
  int64_t prev = -1;
  for (int64_t s = head_; s >= 0; s = next_[static_cast<size_t>(s)]) {
    KV_CHECK(used(s) && prev_[static_cast<size_t>(s)] == prev, "SlotMap: LRU links corrupt");
    KV_CHECK(find(keys_[static_cast<size_t>(s)]) == s, "SlotMap: listed slot not in the key map");
    prev = s;
    KV_CHECK(++n <= n_slots(), "SlotMap: LRU cycle");
  }
  KV_CHECK(prev == tail_, "SlotMap: tail mismatch");
  KV_CHECK(n == size(), "SlotMap: listed slots != keys");
  KV_CHECK(n + static_cast<int64_t>(free_.size()) == n_slots(), "SlotMap: used + free != slots");
  for (int64_t s : free_) KV_CHECK(!used(s), "SlotMap: free slot marked used");
}

// --------------------------------------------------------------- HostStore

Result<std::unique_ptr<HostStore>> HostStore::create(const BlockRecordIdentity& id,
                                                     int64_t capacity_bytes) {
  const int64_t header = round_up(block_record_header_bytes(id.block_size), 64);
  const int64_t slot = header + round_up(id.payload_bytes, 64);
  const int64_t n_slots = capacity_bytes / slot;
  if (n_slots <= 0) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-host-mem: " + std::to_string(capacity_bytes) +
                          " bytes hold no KV block (one block record takes " +
                          std::to_string(slot) + " bytes)");
  }
  const int64_t map_bytes = round_up(n_slots * slot, 4096);
  void* p = mmap(nullptr, static_cast<size_t>(map_bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return make_error(Errc::kIo, "--kv-host-mem: cannot map " + std::to_string(map_bytes) +
                                     " bytes: " + std::strerror(errno));
  }
  return std::unique_ptr<HostStore>(
      new HostStore(id, n_slots, slot, static_cast<uint8_t*>(p), map_bytes));
}

HostStore::HostStore(const BlockRecordIdentity& id, int64_t n_slots, int64_t slot_bytes,
                     uint8_t* base, int64_t map_bytes)
    : id_(id),
      header_bytes_(round_up(block_record_header_bytes(id.block_size), 64)),
      slot_bytes_(slot_bytes),
      base_(base),
      map_bytes_(map_bytes),
      map_(n_slots),
      parent_of_(static_cast<size_t>(n_slots)) {
  stats_.name = "host";
  stats_.n_slots = n_slots;
  stats_.slot_bytes = slot_bytes;
  stats_.capacity_bytes = n_slots * slot_bytes;
}

HostStore::~HostStore() {
  munmap(base_, static_cast<size_t>(map_bytes_));
}

TierRecord HostStore::record(int64_t slot) const {
  uint8_t* p = base_ + slot * slot_bytes_;
  return {.header = p, .payload = p + header_bytes_};
}

void HostStore::unlink_parent(int64_t slot) {
  if (map_.key(slot).group != 0) return;
  auto it = children_.find(parent_of_[static_cast<size_t>(slot)]);
  if (it == children_.end()) return;
  std::erase(it->second, slot);
  if (it->second.empty()) children_.erase(it);
}

std::vector<TierKey> HostStore::children(const Hash128& parent) const {
  std::vector<TierKey> out;
  if (auto it = children_.find(parent); it != children_.end()) {
    for (int64_t s : it->second) out.push_back(map_.key(s));
  }
  return out;
}

void HostStore::check_invariants() const {
  map_.check_invariants();
  size_t n = 0;
  for (const auto& [parent, slots] : children_) {
    for (int64_t s : slots) {
      KV_CHECK(
          map_.used(s) && map_.key(s).group == 0 && parent_of_[static_cast<size_t>(s)] == parent,
          "HostStore: a child link names a slot that is not that parent's child");
      ++n;
    }
  }
  size_t want = 0;
  for (int64_t s : map_.slots_lru_order()) want += map_.key(s).group == 0 ? 1 : 0;
  KV_CHECK(n == want, "HostStore: child links and group-0 entries differ");
}

void HostStore::store(int64_t slot, const TierRecord& rec) {
  if (map_.key(slot).group == 0) {
    const Hash128 parent = read_record_header(rec.header).parent_hash;
    parent_of_[static_cast<size_t>(slot)] = parent;
    children_[parent].push_back(slot);
  }
  uint8_t* p = base_ + slot * slot_bytes_;
  std::memcpy(p, rec.header, static_cast<size_t>(block_record_header_bytes(id_.block_size)));
  std::memcpy(p + header_bytes_, rec.payload, static_cast<size_t>(id_.payload_bytes));
  ++stats_.n_stored;
  stats_.bytes_in += id_.payload_bytes;
}

TierRecord HostStore::peek(const TierKey& key) const {
  const int64_t s = map_.find(key);
  return s < 0 ? TierRecord{} : record(s);
}

bool HostStore::fetch(const TierKey& key, uint8_t* dst) {
  const int64_t s = map_.find(key);
  if (s < 0) return false;
  std::memcpy(dst, record(s).payload, static_cast<size_t>(id_.payload_bytes));
  map_.touch(s);
  ++stats_.n_hits;
  stats_.bytes_out += id_.payload_bytes;
  return true;
}

bool HostStore::erase(const TierKey& key) {
  const int64_t s = map_.find(key);
  if (s < 0) return false;
  unlink_parent(s);
  map_.erase(s);
  ++stats_.n_erased;
  return true;
}

std::vector<TierKey> HostStore::keys() const {
  std::vector<TierKey> out;
  for (int64_t s : map_.slots_lru_order()) out.push_back(map_.key(s));
  return out;
}

TierStoreStats HostStore::stats() const {
  TierStoreStats s = stats_;
  s.n_blocks = map_.size();
  return s;
}

// --------------------------------------------------------------- DiskStore

namespace {

constexpr char kIndexMagic[8] = {'K', 'V', 'S', 'I', 'D', 'X', '0', '1'};

// Index file: header, entries, then XXH3-64 of everything before it.
struct IndexHeader {
  char magic[8];
  uint32_t version = 1;
  int32_t block_size = 0;
  int64_t payload_bytes = 0;
  int64_t slot_bytes = 0;
  int64_t n_entries = 0;
  Hash128 model_digest;
  Hash128 format_digest;
};
struct IndexEntry {
  int64_t slot = 0;
  int32_t group = 0;
  int32_t pad = 0;
  Hash128 hash;
  Hash128 ns_digest;
};

// Journal file: a header (the index's, n_entries 0, then XXH3-64 of it),
// then entries, each an IndexEntry and XXH3-64 of it.
constexpr char kJournalMagic[8] = {'K', 'V', 'S', 'J', 'R', 'N', '0', '1'};
struct JournalEntry {
  IndexEntry e;
  uint64_t checksum = 0;
};

}  // namespace

void DiskStore::AlignedFree::operator()(uint8_t* p) const {
  std::free(p);
}

DiskStore::Buffer DiskStore::new_buffer() const {
  void* p = nullptr;
  KV_CHECK(posix_memalign(&p, 4096, static_cast<size_t>(slot_bytes_)) == 0,
           "DiskStore: out of memory for an I/O buffer");
  return Buffer(static_cast<uint8_t*>(p));
}

Result<std::unique_ptr<DiskStore>> DiskStore::open(const BlockRecordIdentity& id,
                                                   const std::string& dir, int64_t capacity_bytes,
                                                   bool direct_io) {
  const int64_t header_region = round_up(block_record_header_bytes(id.block_size), 4096);
  const int64_t slot = header_region + round_up(id.payload_bytes, 4096);
  const int64_t n_slots = capacity_bytes / slot;
  if (n_slots <= 0) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-disk-size: " + std::to_string(capacity_bytes) +
                          " bytes hold no KV block (one block record takes " +
                          std::to_string(slot) + " bytes on disk)");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    return make_error(Errc::kIo, "--kv-disk: cannot create directory '" + dir + "'" +
                                     (ec ? ": " + ec.message() : ""));
  }
  std::unique_ptr<DiskStore> d(new DiskStore(id, dir, n_slots, slot));
  // One process per directory: two would overwrite each other's slots and
  // index (records would still self-check, but the cache would thrash).
  d->lock_fd_ = ::open((dir + "/lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (d->lock_fd_ < 0 || ::flock(d->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return make_error(Errc::kIo, "--kv-disk: '" + dir +
                                     "' is in use by another kvstack process (or its lock file "
                                     "cannot be opened)");
  }
  d->header_region_ = header_region;
  KV_TRY_STATUS(d->open_files(direct_io));
  d->load_index();
  d->load_journal();
  d->journal_fd_ =
      ::open(d->journal_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  // What was loaded becomes the index; the journal starts empty.
  d->write_index();
  return d;
}

DiskStore::DiskStore(const BlockRecordIdentity& id, std::string dir, int64_t n_slots,
                     int64_t slot_bytes)
    : id_(id),
      dir_(std::move(dir)),
      data_path_(dir_ + "/blocks.kvs"),
      index_path_(dir_ + "/index.kvs"),
      journal_path_(dir_ + "/journal.kvs"),
      slot_bytes_(slot_bytes),
      map_(n_slots),
      ns_of_(static_cast<size_t>(n_slots)) {
  stats_.name = "disk";
  stats_.n_slots = n_slots;
  stats_.slot_bytes = slot_bytes;
  stats_.capacity_bytes = n_slots * slot_bytes;
}

DiskStore::~DiskStore() {
  if (fd_ >= 0) flush();
  if (fd_ >= 0) ::close(fd_);
  if (journal_fd_ >= 0) ::close(journal_fd_);
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

Status DiskStore::open_files(bool direct_io) {
  fd_ = ::open(data_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | (direct_io ? O_DIRECT : 0), 0644);
  direct_ = direct_io && fd_ >= 0;
  if (fd_ < 0 && direct_io && errno == EINVAL) {
    // The file system has no O_DIRECT (tmpfs): buffered I/O.
    fd_ = ::open(data_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  }
  if (fd_ < 0) {
    return make_error(Errc::kIo,
                      "--kv-disk: cannot open '" + data_path_ + "': " + std::strerror(errno));
  }
  read_buf_ = new_buffer();
  return {};
}

void DiskStore::reopen_buffered() {
  const int fd = ::open(data_path_.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return;
  ::close(fd_);
  fd_ = fd;
  direct_ = false;
}

namespace {

// Reads the file at `path` into *out (up to the first read error); false
// when it cannot be opened.
bool read_whole_file(const std::string& path, std::vector<uint8_t>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  uint8_t chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n <= 0) break;
    out->insert(out->end(), chunk, chunk + n);
  }
  ::close(fd);
  return true;
}

}  // namespace

void DiskStore::load_index() {
  std::vector<uint8_t> buf;
  if (!read_whole_file(index_path_, &buf)) return;  // a fresh directory
  IndexHeader h;
  if (buf.size() < sizeof(h) + 8) {
    ++stats_.n_corrupt;
    return;
  }
  std::memcpy(&h, buf.data(), sizeof(h));
  const size_t want =
      sizeof(h) + static_cast<size_t>(std::max<int64_t>(0, h.n_entries)) * sizeof(IndexEntry);
  uint64_t sum = 0;
  if (std::memcmp(h.magic, kIndexMagic, sizeof(h.magic)) != 0 || h.version != 1 ||
      h.n_entries < 0 || buf.size() != want + 8) {
    ++stats_.n_corrupt;
    return;
  }
  std::memcpy(&sum, buf.data() + want, 8);
  if (XXH3_64bits(buf.data(), want) != sum) {
    ++stats_.n_corrupt;
    return;
  }
  if (h.model_digest != id_.model_digest || h.format_digest != id_.format_digest ||
      h.block_size != id_.block_size || h.payload_bytes != id_.payload_bytes ||
      h.slot_bytes != slot_bytes_) {
    // Another model, KV format or layout wrote this cache: none of it is ours.
    stats_.n_identity_mismatch += h.n_entries;
    return;
  }
  std::vector<std::pair<int64_t, TierKey>> entries;
  std::vector<IndexEntry> raw(static_cast<size_t>(h.n_entries));
  for (int64_t i = 0; i < h.n_entries; ++i) {
    IndexEntry& e = raw[static_cast<size_t>(i)];
    std::memcpy(&e, buf.data() + sizeof(h) + static_cast<size_t>(i) * sizeof(e), sizeof(e));
    entries.emplace_back(e.slot, TierKey{.hash = e.hash, .group = e.group});
  }
  // Entries are listed least recently used first.
  map_.restore(entries);
  for (const IndexEntry& e : raw) {
    if (e.slot >= 0 && e.slot < map_.n_slots() && map_.used(e.slot)) {
      ns_of_[static_cast<size_t>(e.slot)] = e.ns_digest;
    }
  }
}

void DiskStore::load_journal() {
  std::vector<uint8_t> buf;
  if (!read_whole_file(journal_path_, &buf)) return;
  IndexHeader h;
  uint64_t sum = 0;
  if (buf.size() < sizeof(h) + 8) return;  // empty, or torn at its header
  std::memcpy(&h, buf.data(), sizeof(h));
  std::memcpy(&sum, buf.data() + sizeof(h), 8);
  if (std::memcmp(h.magic, kJournalMagic, sizeof(h.magic)) != 0 ||
      XXH3_64bits(buf.data(), sizeof(h)) != sum) {
    ++stats_.n_corrupt;
    return;
  }
  if (h.model_digest != id_.model_digest || h.format_digest != id_.format_digest ||
      h.block_size != id_.block_size || h.payload_bytes != id_.payload_bytes ||
      h.slot_bytes != slot_bytes_) {
    return;  // another identity's journal (its index said so already)
  }
  // The loaded entries (least recently used first), then the journal's in
  // order: a later entry for a slot or a key replaces the earlier one.
  std::vector<std::pair<int64_t, TierKey>> order;
  std::vector<Hash128> ns(static_cast<size_t>(map_.n_slots()));
  for (int64_t s : map_.slots_lru_order()) {
    order.emplace_back(s, map_.key(s));
    ns[static_cast<size_t>(s)] = ns_of_[static_cast<size_t>(s)];
  }
  int64_t n_replayed = 0;
  for (size_t off = sizeof(h) + 8; off + sizeof(JournalEntry) <= buf.size();
       off += sizeof(JournalEntry)) {
    JournalEntry j;
    std::memcpy(&j, buf.data() + off, sizeof(j));
    if (XXH3_64bits(&j.e, sizeof(j.e)) != j.checksum) break;  // torn tail
    if (j.e.slot < 0 || j.e.slot >= map_.n_slots()) break;
    const TierKey k{.hash = j.e.hash, .group = j.e.group};
    std::erase_if(order, [&](const auto& p) { return p.first == j.e.slot || p.second == k; });
    order.emplace_back(j.e.slot, k);
    ns[static_cast<size_t>(j.e.slot)] = j.e.ns_digest;
    ++n_replayed;
  }
  if (n_replayed == 0) return;
  SlotMap fresh(map_.n_slots());
  fresh.restore(order);
  map_ = std::move(fresh);
  for (const auto& [s, k] : order) ns_of_[static_cast<size_t>(s)] = ns[static_cast<size_t>(s)];
}

void DiskStore::reset_journal() {
  if (journal_fd_ < 0) return;
  if (::ftruncate(journal_fd_, 0) != 0) {
    ++stats_.n_write_failed;
    return;
  }
  IndexHeader h;
  std::memcpy(h.magic, kJournalMagic, sizeof(h.magic));
  h.block_size = id_.block_size;
  h.payload_bytes = id_.payload_bytes;
  h.slot_bytes = slot_bytes_;
  h.model_digest = id_.model_digest;
  h.format_digest = id_.format_digest;
  uint8_t buf[sizeof(h) + 8];
  std::memcpy(buf, &h, sizeof(h));
  const uint64_t sum = XXH3_64bits(&h, sizeof(h));
  std::memcpy(buf + sizeof(h), &sum, 8);
  if (::write(journal_fd_, buf, sizeof(buf)) != static_cast<ssize_t>(sizeof(buf))) {
    ++stats_.n_write_failed;
  }
}

void DiskStore::journal(std::span<const int64_t> slots) {
  if (journal_fd_ < 0 || slots.empty()) return;
  std::vector<JournalEntry> out;
  out.reserve(slots.size());
  for (int64_t s : slots) {
    if (!map_.used(s)) continue;  // its write failed
    JournalEntry j;
    j.e.slot = s;
    j.e.group = map_.key(s).group;
    j.e.hash = map_.key(s).hash;
    j.e.ns_digest = ns_of_[static_cast<size_t>(s)];
    j.checksum = XXH3_64bits(&j.e, sizeof(j.e));
    out.push_back(j);
  }
  const auto bytes = static_cast<ssize_t>(out.size() * sizeof(JournalEntry));
  // One append per batch; page-cache durability (a process crash keeps it;
  // the index rewrite at flush() follows an fdatasync of the data).
  if (::write(journal_fd_, out.data(), static_cast<size_t>(bytes)) != bytes) {
    ++stats_.n_write_failed;
  }
}

void DiskStore::write_index() {
  IndexHeader h;
  std::memcpy(h.magic, kIndexMagic, sizeof(h.magic));
  h.block_size = id_.block_size;
  h.payload_bytes = id_.payload_bytes;
  h.slot_bytes = slot_bytes_;
  h.model_digest = id_.model_digest;
  h.format_digest = id_.format_digest;
  const std::vector<int64_t> order = map_.slots_lru_order();
  h.n_entries = static_cast<int64_t>(order.size());
  std::vector<uint8_t> buf(sizeof(h) + order.size() * sizeof(IndexEntry) + 8);
  std::memcpy(buf.data(), &h, sizeof(h));
  size_t off = sizeof(h);
  for (int64_t s : order) {
    IndexEntry e;
    e.slot = s;
    e.group = map_.key(s).group;
    e.hash = map_.key(s).hash;
    e.ns_digest = ns_of_[static_cast<size_t>(s)];
    std::memcpy(buf.data() + off, &e, sizeof(e));
    off += sizeof(e);
  }
  const uint64_t sum = XXH3_64bits(buf.data(), off);
  std::memcpy(buf.data() + off, &sum, 8);
  const std::string tmp = index_path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    ++stats_.n_write_failed;
    return;
  }
  const bool ok = ::write(fd, buf.data(), buf.size()) == static_cast<ssize_t>(buf.size());
  ::close(fd);
  if (!ok || std::rename(tmp.c_str(), index_path_.c_str()) != 0) {
    ++stats_.n_write_failed;
    ::unlink(tmp.c_str());
    return;  // the journal keeps what the old index lacks
  }
  reset_journal();
  n_since_index_ = 0;
}

void DiskStore::put(const TierKey& key, const TierRecord& rec) {
  const int64_t have = map_.find(key);
  if (have >= 0) {
    map_.touch(have);
    return;
  }
  int64_t s = map_.insert(key);
  if (s < 0) {
    const int64_t victim = map_.lru();
    pending_.erase(victim);
    map_.erase(victim);
    ++stats_.n_evicted;
    s = map_.insert(key);
  }
  Buffer b;
  if (!spare_.empty()) {
    b = std::move(spare_.back());
    spare_.pop_back();
  } else {
    b = new_buffer();
  }
  const auto hb = static_cast<size_t>(block_record_header_bytes(id_.block_size));
  std::memcpy(b.get(), rec.header, hb);
  std::memset(b.get() + hb, 0, static_cast<size_t>(header_region_) - hb);
  std::memcpy(b.get() + header_region_, rec.payload, static_cast<size_t>(id_.payload_bytes));
  const int64_t tail = slot_bytes_ - header_region_ - id_.payload_bytes;
  if (tail > 0) std::memset(b.get() + header_region_ + id_.payload_bytes, 0, tail);
  ns_of_[static_cast<size_t>(s)] = read_record_header(rec.header).ns_digest;
  pending_[s] = std::move(b);
  if (static_cast<int64_t>(pending_.size()) * slot_bytes_ >= kDiskWriteBatchBytes) {
    write_pending();
  }
}

void DiskStore::write_pending() {
  if (pending_.empty()) return;
  std::vector<int64_t> slots;
  slots.reserve(pending_.size());
  for (const auto& [s, b] : pending_) slots.push_back(s);
  std::sort(slots.begin(), slots.end());
  size_t i = 0;
  while (i < slots.size()) {
    // One pwritev per run of consecutive slots (at most IOV_MAX buffers).
    size_t j = i + 1;
    while (j < slots.size() && slots[j] == slots[j - 1] + 1 && j - i < IOV_MAX) ++j;
    std::vector<iovec> iov(j - i);
    for (size_t k = i; k < j; ++k) {
      iov[k - i] = {.iov_base = pending_[slots[k]].get(),
                    .iov_len = static_cast<size_t>(slot_bytes_)};
    }
    const auto want = static_cast<ssize_t>((j - i) * static_cast<size_t>(slot_bytes_));
    ssize_t n = ::pwritev(fd_, iov.data(), static_cast<int>(iov.size()), slots[i] * slot_bytes_);
    if (n < 0 && errno == EINVAL && direct_) {
      reopen_buffered();
      n = ::pwritev(fd_, iov.data(), static_cast<int>(iov.size()), slots[i] * slot_bytes_);
    }
    if (n != want) {
      // Disk full (ENOSPC, EFBIG) or an I/O error: these blocks are not
      // cached on disk. Nothing else is affected.
      for (size_t k = i; k < j; ++k) {
        map_.erase(slots[k]);
        ++stats_.n_write_failed;
      }
    } else {
      for (size_t k = i; k < j; ++k) {
        ++stats_.n_stored;
        stats_.bytes_in += slot_bytes_;
      }
    }
    i = j;
  }
  for (auto& [s, b] : pending_) {
    if (spare_.size() < 64) spare_.push_back(std::move(b));
  }
  pending_.clear();
  n_since_index_ += static_cast<int64_t>(slots.size());
  if (n_since_index_ >= kDiskIndexEvery) {
    write_index();
  } else {
    journal(slots);
  }
}

void DiskStore::flush() {
  write_pending();
  if (fd_ >= 0) (void)::fdatasync(fd_);
  write_index();
}

bool DiskStore::fetch(const TierKey& key, const Hash128& ns_digest, std::span<const int32_t> tokens,
                      uint8_t* dst) {
  const int64_t s = map_.find(key);
  if (s < 0) return false;
  const uint8_t* rec = nullptr;
  auto it = pending_.find(s);
  if (it != pending_.end()) {
    rec = it->second.get();
  } else {
    ssize_t n = ::pread(fd_, read_buf_.get(), static_cast<size_t>(slot_bytes_), s * slot_bytes_);
    if (n < 0 && errno == EINVAL && direct_) {
      reopen_buffered();
      n = ::pread(fd_, read_buf_.get(), static_cast<size_t>(slot_bytes_), s * slot_bytes_);
    }
    if (n != slot_bytes_) {
      // Truncated file or read error.
      ++stats_.n_corrupt;
      map_.erase(s);
      return false;
    }
    rec = read_buf_.get();
  }
  const BlockRecordKey want{
      .ns_digest = ns_digest, .hash = key.hash, .parent_hash = {}, .group = key.group};
  BlockRecordCheck c = check_block_record(id_, want, tokens, rec);
  if (c == BlockRecordCheck::kOk) {
    c = check_block_payload(rec, std::span<const uint8_t>(rec + header_region_,
                                                          static_cast<size_t>(id_.payload_bytes)));
  }
  if (c != BlockRecordCheck::kOk) {
    if (c == BlockRecordCheck::kIdentityMismatch) {
      ++stats_.n_identity_mismatch;
    } else {
      ++stats_.n_corrupt;
    }
    pending_.erase(s);
    map_.erase(s);
    return false;
  }
  std::memcpy(dst, rec + header_region_, static_cast<size_t>(id_.payload_bytes));
  map_.touch(s);
  ++stats_.n_hits;
  stats_.bytes_out += id_.payload_bytes;
  return true;
}

bool DiskStore::erase(const TierKey& key) {
  const int64_t s = map_.find(key);
  if (s < 0) return false;
  pending_.erase(s);
  map_.erase(s);
  ++stats_.n_erased;
  return true;
}

std::pair<double, double> DiskStore::probe_read_seconds() {
  const std::string path = dir_ + "/probe.kvs";
  int fd =
      ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (direct_ ? O_DIRECT : 0), 0644);
  if (fd < 0) return {0, 0};
  Buffer b = new_buffer();
  std::memset(b.get(), 0x5a, static_cast<size_t>(slot_bytes_));
  bool ok = true;
  for (int i = 0; i < 5 && ok; ++i) {
    ok = ::pwrite(fd, b.get(), static_cast<size_t>(slot_bytes_), i * slot_bytes_) == slot_bytes_;
  }
  (void)::fdatasync(fd);
  if (!direct_) (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  auto now = [] {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  // A 4 KiB read (the fixed cost) after one slot read (warm the path),
  // then one read of 4 slots (the bandwidth).
  double t_small = 0, t_big = 0;
  Buffer big;
  if (ok) {
    void* p = nullptr;
    ok = posix_memalign(&p, 4096, static_cast<size_t>(4 * slot_bytes_)) == 0;
    big = Buffer(static_cast<uint8_t*>(p));
  }
  if (ok) {
    ok = ::pread(fd, b.get(), static_cast<size_t>(slot_bytes_), 0) == slot_bytes_;
    t_small = t_big = 1e30;
    for (int rep = 0; rep < 3 && ok; ++rep) {  // best of 3: the machine is shared
      double t = now();
      ok = ::pread(fd, b.get(), 4096, slot_bytes_) == 4096;
      t_small = std::min(t_small, now() - t);
      t = now();
      ok = ok && ::pread(fd, big.get(), static_cast<size_t>(4 * slot_bytes_), slot_bytes_) ==
                     4 * slot_bytes_;
      t_big = std::min(t_big, now() - t);
    }
  }
  ::close(fd);
  ::unlink(path.c_str());
  return ok ? std::pair<double, double>{t_small, t_big} : std::pair<double, double>{0, 0};
}

TierStoreStats DiskStore::stats() const {
  TierStoreStats s = stats_;
  s.n_blocks = map_.size();
  s.direct_io = direct_;
  return s;
}

}  // namespace kvstack

#include "transfer/lease_table.h"

#include <algorithm>

namespace kvstack::transfer {

const char* lease_end_name(LeaseEnd e) {
  switch (e) {
    case LeaseEnd::kCompleted:
      return "completed";
    case LeaseEnd::kCancelled:
      return "cancelled";
    case LeaseEnd::kExpired:
      return "expired";
  }
  return "?";
}

uint64_t LeaseTable::add(Lease lease, std::chrono::milliseconds timeout, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  lease.id = id;
  lease.deadline = now + timeout;
  lease.pulling = false;
  lease.ended.reset();
  stats_.n_created++;
  stats_.n_open++;
  stats_.n_pinned_blocks += lease.n_blocks();
  leases_.emplace(id, std::move(lease));
  return id;
}

Result<LeaseView> LeaseTable::begin_pull(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.ended) {
    stats_.n_refused++;
    return make_error(Errc::kNotFound, "transfer " + std::to_string(id) +
                                           " is unknown or its lease has ended (completed, "
                                           "cancelled or expired)");
  }
  Lease& l = it->second;
  if (l.pulling) {
    stats_.n_refused++;
    return make_error(Errc::kBusy, "transfer " + std::to_string(id) + " is already being pulled");
  }
  l.pulling = true;
  LeaseView v;
  v.id = id;
  v.addrs = l.addrs;
  v.headers = l.headers;
  v.header_bytes = l.header_bytes;
  v.block_bytes = l.block_bytes;
  v.n_tokens = l.n_tokens;
  return v;
}

bool LeaseTable::end_locked(Lease& l, LeaseEnd why) {
  if (l.ended) return false;
  l.ended = why;
  stats_.n_open--;
  stats_.n_pinned_blocks -= l.n_blocks();
  stats_.n_pending_release++;
  switch (why) {
    case LeaseEnd::kCompleted:
      stats_.n_completed++;
      break;
    case LeaseEnd::kCancelled:
      stats_.n_cancelled++;
      break;
    case LeaseEnd::kExpired:
      stats_.n_expired++;
      break;
  }
  return true;
}

bool LeaseTable::end(uint64_t id, LeaseEnd why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return false;
  return end_locked(it->second, why);
}

std::vector<uint64_t> LeaseTable::expire(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> out;
  for (auto& [id, l] : leases_) {
    if (!l.ended && l.deadline <= now && end_locked(l, LeaseEnd::kExpired)) out.push_back(id);
  }
  return out;
}

void LeaseTable::end_all() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, l] : leases_) end_locked(l, LeaseEnd::kCancelled);
}

std::vector<Lease> LeaseTable::drain_ended() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Lease> out;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.ended) {
      out.push_back(std::move(it->second));
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
  stats_.n_pending_release -= static_cast<int64_t>(out.size());
  return out;
}

bool LeaseTable::is_open(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(id);
  return it != leases_.end() && !it->second.ended;
}

std::optional<Clock::time_point> LeaseTable::next_deadline() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Clock::time_point> best;
  for (const auto& [id, l] : leases_) {
    if (!l.ended && (!best || l.deadline < *best)) best = l.deadline;
  }
  return best;
}

LeaseStats LeaseTable::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kvstack::transfer

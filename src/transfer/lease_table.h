// LeaseTable: the prefill side's pinned KV blocks awaiting a pull by a
// decode worker (kv-cache-spec.md section 10; issue 21 item 1).
//
// A lease is created when a prefill request marked do_remote_decode
// finishes: it holds a reference to every full block of the prompt's
// published prefix (BlockRef handles: the blocks stay kUsed, so they are
// neither evicted nor reused while the decode worker reads them), their
// record headers (block_record.h: identity travels with the bytes) and the
// blocks' addresses in the pool mapping. It ends exactly once, for one of:
//   kCompleted  the decode worker reported a verified pull;
//   kCancelled  the puller went away mid-pull (control connection lost or
//               an explicit abort), or the server shuts down;
//   kExpired    its deadline (--kv-lease-timeout from creation) passed
//               before the pull completed (an abandoned decode request, a
//               router that never sent it, a puller that hangs).
// A pull takes the lease (begin_pull) so that at most one puller reads it;
// a second pull of the same id is refused (kBusy) until the first ends, and
// an ended id is unknown (kNotFound).
//
// Block references must be dropped on the pool's owner thread (the engine
// thread): end() and expire() only move the lease to the ended list, and
// the owner calls drain_ended() (e.g. inside Scheduler::inspect), which
// destroys the ended leases and with them their references.
//
// Thread-safety: every method is safe from any thread (one mutex), except
// that the references inside the leases returned by drain_ended() must be
// destroyed on the pool owner's thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/result.h"
#include "kv/block_pool.h"

namespace kvstack::transfer {

using Clock = std::chrono::steady_clock;

enum class LeaseEnd : uint8_t { kCompleted, kCancelled, kExpired };
const char* lease_end_name(LeaseEnd e);

// One pinned prefix. Units: bytes, addresses in the prefill process.
struct Lease {
  uint64_t id = 0;
  std::vector<BlockRef> refs;      // [n_blocks] held until the lease ends (owner thread drops)
  std::vector<int32_t> block_ids;  // [n_blocks] the producer's block ids (meaningless remotely)
  std::vector<uint64_t> addrs;     // [n_blocks] start of each block's bytes in the pool mapping
  std::vector<uint8_t> headers;    // [n_blocks, header_bytes] block records' headers
  int64_t header_bytes = 0;        // block_record_header_bytes(P)
  int64_t block_bytes = 0;         // payload bytes of one block
  int64_t n_tokens = 0;            // logical length covered: n_blocks * P
  Clock::time_point deadline;
  bool pulling = false;  // a puller holds it (begin_pull .. end)
  std::optional<LeaseEnd> ended;
  int64_t n_blocks() const { return static_cast<int64_t>(block_ids.size()); }
};

// What a puller gets (a copy: the lease itself stays in the table).
struct LeaseView {
  uint64_t id = 0;
  std::vector<uint64_t> addrs;
  std::vector<uint8_t> headers;
  int64_t header_bytes = 0;
  int64_t block_bytes = 0;
  int64_t n_tokens = 0;
};

struct LeaseStats {
  int64_t n_open = 0;             // leases not yet ended
  int64_t n_pinned_blocks = 0;    // blocks held by open leases
  int64_t n_created = 0;          // lifetime
  int64_t n_completed = 0;        // ended by a verified pull
  int64_t n_cancelled = 0;        // ended by the puller's loss / abort / shutdown
  int64_t n_expired = 0;          // ended by the deadline
  int64_t n_refused = 0;          // pulls refused (unknown id, already being pulled)
  int64_t n_pending_release = 0;  // ended, references not yet dropped
};

class LeaseTable {
 public:
  LeaseTable() = default;
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  // Registers `lease` (its id is assigned here, unique for the table's
  // life; its deadline is now + timeout). Returns the id.
  uint64_t add(Lease lease, std::chrono::milliseconds timeout,
               Clock::time_point now = Clock::now());

  // Starts the one pull of lease `id`: kNotFound when unknown or ended,
  // kBusy when another pull holds it. The view names what to read.
  Result<LeaseView> begin_pull(uint64_t id);

  // Ends lease `id` (no-op when it is unknown or already ended); the
  // references are dropped by the next drain_ended(). Returns whether this
  // call ended it.
  bool end(uint64_t id, LeaseEnd why);

  // Ends every open lease whose deadline is <= now (kExpired); returns
  // their ids (a pull in progress is then aborted by its server).
  std::vector<uint64_t> expire(Clock::time_point now = Clock::now());
  // Ends every open lease (kCancelled): shutdown.
  void end_all();

  // Removes the ended leases and returns them; destroying them drops their
  // block references. REQUIRES: destroyed on the pool owner's thread.
  std::vector<Lease> drain_ended();

  // Whether `id` is open (neither ended nor unknown).
  bool is_open(uint64_t id) const;
  // Earliest deadline of an open lease (nullopt: none open).
  std::optional<Clock::time_point> next_deadline() const;
  LeaseStats stats() const;

 private:
  bool end_locked(Lease& l, LeaseEnd why);
  mutable std::mutex mu_;
  std::map<uint64_t, Lease> leases_;  // open and ended-not-drained
  uint64_t next_id_ = 1;
  LeaseStats stats_;
};

}  // namespace kvstack::transfer

// Layer-wise streaming of a prefill to a decode worker (pd_agent.h, "Layer-
// wise streaming"): what the prefill worker's layer hook records for each
// streamed prefill. Internal to PdAgent (pd_agent.cpp, pd_stream.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "engine/forward.h"
#include "kv/block_pool.h"
#include "server/pd_agent.h"

namespace kvstack::server {

// One streamed prefill. The hook (engine thread) writes under `mu`; the
// stream's connection thread waits on `cv`.
struct StreamWatch {
  int64_t n_prompt = 0;  // prompt tokens: the final chunk ends there
  size_t n_blocks = 0;   // blocks streamed: floor((n_prompt - 1) / P)
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;         // the final chunk's step reserved its slots
  int layers_done = 0;          // layers of that step written (0..L)
  std::vector<uint64_t> addrs;  // [n_blocks] the blocks' addresses
  // References that keep the blocks from reuse until the lease takes over;
  // dropped on the engine thread (or after it returned).
  std::vector<BlockRef> refs;
};

struct StreamWatches {
  std::mutex mu;
  std::map<uint64_t, std::shared_ptr<StreamWatch>> by_id;
  std::atomic<int> n{0};  // by_id.size(): the hook's fast path
  std::atomic<uint64_t> next_id{1};
};

// The layer hook's part (engine thread): for each entry of `batch` with a
// watch, at n_done 0 of the final prefill chunk take its blocks'
// references and addresses; then count layers done.
void watches_on_layer(StreamWatches& w, int n_done, std::span<const StepSeq> batch);

// A puller held by one pull; returned to the free list on destruction.
class PdAgent::Lane {
 public:
  Lane(PdAgent& a, transfer::UcxPuller* p) : a_(a), p_(p) {}
  ~Lane() {
    {
      std::lock_guard<std::mutex> lock(a_.mu_);
      a_.free_pullers_.push_back(p_);
      a_.stats_.pulls_in_flight--;
    }
    a_.lane_cv_.notify_all();
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  transfer::UcxPuller* puller() const { return p_; }

 private:
  PdAgent& a_;
  transfer::UcxPuller* p_;
};

}  // namespace kvstack::server

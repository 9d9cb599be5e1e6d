#include "server/request_group.h"

namespace kvstack::server {

RequestGroup::RequestGroup(std::vector<std::shared_ptr<RequestHandle>> handles, int n)
    : handles_(std::move(handles)), finished_(handles_.size(), false), n_(n) {}

RequestGroup::~RequestGroup() {
  if (!done_) cancel();
}

void RequestGroup::cancel() {
  for (size_t i = 0; i < handles_.size(); ++i) {
    if (!finished_[i]) handles_[i]->cancel();
  }
}

bool RequestGroup::cancelled() const {
  for (const auto& h : handles_) {
    if (h->cancelled()) return true;
  }
  return false;
}

bool RequestGroup::wait(std::vector<SeqEvent>* out, std::chrono::milliseconds timeout) {
  if (done_) return false;
  std::vector<SeqEvent> evs;
  std::vector<size_t> from;
  auto collect = [&](size_t i, std::chrono::milliseconds t) {
    const size_t before = evs.size();
    handles_[i]->wait(&evs, t);
    from.resize(evs.size(), i);
    return evs.size() > before;
  };
  bool any = false;
  for (size_t i = 0; i < handles_.size(); ++i) {
    if (!finished_[i]) any |= collect(i, std::chrono::milliseconds(0));
  }
  if (!any) {
    for (size_t i = 0; i < handles_.size(); ++i) {
      if (!finished_[i]) {
        collect(i, timeout);
        break;
      }
    }
  }
  if (evs.empty()) return false;
  for (size_t k = 0; k < evs.size(); ++k) {
    SeqEvent& ev = evs[k];
    const size_t i = from[k];
    if (done_ || finished_[i]) continue;
    ev.index += static_cast<int>(i) * n_;
    if (ev.kind == SeqEvent::Kind::kError) {
      finished_[i] = true;
      cancel();
      done_ = true;
      ev.request_done = true;
      out->push_back(std::move(ev));
      continue;
    }
    if (ev.request_done) {
      finished_[i] = true;
      usage_.prompt_tokens += ev.usage.prompt_tokens;
      usage_.completion_tokens += ev.usage.completion_tokens;
      usage_.cached_tokens += ev.usage.cached_tokens;
      bool all = true;
      for (bool f : finished_) all = all && f;
      ev.request_done = all;
      if (all) {
        ev.usage = usage_;
        done_ = true;
      }
    }
    out->push_back(std::move(ev));
  }
  return true;
}

}  // namespace kvstack::server

// RequestGroup: the scheduler requests of one API call seen as one, for a
// /v1/completions "prompt" that is a list (one scheduler request per
// prompt, each with n choices). Events come out as from one RequestHandle:
// choice index = prompt * n + choice, and request_done only on the last
// event of the last request, carrying the summed usage. An error event of
// any request ends the group (request_done set; the others are cancelled).
//
// Thread-safety: one owner thread (the HTTP handler or its stream).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "engine/scheduler.h"

namespace kvstack::server {

class RequestGroup {
 public:
  // REQUIRES: handles non-empty; n = choices per request.
  RequestGroup(std::vector<std::shared_ptr<RequestHandle>> handles, int n);
  ~RequestGroup();  // cancels what did not finish

  // Moves the events that arrived into *out, waiting up to `timeout` for one.
  bool wait(std::vector<SeqEvent>* out, std::chrono::milliseconds timeout);
  void cancel();
  bool cancelled() const;
  bool done() const { return done_; }

 private:
  std::vector<std::shared_ptr<RequestHandle>> handles_;
  std::vector<bool> finished_;
  const int n_;
  bool done_ = false;
  RequestUsage usage_;
};

}  // namespace kvstack::server

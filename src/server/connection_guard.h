// GuardedServer: cpp-httplib's Server with the connection handling replaced
// by one built for hostile clients (issue 22). httplib keeps parsing the
// request, routing and writing responses; what changes is how a connection
// reaches it and what the socket it reads from allows:
//
//   accept (httplib) -> head waiter (one epoll thread, no worker held)
//                    -> framing check of the complete head
//                    -> worker pool: httplib's process_request over a
//                       GuardedStream (one request per connection)
//
// - Head deadline: a connection whose request head (request line, headers,
//   blank line) is not complete within head_timeout is closed. Waiting costs
//   a file descriptor and at most max_head_bytes of buffer, never a thread,
//   so slow or idle connections cannot exhaust the worker pool. At most
//   max_waiting connections (max_waiting_per_client per client address) wait
//   at once; past that the oldest waiting one is closed.
// - Framing, checked before httplib sees the request: strict CRLF lines, no
//   obsolete line folding, no space before a colon; at most one
//   Content-Length, all digits, at most max_body_bytes (413); no
//   Content-Length together with Transfer-Encoding; Transfer-Encoding only
//   "chunked" (501 otherwise); no Content-Encoding other than identity (415:
//   nothing is ever decompressed); a POST/PUT/PATCH without either length
//   or chunking gets 411 (httplib would read it to the end of the stream).
//   Rejections are a short JSON error and a closed connection.
// - Body deadline: reads fail once request_timeout has passed since accept,
//   and after max_body_bytes * 2 + 64 KiB raw body bytes (chunk framing
//   included), whatever the transfer encoding. The decoded-size limit is the
//   handler's (http_server.cpp reads bodies through a capped ContentReader).
// - Per-client concurrency: at most max_active_per_client connections of one
//   client address are served at once (429 past that), and at most
//   n_threads overall (503), so one client cannot take every worker.
//   Addresses in trusted_proxies (a router in front of the server, which
//   carries many users' requests on its connections) skip both per-client
//   caps; the overall caps still hold for them.
// - Range requests are ignored (full 200 responses): API responses are not
//   files, and httplib's multipart ranges amplify a response many times.
// - Every connection serves one request (Connection: close), so every
//   request passes the checks above.
//
// current_connection_alive() lets a handler on a worker thread ask whether
// its client is still there (non-streaming requests cancel on disconnect).
//
// Thread-safety: stop_guard() and stats() from any thread; the rest is
// driven by httplib's accept loop and the worker pool.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kvstack::server {

struct GuardLimits {
  double head_timeout_s = 10;     // accept -> complete request head
  double request_timeout_s = 30;  // accept -> request body read
  size_t max_head_bytes = 16384;  // request line + headers
  size_t max_body_bytes = 8u << 20;
  int max_waiting = 1024;            // connections with an incomplete head, all clients
  int max_waiting_per_client = 256;  // of those, per client address
  int n_threads = 96;                // worker threads (connections served at once)
  int max_active_per_client = 0;     // served at once per client address (0 = n_threads / 2)
  std::vector<std::string> trusted_proxies;  // peer addresses exempt from the per-client caps
};

// Connections closed or refused by the guard, by reason (the /metrics page).
struct GuardStats {
  int64_t head_timeouts = 0;  // head not complete within head_timeout
  int64_t evicted = 0;        // oldest waiting connection closed for a new one
  int64_t bad_framing = 0;    // 400/411/413/415/431/501 before httplib
  int64_t client_limit = 0;   // 429: the client has max_active_per_client served
  int64_t busy = 0;           // 503: every worker is serving
  int64_t body_timeouts = 0;  // reads refused after request_timeout
  int64_t served = 0;         // requests handed to httplib
};

class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(GuardLimits limits);
  ~GuardedServer() override;
  GuardedServer(const GuardedServer&) = delete;
  GuardedServer& operator=(const GuardedServer&) = delete;

  // Closes every waiting connection and hands no more to the workers. Call
  // before httplib::Server::stop() (HttpServer::stop does).
  void stop_guard();

  GuardStats stats() const;

  // Re-listens on the bound socket with a larger accept backlog (httplib
  // listens with 5: a burst of connections past it waits for SYN
  // retransmits, a second and more). REQUIRES: a bind_to_* succeeded.
  void widen_backlog(int backlog);

  struct Conn;  // one accepted connection (connection_guard.cpp)

 private:
  bool process_and_close_socket(socket_t sock) override;
  void waiter_loop();
  // Reads what arrived on a waiting connection; true when it left the waiter.
  bool on_readable(const std::shared_ptr<Conn>& c);
  void close_waiting(const std::shared_ptr<Conn>& c);
  void hand_over(const std::shared_ptr<Conn>& c);
  void serve(const std::shared_ptr<Conn>& c);
  void reject(const std::shared_ptr<Conn>& c, int status, const std::string& message);
  bool trusted(const std::string& client) const;

  const GuardLimits limits_;
  httplib::TaskQueue* pool_ = nullptr;  // owned by httplib's listen loop
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: new connection or stop
  std::thread waiter_;

  mutable std::mutex mu_;
  bool stopping_ = false;
  std::deque<std::shared_ptr<Conn>> incoming_;  // accepted, not yet in the epoll set
  std::unordered_map<std::string, int> active_per_client_;
  int n_active_ = 0;
  GuardStats stats_;

  // Waiter thread only.
  std::map<int, std::shared_ptr<Conn>> waiting_;   // by fd
  std::deque<std::weak_ptr<Conn>> waiting_order_;  // accept order (= deadline order)
  std::unordered_map<std::string, int> waiting_per_client_;
  std::atomic<int64_t> body_timeouts_{0};
};

// Whether the client of the request being handled on this thread is still
// connected (false once it closed or reset its side). True outside a
// GuardedServer worker.
bool current_connection_alive();

}  // namespace kvstack::server

// HttpServer: the OpenAI-compatible HTTP front end over a Scheduler
// (cpp-httplib). Routes:
//   POST /v1/completions, POST /v1/chat/completions  (JSON or SSE stream)
//   GET  /v1/models, GET /health, GET /metrics (Prometheus text),
//   GET  /v1/kv/stats (pool and prefix-cache statistics, JSON)
//   GET  /v1/kv/blocks (every cached block's hash, parent and namespace digest;
//        admin key only when one is set: the KV-events consumers' check)
// Errors use the OpenAI shape {"error": {message, type, param, code}} with
// the HTTP status that fits (400 bad input, 401 bad API key, 404 unknown
// model or route, 413 body too large, 429 queue full, 503 not ready or
// shutting down).
//
// Connections go through GuardedServer (connection_guard.h): deadlines for
// the request head and body, strict framing, no compressed bodies, one
// request per connection, per-client concurrency limits, no Range.
//
// Disconnects: each SSE response polls its request's events and a failed
// write cancels the request; a non-streaming request polls its connection
// every 50 ms while it waits. Either way the scheduler frees the request's
// blocks within one step (queued, prefilling or decoding).
//
// Tenants (cache_salt): a salt is length-capped and hashed before it names a
// prefix-cache namespace (openai_protocol.h). /v1/kv/stats shows the pool,
// the scheduler gauges and the caller's own namespace (?cache_salt=SALT, or
// the default one); the global prefix-cache counters and every namespace
// with blocks only to the admin key (ServerConfig::admin_api_key).
//
// Thread-safety: handlers run on httplib's worker threads; they talk to the
// engine only through Scheduler::submit / RequestHandle / inspect / metrics,
// which are thread-safe. attach() and stop() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/scheduler.h"
#include "server/connection_guard.h"
#include "server/kv_events.h"
#include "server/openai_protocol.h"
#include "server/pd_agent.h"
#include "tokenizer/chat_template.h"

namespace kvstack::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8080;            // 0 = any free port (see port())
  std::string api_key;        // empty = no authentication
  std::string admin_api_key;  // empty = no admin: /v1/kv/stats shows tenants their own only
  std::string model_id;       // name reported by /v1/models and responses
  // Other names a request's "model" may use for the served model ("kvstack",
  // the GGUF's file name).
  std::vector<std::string> model_aliases;
  int n_http_threads = 96;  // concurrent connections served
  size_t max_body_bytes = 8u << 20;
  double head_timeout_s = 10;     // accept -> request head complete, else closed
  double request_timeout_s = 30;  // accept -> request body read, else closed
  int max_conns_per_client = 0;   // served at once per client address (0 = half the threads)
  std::vector<std::string> trusted_proxies;  // client addresses exempt from that cap (a router)
};

class HttpServer {
 public:
  explicit HttpServer(ServerConfig config);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket; kIo naming host:port on failure.
  Status bind();
  int port() const { return port_; }

  // Makes the model endpoints live (before this, /health and the API answer
  // 503 "loading"). REQUIRES: scheduler (and its engine) and chat outlive the
  // server; chat may be null (then /v1/chat/completions answers 400).
  void attach(Scheduler* scheduler, const ChatTemplate* chat);
  // The PD agent of a --role prefill/decode server (pd_agent.h); null for
  // --role both. REQUIRES: set before attach(); outlives the server.
  void set_pd(PdAgent* agent) { pd_ = agent; }

  // Serves until stop(). REQUIRES: bind() succeeded.
  void listen();
  // Stops accepting; listen() returns once in-flight handlers finished.
  void stop();

  // Adds the KV event publisher's counters to /metrics. REQUIRES: called
  // before listen(); `p` outlives the server.
  void set_kv_events(const KvEventPublisher* p) { kv_events_ = p; }

  // Waits up to `timeout` until no completion handler runs (the last events
  // of cancelled streams written); true when none is left.
  bool wait_handlers(std::chrono::milliseconds timeout) const;

 private:
  void routes();
  void completion(Endpoint endpoint, const std::string& body, httplib::Response& res);
  void render(Endpoint endpoint, const std::string& body, httplib::Response& res);
  ProtocolLimits protocol_limits(const Engine& engine) const;
  void observe_tpot(double seconds);

  ServerConfig config_;
  std::unique_ptr<GuardedServer> http_;
  int port_ = 0;
  std::atomic<Scheduler*> scheduler_{nullptr};
  const ChatTemplate* chat_ = nullptr;
  const KvEventPublisher* kv_events_ = nullptr;
  PdAgent* pd_ = nullptr;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<int> n_handlers_{0};  // completion handlers running
  mutable std::mutex tpot_mu_;
  // Time per output token of each finished request with >= 2 tokens per
  // choice: (last token - first token) / (tokens - 1), seconds.
  Histogram tpot_{{0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0}};
};

// The /metrics page for a scheduler's counters and its pool (exposed for tests).
// `guard` and `tpot` may be null (then their series are left out).
std::string prometheus_text(const SchedulerMetrics& m, const BlockPoolStats& pool,
                            const std::string& model_id, const GuardStats* guard = nullptr,
                            const Histogram* tpot = nullptr);

}  // namespace kvstack::server

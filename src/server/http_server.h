// HttpServer: the OpenAI-compatible HTTP front end over a Scheduler
// (cpp-httplib). Routes:
//   POST /v1/completions, POST /v1/chat/completions  (JSON or SSE stream)
//   GET  /v1/models, GET /health, GET /metrics (Prometheus text),
//   GET  /v1/kv/stats (pool and prefix-cache statistics, JSON)
// Errors use the OpenAI shape {"error": {message, type, param, code}} with
// the HTTP status that fits (400 bad input, 401 bad API key, 404 unknown
// model or route, 413 body too large, 429 queue full, 503 not ready or
// shutting down).
//
// Streams: each SSE response polls its request's events; a failed write
// (the client went away) cancels the request, and the scheduler frees its
// blocks within one step.
//
// Thread-safety: handlers run on httplib's worker threads; they talk to the
// engine only through Scheduler::submit / RequestHandle / inspect / metrics,
// which are thread-safe. attach() and stop() may be called from any thread.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "core/result.h"
#include "engine/scheduler.h"
#include "tokenizer/chat_template.h"

namespace httplib {
class Server;
}

namespace kvstack::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8080;          // 0 = any free port (see port())
  std::string api_key;      // empty = no authentication
  std::string model_id;     // name reported by /v1/models and responses
  int n_http_threads = 96;  // concurrent connections served
  size_t max_body_bytes = 8u << 20;
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

  // Serves until stop(). REQUIRES: bind() succeeded.
  void listen();
  // Stops accepting; listen() returns once in-flight handlers finished.
  void stop();

 private:
  void routes();

  ServerConfig config_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  std::atomic<Scheduler*> scheduler_{nullptr};
  const ChatTemplate* chat_ = nullptr;
  std::atomic<uint64_t> next_id_{1};
};

// The /metrics page for a scheduler's counters and its pool (exposed for tests).
std::string prometheus_text(const SchedulerMetrics& m, const BlockPoolStats& pool,
                            const std::string& model_id);

}  // namespace kvstack::server

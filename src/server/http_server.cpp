#include "server/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <thread>

#include "core/prometheus_text.h"
#include "kv/prefix_index.h"
#include "kv/retention.h"
#include "server/openai_protocol.h"
#include "server/request_group.h"

namespace kvstack::server {

using nlohmann::json;

namespace {

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  // Overload (queue full, pool full, shutting down): a well-behaved client
  // backs off and retries.
  if (e.status == 429 || e.status == 503) res.set_header("Retry-After", "1");
  res.set_content(dump(e.to_json()), "application/json");
}

int64_t unix_now() {
  return static_cast<int64_t>(std::time(nullptr));
}

// Everything one response accumulates per choice.
struct ChoiceOut {
  std::string text;
  std::vector<SampledToken> logprobs;
  std::optional<FinishReason> finish;
  bool role_sent = false;
};

// Counts a running completion handler (HttpServer::wait_handlers).
struct HandlerCount {
  std::atomic<int>& n;
  explicit HandlerCount(std::atomic<int>& c) : n(c) { n.fetch_add(1); }
  ~HandlerCount() { n.fetch_sub(1); }
  HandlerCount(const HandlerCount&) = delete;
  HandlerCount& operator=(const HandlerCount&) = delete;
};

// First and last token times per choice, for the TPOT histogram.
class TokenClock {
 public:
  void on_event(const SeqEvent& ev) {
    if (ev.kind != SeqEvent::Kind::kToken) return;
    Times& t = by_choice_[ev.index];
    const auto now = std::chrono::steady_clock::now();
    if (t.n == 0) t.first = now;
    t.last = now;
    t.n++;
  }
  // Mean over choices with >= 2 tokens of (last - first) / (tokens - 1).
  std::optional<double> tpot() const {
    double sum = 0;
    int n = 0;
    for (const auto& [i, t] : by_choice_) {
      if (t.n < 2) continue;
      sum += std::chrono::duration<double>(t.last - t.first).count() / (t.n - 1);
      n++;
    }
    if (n == 0) return std::nullopt;
    return sum / n;
  }

 private:
  struct Times {
    std::chrono::steady_clock::time_point first, last;
    int64_t n = 0;
  };
  std::map<int, Times> by_choice_;
};

// Log-probabilities of each prompt token given the ones before it (the
// first token has none: its entry holds token only), with the `n_top` most
// likely alternatives, from the model's raw logits (log-softmax in double).
// Runs the prompt through a scratch table in chunks (its blocks return to
// the pool at the end). REQUIRES: the engine thread (Scheduler::inspect).
Result<std::vector<SampledToken>> prompt_logprobs(Engine& e, const std::vector<int32_t>& prompt,
                                                  int n_top) {
  std::vector<SampledToken> out(prompt.size());
  if (prompt.empty()) return out;
  out[0].token = prompt[0];
  BlockTable table = e.new_table();
  const int n_vocab = e.tokenizer().n_vocab();
  const size_t chunk = 64;
  std::vector<float> logits;
  std::vector<int32_t> order(static_cast<size_t>(n_vocab));
  for (size_t from = 0; from + 1 < prompt.size(); from += chunk) {
    const size_t to = std::min(prompt.size() - 1, from + chunk);  // rows predict [from+1, to]
    logits.clear();
    const std::span<const int32_t> tokens(prompt.data() + from, to - from);
    if (auto st = e.prefill(table, tokens, LogitsMode::kAll, &logits); !st.ok()) return st.error();
    for (size_t r = 0; r < to - from; ++r) {
      const float* row = logits.data() + r * static_cast<size_t>(n_vocab);
      double mx = row[0];
      for (int v = 1; v < n_vocab; ++v) mx = std::max<double>(mx, row[v]);
      double z = 0;
      for (int v = 0; v < n_vocab; ++v) z += std::exp(static_cast<double>(row[v]) - mx);
      const double lse = mx + std::log(z);
      SampledToken& t = out[from + r + 1];
      t.token = prompt[from + r + 1];
      t.logprob = static_cast<float>(row[t.token] - lse);
      if (n_top > 0) {
        for (int v = 0; v < n_vocab; ++v) order[static_cast<size_t>(v)] = v;
        const auto k = static_cast<ptrdiff_t>(std::min(n_top, n_vocab));
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
          return row[a] > row[b] || (row[a] == row[b] && a < b);
        });
        for (ptrdiff_t j = 0; j < k; ++j) {
          t.top.push_back({order[static_cast<size_t>(j)],
                           static_cast<float>(row[order[static_cast<size_t>(j)]] - lse)});
        }
      }
    }
  }
  return out;
}

// The completions logprobs object of an echoed prompt followed by the
// generated tokens' object `generated` (null when there are none yet): the
// prompt's first token has a null logprob and null top_logprobs, as OpenAI's.
json echo_logprobs_json(const Tokenizer& tok, const std::vector<SampledToken>& prompt,
                        const json& generated) {
  json lp = logprobs_json(Endpoint::kCompletions, tok, prompt, 0);
  if (!prompt.empty()) {
    lp["token_logprobs"][0] = nullptr;
    lp["top_logprobs"][0] = nullptr;
  }
  if (generated.is_object()) {
    for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
      for (const json& v : generated[key]) lp[key].push_back(v);
    }
  }
  return lp;
}

GuardLimits guard_limits(const ServerConfig& c) {
  GuardLimits g;
  g.head_timeout_s = std::min(c.head_timeout_s, c.request_timeout_s);
  g.request_timeout_s = c.request_timeout_s;
  g.max_body_bytes = c.max_body_bytes;
  g.n_threads = std::max(4, c.n_http_threads);
  g.max_active_per_client = c.max_conns_per_client;
  g.trusted_proxies = c.trusted_proxies;
  return g;
}

}  // namespace

HttpServer::HttpServer(ServerConfig config)
    : config_(std::move(config)), http_(std::make_unique<GuardedServer>(guard_limits(config_))) {
  http_->set_payload_max_length(config_.max_body_bytes);
  routes();
}

HttpServer::~HttpServer() = default;

Status HttpServer::bind() {
  if (config_.port == 0) {
    port_ = http_->bind_to_any_port(config_.host);
  } else {
    port_ = http_->bind_to_port(config_.host, config_.port) ? config_.port : -1;
  }
  if (port_ <= 0) {
    return make_error(Errc::kIo, "cannot listen on " + config_.host + ":" +
                                     std::to_string(config_.port) +
                                     " (address in use or not available)");
  }
  http_->widen_backlog(1024);
  return {};
}

void HttpServer::attach(Scheduler* scheduler, const ChatTemplate* chat) {
  chat_ = chat;
  scheduler_.store(scheduler, std::memory_order_release);
}

void HttpServer::listen() {
  http_->listen_after_bind();
}

void HttpServer::stop() {
  http_->stop_guard();
  http_->stop();
}

bool HttpServer::wait_handlers(std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (n_handlers_.load() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

void HttpServer::observe_tpot(double seconds) {
  std::lock_guard<std::mutex> lock(tpot_mu_);
  tpot_.observe(seconds);
}

void HttpServer::routes() {
  httplib::Server& h = *http_;

  // Authentication and readiness for the API routes.
  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    if (!config_.api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      const bool admin =
          !config_.admin_api_key.empty() && auth == "Bearer " + config_.admin_api_key;
      if (auth != "Bearer " + config_.api_key && !admin) {
        send_error(res, api_error(401, "authentication_error",
                                  auth.empty() ? "missing API key: send the header "
                                                 "'Authorization: Bearer KEY'"
                                               : "incorrect API key provided",
                                  "", "invalid_api_key"));
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (scheduler_.load(std::memory_order_acquire) == nullptr) {
      send_error(res, api_error(503, "service_unavailable", "the model is still loading"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  h.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    ApiError e = api_error(res.status, "invalid_request_error", "");
    if (res.status == 404) {
      e.message = "no route for " + req.method + " " + req.path;
    } else if (res.status == 413) {
      e.message = "the request body is too large";
    } else {
      e.message = "HTTP error " + std::to_string(res.status);
    }
    res.set_content(dump(e.to_json()), "application/json");
  });

  h.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (scheduler_.load(std::memory_order_acquire) == nullptr) {
      res.status = 503;
      res.set_content(R"({"status":"loading"})", "application/json");
      return;
    }
    res.set_content(R"({"status":"ok"})", "application/json");
  });

  // The load a router polls (vllm-router's power_of_two policy, every 5 s;
  // the SGLang-router format it reads): one entry per data-parallel rank
  // (this server is one rank, 0). num_reqs = running sequences, num_waiting_reqs
  // = queued requests, num_tokens = KV slots held by live sequences (committed
  // + reserved tokens): the router adds num_tokens to its own in-flight count.
  h.Get("/get_load", [this](const httplib::Request&, httplib::Response& res) {
    Scheduler* s = scheduler_.load();
    if (s == nullptr) {
      send_error(res, api_error(503, "service_unavailable", "the model is still loading"));
      return;
    }
    BlockPoolStats pool;
    (void)s->inspect([&](Engine& e) { pool = e.pool().stats(); });
    const SchedulerMetrics m = s->metrics();
    json rank = {{"dp_rank", 0},
                 {"num_reqs", m.n_running},
                 {"num_waiting_reqs", m.n_waiting},
                 {"num_tokens", pool.n_tokens_committed + pool.n_tokens_reserved}};
    res.set_content(dump(json::array({rank})), "application/json");
  });

  h.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    Scheduler* s = scheduler_.load();
    json model = {{"id", config_.model_id},
                  {"object", "model"},
                  {"created", unix_now()},
                  {"owned_by", "kvstack"},
                  {"max_model_len", s->engine().model().config().n_ctx_train}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({model})}}),
                    "application/json");
  });

  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    Scheduler* s = scheduler_.load();
    if (s == nullptr) {
      res.status = 503;
      res.set_content("# model loading\n", "text/plain");
      return;
    }
    BlockPoolStats pool;
    KvTiersStats tiers;
    (void)s->inspect([&](Engine& e) {
      pool = e.pool().stats();
      tiers = e.kv().tier_stats();
    });
    const GuardStats guard = http_->stats();
    Histogram tpot;
    {
      std::lock_guard<std::mutex> lock(tpot_mu_);
      tpot = tpot_;
    }
    PromText events("model_name=\"" + config_.model_id + "\"");
    if (kv_events_ != nullptr) {
      const KvEventPublisherStats k = kv_events_->stats();
      auto counter = [&](const char* name, const char* help, int64_t v) {
        events.metric(name, "counter", help, v);
      };
      counter("kvstack:kv_events_published_total", "KV events published (--kv-events).",
              k.n_events);
      counter("kvstack:kv_event_batches_total", "KV event batches (messages) published.",
              k.n_batches);
      counter("kvstack:kv_events_dropped_total", "KV events dropped: the publisher queue was full.",
              k.n_dropped);
      counter("kvstack:kv_event_replay_requests_total", "KV event replay requests answered.",
              k.n_replay_requests);
    }
    const std::string labels = "model_name=\"" + config_.model_id + "\"";
    res.set_content(prometheus_text(s->metrics(), pool, config_.model_id, &guard, &tpot) +
                        kv_tiers_prometheus(tiers, labels) + events.str() +
                        (pd_ != nullptr ? pd_prometheus(pd_->stats(), labels) : std::string()),
                    "text/plain; version=0.0.4");
  });

  // The prefix cache's current blocks (what a KV-events subscriber should
  // have rebuilt): hash, parent (zeros at the top) and namespace digest, hex.
  h.Get("/v1/kv/blocks", [this](const httplib::Request& req, httplib::Response& res) {
    if (!config_.admin_api_key.empty() &&
        req.get_header_value("Authorization") != "Bearer " + config_.admin_api_key) {
      send_error(res, api_error(403, "permission_error", "/v1/kv/blocks needs the admin key"));
      return;
    }
    Scheduler* s = scheduler_.load();
    json blocks = json::array();
    (void)s->inspect([&](Engine& e) {
      const PrefixIndex* index = e.kv().index();
      if (index == nullptr) return;
      index->replay_stored([&](const KvEvent& ev) {
        blocks.push_back({{"hash", ev.hash.hex()},
                          {"parent", ev.parent_hash.hex()},
                          {"namespace", index->namespace_digest(ev.ns).hex()}});
      });
    });
    res.set_content(dump(json{{"blocks", blocks}}), "application/json");
  });

  // Clears the prefix cache: vllm-router's POST /flush_cache (it sends one to
  // every worker, prefill and decode alike) and vLLM's POST
  // /reset_prefix_cache. Every unreferenced cached block is dropped; blocks
  // held by running requests, leases and pinned public prefixes stay
  // (PrefixIndex::clear_cached, which also sends the KV events). With an
  // admin key configured only that key may clear, else with an API key that
  // key (or the admin key).
  auto clear_cache = [this](const httplib::Request& req, httplib::Response& res) {
    const std::string auth = req.get_header_value("Authorization");
    const std::string& need =
        !config_.admin_api_key.empty() ? config_.admin_api_key : config_.api_key;
    if (!need.empty() && auth != "Bearer " + need) {
      send_error(res,
                 api_error(403, "permission_error",
                           req.path + (config_.admin_api_key.empty() ? " needs the API key"
                                                                     : " needs the admin key")));
      return;
    }
    Scheduler* s = scheduler_.load(std::memory_order_acquire);
    if (s == nullptr) {
      send_error(res, api_error(503, "service_unavailable", "the model is still loading"));
      return;
    }
    bool has_cache = false;
    PrefixIndex::ClearResult r;
    const Status st = s->inspect([&](Engine& e) {
      PrefixIndex* index = e.kv().index();
      if (index == nullptr) return;
      has_cache = true;
      r = index->clear_cached();
    });
    if (!st.ok()) {
      send_error(res, api_error(503, "service_unavailable", st.error().message));
      return;
    }
    res.set_content(dump(json{{"status", "ok"},
                              {"prefix_cache", has_cache},
                              {"freed_blocks", r.n_freed},
                              {"kept_blocks", r.n_kept},
                              {"all_cleared", r.all_cleared}}),
                    "application/json");
  };
  h.Post("/flush_cache", clear_cache);
  h.Post("/reset_prefix_cache", clear_cache);

  h.Get("/v1/kv/stats", [this](const httplib::Request& req, httplib::Response& res) {
    Scheduler* s = scheduler_.load();
    const bool admin = !config_.admin_api_key.empty() &&
                       req.get_header_value("Authorization") == "Bearer " + config_.admin_api_key;
    // The caller's namespace: the one its requests with this salt use.
    const std::string salt = req.get_param_value("cache_salt");
    if (salt.size() > kMaxCacheSaltBytes) {
      send_error(res,
                 api_error(400, "invalid_request_error",
                           "'cache_salt' is over " + std::to_string(kMaxCacheSaltBytes) + " bytes",
                           "cache_salt"));
      return;
    }
    const std::string own_name = salt.empty() ? std::string() : "salt:" + cache_salt_key(salt);
    json out;
    const Status st = s->inspect([&](Engine& e) {
      const BlockPoolStats p = e.pool().stats();
      out["pool"] = {{"blocks_total", p.n_blocks_total},
                     {"blocks_free", p.n_blocks_free},
                     {"blocks_used", p.n_blocks_used},
                     {"blocks_cached", p.n_blocks_cached},
                     {"block_size", p.block_size},
                     {"block_bytes", p.block_bytes},
                     {"tables", p.n_tables},
                     {"tokens_committed", p.n_tokens_committed},
                     {"tokens_reserved", p.n_tokens_reserved},
                     {"payload_bytes", p.payload_bytes},
                     {"allocated_bytes", p.allocated_bytes},
                     {"pool_bytes", p.pool_bytes},
                     {"evictions", p.n_evictions},
                     {"cow_copies", p.n_cow_copies},
                     {"out_of_blocks", p.n_out_of_blocks}};
      // Retention compaction (kv/retention.h), all sequences, lifetime.
      out["pool"]["retention"] = {{"compactions", p.retention.n_compactions},
                                  {"tokens_dropped", p.retention.n_tokens_dropped},
                                  {"blocks_freed", p.retention.n_blocks_freed},
                                  {"bytes_moved", p.retention.n_bytes_moved},
                                  {"deferred", p.retention.n_deferred},
                                  {"topk_blocks_read", p.retention.n_topk_blocks_read},
                                  {"topk_blocks_total", p.retention.n_topk_blocks_total}};
      // Per KV group (kv_groups.h): a hybrid model's full and window groups.
      json groups = json::array();
      for (const BlockPoolGroupStats& g : p.groups) {
        groups.push_back({{"layers", g.n_layers},
                          {"window", g.window},
                          {"blocks_used", g.n_blocks_used},
                          {"blocks_cached", g.n_blocks_cached},
                          {"tokens_resident", g.n_tokens_resident},
                          {"payload_bytes", g.payload_bytes},
                          {"allocated_bytes", g.allocated_bytes}});
      }
      out["pool"]["groups"] = groups;
      // Holders: every used block has a holder; none may remain once idle.
      int64_t n_refs = 0;
      for (int32_t b = 0; b < p.n_blocks_total; ++b) n_refs += e.pool().ref_count(BlockId{b});
      out["pool"]["references"] = n_refs;
      // Storage tiers below the pool (kv_tiers.h): occupancy, hits, bytes
      // moved, fetch latencies; aggregate over namespaces, like the pool.
      out["tiers"] = json::parse(kv_tiers_stats_json(e.kv().tier_stats()));
      json pc = {{"enabled", e.kv().index() != nullptr}};
      if (e.kv().index() == nullptr) {
        out["prefix_cache"] = pc;
        return;
      }
      const KvPrefixStats ks = e.kv().prefix_stats();
      auto ns_json = [](const KvNamespaceStats& n) {
        return json{{"namespace", n.ns},
                    {"name", n.name},
                    {"queries", n.counts.n_queries},
                    {"query_tokens", n.counts.n_query_tokens},
                    {"hit_blocks", n.counts.n_hit_blocks},
                    {"hit_tokens", n.counts.n_hit_tokens},
                    {"hit_rate", n.counts.hit_rate()},
                    {"published_blocks", n.counts.n_published},
                    {"blocks", n.counts.n_nodes}};
      };
      // The caller's own namespace (zeros when it was never used).
      const std::string& want = own_name.empty() ? e.config().default_namespace : own_name;
      json own = {{"name", want},    {"queries", 0},    {"query_tokens", 0},     {"hit_blocks", 0},
                  {"hit_tokens", 0}, {"hit_rate", 0.0}, {"published_blocks", 0}, {"blocks", 0}};
      for (const KvNamespaceStats& n : ks.namespaces) {
        if (n.name == want) own = ns_json(n);
      }
      pc["block_size"] = ks.block_size;
      pc["namespace"] = own;
      if (admin) {
        const PrefixIndex* idx = e.kv().index();
        const PrefixIndexStats is = idx->stats();
        pc["nodes"] = is.n_nodes;
        pc["cached_blocks"] = is.n_cached_blocks;
        pc["pinned_blocks"] = e.kv().n_pinned_blocks();
        pc["evictions"] = is.n_evictions;
        pc["queries"] = is.total.n_queries;
        pc["query_tokens"] = is.total.n_query_tokens;
        pc["hit_blocks"] = is.total.n_hit_blocks;
        pc["hit_tokens"] = is.total.n_hit_tokens;
        pc["hit_rate"] = is.total.hit_rate();
        pc["partial_hits"] = is.n_partial_hits;
        pc["partial_tokens"] = is.n_partial_tokens;
        pc["published_blocks"] = is.total.n_published;
        pc["cow_copies"] = p.n_cow_copies;
        pc["collisions"] = is.n_collisions;
        pc["duplicates"] = is.n_duplicates;
        pc["events_dropped"] = is.n_events_dropped;
        // Namespaces holding blocks (bounded by the pool); live ones (used
        // by a request or holding blocks) and those expired so far.
        json ns = json::array();
        for (const KvNamespaceStats& n : ks.namespaces) {
          if (n.counts.n_nodes > 0) ns.push_back(ns_json(n));
        }
        pc["namespaces"] = ns;
        pc["namespaces_live"] = ks.n_namespaces;
        pc["namespaces_expired"] = ks.n_namespaces_expired;
      }
      out["prefix_cache"] = pc;
    });
    if (!st.ok()) {
      send_error(res, api_error_from(st.error()));
      return;
    }
    const SchedulerMetrics m = s->metrics();
    out["scheduler"] = {{"running", m.n_running},
                        {"waiting", m.n_waiting},
                        {"preemptions", m.n_preemptions},
                        {"recomputed_tokens", m.n_recomputed_tokens},
                        {"requests_finished", m.n_requests_finished},
                        {"requests_failed", m.n_requests_failed}};
    // Prefill/decode transfer (pd_agent.h): leases, pulls, bytes, times.
    if (pd_ != nullptr) out["transfer"] = pd_stats_json(pd_->stats());
    res.set_content(dump(out), "application/json");
  });

  // Bodies are read through a capped receiver: the limit holds for every
  // transfer encoding (Content-Length was checked by the guard already).
  auto post = [this, &h](const char* path, Endpoint endpoint, bool render_only = false) {
    h.Post(path, [this, endpoint, render_only](const httplib::Request&, httplib::Response& res,
                                               const httplib::ContentReader& reader) {
      std::string body;
      bool too_large = false;
      const bool ok = reader([&](const char* data, size_t n) {
        if (body.size() + n > config_.max_body_bytes) {
          too_large = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      if (too_large) {
        send_error(res, api_error(413, "invalid_request_error",
                                  "the request body is over the " +
                                      std::to_string(config_.max_body_bytes) + "-byte limit"));
        return;
      }
      if (!ok) {
        send_error(res, api_error(400, "invalid_request_error",
                                  "the request body could not be read (malformed chunked "
                                  "encoding, or not received in time)"));
        return;
      }
      if (render_only) {
        render(endpoint, body, res);
      } else {
        completion(endpoint, body, res);
      }
    });
    // A POST without a body (Content-Length: 0) takes the plain handler.
    h.Post(path, [this, endpoint](const httplib::Request& req, httplib::Response& res) {
      completion(endpoint, req.body, res);
    });
  };
  post("/v1/completions", Endpoint::kCompletions);
  post("/v1/chat/completions", Endpoint::kChat);
  post("/v1/completions/render", Endpoint::kCompletions, true);
  post("/v1/chat/completions/render", Endpoint::kChat, true);
}

ProtocolLimits HttpServer::protocol_limits(const Engine& engine) const {
  ProtocolLimits limits;
  limits.model_id = config_.model_id;
  limits.model_aliases = config_.model_aliases;
  limits.n_ctx = engine.model().config().n_ctx_train;
  if (const Status rs = retention_supported(engine.layout()); !rs.ok()) {
    limits.retention_unsupported = rs.error().message;
  }
  return limits;
}

// POST /v1/completions/render, /v1/chat/completions/render (vLLM's render
// endpoints, which vllm-router's cache_aware and kv_aware policies call to
// learn a request's prompt tokens): the request is parsed exactly as the
// completion endpoint parses it (same errors) and nothing runs. Chat: one
// object {"request_id", "token_ids", "model", ...}; completions: a list of
// them, one per prompt. token_ids are the tokens the engine would prefill
// (chat template applied, BOS as the model asks).
void HttpServer::render(Endpoint endpoint, const std::string& body, httplib::Response& res) {
  Scheduler* s = scheduler_.load();
  const Engine& engine = s->engine();
  auto parsed = parse_request(endpoint, body, engine.tokenizer(), chat_, protocol_limits(engine));
  if (auto* e = std::get_if<ApiError>(&parsed)) {
    send_error(res, *e);
    return;
  }
  const ParsedRequest& p = std::get<ParsedRequest>(parsed);
  const uint64_t id = next_id_.fetch_add(1);
  auto one = [&](const std::vector<int32_t>& tokens, size_t k) {
    return json{{"request_id", "render-" + std::to_string(id) + "-" + std::to_string(k)},
                {"token_ids", tokens},
                {"features", nullptr},
                {"sampling_params",
                 {{"max_tokens", p.seq.max_tokens < 0 ? json(nullptr) : json(p.seq.max_tokens)}}},
                {"model", p.model.empty() ? config_.model_id : p.model},
                {"stream", p.stream}};
  };
  if (endpoint == Endpoint::kChat) {
    res.set_content(dump(one(p.seq.prompt, 0)), "application/json");
    return;
  }
  json out = json::array({one(p.seq.prompt, 0)});
  for (size_t k = 0; k < p.more_prompts.size(); ++k) out.push_back(one(p.more_prompts[k], k + 1));
  res.set_content(dump(out), "application/json");
}

void HttpServer::completion(Endpoint endpoint, const std::string& body, httplib::Response& res) {
  // Counts this handler (and its stream, which outlives this function).
  auto count = std::make_shared<HandlerCount>(n_handlers_);
  Scheduler* s = scheduler_.load();
  Engine& engine = s->engine();
  const Tokenizer& tok = engine.tokenizer();
  const int64_t n_ctx = engine.model().config().n_ctx_train;
  auto parsed = parse_request(endpoint, body, tok, chat_, protocol_limits(engine));
  if (auto* e = std::get_if<ApiError>(&parsed)) {
    send_error(res, *e);
    return;
  }
  auto p = std::make_shared<ParsedRequest>(std::move(std::get<ParsedRequest>(parsed)));
  if (p->seq.max_tokens < 0) {
    // Chat without a limit: as much as the context and the pool allow.
    const auto n_prompt = static_cast<int64_t>(p->seq.prompt.size());
    // Tokens one sequence can reach in the pool, per KV group (window
    // groups capped: kv_groups.h), not a model-wide ceil(T / P).
    const int64_t pool_tokens = engine.pool().groups().max_tokens_in(engine.pool().n_blocks(),
                                                                     engine.config().prefill_chunk);
    const int64_t per_choice =
        (pool_tokens - n_prompt) / std::max(1, p->seq.n) - engine.pool().block_size();
    p->seq.max_tokens = std::max<int64_t>(1, std::min(n_ctx - n_prompt, per_choice));
  }
  if (p->model.empty()) p->model = config_.model_id;
  // Every prompt of the request (a list on /v1/completions): one scheduler
  // request each, seen as one through a RequestGroup.
  std::vector<std::vector<int32_t>> prompts = {p->seq.prompt};
  auto texts = std::make_shared<std::vector<std::string>>(1, p->prompt_text);
  for (size_t k = 0; k < p->more_prompts.size(); ++k) {
    prompts.push_back(p->more_prompts[k]);
    texts->push_back(p->more_prompt_texts[k]);
  }
  // echo + logprobs: the prompt tokens' own logprobs (the first has none).
  auto echo_lps = std::make_shared<std::vector<std::vector<SampledToken>>>(prompts.size());
  if (p->echo && p->logprobs && endpoint == Endpoint::kCompletions) {
    Status st = Status();
    const Status ran = s->inspect([&](Engine& e) {
      for (size_t k = 0; k < prompts.size() && st.ok(); ++k) {
        auto r = prompt_logprobs(e, prompts[k], std::max(0, p->seq.n_logprobs));
        if (r) {
          (*echo_lps)[k] = std::move(*r);
        } else {
          st = r.error();
        }
      }
    });
    if (!ran.ok()) st = ran;
    if (!st.ok()) {
      send_error(res, api_error_from(st.error()));
      return;
    }
  }
  // Prefill/decode disaggregation (pd_agent.h). Decode: the pulled prefix
  // is published before the request is submitted and held (`pin`) until
  // its first event, when the scheduler holds its own references.
  auto pin = std::make_shared<std::unique_ptr<PulledPrefix>>();
  bool offer_kv = false;
  if (pd_ != nullptr && p->kv_transfer_params.is_object()) {
    const json& kp = p->kv_transfer_params;
    auto is_true = [&](const char* k) {
      auto it = kp.find(k);
      return it != kp.end() && it->is_boolean() && it->get<bool>();
    };
    if (pd_->role() == PdRole::kDecode && is_true("do_remote_prefill")) {
      if (prompts.size() != 1) {
        send_error(res, api_error(400, "invalid_request_error",
                                  "do_remote_prefill needs exactly one prompt", "prompt"));
        return;
      }
      auto pulled = pd_->pull(*s, kp, p->seq.prompt, p->seq.cache_salt);
      if (!pulled) {
        const Error& e = pulled.error();
        if (e.code == Errc::kInvalidArgument) {
          send_error(res, api_error(400, "invalid_request_error", e.message, "kv_transfer_params"));
        } else if (e.code == Errc::kOutOfBlocks) {
          send_error(res, api_error_from(e));  // 503 kv_cache_full: retry later
        } else {
          send_error(res, api_error(502, "server_error", e.message, "", "kv_transfer_failed"));
        }
        return;
      }
      *pin = std::move(*pulled);
    } else if (pd_->role() == PdRole::kPrefill && is_true("do_remote_decode")) {
      if (p->stream) {
        send_error(res, api_error(400, "invalid_request_error",
                                  "do_remote_decode needs \"stream\": false", "stream"));
        return;
      }
      offer_kv = true;
    }
  }
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (const auto& prompt : prompts) {
    SeqRequest q = p->seq;
    q.prompt = prompt;
    auto h = s->submit(std::move(q));
    if (!h) {
      for (auto& done : handles) done->cancel();
      send_error(res, api_error_from(h.error()));
      return;
    }
    handles.push_back(*h);
  }
  auto group = std::make_shared<RequestGroup>(std::move(handles), p->seq.n);
  const int n_per_prompt = p->seq.n;
  const bool chat = endpoint == Endpoint::kChat;
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id_.fetch_add(1)) +
                         "-" + std::to_string(unix_now());
  const int64_t created = unix_now();
  const Tokenizer* tokp = &tok;

  if (!p->stream) {
    std::map<int, ChoiceOut> choices;
    RequestUsage usage;
    std::optional<Error> error;
    TokenClock clock;
    auto last_check = std::chrono::steady_clock::now();
    bool done = false;
    while (!done) {
      std::vector<SeqEvent> evs;
      group->wait(&evs, std::chrono::milliseconds(50));
      if (!evs.empty()) pin->reset();  // admitted: the request holds the prefix now
      // Every 50 ms, tokens arriving or not: is the client still there? If
      // not, nobody waits for the answer: free the request's blocks (the
      // scheduler drops it within one step, queued or running).
      const auto now = std::chrono::steady_clock::now();
      if (now - last_check >= std::chrono::milliseconds(50)) {
        last_check = now;
        if (!group->cancelled() && !current_connection_alive()) group->cancel();
      }
      for (SeqEvent& ev : evs) {
        ChoiceOut& c = choices[ev.index];
        clock.on_event(ev);
        if (ev.kind == SeqEvent::Kind::kToken) {
          c.text += ev.text;
          if (ev.logprob) c.logprobs.push_back(std::move(*ev.logprob));
        } else if (ev.kind == SeqEvent::Kind::kFinish) {
          c.text += ev.text;
          c.finish = ev.finish;
        } else {
          error = ev.error.error();
        }
        if (ev.request_done) {
          done = true;
          usage = ev.usage;
        }
      }
    }
    if (error) {
      send_error(res, api_error_from(*error));
      return;
    }
    if (auto t = clock.tpot()) observe_tpot(*t);
    json arr = json::array();
    for (auto& [i, c] : choices) {
      json lp = nullptr;
      const std::string& prompt_text = (*texts)[static_cast<size_t>(i / n_per_prompt)];
      if (p->logprobs) {
        lp = logprobs_json(endpoint, tok, c.logprobs,
                           p->echo ? static_cast<int64_t>(prompt_text.size()) : 0);
      }
      if (p->logprobs && p->echo) {
        lp = echo_logprobs_json(tok, (*echo_lps)[static_cast<size_t>(i / n_per_prompt)], lp);
      }
      json choice = {
          {"index", i},
          {"logprobs", lp},
          {"finish_reason", openai_finish_reason(c.finish.value_or(FinishReason::kLength))}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      } else {
        choice["text"] = p->echo ? prompt_text + c.text : c.text;
      }
      arr.push_back(choice);
    }
    json out = {{"id", id},           {"object", chat ? "chat.completion" : "text_completion"},
                {"created", created}, {"model", p->model},
                {"choices", arr},     {"usage", usage_json(usage)}};
    if (offer_kv) {
      // The prompt's blocks are published now: pin them for the decode worker.
      auto kp = pd_->offer(*s, p->seq.prompt, p->seq.cache_salt);
      out["kv_transfer_params"] =
          kp ? *kp : json{{"do_remote_prefill", false}, {"reason", kp.error().message}};
    }
    res.set_content(dump(out), "application/json");
    return;
  }

  // Server-sent events.
  const std::shared_ptr<RequestGroup>& h = group;
  auto state = std::make_shared<std::map<int, ChoiceOut>>();
  auto finished = std::make_shared<bool>(false);
  auto clock = std::make_shared<TokenClock>();
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, count, h, p, state, finished, id, created, chat, endpoint, tokp, echo_lps, texts,
       clock, n_per_prompt, pin](size_t, httplib::DataSink& sink) {
        auto send = [&](const json& j) {
          const std::string line = "data: " + dump(j) + "\n\n";
          return sink.write(line.data(), line.size());
        };
        auto chunk = [&](int index, const std::string& text, const std::vector<SampledToken>& lps,
                         std::optional<FinishReason> finish, bool first) {
          json lp = nullptr;
          if (p->logprobs && !lps.empty()) lp = logprobs_json(endpoint, *tokp, lps, 0);
          if (p->logprobs && p->echo && first && !chat) {
            lp = echo_logprobs_json(*tokp, (*echo_lps)[static_cast<size_t>(index / n_per_prompt)],
                                    lp);
          }
          json c = {
              {"index", index},
              {"logprobs", lp},
              {"finish_reason", finish ? json(openai_finish_reason(*finish)) : json(nullptr)}};
          if (chat) {
            json delta = json::object();
            if (first) delta["role"] = "assistant";
            if (!text.empty() || (first && !finish)) delta["content"] = text;
            c["delta"] = delta;
          } else {
            c["text"] = text;
          }
          json j = {{"id", id},
                    {"object", chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", created},
                    {"model", p->model},
                    {"choices", json::array({c})}};
          if (p->include_usage) j["usage"] = nullptr;
          return send(j);
        };
        if (*finished) return false;
        if (!sink.is_writable()) {
          h->cancel();
          return false;
        }
        std::vector<SeqEvent> evs;
        h->wait(&evs, std::chrono::milliseconds(100));
        if (!evs.empty()) pin->reset();
        for (SeqEvent& ev : evs) {
          ChoiceOut& c = (*state)[ev.index];
          clock->on_event(ev);
          if (ev.request_done && ev.kind != SeqEvent::Kind::kError) {
            if (auto t = clock->tpot()) observe_tpot(*t);
          }
          bool ok = true;
          const bool first = !c.role_sent;
          if (ev.kind == SeqEvent::Kind::kToken) {
            std::string text = ev.text;
            if (first && p->echo && !chat) {
              text.insert(0, (*texts)[static_cast<size_t>(ev.index / n_per_prompt)]);
            }
            std::vector<SampledToken> lps;
            if (ev.logprob) lps.push_back(*ev.logprob);
            if (!text.empty() || !lps.empty() || first) {
              ok = chunk(ev.index, text, lps, std::nullopt, first);
              c.role_sent = true;
            }
          } else if (ev.kind == SeqEvent::Kind::kFinish) {
            ok = chunk(ev.index, ev.text, {}, ev.finish, first);
            c.role_sent = true;
          } else {
            ok = send(api_error_from(ev.error.error()).to_json());
          }
          if (ok && ev.request_done) {
            if (p->include_usage && ev.kind != SeqEvent::Kind::kError) {
              ok = send(json{{"id", id},
                             {"object", chat ? "chat.completion.chunk" : "text_completion"},
                             {"created", created},
                             {"model", p->model},
                             {"choices", json::array()},
                             {"usage", usage_json(ev.usage)}});
            }
            static const char kDone[] = "data: [DONE]\n\n";
            ok = ok && sink.write(kDone, sizeof(kDone) - 1);
            *finished = true;
            if (ok) sink.done();
            return ok;
          }
          if (!ok) {
            h->cancel();  // the client went away: free its blocks
            return false;
          }
        }
        return true;
      },
      [h](bool) {
        if (!h->done()) h->cancel();
      });
}

}  // namespace kvstack::server

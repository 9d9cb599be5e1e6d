#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <map>

#include "kv/prefix_index.h"
#include "server/openai_protocol.h"

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

void append_histogram(std::string& out, const std::string& name, const std::string& help,
                      const Histogram& h, const std::string& labels) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  char buf[256];
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cum += h.counts[i];
    std::snprintf(buf, sizeof(buf), "%s_bucket{%s,le=\"%g\"} %" PRIu64 "\n", name.c_str(),
                  labels.c_str(), h.bounds[i], cum);
    out += buf;
  }
  cum += h.counts.back();
  std::snprintf(buf, sizeof(buf), "%s_bucket{%s,le=\"+Inf\"} %" PRIu64 "\n", name.c_str(),
                labels.c_str(), cum);
  out += buf;
  std::snprintf(buf, sizeof(buf), "%s_sum{%s} %.9g\n%s_count{%s} %" PRIu64 "\n", name.c_str(),
                labels.c_str(), h.sum, name.c_str(), labels.c_str(), h.count);
  out += buf;
}

void append_metric(std::string& out, const std::string& name, const char* type,
                   const std::string& help, double value, const std::string& labels) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + "{" +
         labels + "} " + buf + "\n";
}

}  // namespace

std::string prometheus_text(const SchedulerMetrics& m, const BlockPoolStats& pool,
                            const std::string& model_id) {
  const std::string labels = "model_name=\"" + model_id + "\"";
  std::string out;
  const double usage =
      pool.n_blocks_total > 0 ? static_cast<double>(pool.n_blocks_used) / pool.n_blocks_total : 0;
  append_metric(out, "kvstack:num_requests_running", "gauge",
                "Sequences (choices) in the running batch.", static_cast<double>(m.n_running),
                labels);
  append_metric(out, "kvstack:num_requests_waiting", "gauge",
                "Requests waiting for admission (new and preempted).",
                static_cast<double>(m.n_waiting), labels);
  append_metric(out, "kvstack:kv_cache_usage_perc", "gauge",
                "Fraction of KV blocks referenced by sequences (1 = full).", usage, labels);
  append_metric(out, "kvstack:prefix_cache_queries_total", "counter",
                "Prompt tokens looked up in the prefix cache.",
                static_cast<double>(m.n_prefix_queries), labels);
  append_metric(out, "kvstack:prefix_cache_hits_total", "counter",
                "Prompt tokens found in the prefix cache.", static_cast<double>(m.n_prefix_hits),
                labels);
  append_metric(out, "kvstack:num_preemptions_total", "counter",
                "Sequences preempted (blocks released, recomputed on resume).",
                static_cast<double>(m.n_preemptions), labels);
  append_metric(out, "kvstack:prompt_tokens_total", "counter",
                "Prompt tokens of finished requests.", static_cast<double>(m.n_prompt_tokens),
                labels);
  append_metric(out, "kvstack:generation_tokens_total", "counter", "Tokens sampled.",
                static_cast<double>(m.n_generation_tokens), labels);
  append_metric(out, "kvstack:recomputed_tokens_total", "counter",
                "Tokens prefilled again after a preemption.",
                static_cast<double>(m.n_recomputed_tokens), labels);
  append_metric(out, "kvstack:request_success_total", "counter", "Requests finished.",
                static_cast<double>(m.n_requests_finished), labels);
  append_metric(out, "kvstack:request_failure_total", "counter",
                "Requests ended by an error or a cancellation.",
                static_cast<double>(m.n_requests_failed), labels);
  append_metric(out, "kvstack:engine_steps_total", "counter", "Forward steps run.",
                static_cast<double>(m.n_steps), labels);
  append_histogram(out, "kvstack:time_to_first_token_seconds",
                   "Arrival to first sampled token (queueing and prefill included).", m.ttft,
                   labels);
  append_histogram(out, "kvstack:inter_token_latency_seconds",
                   "Time between consecutive tokens of a sequence.", m.itl, labels);
  append_histogram(out, "kvstack:e2e_request_latency_seconds",
                   "Arrival to the last token of the request.", m.e2e, labels);
  return out;
}

HttpServer::HttpServer(ServerConfig config)
    : config_(std::move(config)), http_(std::make_unique<httplib::Server>()) {
  const int n = std::max(4, config_.n_http_threads);
  http_->new_task_queue = [n] { return new httplib::ThreadPool(static_cast<size_t>(n)); };
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
  http_->stop();
}

void HttpServer::routes() {
  httplib::Server& h = *http_;

  // Authentication and readiness for the API routes.
  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    if (!config_.api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      if (auth != "Bearer " + config_.api_key) {
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
    (void)s->inspect([&](Engine& e) { pool = e.pool().stats(); });
    res.set_content(prometheus_text(s->metrics(), pool, config_.model_id),
                    "text/plain; version=0.0.4");
  });

  h.Get("/v1/kv/stats", [this](const httplib::Request&, httplib::Response& res) {
    Scheduler* s = scheduler_.load();
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
      json pc = {{"enabled", e.kv().index() != nullptr}};
      if (const PrefixIndex* idx = e.kv().index()) {
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
        json ns = json::array();
        for (const auto& [id, n] : is.per_namespace) {
          ns.push_back({{"namespace", id},
                        {"queries", n.n_queries},
                        {"query_tokens", n.n_query_tokens},
                        {"hit_blocks", n.n_hit_blocks},
                        {"hit_tokens", n.n_hit_tokens},
                        {"hit_rate", n.hit_rate()},
                        {"published_blocks", n.n_published},
                        {"blocks", n.n_nodes}});
        }
        pc["namespaces"] = ns;
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
    res.set_content(dump(out), "application/json");
  });

  auto completion = [this](Endpoint endpoint) {
    return [this, endpoint](const httplib::Request& req, httplib::Response& res) {
      Scheduler* s = scheduler_.load();
      Engine& engine = s->engine();
      const Tokenizer& tok = engine.tokenizer();
      const int64_t n_ctx = engine.model().config().n_ctx_train;
      ProtocolLimits limits;
      limits.model_id = config_.model_id;
      limits.n_ctx = n_ctx;
      auto parsed = parse_request(endpoint, req.body, tok, chat_, limits);
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
        const int64_t pool_tokens = engine.pool().groups().max_tokens_in(
            engine.pool().n_blocks(), engine.config().prefill_chunk);
        const int64_t per_choice =
            (pool_tokens - n_prompt) / std::max(1, p->seq.n) - engine.pool().block_size();
        p->seq.max_tokens = std::max<int64_t>(1, std::min(n_ctx - n_prompt, per_choice));
      }
      if (p->model.empty()) p->model = config_.model_id;
      const int64_t n_prompt_echo = static_cast<int64_t>(p->prompt_text.size());
      auto handle = s->submit(p->seq);
      if (!handle) {
        send_error(res, api_error_from(handle.error()));
        return;
      }
      const bool chat = endpoint == Endpoint::kChat;
      const std::string id = (chat ? "chatcmpl-" : "cmpl-") +
                             std::to_string(next_id_.fetch_add(1)) + "-" +
                             std::to_string(unix_now());
      const int64_t created = unix_now();
      const Tokenizer* tokp = &tok;

      if (!p->stream) {
        std::map<int, ChoiceOut> choices;
        RequestUsage usage;
        std::optional<Error> error;
        bool done = false;
        while (!done) {
          std::vector<SeqEvent> evs;
          (*handle)->wait(&evs, std::chrono::milliseconds(200));
          for (SeqEvent& ev : evs) {
            ChoiceOut& c = choices[ev.index];
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
        json arr = json::array();
        for (auto& [i, c] : choices) {
          json lp = nullptr;
          if (p->logprobs) lp = logprobs_json(endpoint, tok, c.logprobs, n_prompt_echo);
          json choice = {
              {"index", i},
              {"logprobs", lp},
              {"finish_reason", openai_finish_reason(c.finish.value_or(FinishReason::kLength))}};
          if (chat) {
            choice["message"] = {{"role", "assistant"}, {"content", c.text}};
          } else {
            choice["text"] = p->echo ? p->prompt_text + c.text : c.text;
          }
          arr.push_back(choice);
        }
        json out = {{"id", id},           {"object", chat ? "chat.completion" : "text_completion"},
                    {"created", created}, {"model", p->model},
                    {"choices", arr},     {"usage", usage_json(usage)}};
        res.set_content(dump(out), "application/json");
        return;
      }

      // Server-sent events.
      auto h = *handle;
      auto state = std::make_shared<std::map<int, ChoiceOut>>();
      auto finished = std::make_shared<bool>(false);
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [h, p, state, finished, id, created, chat, endpoint, tokp, n_prompt_echo](
              size_t, httplib::DataSink& sink) {
            auto send = [&](const json& j) {
              const std::string line = "data: " + dump(j) + "\n\n";
              return sink.write(line.data(), line.size());
            };
            auto chunk = [&](int index, const std::string& text,
                             const std::vector<SampledToken>& lps,
                             std::optional<FinishReason> finish, bool first) {
              json lp = nullptr;
              if (p->logprobs && !lps.empty()) lp = logprobs_json(endpoint, *tokp, lps, 0);
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
            for (SeqEvent& ev : evs) {
              ChoiceOut& c = (*state)[ev.index];
              bool ok = true;
              const bool first = !c.role_sent;
              if (ev.kind == SeqEvent::Kind::kToken) {
                std::string text = ev.text;
                if (first && p->echo && !chat) text.insert(0, p->prompt_text);
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
            (void)n_prompt_echo;
            return true;
          },
          [h](bool) {
            if (!h->done()) h->cancel();
          });
    };
  };
  h.Post("/v1/completions", completion(Endpoint::kCompletions));
  h.Post("/v1/chat/completions", completion(Endpoint::kChat));
}

}  // namespace kvstack::server

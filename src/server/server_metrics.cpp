// The Prometheus /metrics page of a server: the scheduler's counters, its
// pool's, the connection guard's and the TPOT histogram (see
// http_server.h). Split out of http_server.cpp, which serves the page.
#include <span>
#include <string>

#include "core/prometheus_text.h"
#include "server/http_server.h"

namespace kvstack::server {

std::string prometheus_text(const SchedulerMetrics& m, const BlockPoolStats& pool,
                            const std::string& model_id, const GuardStats* guard,
                            const Histogram* tpot) {
  PromText out("model_name=\"" + model_id + "\"");
  const double usage =
      pool.n_blocks_total > 0 ? static_cast<double>(pool.n_blocks_used) / pool.n_blocks_total : 0;
  auto gauge = [&](const char* name, const char* help, double v) {
    out.metric_f(name, "gauge", help, v);
  };
  auto counter = [&](const char* name, const char* help, int64_t v) {
    out.metric_f(name, "counter", help, static_cast<double>(v));
  };
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    out.family(name, "histogram", help);
    out.histogram(name, std::span<const double>(h.bounds), std::span<const uint64_t>(h.counts),
                  h.sum, h.count);
  };
  gauge("kvstack:num_requests_running", "Sequences (choices) in the running batch.",
        static_cast<double>(m.n_running));
  gauge("kvstack:num_requests_waiting", "Requests waiting for admission (new and preempted).",
        static_cast<double>(m.n_waiting));
  gauge("kvstack:kv_cache_usage_perc", "Fraction of KV blocks referenced by sequences (1 = full).",
        usage);
  // Per KV group (kv_groups.h): one sample per group, labelled with its
  // index and window (0 = full attention).
  auto group_metric = [&](const char* name, const char* help, auto field) {
    out.family(name, "gauge", help);
    for (size_t g = 0; g < pool.groups.size(); ++g) {
      out.sample(name, field(pool.groups[g]),
                 "group=\"" + std::to_string(g) + "\",window=\"" +
                     std::to_string(pool.groups[g].window) + "\"");
    }
  };
  group_metric("kvstack:kv_group_blocks_used", "KV blocks of this group held by sequences.",
               [](const BlockPoolGroupStats& g) { return g.n_blocks_used; });
  group_metric("kvstack:kv_group_blocks_cached",
               "KV blocks of this group kept cached (published, unreferenced).",
               [](const BlockPoolGroupStats& g) { return g.n_blocks_cached; });
  group_metric("kvstack:kv_group_tokens_resident",
               "Committed tokens whose KV this group's tables still hold.",
               [](const BlockPoolGroupStats& g) { return g.n_tokens_resident; });
  group_metric("kvstack:kv_group_payload_bytes",
               "Payload bytes of this group's resident tokens (per-layer formula).",
               [](const BlockPoolGroupStats& g) { return g.payload_bytes; });
  group_metric("kvstack:kv_group_allocated_bytes", "Bytes of this group's used and cached blocks.",
               [](const BlockPoolGroupStats& g) { return g.allocated_bytes; });
  counter("kvstack:kv_retention_tokens_dropped_total",
          "Resident tokens removed by retention compaction (--kv-retention).",
          pool.retention.n_tokens_dropped);
  counter("kvstack:kv_retention_blocks_freed_total",
          "KV blocks retention compaction released from sequences.", pool.retention.n_blocks_freed);
  counter("kvstack:kv_retention_bytes_moved_total",
          "KV bytes retention compaction copied (moved rows, copy-on-write blocks).",
          pool.retention.n_bytes_moved);
  counter("kvstack:kv_topk_blocks_read_total",
          "KV blocks decode queries read under topk (per layer).",
          pool.retention.n_topk_blocks_read);
  counter("kvstack:kv_topk_blocks_total",
          "KV blocks those queries would have read without topk (per layer).",
          pool.retention.n_topk_blocks_total);
  counter("kvstack:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          m.n_prefix_queries);
  counter("kvstack:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
          m.n_prefix_hits);
  counter("kvstack:num_preemptions_total",
          "Sequences preempted (blocks released, recomputed on resume).", m.n_preemptions);
  counter("kvstack:prompt_tokens_total", "Prompt tokens of finished requests.", m.n_prompt_tokens);
  counter("kvstack:generation_tokens_total", "Tokens sampled.", m.n_generation_tokens);
  counter("kvstack:recomputed_tokens_total", "Tokens prefilled again after a preemption.",
          m.n_recomputed_tokens);
  counter("kvstack:request_success_total", "Requests finished.", m.n_requests_finished);
  counter("kvstack:request_failure_total", "Requests ended by an error or a cancellation.",
          m.n_requests_failed);
  counter("kvstack:engine_steps_total", "Forward steps run.", m.n_steps);
  histogram("kvstack:time_to_first_token_seconds",
            "Arrival to first sampled token (queueing and prefill included).", m.ttft);
  histogram("kvstack:inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
            m.itl);
  histogram("kvstack:e2e_request_latency_seconds", "Arrival to the last token of the request.",
            m.e2e);
  if (tpot != nullptr) {
    histogram("kvstack:time_per_output_token_seconds",
              "Per request: (last token - first token) / (tokens per choice - 1).", *tpot);
  }
  if (guard != nullptr) {
    const char* name = "kvstack:http_connections_dropped_total";
    out.family(name, "counter", "Connections closed or refused before a handler ran, by reason.");
    const std::pair<const char*, int64_t> reasons[] = {{"head_timeout", guard->head_timeouts},
                                                       {"evicted", guard->evicted},
                                                       {"bad_framing", guard->bad_framing},
                                                       {"client_limit", guard->client_limit},
                                                       {"busy", guard->busy},
                                                       {"body_timeout", guard->body_timeouts}};
    for (const auto& [reason, n] : reasons) {
      out.sample(name, n, std::string("reason=\"") + reason + "\"");
    }
    counter("kvstack:http_requests_served_total", "Requests handed to the HTTP handlers.",
            guard->served);
  }
  return out.take();
}

}  // namespace kvstack::server

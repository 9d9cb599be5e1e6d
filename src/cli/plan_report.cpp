// `kvstack plan`'s output renderers (see plan_report.h).
#include "cli/plan_report.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/json_string.h"

namespace kvstack::cli::plan_report {

using capacity::KvFormat;
using capacity::LayerKind;
using capacity::ModelArch;
using capacity::PlanInput;
using capacity::PlanResult;

namespace {

void row(const char* label, const std::string& value) {
  std::printf("  %-34s %s\n", label, value.c_str());
}

std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace

void print_table(const PlanInput& in, const PlanResult& r, const Out& o, const Omitted& omit) {
  std::printf("model: %s\n", r.model_name.c_str());
  if (!in.arch.source.empty()) std::printf("source: %s\n", in.arch.source.c_str());
  std::printf("\nKV format: %s (%s)\n", r.kv_format_name.c_str(), in.kv_format.description.c_str());
  row("bytes per element (w/8 + s/g)", fmt_double(r.kv_bytes_per_element) + " B");
  for (const auto& g : r.layer_groups) {
    std::string label = std::to_string(g.n_layers) + " x " + capacity::layer_kind_name(g.kind);
    if (g.kind == LayerKind::kWindow) {
      // Appended piecewise: GCC 12 gives a false -Wrestrict on "(" + to_string(..).
      label += '(';
      label += std::to_string(g.window);
      label += ')';
    }
    label += g.shared ? " layers, shared KV" : " layers";
    row(label.c_str(), fmt_double(g.bytes_per_token) + " B/token/layer" +
                           (g.exact ? "" : " (amortised)") + ", workload " +
                           o.bytes(g.payload_bytes));
  }
  row("KV per token (all layers)", r.kv_bytes_per_token_exact
                                       ? o.bytes(r.kv_bytes_per_token_int)
                                       : fmt_double(r.kv_bytes_per_token) + " B (amortised)");

  std::printf("\nworkload: %" PRId64 " sequence(s), %" PRIu64 " tokens", r.n_sequences,
              r.total_tokens);
  if (in.workload.shared_prefix > 0) {
    std::printf(", shared prefix %" PRId64 " tokens", in.workload.shared_prefix);
  }
  std::printf("\n");
  row("KV payload", o.bytes(r.kv_payload_bytes));
  if (in.workload.shared_prefix > 0)
    row("KV payload, unshared", o.bytes(r.kv_payload_bytes_unshared));
  if (r.paging) {
    const auto& p = *r.paging;
    std::printf("\npaging: block size %" PRId64 " tokens\n", p.block_size);
    row(p.groups.empty() ? "block bytes (all layers)" : "block bytes (largest KV group)",
        o.bytes(p.block_bytes));
    row("blocks",
        std::to_string(p.block_count) + " blocks (" + std::to_string(p.slots) + " token slots)");
    for (size_t g = 0; g < p.groups.size(); ++g) {
      const auto& kg = p.groups[g];
      const std::string label =
          "  group " + std::to_string(g) + ": " + std::to_string(kg.n_layers) + " x " +
          (kg.window > 0 ? "window(" + std::to_string(kg.window) + ")" : std::string("full"));
      row(label.c_str(), std::to_string(kg.block_count) + " blocks, payload " +
                             std::to_string(kg.payload_bytes) + " B, resident " +
                             std::to_string(kg.resident_bytes) + " B, allocated " +
                             o.bytes(kg.allocated_bytes));
    }
    row("tail waste", std::to_string(p.tail_waste_tokens) + " tokens");
    row("KV allocated", o.bytes(p.kv_allocated_bytes));
    if (p.residual_buffer_bytes)
      row("  of which residual buffers", o.bytes(p.residual_buffer_bytes));
    row("block tables (4 B per id)", o.bytes(p.table_bytes));
    row("allocator total", o.bytes(p.allocator_total_bytes));
    if (in.workload.shared_prefix > 0) {
      row("blocks, unshared", std::to_string(p.block_count_unshared) + " blocks");
      row("KV allocated, unshared", o.bytes(p.kv_allocated_bytes_unshared));
    }
  }
  if (r.tp) {
    const auto& t = *r.tp;
    std::printf("\ntensor parallel: tp=%" PRId64 "\n", t.tp);
    row("KV heads per rank", std::to_string(t.kv_heads_per_rank) + " (replication " +
                                 std::to_string(t.replication) + "x)");
    row("KV payload per rank", o.bytes(t.kv_payload_bytes_per_rank));
    if (t.kv_allocated_bytes_per_rank)
      row("KV allocated per rank", o.bytes(t.kv_allocated_bytes_per_rank));
    row("KV over all ranks", o.bytes(t.kv_bytes_all_ranks));
    row("payload / tp (ignores replication)", o.bytes(t.naive_per_rank_bytes));
  }
  const auto& m = r.memory;
  // The workspace estimate reads the query heads; --act-bytes replaces it.
  const bool act_known = !omit.q_heads || !m.activation_estimated;
  std::printf("\nmemory per device\n");
  if (!omit.weights) {
    row("weights",
        o.bytes(m.weights_bytes) + (in.arch.weight_bytes ? " [" + in.arch.weight_format_name + "]"
                                                         : " [" + in.weight_format.name + "]"));
  }
  row("KV (allocator total or payload)", o.bytes(m.kv_bytes));
  if (act_known) {
    row(m.activation_estimated ? "activations/workspace (estimate)" : "activations/workspace",
        o.bytes(m.activation_bytes));
  }
  row("overhead", o.bytes(m.overhead_bytes));
  if (!omit.weights && act_known) row("total", o.bytes(m.total_bytes));
  if (in.hw.mem_budget) row("budget (--mem)", o.bytes(in.hw.mem_budget));
  if (r.max_batch_for_budget) {
    row("max batch for budget", std::to_string(*r.max_batch_for_budget) + " requests of " +
                                    std::to_string(r.ref_ctx) + " tokens");
  }
  if (r.max_ctx_for_budget) {
    row("max context for budget", std::to_string(*r.max_ctx_for_budget) + " tokens x " +
                                      std::to_string(r.ref_batch) + " sequence(s)");
  }
  if (r.crossover_tokens && !omit.weights) {
    row("crossover (KV = weights)", std::to_string(*r.crossover_tokens) + " tokens (1 sequence)");
  }
  if (!omit.q_heads || r.decode) std::printf("\ndecode\n");
  if (!omit.q_heads) {
    row("attention FLOPs per step", fmt_double(r.attention.flops_per_step) + " FLOP");
    row("attention intensity", fmt_double(r.attention.flop_per_byte) + " FLOP/B");
  }
  if (r.decode) {
    row("bytes read per step", o.bytes(r.decode->bytes_per_step));
    row("step lower bound", Out::secs(r.decode->step_lower_bound_s));
    row("throughput upper bound", fmt_double(r.decode->tokens_per_s_upper_bound) + " tokens/s");
  }
  if (r.fetch) {
    const auto& f = *r.fetch;
    std::printf("\nfetch versus recompute: prefix of %" PRId64 " tokens\n", f.prefix_tokens);
    row("fetch bytes", o.bytes(f.fetch_bytes));
    row("fetch time", Out::secs(f.fetch_time_s));
    if (f.recompute_time_s) row("recompute time", Out::secs(*f.recompute_time_s));
    if (f.break_even_tokens) {
      row("break-even prefix",
          "fetch is faster from " + std::to_string(*f.break_even_tokens) + " tokens");
    } else if (f.fetch_never_wins) {
      row("break-even prefix", "none: recomputing is cheaper at every length");
    } else {
      row("break-even prefix", "give --recompute-rate or --compute");
    }
  }
  if (r.transfer) {
    const auto& t = *r.transfer;
    std::printf("\ndisaggregated transfer of the workload's cache\n");
    row("bytes", o.bytes(t.bytes));
    row("transfer time", Out::secs(t.transfer_time_s));
    row("in flight (both sides)", o.bytes(t.in_flight_bytes));
    if (t.prefill_time_s) row("prefill compute", Out::secs(*t.prefill_time_s));
    if (t.pipelined_ready_time_s)
      row("ready, per-layer pipelined", Out::secs(*t.pipelined_ready_time_s));
    if (t.sequential_ready_time_s)
      row("ready, transfer after prefill", Out::secs(*t.sequential_ready_time_s));
  }
  if (!r.notes.empty()) {
    std::printf("\nnotes\n");
    for (const auto& n : r.notes) std::printf("  - %s\n", n.c_str());
  }
}

namespace {

class Json {
 public:
  void str(const char* k, const std::string& v) { add(k, json_quote(v)); }
  void u64(const char* k, uint64_t v) { add(k, std::to_string(v)); }
  void i64(const char* k, int64_t v) { add(k, std::to_string(v)); }
  void num(const char* k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.9g", v);
    add(k, std::isfinite(v) ? buf : "null");
  }
  void boolean(const char* k, bool v) { add(k, v ? "true" : "false"); }
  void raw(const char* k, const std::string& v) { add(k, v); }
  std::string done() const { return "{\n" + body_ + "\n}\n"; }

 private:
  void add(const char* k, const std::string& v) {
    if (!body_.empty()) body_ += ",\n";
    body_ += "  \"" + std::string(k) + "\": " + v;
  }
  std::string body_;
};

}  // namespace

std::string to_json(const PlanInput& in, const PlanResult& r, const Omitted& omit) {
  Json j;
  j.str("model", r.model_name);
  j.str("kv_dtype", r.kv_format_name);
  j.i64("n_layers", r.n_layers);
  j.i64("n_sequences", r.n_sequences);
  j.u64("total_tokens", r.total_tokens);
  j.num("kv_bytes_per_element", r.kv_bytes_per_element);
  if (r.kv_bytes_per_token_exact)
    j.u64("kv_bytes_per_token", r.kv_bytes_per_token_int);
  else
    j.num("kv_bytes_per_token", r.kv_bytes_per_token);
  j.boolean("kv_bytes_per_token_exact", r.kv_bytes_per_token_exact);
  std::string groups = "[";
  for (const auto& g : r.layer_groups) {
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"kind\": \"%s\", \"window\": %" PRId64 ", \"n_layers\": %" PRId64
                  ", \"bytes_per_token_per_layer\": %.9g, \"payload_bytes\": %" PRIu64
                  ", \"shared_kv\": %s}",
                  groups.size() > 1 ? ", " : "", capacity::layer_kind_name(g.kind), g.window,
                  g.n_layers, g.bytes_per_token, g.payload_bytes, g.shared ? "true" : "false");
    groups += buf;
  }
  j.raw("layer_groups", groups + "]");
  j.u64("kv_payload_bytes", r.kv_payload_bytes);
  j.u64("kv_payload_bytes_unshared", r.kv_payload_bytes_unshared);
  if (in.workload.shared_prefix > 0) j.i64("shared_prefix_tokens", in.workload.shared_prefix);
  if (r.paging) {
    const auto& p = *r.paging;
    j.i64("block_size", p.block_size);
    j.u64("block_bytes", p.block_bytes);
    j.u64("block_count", p.block_count);
    j.u64("slots", p.slots);
    j.u64("tail_waste_tokens", p.tail_waste_tokens);
    j.u64("kv_allocated_bytes", p.kv_allocated_bytes);
    j.u64("residual_buffer_bytes", p.residual_buffer_bytes);
    j.u64("table_bytes", p.table_bytes);
    j.u64("allocator_total_bytes", p.allocator_total_bytes);
    j.u64("block_count_unshared", p.block_count_unshared);
    j.u64("kv_allocated_bytes_unshared", p.kv_allocated_bytes_unshared);
    if (!p.groups.empty()) {
      std::string kg = "[";
      for (const auto& g : p.groups) {
        char buf[320];
        std::snprintf(buf, sizeof buf,
                      "%s{\"window\": %" PRId64 ", \"n_layers\": %" PRId64
                      ", \"block_count\": %" PRIu64 ", \"payload_bytes\": %" PRIu64
                      ", \"resident_bytes\": %" PRIu64 ", \"allocated_bytes\": %" PRIu64 "}",
                      kg.size() > 1 ? ", " : "", g.window, g.n_layers, g.block_count,
                      g.payload_bytes, g.resident_bytes, g.allocated_bytes);
        kg += buf;
      }
      j.raw("kv_groups", kg + "]");
    }
  }
  if (r.tp) {
    const auto& t = *r.tp;
    j.i64("tp", t.tp);
    j.i64("kv_heads_per_rank", t.kv_heads_per_rank);
    j.i64("kv_replication", t.replication);
    j.u64("kv_payload_bytes_per_rank", t.kv_payload_bytes_per_rank);
    if (r.paging) j.u64("kv_allocated_bytes_per_rank", t.kv_allocated_bytes_per_rank);
    j.u64("kv_bytes_all_ranks", t.kv_bytes_all_ranks);
    j.u64("kv_naive_per_rank_bytes", t.naive_per_rank_bytes);
  }
  const auto& m = r.memory;
  const bool act_known = !omit.q_heads || !m.activation_estimated;
  if (!omit.weights) {
    j.u64("weights_bytes", m.weights_bytes);
    j.u64("weights_bytes_total", m.weights_bytes_total);
    j.u64("active_weights_bytes", m.active_weights_bytes);
  }
  j.u64("kv_memory_bytes", m.kv_bytes);
  if (act_known) {
    j.u64("activation_bytes", m.activation_bytes);
    j.boolean("activation_estimated", m.activation_estimated);
  }
  j.u64("overhead_bytes", m.overhead_bytes);
  if (!omit.weights && act_known) j.u64("total_bytes", m.total_bytes);
  if (in.hw.mem_budget) j.u64("mem_budget_bytes", in.hw.mem_budget);
  if (r.max_batch_for_budget) j.i64("max_batch_for_budget", *r.max_batch_for_budget);
  if (r.max_ctx_for_budget) j.i64("max_ctx_for_budget", *r.max_ctx_for_budget);
  if (in.hw.mem_budget) {
    j.i64("budget_ref_ctx", r.ref_ctx);
    j.i64("budget_ref_batch", r.ref_batch);
  }
  if (r.crossover_tokens && !omit.weights) j.i64("crossover_tokens", *r.crossover_tokens);
  if (!omit.q_heads) {
    j.num("decode_attention_flops_per_step", r.attention.flops_per_step);
    j.num("decode_attention_flop_per_byte", r.attention.flop_per_byte);
  }
  if (r.decode) {
    j.u64("decode_bytes_per_step", r.decode->bytes_per_step);
    j.num("decode_step_lower_bound_s", r.decode->step_lower_bound_s);
    j.num("decode_tokens_per_s_upper_bound", r.decode->tokens_per_s_upper_bound);
  }
  if (r.fetch) {
    const auto& f = *r.fetch;
    j.i64("prefix_tokens", f.prefix_tokens);
    j.u64("fetch_bytes", f.fetch_bytes);
    j.num("fetch_time_s", f.fetch_time_s);
    if (f.recompute_time_s) j.num("recompute_time_s", *f.recompute_time_s);
    if (f.break_even_tokens) j.i64("break_even_tokens", *f.break_even_tokens);
    if (f.recompute_time_s) j.boolean("fetch_never_wins", f.fetch_never_wins);
  }
  if (r.transfer) {
    const auto& t = *r.transfer;
    j.u64("transfer_bytes", t.bytes);
    j.num("transfer_time_s", t.transfer_time_s);
    j.u64("transfer_in_flight_bytes", t.in_flight_bytes);
    if (t.prefill_time_s) j.num("prefill_time_s", *t.prefill_time_s);
    if (t.pipelined_ready_time_s) j.num("pipelined_ready_time_s", *t.pipelined_ready_time_s);
    if (t.sequential_ready_time_s) j.num("sequential_ready_time_s", *t.sequential_ready_time_s);
  }
  std::string notes = "[";
  for (size_t i = 0; i < r.notes.size(); ++i) {
    notes += (i ? ", " : "") + json_quote(r.notes[i]);
  }
  j.raw("notes", notes + "]");
  return j.done();
}

namespace {

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Memory (GiB, per device) versus context length for r.ref_batch sequences:
// weights, KV for each KV dtype, total for the chosen dtype, the budget.
}  // namespace

std::string render_svg(const PlanInput& in, const PlanResult& r) {
  constexpr double kW = 900, kH = 560, kL = 80, kR = 200, kT = 50, kB = 60;
  constexpr int kPoints = 64;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  int64_t x_max = std::max<int64_t>(r.ref_ctx * 2, in.arch.context_length);
  if (r.max_ctx_for_budget && *r.max_ctx_for_budget > 0) {
    x_max = std::max<int64_t>(x_max, *r.max_ctx_for_budget + *r.max_ctx_for_budget / 4);
  }
  // Round axis ends up to 1, 2, 2.5 or 5 x 10^k so the five ticks are round numbers.
  auto nice_ceil = [](double v) {
    const double p = std::pow(10.0, std::floor(std::log10(v)));
    for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
      if (m * p >= v) return m * p;
    }
    return 10 * p;
  };
  x_max = static_cast<int64_t>(nice_ceil(static_cast<double>(std::max<int64_t>(x_max, 16))));
  const int64_t batch = r.ref_batch;
  int64_t replication = 1;
  auto rank = capacity::arch_per_rank(in.arch, in.tp, &replication);
  const ModelArch& rank_arch = rank.ok() ? *rank : in.arch;

  struct Series {
    std::string label;
    std::string color;
    bool dashed;
    std::vector<double> y;  // bytes
  };
  std::vector<Series> series;
  std::vector<double> xs(kPoints + 1);
  for (int i = 0; i <= kPoints; ++i) {
    xs[i] = std::max(1.0, std::round(static_cast<double>(x_max) * i / kPoints));
  }
  series.push_back({"weights", "#000000", false,
                    std::vector<double>(kPoints + 1, static_cast<double>(r.memory.weights_bytes))});
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};
  std::vector<KvFormat> formats;
  for (const auto& f : capacity::kv_format_table()) {
    if (f.name != "bf16") formats.push_back(f);  // bf16 draws on top of f16
  }
  bool chosen_listed = false;
  for (const auto& f : formats) chosen_listed = chosen_listed || f.name == in.kv_format.name;
  if (!chosen_listed) formats.push_back(in.kv_format);
  size_t ci = 0;
  for (const auto& f : formats) {
    Series s{"KV " + f.name, colors[ci++ % 6], true, {}};
    for (double x : xs) {
      capacity::Workload w;
      w.seq_tokens.assign(1, static_cast<int64_t>(x));
      w.block_size = in.workload.block_size;
      s.y.push_back(static_cast<double>(capacity::kv_payload_bytes(rank_arch, f, w)) *
                    static_cast<double>(batch));
    }
    series.push_back(std::move(s));
  }
  Series total{"total (" + in.kv_format.name + ")", "#e377c2", false, {}};
  for (double x : xs) {
    total.y.push_back(static_cast<double>(capacity::total_bytes_for(
        in, std::vector<int64_t>(static_cast<size_t>(batch), static_cast<int64_t>(x)))));
  }
  series.push_back(std::move(total));

  double y_max = in.hw.mem_budget ? static_cast<double>(in.hw.mem_budget) * 1.1 : 0;
  for (const auto& s : series) y_max = std::max(y_max, *std::max_element(s.y.begin(), s.y.end()));
  y_max = std::max(y_max, 1.0);
  if (in.hw.mem_budget) y_max = std::min(y_max, static_cast<double>(in.hw.mem_budget) * 3);
  y_max = nice_ceil(y_max / gib) * gib;
  const double pw = kW - kL - kR, ph = kH - kT - kB;
  auto px = [&](double x) { return kL + pw * x / static_cast<double>(x_max); };
  auto py = [&](double y) { return kT + ph * (1 - std::min(y, y_max) / y_max); };

  std::string svg;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
                "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                kW, kH, kW, kH);
  svg += buf;
  std::string title = "KV memory per device vs context: " + r.model_name + ", batch " +
                      std::to_string(batch) + (in.tp > 1 ? ", tp " + std::to_string(in.tp) : "");
  std::snprintf(buf, sizeof(buf), "<text x=\"%.0f\" y=\"24\" font-size=\"14\">", kL);
  svg += buf + xml_escape(title) + "</text>\n";
  // Axes, ticks and grid.
  std::snprintf(buf, sizeof(buf),
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n"
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
                kL, kT + ph, kL + pw, kT + ph, kL, kT, kL, kT + ph);
  svg += buf;
  for (int i = 0; i <= 5; ++i) {
    const double xv = static_cast<double>(x_max) * i / 5;
    const double yv = y_max * i / 5;
    std::snprintf(buf, sizeof(buf),
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n"
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.3g</text>\n",
                  px(xv), kT, px(xv), kT + ph, px(xv), kT + ph + 16, xv, kL, py(yv), kL + pw,
                  py(yv), kL - 6, py(yv) + 4, yv / gib);
    svg += buf;
  }
  std::snprintf(buf, sizeof(buf),
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">context length (tokens per "
                "sequence)</text>\n"
                "<text x=\"18\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 18 "
                "%.1f)\">memory per device (GiB)</text>\n",
                kL + pw / 2, kH - 18, kT + ph / 2, kT + ph / 2);
  svg += buf;
  // Series and legend.
  int li = 0;
  auto legend = [&](const std::string& label, const std::string& color, bool dashed) {
    const double ly = kT + 10 + 18 * li++;
    std::snprintf(buf, sizeof(buf),
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                  "stroke-width=\"2\"%s/>\n<text x=\"%.1f\" y=\"%.1f\">",
                  kL + pw + 12, ly, kL + pw + 40, ly, color.c_str(),
                  dashed ? " stroke-dasharray=\"6 3\"" : "", kL + pw + 46, ly + 4);
    svg += buf + xml_escape(label) + "</text>\n";
  };
  for (const auto& s : series) {
    std::string pts;
    for (int i = 0; i <= kPoints; ++i) {
      std::snprintf(buf, sizeof(buf), "%s%.1f,%.1f", i ? " " : "", px(xs[i]), py(s.y[i]));
      pts += buf;
    }
    std::snprintf(buf, sizeof(buf),
                  "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"",
                  s.color.c_str(), s.dashed ? " stroke-dasharray=\"6 3\"" : "");
    svg += buf + pts + "\"/>\n";
    legend(s.label, s.color, s.dashed);
  }
  if (in.hw.mem_budget) {
    const double by = py(static_cast<double>(in.hw.mem_budget));
    std::snprintf(buf, sizeof(buf),
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#d00\" "
                  "stroke-width=\"2\" stroke-dasharray=\"2 2\"/>\n",
                  kL, by, kL + pw, by);
    svg += buf;
    legend("budget " + format_bytes(static_cast<double>(in.hw.mem_budget)), "#d00", true);
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace kvstack::cli::plan_report

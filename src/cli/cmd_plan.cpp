// `kvstack plan`: capacity and cost planning with the spec's formulas
// (kv/capacity.h). The model comes from a preset, explicit dimensions or a
// GGUF file's metadata; output is a unit-labelled table, --json or an --svg
// chart of memory versus context length.
#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/plan_report.h"
#include "core/json_string.h"
#include "core/units.h"
#include "kv/capacity.h"
#include "kv/presets.h"
#include "model/gguf.h"

namespace kvstack::cli {
namespace {

using capacity::LayerKind;
using capacity::LayerSpec;
using capacity::ModelArch;
using capacity::PlanInput;
using capacity::PlanResult;

using plan_report::Omitted;
using plan_report::Out;
using plan_report::print_table;
using plan_report::render_svg;
using plan_report::to_json;

constexpr const char* kCmd = "plan";

// ---------------------------------------------------------------------------
// Parsing helpers (units)
// ---------------------------------------------------------------------------

// Splits "2.5ms" into 2.5 and "ms"; the number must be finite and >= 0.
Result<double> split_value(const std::string& flag, const std::string& text, std::string* suffix) {
  const char* s = text.c_str();
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || !std::isfinite(v)) {
    return make_error(Errc::kInvalidArgument, "--" + flag + ": '" + text + "' is not a number");
  }
  if (v < 0) {
    return make_error(Errc::kInvalidArgument,
                      "--" + flag + ": '" + text + "' must not be negative");
  }
  *suffix = std::string(end);
  while (!suffix->empty() && std::isspace(static_cast<unsigned char>(suffix->front()))) {
    suffix->erase(suffix->begin());
  }
  return v;
}

double si_prefix(char c) {
  switch (c) {
    case 'k':
    case 'K':
      return 1e3;
    case 'M':
      return 1e6;
    case 'G':
      return 1e9;
    case 'T':
      return 1e12;
    case 'P':
      return 1e15;
    default:
      return 0;
  }
}

// "5us", "2ms", "0.1s", "100ns"; a bare number is seconds.
Result<double> parse_seconds(const std::string& flag, const std::string& text) {
  std::string suffix;
  auto v = split_value(flag, text, &suffix);
  if (!v) return v.error();
  if (suffix.empty() || suffix == "s") return *v;
  if (suffix == "ms") return *v * 1e-3;
  if (suffix == "us") return *v * 1e-6;
  if (suffix == "ns") return *v * 1e-9;
  return make_error(Errc::kInvalidArgument,
                    "--" + flag + ": '" + text + "' has unknown unit (use s, ms, us, ns)");
}

// A number with an optional SI prefix and one of `units` (or none), e.g.
// "5ktok/s" or "989TFLOP/s"; `expected` describes the unit in the error.
Result<double> parse_scaled(const std::string& flag, const std::string& text,
                            std::initializer_list<const char*> units, const char* expected) {
  std::string suffix;
  auto v = split_value(flag, text, &suffix);
  if (!v) return v.error();
  double scale = 1;
  if (!suffix.empty() && si_prefix(suffix[0]) > 0) {
    scale = si_prefix(suffix[0]);
    suffix.erase(suffix.begin());
  }
  if (suffix.empty()) return *v * scale;
  for (const char* u : units) {
    if (suffix == u) return *v * scale;
  }
  return make_error(Errc::kInvalidArgument, "--" + flag + ": '" + text + "' must be " + expected);
}

// "5000", "5k", "5000tok/s", "12ktokens/s": tokens per second.
Result<double> parse_token_rate(const std::string& flag, const std::string& text) {
  return parse_scaled(flag, text, {"tok/s", "tokens/s", "/s"},
                      "tokens per second (e.g. 5000tok/s)");
}

// "989TFLOP/s", "1.5e15", "312 TFLOPS": FLOP per second.
Result<double> parse_flops(const std::string& flag, const std::string& text) {
  return parse_scaled(flag, text, {"FLOP/s", "FLOPS", "flop/s", "flops"},
                      "FLOP/s (e.g. 989TFLOP/s)");
}

// "7000000000", "7e9", "7B", "135M", "1.5T": a parameter count.
Result<int64_t> parse_count(const std::string& flag, const std::string& text) {
  std::string suffix;
  auto v = split_value(flag, text, &suffix);
  if (!v) return v.error();
  double scale = 1;
  if (suffix == "K" || suffix == "k")
    scale = 1e3;
  else if (suffix == "M")
    scale = 1e6;
  else if (suffix == "B" || suffix == "G")
    scale = 1e9;
  else if (suffix == "T")
    scale = 1e12;
  else if (!suffix.empty()) {
    return make_error(Errc::kInvalidArgument,
                      "--" + flag + ": '" + text + "' has unknown suffix (use K, M, B, T)");
  }
  const double n = *v * scale;
  if (n > 1e16)
    return make_error(Errc::kInvalidArgument, "--" + flag + ": '" + text + "' is too large");
  return static_cast<int64_t>(std::llround(n));
}

Result<double> get_rate(const Args& a, const std::string& flag) {
  auto v = a.get(flag);
  if (!v) return 0.0;
  auto r = parse_rate(*v);
  if (!r) return make_error(Errc::kInvalidArgument, "--" + flag + ": " + r.error().message);
  if (*r <= 0) return make_error(Errc::kInvalidArgument, "--" + flag + " must be > 0");
  return *r;
}

Result<std::vector<int64_t>> parse_lengths(const std::string& text) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string item =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') {
      return make_error(Errc::kInvalidArgument, "--lengths: '" + item + "' is not an integer");
    }
    if (v <= 0) {
      return make_error(Errc::kInvalidArgument,
                        "--lengths: " + item + " must be > 0 (tokens per request)");
    }
    out.push_back(v);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Model sources
// ---------------------------------------------------------------------------

// A per-layer integer that GGUF stores either as a scalar or an array.
Result<std::vector<int64_t>> per_layer(const GgufFile& f, const std::string& key, size_t n_layers,
                                       std::optional<int64_t> fallback) {
  const GgufValue* v = f.find(key);
  if (v == nullptr) {
    if (fallback) return std::vector<int64_t>(n_layers, *fallback);
    return make_error(Errc::kNotFound, f.path() + ": metadata key '" + key + "' is missing");
  }
  if (v->type == GgufType::kArray) {
    auto arr = f.get_int_array(key);
    if (!arr) return arr.error();
    if (arr->size() != n_layers) {
      return make_error(Errc::kCorruptFile, f.path() + ": '" + key + "' has " +
                                                std::to_string(arr->size()) + " entries for " +
                                                std::to_string(n_layers) + " layers");
    }
    return *arr;
  }
  auto x = f.get_i64(key);
  if (!x) return x.error();
  return std::vector<int64_t>(n_layers, *x);
}

Result<ModelArch> arch_from_gguf(const std::string& path, std::vector<std::string>* notes) {
  auto file = GgufFile::open(path);
  if (!file) return file.error();
  const GgufFile& f = *file;
  auto arch_name = f.get_string("general.architecture");
  if (!arch_name) return arch_name.error();
  const std::string a = *arch_name + ".";
  auto n_layers = f.get_u64(a + "block_count");
  if (!n_layers) return n_layers.error();
  if (*n_layers == 0 || *n_layers > 100000) {
    return make_error(Errc::kCorruptFile,
                      path + ": block_count " + std::to_string(*n_layers) + " is out of range");
  }
  const size_t n = static_cast<size_t>(*n_layers);
  auto hidden = f.get_u64(a + "embedding_length");
  if (!hidden) return hidden.error();
  auto heads = per_layer(f, a + "attention.head_count", n, std::nullopt);
  if (!heads) return heads.error();
  auto kv_heads = per_layer(f, a + "attention.head_count_kv", n, std::nullopt);
  if (!kv_heads) kv_heads = *heads;  // absent: multi-head attention
  const int64_t h0 = (*heads)[0] > 0 ? (*heads)[0] : 1;
  auto key_len = f.get_i64(a + "attention.key_length");
  auto value_len = f.get_i64(a + "attention.value_length");
  const int64_t d_k = key_len ? *key_len : static_cast<int64_t>(*hidden) / h0;
  const int64_t d_v = value_len ? *value_len : d_k;
  const auto* window = f.find(a + "attention.sliding_window");
  auto kv_lora = f.get_i64(a + "attention.kv_lora_rank");

  ModelArch m;
  m.name = path;
  if (auto g = f.get_string("general.name")) m.name = *g + " (" + path + ")";
  m.hidden = static_cast<int64_t>(*hidden);
  m.layers.resize(n);
  int64_t w = 0;
  if (window != nullptr) {
    auto wv = f.get_i64(a + "attention.sliding_window");
    if (wv) w = *wv;
  }
  int64_t pattern = 0;  // every pattern-th layer is global; 1 = all windowed
  if (w > 0) {
    if (auto p = f.get_i64(a + "attention.sliding_window_pattern")) {
      pattern = *p;
    } else if (*arch_name == "gemma3") {
      pattern = 6;  // Gemma 3: five local layers, then one global
    } else if (*arch_name == "gemma2") {
      pattern = 2;  // Gemma 2: local and global alternate
    } else {
      pattern = 1;
    }
    notes->push_back("GGUF sliding_window " + std::to_string(w) +
                     (pattern == 1 ? " applied to every layer"
                                   : " on local layers (every " + std::to_string(pattern) +
                                         "th layer is global)"));
  }
  for (size_t i = 0; i < n; ++i) {
    LayerSpec& l = m.layers[i];
    l.n_q_heads = (*heads)[i];
    l.n_kv_heads = (*kv_heads)[i];
    l.head_dim_k = d_k;
    l.head_dim_v = d_v;
    if (kv_lora) {
      l.kind = LayerKind::kMla;
      l.mla_latent = *kv_lora;
      auto rope = f.get_i64(a + "rope.dimension_count");
      l.mla_rope_dim = rope ? *rope : 0;
    } else if (w > 0 && (pattern == 1 || (pattern > 1 && (i + 1) % pattern != 0))) {
      // Gemma 2 alternates starting with a local layer: (i + 1) % 2 != 0 for even i.
      l.kind = LayerKind::kWindow;
      l.window = w;
    }
  }
  // Cross-layer KV sharing (model/config.h): the last N layers read the last
  // storing layer of their kind and window and store nothing.
  if (auto shared = f.get_i64(a + "attention.shared_kv_layers"); shared && *shared > 0) {
    const auto first = static_cast<int64_t>(n) - *shared;
    for (int64_t i = std::max<int64_t>(first, 0); i < static_cast<int64_t>(n); ++i) {
      LayerSpec& l = m.layers[static_cast<size_t>(i)];
      for (int64_t s = first - 1; s >= 0; --s) {
        const LayerSpec& src = m.layers[static_cast<size_t>(s)];
        if (src.kind == l.kind && src.window == l.window) {
          l.kv_source = s;
          break;
        }
      }
    }
    notes->push_back("GGUF attention.shared_kv_layers " + std::to_string(*shared) +
                     ": the last layers read an earlier layer's KV and store none");
  }
  if (auto ffn = per_layer(f, a + "feed_forward_length", n, int64_t{0})) {
    m.ffn = *std::max_element(ffn->begin(), ffn->end());
  }
  auto experts = f.get_i64(a + "expert_count");
  auto experts_used = f.get_i64(a + "expert_used_count");
  if (auto eff = f.get_i64(a + "expert_feed_forward_length"); eff && experts_used) {
    m.ffn = *eff * *experts_used;
  }
  if (auto ctx = f.get_i64(a + "context_length")) m.context_length = *ctx;
  if (const auto* emb = f.find_tensor("token_embd.weight"); emb && emb->dims.size() >= 2) {
    m.vocab = emb->dims[1];
  } else if (auto toks = f.get_string_array("tokenizer.ggml.tokens")) {
    m.vocab = static_cast<int64_t>(toks->size());
  }
  uint64_t bytes = 0, params = 0, expert_bytes = 0, expert_params = 0;
  for (const auto& t : f.tensors()) {
    bytes += t.n_bytes;
    params += static_cast<uint64_t>(t.n_elements());
    if (t.name.find("_exps") != std::string::npos) {
      expert_bytes += t.n_bytes;
      expert_params += static_cast<uint64_t>(t.n_elements());
    }
  }
  m.n_params = params;
  m.weight_bytes = bytes;
  m.weight_format_name = "GGUF tensors";
  if (expert_bytes > 0 && experts && experts_used && *experts > 0) {
    const double frac = static_cast<double>(*experts_used) / static_cast<double>(*experts);
    m.active_weight_bytes =
        bytes - expert_bytes + static_cast<uint64_t>(std::llround(expert_bytes * frac));
    m.n_active_params =
        params - expert_params + static_cast<uint64_t>(std::llround(expert_params * frac));
  }
  m.source = path + " (GGUF metadata, " + *arch_name + ")";
  return m;
}

Result<ModelArch> arch_from_flags(const Args& args, Omitted* omitted) {
  auto layers = args.get_int("layers", 0, 1, 1000000);
  if (!layers) return layers.error();
  if (!args.has("q-heads") && !args.has("kv-heads")) {
    return make_error(Errc::kInvalidArgument, "give --kv-heads (or --q-heads for MHA)");
  }
  // Without --q-heads the query heads are taken equal to the KV heads; the
  // figures that depend on them are omitted, never shown from this guess.
  omitted->q_heads = !args.has("q-heads");
  auto kv0 = args.get_int("kv-heads", 0, 1, 1000000);
  if (!kv0) return kv0.error();
  auto q = args.get_int("q-heads", *kv0, 1, 1000000);
  if (!q) return q.error();
  auto kv = args.get_int("kv-heads", *q, 1, 1000000);
  if (!kv) return kv.error();
  auto hidden = args.get_int("hidden", 0, 1, int64_t{1} << 40);
  if (!hidden) return hidden.error();
  int64_t head_dim = 0;
  if (args.has("head-dim")) {
    auto hd = args.get_int("head-dim", 0, 1, 1000000);
    if (!hd) return hd.error();
    head_dim = *hd;
  } else {
    if (*hidden == 0 || omitted->q_heads) {
      return make_error(Errc::kInvalidArgument, "give --head-dim (or --hidden and --q-heads)");
    }
    if (*hidden % *q != 0) {
      return make_error(Errc::kInvalidArgument, "--hidden " + std::to_string(*hidden) +
                                                    " is not divisible by --q-heads " +
                                                    std::to_string(*q) + "; give --head-dim");
    }
    head_dim = *hidden / *q;
  }
  auto params = parse_count("params", args.get_or("params", "0"));
  if (!params) return params.error();
  if (args.has("params") && *params == 0) {
    return make_error(Errc::kInvalidArgument, "--params must be > 0");
  }
  omitted->weights = !args.has("params") && !args.has("weights");
  ModelArch m = capacity::make_uniform_arch("explicit", *layers, *q, *kv, head_dim, *hidden,
                                            static_cast<uint64_t>(*params));
  if (omitted->weights) {
    m.weight_bytes = 0;  // unknown: every figure that reads it is omitted
    m.weight_format_name = "not given";
  }
  if (args.has("weights")) {
    auto wb = args.get_bytes("weights", 0);
    if (!wb) return wb.error();
    if (*wb == 0) return make_error(Errc::kInvalidArgument, "--weights must be > 0");
    m.weight_bytes = *wb;
    m.weight_format_name = "given";
  }
  auto ffn = args.get_int("ffn", 0, 0, int64_t{1} << 40);
  if (!ffn) return ffn.error();
  auto vocab = args.get_int("vocab", 0, 0, int64_t{1} << 40);
  if (!vocab) return vocab.error();
  auto context = args.get_int("context", 0, 0, int64_t{1} << 40);
  if (!context) return context.error();
  m.ffn = *ffn;
  m.vocab = *vocab;
  m.context_length = *context;
  if (args.has("mla-latent")) {
    auto dc = args.get_int("mla-latent", 0, 1, 1000000);
    if (!dc) return dc.error();
    auto dr = args.get_int("mla-rope-dim", 0, 0, 1000000);
    if (!dr) return dr.error();
    for (auto& l : m.layers) {
      l.kind = LayerKind::kMla;
      l.mla_latent = *dc;
      l.mla_rope_dim = *dr;
    }
  } else if (args.has("mla-rope-dim")) {
    return make_error(Errc::kInvalidArgument, "--mla-rope-dim needs --mla-latent");
  }
  if (args.has("window")) {
    auto w = args.get_int("window", 0, 1, int64_t{1} << 40);
    if (!w) return w.error();
    auto pattern = args.get_int("window-pattern", 1, 1, 1000000);
    if (!pattern) return pattern.error();
    for (size_t i = 0; i < m.layers.size(); ++i) {
      if (m.layers[i].kind == LayerKind::kMla) {
        return make_error(Errc::kInvalidArgument, "--window cannot be combined with --mla-latent");
      }
      if (*pattern == 1 || (i + 1) % static_cast<size_t>(*pattern) != 0) {
        m.layers[i].kind = LayerKind::kWindow;
        m.layers[i].window = *w;
      }
    }
  }
  KV_TRY_STATUS(capacity::validate_arch(m));
  return m;
}

// ---------------------------------------------------------------------------
// --verify
// ---------------------------------------------------------------------------

int run_verify(const PlanInput& in, const PlanResult& predicted, const std::string& model_path,
               const Args& args) {
  if (!in.workload.block_size) return fail(kCmd, "--verify needs --block-size");
  if (args.has("kv-quant-group") || args.has("kv-quant-meta-bytes")) {
    return fail(kCmd,
                "--verify: the engine's formats have fixed groups; drop --kv-quant-group / "
                "--kv-quant-meta-bytes");
  }
  capacity::VerifyRequest req;
  req.model_path = model_path;
  req.seq_tokens = in.workload.seq_tokens;
  req.block_size = in.workload.block_size;
  req.kv_dtype = args.get_or("kv-dtype", "f16");
  req.kv_dtype_k = args.get_or("kv-dtype-k", "");
  req.kv_dtype_v = args.get_or("kv-dtype-v", "");
  req.kv_residual = in.kv_format.residual_tokens;
#if defined(KVSTACK_HAVE_PLAN_VERIFY)
  auto measured = capacity::run_plan_verify(req);
  if (!measured) return fail(kCmd, "--verify: " + measured.error().message);
  const capacity::VerifyComparison c = capacity::compare_verify(predicted, *measured);
  std::printf("\nverify against the engine (%s)\n", model_path.c_str());
  std::printf("  %-20s %20s %20s  %s\n", "figure", "predicted", "measured", "");
  for (const auto& row : c.rows) {
    std::printf("  %-20s %20.0f %20.0f  %s\n", row.name.c_str(), row.predicted, row.measured,
                row.must_match ? (row.matches ? "match" : "MISMATCH") : "(informative)");
  }
  if (!c.ok) {
    std::fprintf(stderr, "kvstack plan: error: --verify: predicted and measured bytes differ\n");
    return 1;
  }
  return 0;
#else
  (void)predicted;
  return fail(kCmd,
              "--verify is not available in this build yet: it needs the engine's "
              "run_plan_verify() (src/engine), which is not implemented; the predictions above "
              "are unverified");
#endif
}

// ---------------------------------------------------------------------------

std::vector<OptionSpec> plan_specs() {
  return {
      model_option(),
      {"preset", 0, "NAME", "architecture preset instead of a GGUF (see --list-presets)"},
      {"list-presets", 0, "", "print the presets and exit"},
      {"layers", 0, "N", "explicit model: transformer layers"},
      {"q-heads", 0, "N",
       "explicit model: query heads (optional: KV figures need only --kv-heads)"},
      {"kv-heads", 0, "N", "explicit model: key/value heads (default: q-heads, i.e. MHA)"},
      {"head-dim", 0, "D", "explicit model: head dimension (default: hidden / q-heads)"},
      {"hidden", 0, "N", "explicit model: embedding width"},
      {"params", 0, "N",
       "explicit model: parameters, e.g. 7e9 or 7B (weights = params x --weight-dtype; "
       "optional: without it or --weights, figures that need the weights are omitted)"},
      {"weights", 0, "SIZE", "explicit model: weight bytes instead of --params (e.g. 13GiB)"},
      {"ffn", 0, "N", "explicit model: FFN width per token (workspace estimate; default 0)"},
      {"vocab", 0, "N", "explicit model: vocabulary size (workspace estimate; default 0)"},
      {"context", 0, "N", "explicit model: trained context length in tokens"},
      {"window", 0, "W", "explicit model: sliding window of W tokens"},
      {"window-pattern", 0, "N", "with --window: every N-th layer is global (default 1: all)"},
      {"mla-latent", 0, "D_C", "explicit model: MLA latent width d_c (caches d_c + d_R)"},
      {"mla-rope-dim", 0, "D_R", "explicit model: MLA decoupled RoPE key width d_R"},
      {"batch", 'b', "B", "concurrent requests (default 1)"},
      {"ctx", 'c', "T", "tokens per request (default: the model's context, else 4096)"},
      {"lengths", 0, "T1,T2,...", "per-request token counts instead of --batch/--ctx"},
      {"shared-prefix", 0, "S", "tokens of prefix shared by every request (default 0)"},
      {"block-size", 0, "P", "KV block size in tokens: paging figures (default: none)"},
      {"kv-dtype", 0, "DTYPE", "f32, f16, bf16, fp8, int8, int4, kivi2, kivi4 (default f16)"},
      {"kv-dtype-k", 0, "DTYPE", "K's format when it differs from --kv-dtype"},
      {"kv-dtype-v", 0, "DTYPE", "V's format when it differs from --kv-dtype"},
      {"kv-quant-group", 0, "G", "group size g of a quantized KV format (elements or tokens)"},
      {"kv-quant-meta-bytes", 0, "S", "metadata bytes s per group (scale, zero/min)"},
      {"kv-residual", 0, "R", "newest tokens kept in f16 per sequence and layer"},
      {"tp", 0, "N", "tensor-parallel degree (default 1)"},
      {"weight-dtype", 0, "DTYPE",
       "weights for presets/explicit: f32, f16, bf16, fp8, int8, int4, q8_0, q4_0, q4_1, "
       "q4_k, ... (default bf16)"},
      {"mem", 0, "SIZE", "memory budget per device (e.g. 24GiB, 80GB)"},
      {"act-bytes", 0, "SIZE", "activation/workspace bytes (default: estimate)"},
      {"overhead", 0, "SIZE", "runtime overhead per device (default 0 B)"},
      {"prefill-chunk", 0, "N", "tokens per prefill forward for the workspace estimate (512)"},
      {"mem-bw", 0, "RATE", "memory bandwidth (e.g. 3.35TB/s, 50GiB/s): decode lower bound"},
      {"link-bw", 0, "RATE", "fetch/transfer link bandwidth (e.g. 25GiB/s, 200Gbit/s)"},
      {"link-latency", 0, "TIME", "link latency incl. queueing/mapping (e.g. 20us; default 0)"},
      {"recompute-rate", 0, "RATE", "prefill rate in tokens/s (measured or given, e.g. 8000)"},
      {"compute", 0, "FLOPS", "peak FLOP/s for a FLOP-based recompute estimate (989TFLOP/s)"},
      {"prefix-tokens", 0, "L", "prefix for fetch vs recompute (default: shared prefix or ctx)"},
      {"json", 0, "", "print one JSON object instead of the table"},
      {"svg", 0, "FILE", "write a chart of memory versus context length (SVG)"},
      {"gb", 0, "", "also print decimal GB next to each byte figure"},
      {"verify", 0, "", "run the engine on this workload and compare (needs -m and --block-size)"},
      help_option(),
  };
}

int run_plan(const std::vector<std::string>& argv) {
  const auto specs = plan_specs();
  auto args_r = Args::parse(argv, specs);
  if (!args_r) return fail(kCmd, args_r.error().message);
  const Args& args = *args_r;
  if (args.flag("help")) {
    std::fputs(format_help("kvstack plan [-m MODEL | --preset NAME | --layers N --q-heads N ...] "
                           "[--batch B --ctx T | --lengths ...] [options]",
                           "Capacity and cost planning for the KV cache with the spec's "
                           "formulas (section 3): bytes per token, payload, paging, prefix "
                           "sharing, tensor parallelism, memory budget, decode bound, fetch "
                           "versus recompute and disaggregated transfer. Every byte figure is "
                           "an exact integer with its 2^k unit.",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  if (args.flag("list-presets")) {
    for (const auto& p : capacity::list_presets()) {
      std::printf("%-18s %s\n", p.id.c_str(), p.summary.c_str());
    }
    return 0;
  }

  // Model.
  std::vector<std::string> notes;
  const bool explicit_dims =
      args.has("layers") || args.has("q-heads") || args.has("kv-heads") || args.has("head-dim");
  Omitted omit;
  if (args.has("preset") + args.has("model") + explicit_dims > 1) {
    return fail(kCmd, "give one model source: -m FILE, --preset NAME or explicit dimensions");
  }
  Result<ModelArch> arch = make_error(Errc::kInternal, "no model");
  std::string model_path;
  if (args.has("preset")) {
    arch = capacity::find_preset(*args.get("preset"));
  } else if (explicit_dims) {
    if (!args.has("layers")) return fail(kCmd, "--layers is required with explicit dimensions");
    arch = arch_from_flags(args, &omit);
  } else {
    model_path = resolve_model_path(args);
    arch = arch_from_gguf(model_path, &notes);
  }
  if (!arch) return fail(kCmd, arch.error().message);

  PlanInput in;
  in.arch = std::move(*arch);

  // KV format.
  auto kvf = capacity::find_kv_format(args.get_or("kv-dtype", "f16"));
  if (!kvf) return fail(kCmd, "--kv-dtype: " + kvf.error().message);
  if (args.has("kv-dtype-k") || args.has("kv-dtype-v")) {
    auto kf = capacity::find_kv_format(args.get_or("kv-dtype-k", kvf->name));
    if (!kf) return fail(kCmd, "--kv-dtype-k: " + kf.error().message);
    auto vf = capacity::find_kv_format(args.get_or("kv-dtype-v", kvf->name));
    if (!vf) return fail(kCmd, "--kv-dtype-v: " + vf.error().message);
    *kvf = capacity::combine_kv_formats(*kf, *vf);
  }
  std::optional<int64_t> group, meta, residual;
  for (auto [flag, slot] :
       {std::pair{"kv-quant-group", &group}, std::pair{"kv-quant-meta-bytes", &meta},
        std::pair{"kv-residual", &residual}}) {
    if (!args.has(flag)) continue;
    auto v = args.get_int(flag, 0, std::string(flag) == "kv-quant-group" ? 1 : 0, int64_t{1} << 30);
    if (!v) return fail(kCmd, v.error().message);
    *slot = *v;
  }
  auto custom = capacity::customize_kv_format(*kvf, group, meta, residual);
  if (!custom) return fail(kCmd, custom.error().message);
  in.kv_format = *custom;

  // Workload.
  const int64_t default_ctx = in.arch.context_length > 0 ? in.arch.context_length : 4096;
  if (args.has("lengths")) {
    if (args.has("batch") || args.has("ctx")) {
      return fail(kCmd, "--lengths replaces --batch/--ctx; give one or the other");
    }
    auto l = parse_lengths(*args.get("lengths"));
    if (!l) return fail(kCmd, l.error().message);
    in.workload.seq_tokens = *l;
  } else {
    auto batch = args.get_int("batch", 1, 1, int64_t{1} << 24);
    if (!batch) return fail(kCmd, batch.error().message);
    auto ctx = args.get_int("ctx", default_ctx, 1, int64_t{1} << 40);
    if (!ctx) return fail(kCmd, ctx.error().message);
    in.workload.seq_tokens.assign(static_cast<size_t>(*batch), *ctx);
  }
  auto shared = args.get_int("shared-prefix", 0, 0, int64_t{1} << 40);
  if (!shared) return fail(kCmd, shared.error().message);
  in.workload.shared_prefix = *shared;
  auto block = args.get_int("block-size", 0, 1, int64_t{1} << 20);
  if (!block) return fail(kCmd, block.error().message);
  in.workload.block_size = *block;
  auto tp = args.get_int("tp", 1, 1, 1 << 16);
  if (!tp) return fail(kCmd, tp.error().message);
  in.tp = *tp;

  // Memory.
  auto wf = capacity::find_weight_format(args.get_or("weight-dtype", "bf16"));
  if (!wf) return fail(kCmd, "--weight-dtype: " + wf.error().message);
  in.weight_format = *wf;
  if (args.has("weight-dtype") && in.arch.weight_bytes && in.arch.weight_format_name != "given") {
    in.arch.weight_bytes.reset();  // re-quantize the GGUF's parameter count hypothetically
    in.arch.active_weight_bytes.reset();
    notes.push_back("weights from the GGUF parameter count in --weight-dtype " + wf->name);
  }
  auto mem = args.get_bytes("mem", 0);
  if (!mem) return fail(kCmd, mem.error().message);
  if (args.has("mem") && *mem == 0) return fail(kCmd, "--mem must be > 0");
  in.hw.mem_budget = *mem;
  if (args.has("act-bytes")) {
    auto act = args.get_bytes("act-bytes", 0);
    if (!act) return fail(kCmd, act.error().message);
    in.activation_bytes = *act;
  }
  auto overhead = args.get_bytes("overhead", 0);
  if (!overhead) return fail(kCmd, overhead.error().message);
  in.overhead_bytes = *overhead;
  auto chunk = args.get_int("prefill-chunk", 512, 1, int64_t{1} << 30);
  if (!chunk) return fail(kCmd, chunk.error().message);
  in.prefill_chunk = *chunk;

  // Hardware and costs.
  auto mem_bw = get_rate(args, "mem-bw");
  if (!mem_bw) return fail(kCmd, mem_bw.error().message);
  in.hw.mem_bw = *mem_bw;
  auto link_bw = get_rate(args, "link-bw");
  if (!link_bw) return fail(kCmd, link_bw.error().message);
  in.hw.link_bw = *link_bw;
  if (auto v = args.get("link-latency")) {
    auto s = parse_seconds("link-latency", *v);
    if (!s) return fail(kCmd, s.error().message);
    in.hw.link_latency_s = *s;
  }
  if (auto v = args.get("recompute-rate")) {
    auto s = parse_token_rate("recompute-rate", *v);
    if (!s) return fail(kCmd, s.error().message);
    if (*s <= 0) return fail(kCmd, "--recompute-rate must be > 0");
    in.hw.recompute_tokens_per_s = *s;
  }
  if (auto v = args.get("compute")) {
    auto s = parse_flops("compute", *v);
    if (!s) return fail(kCmd, s.error().message);
    if (*s <= 0) return fail(kCmd, "--compute must be > 0");
    in.hw.compute_flops = *s;
  }
  if (args.has("prefix-tokens")) {
    auto l = args.get_int("prefix-tokens", 0, 1, int64_t{1} << 40);
    if (!l) return fail(kCmd, l.error().message);
    in.prefix_tokens = *l;
  }
  if ((in.hw.recompute_tokens_per_s > 0 || in.hw.compute_flops > 0) && in.hw.link_bw <= 0) {
    notes.push_back("--recompute-rate/--compute are used with --link-bw (fetch and transfer)");
  }

  // Figures that would rest on what explicit dimensions left out.
  const bool act_given = in.activation_bytes.has_value();
  if (omit.weights || (omit.q_heads && !act_given)) {
    const std::string missing = omit.weights ? "--params or --weights" : "--q-heads or --act-bytes";
    for (const char* flag : {"mem", "mem-bw", "svg"}) {
      if (args.has(flag)) {
        return fail(kCmd,
                    std::string("--") + flag + " needs the model's total memory: give " + missing);
      }
    }
  }
  if (omit.weights && args.has("compute")) {
    return fail(kCmd, "--compute (FLOP-based recompute) needs the parameter count: give --params");
  }
  if (omit.q_heads && args.has("compute")) {
    return fail(kCmd, "--compute (FLOP-based recompute) needs the query heads: give --q-heads");
  }
  if (omit.weights) {
    notes.push_back(
        "weights not given (--params or --weights): weights, total and the figures "
        "built on them are omitted");
  }
  if (omit.q_heads) {
    notes.push_back(std::string("query heads not given (--q-heads): ") +
                    (act_given ? "" : "the workspace estimate, total and ") +
                    "the attention FLOPs are omitted; KV figures need only --kv-heads");
  }

  auto result = capacity::plan(in);
  if (!result) return fail(kCmd, result.error().message);
  PlanResult& r = *result;
  r.notes.insert(r.notes.begin(), notes.begin(), notes.end());

  if (auto svg_path = args.get("svg")) {
    const std::string svg = render_svg(in, r);
    FILE* f = std::fopen(svg_path->c_str(), "wb");
    if (f == nullptr) return fail(kCmd, "--svg: cannot write '" + *svg_path + "'");
    const bool ok = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
    if (std::fclose(f) != 0 || !ok) return fail(kCmd, "--svg: error writing '" + *svg_path + "'");
  }
  Out out;
  out.gb = args.flag("gb");
  if (args.flag("json")) {
    std::fputs(to_json(in, r, omit).c_str(), stdout);
  } else {
    print_table(in, r, out, omit);
  }
  if (args.flag("verify")) {
    if (model_path.empty()) {
      return fail(kCmd, "--verify needs a GGUF model (-m FILE), not a preset or explicit dims");
    }
    std::fflush(stdout);
    return run_verify(in, r, model_path, args);
  }
  return 0;
}

}  // namespace

KVSTACK_COMMAND(kPlanCommand, "plan",
                "capacity and cost planner: KV bytes, paging, memory budget, decode bound, "
                "fetch vs recompute, transfer",
                run_plan);

}  // namespace kvstack::cli

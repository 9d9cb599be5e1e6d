#include "server/openai_protocol.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "kv/retention.h"
#include "tokenizer/stream_decoder.h"

namespace kvstack::server {

using nlohmann::json;

ApiError api_error(int status, std::string type, std::string message, std::string param,
                   std::string code) {
  ApiError e;
  e.status = status;
  e.type = std::move(type);
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

namespace {

ApiError bad(std::string param, std::string message) {
  return api_error(400, "invalid_request_error", std::move(message), std::move(param));
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

// Field readers: absent or null leaves *out unchanged; a wrong type or an
// out-of-range value is an ApiError naming the field.
std::optional<ApiError> read_number(const json& body, const char* name, double lo, double hi,
                                    double* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    return bad(name, std::string("'") + name + "' must be a number, not " + type_name(*it));
  }
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < lo || v > hi) {
    return bad(name, std::string("'") + name + "' is " + it->dump() + ", outside [" +
                         json(lo).dump() + ", " + json(hi).dump() + "]");
  }
  *out = v;
  return std::nullopt;
}

std::optional<ApiError> read_int(const json& body, const char* name, int64_t lo, int64_t hi,
                                 int64_t* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  bool integral = it->is_number_integer();
  if (it->is_number_float()) {
    const double d = it->get<double>();
    integral = std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15;
  }
  if (!integral) {
    return bad(name, std::string("'") + name + "' must be an integer, not " + type_name(*it) +
                         (it->is_number() ? " with a fraction" : ""));
  }
  const double d = it->get<double>();
  if (d < static_cast<double>(lo) || d > static_cast<double>(hi)) {
    return bad(name, std::string("'") + name + "' is " + it->dump() + ", outside [" +
                         std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  *out = it->is_number_unsigned()  ? static_cast<int64_t>(it->get<uint64_t>())
         : it->is_number_integer() ? it->get<int64_t>()
                                   : static_cast<int64_t>(d);
  return std::nullopt;
}

std::optional<ApiError> read_bool(const json& body, const char* name, bool* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) {
    return bad(name, std::string("'") + name + "' must be a boolean, not " + type_name(*it));
  }
  *out = it->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> read_string(const json& body, const char* name, std::string* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) {
    return bad(name, std::string("'") + name + "' must be a string, not " + type_name(*it));
  }
  *out = it->get<std::string>();
  return std::nullopt;
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts.
std::optional<ApiError> read_content(const json& m, size_t i, std::string* out) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) {
    *out = it->get<std::string>();
    return std::nullopt;
  }
  if (!it->is_array()) {
    return bad(param,
               "'" + param + "' must be a string or an array of text parts, not " + type_name(*it));
  }
  for (const json& part : *it) {
    if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      return bad(param, "'" + param +
                            "' parts must be objects {\"type\": \"text\", \"text\": string} "
                            "(only text content is supported)");
    }
    *out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

const std::set<std::string>& known_fields(Endpoint e) {
  static const std::set<std::string> common = {"model",
                                               "max_tokens",
                                               "temperature",
                                               "top_p",
                                               "top_k",
                                               "min_p",
                                               "frequency_penalty",
                                               "presence_penalty",
                                               "repetition_penalty",
                                               "seed",
                                               "stop",
                                               "n",
                                               "stream",
                                               "stream_options",
                                               "logprobs",
                                               "cache_salt",
                                               "kv_retention",
                                               "user",
                                               "ignore_eos",
                                               "logit_bias",
                                               "best_of",
                                               "suffix",
                                               "echo",
                                               "prompt",
                                               "messages",
                                               "max_completion_tokens",
                                               "top_logprobs",
                                               "tools",
                                               "tool_choice",
                                               "response_format",
                                               "metadata",
                                               "store",
                                               "parallel_tool_calls",
                                               "service_tier"};
  static const std::set<std::string> completions = [] {
    std::set<std::string> s = common;
    for (const char* f :
         {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
          "response_format", "parallel_tool_calls", "store", "metadata"}) {
      s.erase(f);
    }
    return s;
  }();
  static const std::set<std::string> chat = [] {
    std::set<std::string> s = common;
    for (const char* f : {"prompt", "echo", "suffix", "best_of"}) s.erase(f);
    return s;
  }();
  return e == Endpoint::kChat ? chat : completions;
}

// Fields that routers add to every request they forward (vllm-router and the
// SGLang router it derives from rewrite the body with their own defaults),
// with the one value this server honours. A field at another value is
// refused naming it: nothing is silently ignored. `any_bool` fields only
// steer a reasoning parser, which this server does not have (reasoning text
// stays in the content), so every boolean is already what they ask for.
struct ExtensionField {
  const char* name;
  bool chat_only;
  bool any_bool;
  bool value;  // the value honoured when !any_bool
};
constexpr ExtensionField kRouterExtensions[] = {
    {"no_stop_trim", false, false, false},         {"skip_special_tokens", false, false, true},
    {"return_hidden_states", false, false, false}, {"continue_final_message", true, false, false},
    {"separate_reasoning", false, true, false},    {"stream_reasoning", false, true, false},
    {"include_reasoning", false, true, false},
};

// nullopt when `key` is not a router extension field; else the error for a
// value this server cannot honour (or no error: an empty ApiError message).
std::optional<ApiError> router_extension(Endpoint e, const std::string& key, const json& value) {
  for (const ExtensionField& f : kRouterExtensions) {
    if (key != f.name || (f.chat_only && e != Endpoint::kChat)) continue;
    if (value.is_null()) return ApiError{};
    if (!value.is_boolean()) {
      return bad(key, "'" + key + "' must be a boolean, not " + type_name(value));
    }
    if (!f.any_bool && value.get<bool>() != f.value) {
      return bad(key, "'" + key + "' is only supported as " + (f.value ? "true" : "false"));
    }
    return ApiError{};
  }
  return std::nullopt;
}

// vLLM fields beside the router extensions: min_tokens (vllm-router's
// prefill request sends 1 with max_tokens 1) and kv_transfer_params (kept
// for the PD agent).
bool is_pd_field(const std::string& key) {
  return key == "min_tokens" || key == "kv_transfer_params";
}

std::optional<ApiError> parse_router_fields(const json& body, ParsedRequest* out) {
  if (auto it = body.find("min_tokens"); it != body.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return bad("min_tokens", "'min_tokens' must be a non-negative integer");
    }
    // min_tokens 1 with max_tokens 1 (vllm-router's prefill request) holds
    // whatever is sampled; larger values would need EOS masking.
    const auto mt = body.find("max_tokens");
    const bool one = mt != body.end() && mt->is_number_integer() && mt->get<int64_t>() == 1;
    if (it->get<int64_t>() > 1 || (it->get<int64_t>() == 1 && !one)) {
      return bad("min_tokens",
                 "'min_tokens' above 0 is not supported (except 1 with max_tokens 1)");
    }
  }
  if (auto it = body.find("kv_transfer_params"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) {
      return bad("kv_transfer_params", "'kv_transfer_params' must be an object");
    }
    out->kv_transfer_params = *it;
  }
  return std::nullopt;
}

}  // namespace

json ApiError::to_json() const {
  json err = {{"message", message}, {"type", type}};
  err["param"] = param.empty() ? json(nullptr) : json(param);
  err["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", err}};
}

std::string cache_salt_key(std::string_view salt) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(salt.data(), salt.size(), md, &n, EVP_sha256(), nullptr);
  static const char kHex[] = "0123456789abcdef";
  std::string out = "sha256:";
  for (unsigned int i = 0; i < n; ++i) {
    out += kHex[md[i] >> 4];
    out += kHex[md[i] & 15];
  }
  return out;
}

const char* openai_finish_reason(FinishReason r) {
  return r == FinishReason::kLength ? "length" : "stop";
}

ApiError api_error_from(const Error& e) {
  switch (e.code) {
    case Errc::kInvalidArgument: {
      // Scheduler messages start with the field name: "max_tokens: ...".
      const auto colon = e.message.find(':');
      std::string param;
      // colon < 24 also rules out npos (no colon).
      if (colon < 24 && e.message.find(' ') > colon) {
        param = e.message.substr(0, colon);
      }
      ApiError a = bad(param, e.message);
      if (e.message.find("context length") != std::string::npos) {
        a.code = "context_length_exceeded";
      }
      return a;
    }
    case Errc::kBusy:  // queue full: the client should retry later
      return api_error(429, "rate_limit_error", e.message, "", "queue_full");
    case Errc::kOutOfBlocks:  // the pool could not hold an admitted request
      return api_error(503, "service_unavailable", e.message, "", "kv_cache_full");
    case Errc::kCancelled:  // shutting down (a cancelled client sees nothing)
      return api_error(503, "service_unavailable", e.message);
    default:
      return api_error(500, "server_error", e.message);
  }
}

json usage_json(const RequestUsage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json logprobs_json(Endpoint endpoint, const Tokenizer& tok, const std::vector<SampledToken>& tokens,
                   int64_t text_offset) {
  auto piece = [&](int32_t id) {
    std::string p = tok.token_to_piece(id);
    std::string out;
    append_valid_utf8(p, true, out);
    return out;
  };
  if (endpoint == Endpoint::kChat) {
    json content = json::array();
    for (const SampledToken& t : tokens) {
      const std::string raw = tok.token_to_piece(t.token);
      json bytes = json::array();
      for (unsigned char c : raw) bytes.push_back(c);
      json top = json::array();
      for (const TokenLogprob& a : t.top) {
        const std::string araw = tok.token_to_piece(a.token);
        json abytes = json::array();
        for (unsigned char c : araw) abytes.push_back(c);
        top.push_back({{"token", piece(a.token)}, {"logprob", a.logprob}, {"bytes", abytes}});
      }
      content.push_back({{"token", piece(t.token)},
                         {"logprob", t.logprob},
                         {"bytes", bytes},
                         {"top_logprobs", top}});
    }
    return json{{"content", content}};
  }
  json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
  int64_t off = text_offset;
  for (const SampledToken& t : tokens) {
    const std::string p = piece(t.token);
    toks.push_back(p);
    lps.push_back(t.logprob);
    json top = json::object();
    for (const TokenLogprob& a : t.top) top[piece(a.token)] = a.logprob;
    tops.push_back(top);
    offs.push_back(off);
    off += static_cast<int64_t>(p.size());
  }
  return json{
      {"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

std::variant<ParsedRequest, ApiError> parse_request(Endpoint endpoint, const std::string& body_text,
                                                    const Tokenizer& tokenizer,
                                                    const ChatTemplate* chat,
                                                    const ProtocolLimits& limits) {
  // nlohmann's lexer ends the input at a NUL byte; JSON never holds a raw
  // one (not even in strings), so a NUL means bytes after or inside the value.
  if (const size_t nul = body_text.find('\0'); nul != std::string::npos) {
    return bad("",
               "the request body is not valid JSON: a NUL byte at offset " + std::to_string(nul));
  }
  json body;
  try {
    body = json::parse(body_text);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    const bool utf8 =
        what.find("UTF-8") != std::string::npos || what.find("surrogate") != std::string::npos;
    return bad("", utf8 ? "the request body is not valid UTF-8 JSON: " + what
                        : "the request body is not valid JSON: " + what);
  } catch (const json::exception& e) {
    // e.g. out_of_range 406: a number outside double's range (1e400).
    return bad("", std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!body.is_object()) {
    return bad("", std::string("the request body must be a JSON object, not ") + type_name(body));
  }
  for (const auto& [key, value] : body.items()) {
    if (known_fields(endpoint).count(key) != 0 || is_pd_field(key)) continue;
    if (auto ext = router_extension(endpoint, key, value)) {
      if (!ext->message.empty()) return *ext;
      continue;
    }
    return bad(key, "unrecognized request argument supplied: " + key);
  }
  ParsedRequest out;
  out.endpoint = endpoint;
  if (auto e = parse_router_fields(body, &out)) return *e;
  SeqRequest& q = out.seq;
  SamplingParams& s = q.sampling;
  // OpenAI defaults: temperature 1, top_p 1, no penalties.
  s.temperature = 1.0f;
  s.penalty_last_n = -1;

  if (auto e = read_string(body, "model", &out.model)) return *e;
  const bool known_model = out.model.empty() || out.model == limits.model_id ||
                           std::find(limits.model_aliases.begin(), limits.model_aliases.end(),
                                     out.model) != limits.model_aliases.end();
  if (!known_model) {
    return api_error(404, "invalid_request_error",
                     "the model '" + out.model + "' does not exist; this server serves '" +
                         limits.model_id + "'",
                     "model", "model_not_found");
  }
  double d = 0;
  int64_t i = 0;
  d = s.temperature;
  if (auto e = read_number(body, "temperature", 0, 2, &d)) return *e;
  s.temperature = static_cast<float>(d);
  d = s.top_p;
  if (auto e = read_number(body, "top_p", 0, 1, &d)) return *e;
  if (d <= 0) return bad("top_p", "'top_p' must be greater than 0");
  s.top_p = static_cast<float>(d);
  i = 0;
  if (auto e = read_int(body, "top_k", -1, 1 << 24, &i)) return *e;
  s.top_k = i < 0 ? 0 : static_cast<int>(i);
  d = 0;
  if (auto e = read_number(body, "min_p", 0, 1, &d)) return *e;
  s.min_p = static_cast<float>(d);
  d = 0;
  if (auto e = read_number(body, "frequency_penalty", -2, 2, &d)) return *e;
  s.frequency_penalty = static_cast<float>(d);
  d = 0;
  if (auto e = read_number(body, "presence_penalty", -2, 2, &d)) return *e;
  s.presence_penalty = static_cast<float>(d);
  d = 1;
  if (auto e = read_number(body, "repetition_penalty", 1e-3, 100, &d)) return *e;
  s.repetition_penalty = static_cast<float>(d);
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (auto e = read_int(body, "seed", INT64_MIN, INT64_MAX, &i)) return *e;
    s.seed = static_cast<uint64_t>(i);
    s.has_seed = true;
  }
  i = 1;
  if (auto e = read_int(body, "n", 1, 128, &i)) return *e;
  q.n = static_cast<int>(i);
  if (auto e = read_bool(body, "stream", &out.stream)) return *e;
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) {
      return bad("stream_options",
                 std::string("'stream_options' must be an object, not ") + type_name(*it));
    }
    if (!out.stream) return bad("stream_options", "'stream_options' is only allowed with stream");
    if (auto e = read_bool(*it, "include_usage", &out.include_usage)) {
      e->param = "stream_options.include_usage";
      return *e;
    }
  }
  if (auto e = read_bool(body, "ignore_eos", &q.ignore_eos)) return *e;
  if (auto e = read_string(body, "cache_salt", &q.cache_salt)) return *e;
  if (q.cache_salt.size() > kMaxCacheSaltBytes) {
    return bad("cache_salt", "'cache_salt' is " + std::to_string(q.cache_salt.size()) +
                                 " bytes, over the limit of " + std::to_string(kMaxCacheSaltBytes));
  }
  if (!q.cache_salt.empty()) q.cache_salt = cache_salt_key(q.cache_salt);
  if (auto it = body.find("kv_retention"); it != body.end() && !it->is_null()) {
    // {"policy": "streamingllm", "sinks": 4, "window": 1024[, "slack": 16]},
    // {"policy": "snapkv", "budget": 1024, "window": 32[, "kernel": 7]
    // [, "gqa": "mean"]}, {"policy": "h2o", "budget": 512, "window": 512[, "slack": 16]
    // [, "obs": 32]}, or the CLI's text form "streamingllm:sinks=4,window=1024".
    std::string spec;
    if (it->is_string()) {
      spec = it->get<std::string>();
    } else if (it->is_object()) {
      const auto pol = it->find("policy");
      if (pol == it->end() || !pol->is_string()) {
        return bad(
            "kv_retention",
            "'kv_retention' needs a string 'policy' (none, streamingllm, snapkv, pyramidkv, h2o)");
      }
      spec = pol->get<std::string>();
      std::string params;
      for (const auto& [k, v] : it->items()) {
        if (k == "policy") continue;
        const bool text = k == "gqa";  // the one non-integer parameter
        if (text ? !v.is_string() : !v.is_number_integer()) {
          return bad("kv_retention", "'kv_retention." + k + "' must be " +
                                         (text ? "a string" : "an integer") + ", not " +
                                         type_name(v));
        }
        params += (params.empty() ? "" : ",") + k + "=" +
                  (text ? v.get<std::string>() : std::to_string(v.get<int64_t>()));
      }
      if (!params.empty()) spec += ":" + params;
    } else {
      return bad("kv_retention", std::string("'kv_retention' must be an object or a string, not ") +
                                     type_name(*it));
    }
    auto r = parse_retention(spec);
    if (!r) {
      std::string msg = r.error().message;
      const std::string cli = "--kv-retention: ";
      if (msg.rfind(cli, 0) == 0) msg = "'kv_retention': " + msg.substr(cli.size());
      return bad("kv_retention", msg);
    }
    if (r->active() && !limits.retention_unsupported.empty()) {
      return bad("kv_retention", "'kv_retention': " + limits.retention_unsupported);
    }
    q.kv_retention = *r;
  }
  if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      q.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (it->size() > 16) return bad("stop", "'stop' has more than 16 strings");
      for (const json& x : *it) {
        if (!x.is_string()) return bad("stop", "'stop' must hold strings only");
        q.stop.push_back(x.get<std::string>());
      }
    } else {
      return bad("stop", std::string("'stop' must be a string or an array of strings, not ") +
                             type_name(*it));
    }
    for (const auto& st : q.stop) {
      if (st.empty()) return bad("stop", "'stop' contains an empty string");
    }
  }
  if (auto it = body.find("logit_bias"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return bad("logit_bias", "'logit_bias' must be an object");
    if (!it->empty()) return bad("logit_bias", "'logit_bias' is not supported by this server");
  }
  for (const char* f : {"tools", "suffix"}) {
    if (auto it = body.find(f); it != body.end() && !it->is_null()) {
      return bad(f, std::string("'") + f + "' is not supported by this server");
    }
  }
  if (auto it = body.find("response_format"); it != body.end() && !it->is_null()) {
    if (!it->is_object() || it->value("type", json()) != "text") {
      return bad("response_format", "only response_format {\"type\": \"text\"} is supported");
    }
  }
  if (auto it = body.find("best_of"); it != body.end() && !it->is_null()) {
    int64_t b = 1;
    if (auto e = read_int(body, "best_of", 1, 1, &b)) return *e;
  }

  // max_tokens (max_completion_tokens wins on chat).
  int64_t max_tokens = -1;
  if (auto e = read_int(body, "max_tokens", 1, 1 << 24, &max_tokens)) return *e;
  if (endpoint == Endpoint::kChat) {
    if (auto e = read_int(body, "max_completion_tokens", 1, 1 << 24, &max_tokens)) return *e;
  }

  if (endpoint == Endpoint::kCompletions) {
    int64_t k = -1;
    if (auto e = read_int(body, "logprobs", 0, 20, &k)) return *e;
    q.n_logprobs = static_cast<int>(k);
    out.logprobs = k >= 0;
    if (auto e = read_bool(body, "echo", &out.echo)) return *e;
    auto it = body.find("prompt");
    if (it == body.end() || it->is_null()) return bad("prompt", "'prompt' is required");
    // One prompt: a string or an array of token ids.
    auto one = [&](const json& p, const std::string& param, std::vector<int32_t>* ids,
                   std::string* text) -> std::optional<ApiError> {
      if (p.is_string()) {
        *text = p.get<std::string>();
        if (text->empty()) return bad("prompt", "'" + param + "' is empty");
        *ids = tokenizer.tokenize(*text, {.add_special = true, .parse_special = true});
      } else if (p.is_array() && !p.empty() && p[0].is_number()) {
        for (const json& t : p) {
          if (!t.is_number_integer()) {
            return bad("prompt", "'" + param + "' token arrays must hold integers");
          }
          const int64_t id = t.get<int64_t>();
          if (id < 0 || id >= tokenizer.n_vocab()) {
            return bad("prompt", "'" + param + "' token id " + std::to_string(id) +
                                     " is out of range [0, " + std::to_string(tokenizer.n_vocab()) +
                                     ")");
          }
          ids->push_back(static_cast<int32_t>(id));
        }
        if (out.echo) {
          auto t = tokenizer.detokenize(*ids);
          if (t) *text = *t;
        }
      } else if (p.is_array() && p.empty()) {
        return bad("prompt", "'" + param + "' is empty");
      } else {
        return bad("prompt", "'" + param + "' must be a string or an array of token ids, not " +
                                 type_name(p));
      }
      if (ids->empty()) return bad("prompt", "'" + param + "' has no tokens");
      return std::nullopt;
    };
    const json& p = *it;
    const bool single = p.is_string() || (p.is_array() && (p.empty() || p[0].is_number()));
    if (single) {
      if (auto e = one(p, "prompt", &q.prompt, &out.prompt_text)) return *e;
    } else if (p.is_array()) {
      // A list of prompts (strings or token arrays): one choice set each.
      if (p.size() > kMaxPrompts) {
        return bad("prompt", "'prompt' lists " + std::to_string(p.size()) +
                                 " prompts, over the limit of " + std::to_string(kMaxPrompts));
      }
      for (size_t k = 0; k < p.size(); ++k) {
        std::vector<int32_t> ids;
        std::string text;
        if (auto e = one(p[k], "prompt[" + std::to_string(k) + "]", &ids, &text)) return *e;
        if (k == 0) {
          q.prompt = std::move(ids);
          out.prompt_text = std::move(text);
        } else {
          out.more_prompts.push_back(std::move(ids));
          out.more_prompt_texts.push_back(std::move(text));
        }
      }
    } else {
      return bad("prompt", std::string("'prompt' must be a string, an array of token ids or a "
                                       "list of those, not ") +
                               type_name(p));
    }
    if (q.prompt.empty()) return bad("prompt", "'prompt' has no tokens");
    q.max_tokens = max_tokens > 0 ? max_tokens : limits.default_max_tokens_completions;
  } else {
    bool lp = false;
    if (auto e = read_bool(body, "logprobs", &lp)) return *e;
    int64_t top = 0;
    if (auto e = read_int(body, "top_logprobs", 0, 20, &top)) return *e;
    if (body.contains("top_logprobs") && !body["top_logprobs"].is_null() && !lp) {
      return bad("top_logprobs", "'top_logprobs' requires 'logprobs': true");
    }
    out.logprobs = lp;
    q.n_logprobs = lp ? static_cast<int>(top) : -1;
    if (chat == nullptr) {
      return bad("messages", "this model has no chat template; use /v1/completions");
    }
    auto it = body.find("messages");
    if (it == body.end() || it->is_null()) return bad("messages", "'messages' is required");
    if (!it->is_array()) {
      return bad("messages", std::string("'messages' must be an array, not ") + type_name(*it));
    }
    if (it->empty()) return bad("messages", "'messages' is empty");
    std::vector<ChatMessage> msgs;
    for (size_t k = 0; k < it->size(); ++k) {
      const json& m = (*it)[k];
      const std::string where = "messages[" + std::to_string(k) + "]";
      if (!m.is_object()) return bad(where, "'" + where + "' must be an object");
      if (!m.contains("role") || !m["role"].is_string()) {
        return bad(where + ".role", "'" + where + ".role' must be a string");
      }
      ChatMessage cm;
      cm.role = m["role"].get<std::string>();
      // OpenAI's newer name for the system role (sent by current clients).
      if (cm.role == "developer") cm.role = "system";
      if (auto e = read_content(m, k, &cm.content)) return *e;
      if (!m.contains("content") || (m["content"].is_null() && cm.role != "assistant")) {
        return bad(where + ".content", "'" + where + ".content' is required");
      }
      msgs.push_back(std::move(cm));
    }
    auto text = chat->render(msgs, true);
    if (!text) return bad("messages", text.error().message);
    q.prompt =
        tokenizer.tokenize(*text, {.add_special = chat->bos_text().empty(), .parse_special = true});
    for (const auto& st : chat->stop_strings()) q.stop.push_back(st);
    q.max_tokens = max_tokens;  // -1: the server fills in what fits
  }
  return out;
}

}  // namespace kvstack::server

// OpenAI-compatible request parsing and response building for
// /v1/completions and /v1/chat/completions (JSON via nlohmann-json).
//
// parse_request() turns a request body into a SeqRequest plus what the
// response needs (model name, echo of the mode, stream options). Every
// problem is an ApiError carrying the HTTP status and the OpenAI error type
// ("invalid_request_error", ...) and naming the field at fault.
//
// Thread-safety: free functions over their arguments; safe from any thread
// (the Tokenizer and ChatTemplate are immutable).
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/scheduler.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kvstack::server {

struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";  // OpenAI error.type
  std::string message;
  std::string param;  // the field at fault, or empty
  std::string code;   // OpenAI error.code, or empty
  nlohmann::json to_json() const;
};

ApiError api_error(int status, std::string type, std::string message, std::string param = "",
                   std::string code = "");

enum class Endpoint { kCompletions, kChat };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  SeqRequest seq;
  std::string model;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // report logprobs (completions: logprobs=k; chat: logprobs=true)
  bool echo = false;           // completions: prepend the prompt text
  std::string prompt_text;     // for echo
  // completions: the prompts after the first when "prompt" is a list (each
  // one a scheduler request like seq; choice index = prompt * n + choice).
  std::vector<std::vector<int32_t>> more_prompts;
  std::vector<std::string> more_prompt_texts;  // for echo
  // vLLM's disaggregation object (an object, or null when absent): read by
  // the PD agent (pd_agent.h) of a --role prefill/decode server.
  nlohmann::json kv_transfer_params;
};

// Prompts in one /v1/completions request at most.
inline constexpr size_t kMaxPrompts = 64;

struct ProtocolLimits {
  std::string model_id;                    // served model name (requests may name it or omit it)
  std::vector<std::string> model_aliases;  // other accepted names ("kvstack", the file name)
  int64_t n_ctx = 0;                       // model context
  int64_t default_max_tokens_completions = 16;  // OpenAI's default for /v1/completions
  // Why "kv_retention" cannot be honoured by this engine's KV format (400
  // for a request asking for a policy); empty when it can.
  std::string retention_unsupported;
};

// Parses and validates a body. The tokenizer turns prompts and rendered chat
// messages into ids (special-token text parsed; BOS added for completions
// when the vocabulary asks for it, as `kvstack run` does).
std::variant<ParsedRequest, ApiError> parse_request(Endpoint endpoint, const std::string& body,
                                                    const Tokenizer& tokenizer,
                                                    const ChatTemplate* chat,
                                                    const ProtocolLimits& limits);

// cache_salt: at most this many bytes (400 past it).
inline constexpr size_t kMaxCacheSaltBytes = 1024;

// The fixed-size key a cache salt names its prefix-cache namespace by:
// "sha256:" and the SHA-256 of the salt in hex (71 bytes whatever the salt,
// and a tenant's salt text is never stored or shown). parse_request puts it
// in SeqRequest::cache_salt.
std::string cache_salt_key(std::string_view salt);

// "stop" / "length" as OpenAI names them (EOS is "stop").
const char* openai_finish_reason(FinishReason r);

// The logprobs object for a run of tokens of one choice, in the endpoint's
// shape (completions: tokens/token_logprobs/top_logprobs/text_offset; chat:
// content: [{token, logprob, bytes, top_logprobs}]).
nlohmann::json logprobs_json(Endpoint endpoint, const Tokenizer& tokenizer,
                             const std::vector<SampledToken>& tokens, int64_t text_offset);

nlohmann::json usage_json(const RequestUsage& u);

// An ApiError for a scheduler Status (validation, queue full, shutdown).
ApiError api_error_from(const Error& e);

}  // namespace kvstack::server

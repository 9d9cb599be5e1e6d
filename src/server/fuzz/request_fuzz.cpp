// libFuzzer target for the OpenAI request parser (JSON + schema):
// server::parse_request on both endpoints, with the default model's
// tokenizer and the chatml template, as `kvstack serve` calls it. Byte 0
// picks the endpoint; the rest is the body. Every body must give either a
// ParsedRequest whose prompt ids are inside the vocabulary and whose limits
// hold, or an ApiError with a 4xx status, an OpenAI error type and a
// message. An exception escaping parse_request (which the HTTP layer turns
// into a 500) is a finding; that includes nlohmann's number overflow
// (out_of_range 406, e.g. {"temperature": 1e400}), which parse_request
// turns into a 400.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <variant>

#include "server/openai_protocol.h"
#include "tokenizer/fuzz/fuzz_tokenizer_model.h"

namespace {

const kvstack::ChatTemplate& chatml() {
  static const kvstack::ChatTemplate t =
      kvstack::ChatTemplate::create(kvstack::ChatTemplateKind::kChatML).value();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvstack;
  using namespace kvstack::server;
  if (size == 0) return 0;
  const Tokenizer& tok = fuzz::model_tokenizer();
  const Endpoint endpoint = (data[0] & 1) != 0 ? Endpoint::kChat : Endpoint::kCompletions;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const ProtocolLimits limits{.model_id = "SmolLM2-135M-Instruct.Q4_1.gguf", .n_ctx = 8192};
  std::variant<ParsedRequest, ApiError> r;
  try {
    r = parse_request(endpoint, body, tok, &chatml(), limits);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "request_fuzz: parse_request threw: %s\n", e.what());
    __builtin_trap();
  }
  if (const auto* err = std::get_if<ApiError>(&r)) {
    if (err->status < 400 || err->status > 499 || err->message.empty() || err->type.empty()) {
      std::fprintf(stderr, "request_fuzz: error %d (%s): %s\n", err->status, err->type.c_str(),
                   err->message.c_str());
      __builtin_trap();
    }
    // Serialized as the HTTP layer does (invalid UTF-8 echoed from the body,
    // e.g. in a field name, is replaced rather than thrown on).
    (void)err->to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return 0;
  }
  // Accepted: the request is for this endpoint and asks for at least one
  // choice and at least one token, or (chat without max_tokens) -1, which
  // the server fills in with what fits (ids and lengths are checked again by
  // the scheduler's validate_request before anything runs).
  const ParsedRequest& p = std::get<ParsedRequest>(r);
  const bool max_ok =
      p.seq.max_tokens >= 1 || (endpoint == Endpoint::kChat && p.seq.max_tokens == -1);
  if (p.endpoint != endpoint || p.seq.n < 1 || !max_ok) {
    std::fprintf(stderr, "request_fuzz: accepted with n %d, max_tokens %lld\n", p.seq.n,
                 static_cast<long long>(p.seq.max_tokens));
    __builtin_trap();
  }
  return 0;
}

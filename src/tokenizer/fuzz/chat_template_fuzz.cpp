// libFuzzer target for the chat-template renderer. The input is split into
// a conversation: byte 0 picks the family's defaults source, then records
// "<role byte><content up to the next 0x1E byte>". Every family renders it
// (with and without the generation prompt) or returns an error naming a
// message; a rendered conversation starts with the family's BOS text,
// contains every message's (trimmed) content, and tokenizes on the default
// model's vocabulary with special tokens parsed. The same bytes are also
// fed to detect_chat_template / from_jinja as a template source. No crash,
// no sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_template.h"
#include "tokenizer/fuzz/fuzz_tokenizer_model.h"

namespace {

std::string_view trim_ascii(std::string_view s) {
  auto space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
  };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvstack;
  const std::string_view in(reinterpret_cast<const char*>(data), size);

  // The input as a Jinja template source: detection must not crash, and a
  // detected family must create a template.
  if (auto kind = detect_chat_template(in); kind.ok()) {
    if (!ChatTemplate::create(*kind, in).ok() && !ChatTemplate::from_jinja(in).ok()) {
      // Conflicting default system messages are a legitimate error.
    }
  }
  (void)ChatTemplate::from_jinja(in);

  if (in.empty()) return 0;
  static const char* const kRoles[] = {"system", "user", "assistant", "tool", "developer", ""};
  std::vector<ChatMessage> messages;
  size_t i = 1;
  while (i < in.size() && messages.size() < 64) {
    const auto role = static_cast<unsigned char>(in[i++]) % 6;
    const size_t end = std::min(in.find('\x1e', i), in.size());
    messages.push_back({kRoles[role], std::string(in.substr(i, end - i))});
    i = end + 1;
  }
  const Tokenizer& tok = fuzz::model_tokenizer();
  for (ChatTemplateKind kind : {ChatTemplateKind::kChatML, ChatTemplateKind::kLlama3,
                                ChatTemplateKind::kMistral, ChatTemplateKind::kGemma}) {
    auto tmpl = ChatTemplate::create(kind, (in[0] & 1) != 0 ? in.substr(1) : std::string_view{});
    if (!tmpl) continue;  // conflicting defaults in the "source": an error, not a crash
    for (bool gen : {false, true}) {
      auto text = tmpl->render(messages, gen);
      if (!text) {
        if (text.error().message.empty()) __builtin_trap();
        continue;
      }
      if (messages.empty()) __builtin_trap();  // an empty conversation must be an error
      if (text->rfind(tmpl->bos_text(), 0) != 0) __builtin_trap();
      for (const ChatMessage& m : messages) {
        if (text->find(trim_ascii(m.content)) == std::string::npos) __builtin_trap();
      }
      const auto ids = tok.tokenize(*text, {.add_special = false, .parse_special = true});
      if (!tok.validate(ids).ok()) __builtin_trap();
    }
  }
  return 0;
}

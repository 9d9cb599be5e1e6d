#include "tokenizer/chat_template.h"

#include <array>

namespace kvstack {

namespace {

struct NamedKind {
  std::string_view name;
  ChatTemplateKind kind;
};
constexpr std::array<NamedKind, 4> kKinds = {{{"chatml", ChatTemplateKind::kChatML},
                                              {"llama3", ChatTemplateKind::kLlama3},
                                              {"mistral", ChatTemplateKind::kMistral},
                                              {"gemma", ChatTemplateKind::kGemma}}};

bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

std::string_view trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  const size_t first = s.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kSpace) - first + 1);
}

Error message_error(size_t index, const std::string& what) {
  return make_error(Errc::kInvalidArgument,
                    "chat template: message " + std::to_string(index) + ": " + what);
}

// The chatml default system message: the text of a string literal that reads
// "<|im_start|>system" newline TEXT "<|im_end|>", where the newline is either
// literal (SmolLM2) or the escape \n (Qwen2.5). TEXT must be plain literal
// text (no quotes or braces: i.e. not built from messages[0]['content']).
// Returns "" when there is none.
Result<std::string> extract_chatml_default_system(std::string_view src) {
  constexpr std::string_view kHead = "<|im_start|>system";
  constexpr std::string_view kEnd = "<|im_end|>";
  std::string found;
  for (size_t pos = src.find(kHead); pos != std::string_view::npos;
       pos = src.find(kHead, pos + 1)) {
    std::string_view rest = src.substr(pos + kHead.size());
    bool escaped;
    if (rest.starts_with("\n")) {
      escaped = false;
      rest.remove_prefix(1);
    } else if (rest.starts_with("\\n")) {
      escaped = true;
      rest.remove_prefix(2);
    } else {
      continue;
    }
    const size_t end = rest.find(kEnd);
    if (end == std::string_view::npos) continue;
    const std::string_view raw = rest.substr(0, end);
    if (raw.empty() || raw.find_first_of("'\"{}") != std::string_view::npos) continue;
    std::string text;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (escaped && raw[i] == '\\' && i + 1 < raw.size()) {
        const char c = raw[++i];
        text += c == 'n' ? '\n' : c == 't' ? '\t' : c;
      } else {
        text += raw[i];
      }
    }
    if (!found.empty() && found != text) {
      std::string msg = "chat template: the template has two different default system messages ('";
      msg += found;
      msg += "' and '";
      msg += text;
      msg += "')";
      return make_error(Errc::kUnsupported, std::move(msg));
    }
    found = std::move(text);
  }
  return found;
}

}  // namespace

std::string_view chat_template_name(ChatTemplateKind kind) {
  for (const NamedKind& k : kKinds) {
    if (k.kind == kind) return k.name;
  }
  return "unknown";
}

Result<ChatTemplateKind> parse_chat_template_name(std::string_view name) {
  std::string known;
  for (const NamedKind& k : kKinds) {
    if (k.name == name) return k.kind;
    known += known.empty() ? "" : ", ";
    known += k.name;
  }
  return make_error(Errc::kInvalidArgument,
                    "unknown chat template '" + std::string(name) + "' (known: " + known + ")");
}

Result<ChatTemplateKind> detect_chat_template(std::string_view src) {
  if (trim(src).empty()) {
    return make_error(Errc::kUnsupported,
                      "chat template: the model has no tokenizer.chat_template; choose one of "
                      "chatml, llama3, mistral, gemma explicitly");
  }
  if (contains(src, "<|im_start|>")) return ChatTemplateKind::kChatML;
  if (contains(src, "<|start_header_id|>")) return ChatTemplateKind::kLlama3;
  if (contains(src, "<start_of_turn>")) return ChatTemplateKind::kGemma;
  if (contains(src, "[INST]")) {
    if (contains(src, "<<SYS>>")) {
      return make_error(Errc::kUnsupported,
                        "chat template: Llama 2 style template (<<SYS>>) is not supported");
    }
    if (contains(src, "[AVAILABLE_TOOLS]") || contains(src, "[SYSTEM_PROMPT]")) {
      return make_error(Errc::kUnsupported,
                        "chat template: Mistral v3+ template ([AVAILABLE_TOOLS]/[SYSTEM_PROMPT]) "
                        "is not supported; only the v0.1/v0.2 [INST] layout is");
    }
    return ChatTemplateKind::kMistral;
  }
  return make_error(Errc::kUnsupported,
                    "chat template: unrecognised template (no ChatML, Llama 3, Mistral or Gemma "
                    "markers); choose one of chatml, llama3, mistral, gemma explicitly");
}

Result<ChatTemplate> ChatTemplate::create(ChatTemplateKind kind,
                                          std::string_view jinja_source_for_defaults) {
  std::string default_system;
  if (kind == ChatTemplateKind::kChatML && !jinja_source_for_defaults.empty()) {
    const auto detected = detect_chat_template(jinja_source_for_defaults);
    if (detected.ok() && *detected == ChatTemplateKind::kChatML) {
      auto d = extract_chatml_default_system(jinja_source_for_defaults);
      if (!d.ok()) return d.error();
      default_system = std::move(*d);
    }
  }
  return ChatTemplate(kind, std::move(default_system));
}

Result<ChatTemplate> ChatTemplate::from_jinja(std::string_view jinja_source) {
  const auto kind = detect_chat_template(jinja_source);
  if (!kind.ok()) return kind.error();
  return create(*kind, jinja_source);
}

std::string_view ChatTemplate::bos_text() const {
  switch (kind_) {
    case ChatTemplateKind::kChatML:
      return "";
    case ChatTemplateKind::kLlama3:
      return "<|begin_of_text|>";
    case ChatTemplateKind::kMistral:
      return "<s>";
    case ChatTemplateKind::kGemma:
      return "<bos>";
  }
  return "";
}

std::vector<std::string> ChatTemplate::stop_strings() const {
  switch (kind_) {
    case ChatTemplateKind::kChatML:
      return {"<|im_end|>"};
    case ChatTemplateKind::kLlama3:
      return {"<|eot_id|>", "<|end_of_text|>"};
    case ChatTemplateKind::kMistral:
      return {"</s>"};
    case ChatTemplateKind::kGemma:
      return {"<end_of_turn>"};
  }
  return {};
}

Status ChatTemplate::check_roles(const std::vector<ChatMessage>& messages) const {
  const std::string family(chat_template_name(kind_));
  if (messages.empty()) {
    return make_error(Errc::kInvalidArgument, "chat template: the message list is empty");
  }
  const bool free_order = kind_ == ChatTemplateKind::kChatML || kind_ == ChatTemplateKind::kLlama3;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    const bool known =
        role == "system" || role == "user" || role == "assistant" || (free_order && role == "tool");
    if (!known) {
      std::string msg = "unknown role '";
      msg += role;
      msg += "' (";
      msg += family;
      msg += " accepts system, user, ";
      msg += free_order ? "assistant, tool)" : "assistant)";
      return message_error(i, msg);
    }
  }
  if (free_order) return {};
  // mistral/gemma: [system] user assistant user ...
  const size_t first = messages[0].role == "system" ? 1 : 0;
  if (first == 1 && messages.size() == 1) {
    return message_error(0, family +
                                " folds the system message into the first user turn, "
                                "but there is no user message");
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const char* want = (i - first) % 2 == 0 ? "user" : "assistant";
    if (messages[i].role == want) continue;
    if (messages[i].role == "system") {
      return message_error(i, family + " allows a system message only as the first message");
    }
    return message_error(i, "expected role '" + std::string(want) + "', got '" + messages[i].role +
                                "' (" + family +
                                " needs user/assistant turns alternating, starting with user)");
  }
  return {};
}

Result<std::string> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt) const {
  KV_TRY_STATUS(check_roles(messages));
  std::string out(bos_text());
  switch (kind_) {
    case ChatTemplateKind::kChatML:
      if (!default_system_.empty() && messages[0].role != "system") {
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      }
      for (const ChatMessage& m : messages) {
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case ChatTemplateKind::kLlama3:
      for (const ChatMessage& m : messages) {
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n";
        out += trim(m.content);
        out += "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatTemplateKind::kMistral: {
      const ChatMessage* system = nullptr;
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          system = &m;
        } else if (m.role == "user") {
          out += " [INST] ";
          if (system != nullptr) {
            out += system->content + "\n\n";
            system = nullptr;
          }
          out += m.content + " [/INST]";
        } else {
          out += " " + m.content + "</s>";
        }
      }
      break;  // the prompt already ends in [/INST]: nothing to add for generation
    }
    case ChatTemplateKind::kGemma: {
      std::string_view system;
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          system = trim(m.content);
          continue;
        }
        out += m.role == "user" ? "<start_of_turn>user\n" : "<start_of_turn>model\n";
        if (!system.empty()) {
          out += system;
          out += "\n\n";
          system = {};
        }
        out += trim(m.content);
        out += "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
  }
  return out;
}

}  // namespace kvstack

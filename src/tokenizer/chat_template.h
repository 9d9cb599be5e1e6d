// Chat templates: OpenAI-style message lists -> prompt text, for the template
// families kvstack knows. The family is detected from the GGUF's
// tokenizer.chat_template Jinja source by distinctive markers; Jinja itself is
// not interpreted.
//
// Families and their layout ({...} = message content):
//   chatml   <|im_start|>{role}\n{content}<|im_end|>\n ...   gen: <|im_start|>assistant\n
//            Any order of system/user/assistant/tool. If the template source
//            writes a default system message when the first message is not a
//            system one (SmolLM2, Qwen2.5), it is extracted and reproduced.
//   llama3   <|begin_of_text|> then <|start_header_id|>{role}<|end_header_id|>\n\n
//            {trim(content)}<|eot_id|> ...   gen: <|start_header_id|>assistant<|end_header_id|>\n\n
//            (the Llama 3.0 layout; 3.1+ templates add a dated system header
//            that is not reproduced).
//   mistral  <s> [INST] {system\n\n}{user} [/INST] {assistant}</s> [INST] {user} [/INST]
//            (Mistral v0.1/v0.2, llama.cpp's "mistral-v1"). The prompt already
//            ends in [/INST], so add_generation_prompt adds nothing.
//   gemma    <bos><start_of_turn>user\n{trim(system)\n\n}{trim(user)}<end_of_turn>\n
//            <start_of_turn>model\n{trim(assistant)}<end_of_turn>\n ...   gen:
//            <start_of_turn>model\n
// trim() strips ASCII whitespace at both ends, as llama.cpp does.
// mistral and gemma accept one optional leading system message (folded into
// the first user turn) and then strictly alternating user/assistant turns
// starting with user, as their reference templates demand.
//
// BOS: render() writes the family's BOS text itself (bos_text(): "" for
// chatml), as the Hugging Face templates do. Tokenize the result with special
// tokens parsed and WITHOUT adding another BOS.
//
// Thread-safety: a ChatTemplate is immutable after create().
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace kvstack {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool" (which are allowed depends on family)
  std::string content;
};

enum class ChatTemplateKind { kChatML, kLlama3, kMistral, kGemma };

// "chatml", "llama3", "mistral", "gemma".
std::string_view chat_template_name(ChatTemplateKind kind);
// Inverse of chat_template_name; the error lists the known names.
Result<ChatTemplateKind> parse_chat_template_name(std::string_view name);
// Family of a Jinja chat template by its markers. Errors (kUnsupported) for
// an empty or unrecognised template, and for look-alike families whose
// layout differs (Llama 2 <<SYS>>, Mistral v3+/v7 [AVAILABLE_TOOLS] /
// [SYSTEM_PROMPT]).
Result<ChatTemplateKind> detect_chat_template(std::string_view jinja_source);

class ChatTemplate {
 public:
  // `jinja_source_for_defaults`: the model's template, read for defaults (the
  // chatml default system message) when it is of the same family; ignored
  // otherwise. Errors if it holds conflicting default system messages.
  static Result<ChatTemplate> create(ChatTemplateKind kind,
                                     std::string_view jinja_source_for_defaults = {});
  // detect_chat_template + create.
  static Result<ChatTemplate> from_jinja(std::string_view jinja_source);

  // Errors (kInvalidArgument, naming the message index): empty list, unknown
  // role for the family, misplaced system message, roles not alternating
  // (mistral, gemma), a system message with no user turn to fold into.
  Result<std::string> render(const std::vector<ChatMessage>& messages,
                             bool add_generation_prompt) const;

  // Text that ends an assistant turn, for a StopMatcher. The engine should
  // also stop on the model's EOG token ids: detokenizers that hide special
  // tokens never produce these strings.
  std::vector<std::string> stop_strings() const;

  ChatTemplateKind kind() const { return kind_; }
  std::string_view bos_text() const;                                     // prefix render() writes
  const std::string& default_system() const { return default_system_; }  // chatml only

 private:
  ChatTemplate(ChatTemplateKind kind, std::string default_system)
      : kind_(kind), default_system_(std::move(default_system)) {}
  Status check_roles(const std::vector<ChatMessage>& messages) const;

  ChatTemplateKind kind_;
  std::string default_system_;
};

}  // namespace kvstack

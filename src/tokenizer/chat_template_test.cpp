#include "tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvstack {
namespace {

// tokenizer.chat_template of SmolLM2-135M-Instruct (the default model), verbatim.
constexpr std::string_view kSmolLM2Template =
    R"TMPL({% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %})TMPL";

// A Qwen2.5-style fragment: the default system message written with the \n
// escape and the system turn otherwise built from messages[0]['content'].
constexpr std::string_view kQwenLikeTemplate =
    R"({%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endfor %})";

const std::vector<ChatMessage> kWithSystem = {{"system", "Be brief."},
                                              {"user", "Hi there"},
                                              {"assistant", "Hello!"},
                                              {"user", "What is 2+2?"}};
const std::vector<ChatMessage> kNoSystem = {
    {"user", "Hi there"}, {"assistant", "Hello!"}, {"user", "What is 2+2?"}};

ChatTemplate make(ChatTemplateKind kind, std::string_view src = {}) {
  auto t = ChatTemplate::create(kind, src);
  EXPECT_TRUE(t.ok());
  return std::move(t).value();
}

std::string render(const ChatTemplate& t, const std::vector<ChatMessage>& m, bool gen) {
  auto r = t.render(m, gen);
  EXPECT_TRUE(r.ok()) << r.error().message;
  return r.ok() ? *r : std::string();
}

TEST(ChatTemplateNames, ParseAndList) {
  for (auto kind : {ChatTemplateKind::kChatML, ChatTemplateKind::kLlama3,
                    ChatTemplateKind::kMistral, ChatTemplateKind::kGemma}) {
    auto parsed = parse_chat_template_name(chat_template_name(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  auto bad = parse_chat_template_name("vicuna");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Errc::kInvalidArgument);
  EXPECT_NE(bad.error().message.find("'vicuna'"), std::string::npos);
  EXPECT_NE(bad.error().message.find("chatml, llama3, mistral, gemma"), std::string::npos);
}

TEST(ChatTemplateDetect, Families) {
  auto expect_kind = [](std::string_view src, ChatTemplateKind kind) {
    auto d = detect_chat_template(src);
    ASSERT_TRUE(d.ok()) << src;
    EXPECT_EQ(*d, kind) << src;
  };
  expect_kind(kSmolLM2Template, ChatTemplateKind::kChatML);
  expect_kind(kQwenLikeTemplate, ChatTemplateKind::kChatML);
  expect_kind(
      "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
      "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}",
      ChatTemplateKind::kLlama3);
  expect_kind("{% for m in messages %}{{ '<start_of_turn>' + role + '\n' }}{% endfor %}",
              ChatTemplateKind::kGemma);
  expect_kind(
      "{{ bos_token }}{% for m in messages %}{{ ' [INST] ' + m['content'] + ' [/INST]' "
      "}}{% endfor %}",
      ChatTemplateKind::kMistral);
}

TEST(ChatTemplateDetect, UnrecognisedIsAClearError) {
  for (std::string_view src : {std::string_view("{% for m in messages %}### {{ m.role }}: {{ "
                                                "m.content }}\n{% endfor %}"),
                               std::string_view(""), std::string_view("  \n"),
                               std::string_view("[INST] <<SYS>>\n{{ s }}\n<</SYS>>"),
                               std::string_view("[AVAILABLE_TOOLS] [INST] x [/INST]")}) {
    auto d = detect_chat_template(src);
    ASSERT_FALSE(d.ok()) << src;
    EXPECT_EQ(d.error().code, Errc::kUnsupported);
    EXPECT_NE(d.error().message.find("chat template"), std::string::npos);
  }
  auto t = ChatTemplate::from_jinja("{{ messages }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("chatml, llama3, mistral, gemma"), std::string::npos);
}

TEST(ChatTemplateChatML, SmolLM2DefaultSystem) {
  auto t = ChatTemplate::from_jinja(kSmolLM2Template);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->kind(), ChatTemplateKind::kChatML);
  EXPECT_EQ(t->default_system(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(render(*t, kNoSystem, true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(render(*t, kWithSystem, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n");
  EXPECT_EQ(t->stop_strings(), std::vector<std::string>{"<|im_end|>"});
  EXPECT_EQ(t->bos_text(), "");
}

TEST(ChatTemplateChatML, PlainAndEscapedDefaults) {
  const ChatTemplate plain = make(ChatTemplateKind::kChatML);
  EXPECT_EQ(plain.default_system(), "");
  // Content is written verbatim (no trimming); system may appear later.
  EXPECT_EQ(render(plain, {{"user", " hi \n"}, {"system", "s"}, {"tool", "{}"}}, true),
            "<|im_start|>user\n hi \n<|im_end|>\n<|im_start|>system\ns<|im_end|>\n"
            "<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n");
  const ChatTemplate qwen = make(ChatTemplateKind::kChatML, kQwenLikeTemplate);
  EXPECT_EQ(qwen.default_system(), "You are Qwen, a helpful assistant.");
  EXPECT_EQ(render(qwen, {{"user", "x"}}, false),
            "<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nx<|im_end|>\n");
  // A source of another family gives no defaults.
  const ChatTemplate forced = make(ChatTemplateKind::kLlama3, kSmolLM2Template);
  EXPECT_EQ(forced.default_system(), "");
  // Two different defaults: refuse to guess.
  auto conflict = ChatTemplate::create(
      ChatTemplateKind::kChatML,
      "{{ '<|im_start|>system\\nA<|im_end|>' }}{{ '<|im_start|>system\\nB<|im_end|>' }}");
  ASSERT_FALSE(conflict.ok());
  EXPECT_NE(conflict.error().message.find("two different default system"), std::string::npos);
}

TEST(ChatTemplateLlama3, Layout) {
  const ChatTemplate t = make(ChatTemplateKind::kLlama3);
  EXPECT_EQ(render(t, kWithSystem, true),
            "<|begin_of_text|>"
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(render(t, {{"user", "  padded \n"}}, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>");
  EXPECT_EQ(t.stop_strings(), (std::vector<std::string>{"<|eot_id|>", "<|end_of_text|>"}));
}

TEST(ChatTemplateMistral, SystemFoldedIntoFirstUserTurn) {
  const ChatTemplate t = make(ChatTemplateKind::kMistral);
  const std::string with_system =
      "<s> [INST] Be brief.\n\nHi there [/INST] Hello!</s> [INST] What is 2+2? [/INST]";
  EXPECT_EQ(render(t, kWithSystem, true), with_system);
  EXPECT_EQ(render(t, kWithSystem, false), with_system);  // nothing to add for generation
  EXPECT_EQ(render(t, kNoSystem, true),
            "<s> [INST] Hi there [/INST] Hello!</s> [INST] What is 2+2? [/INST]");
  EXPECT_EQ(render(t, {{"user", "a"}, {"assistant", "b"}}, false), "<s> [INST] a [/INST] b</s>");
  EXPECT_EQ(t.stop_strings(), std::vector<std::string>{"</s>"});
}

TEST(ChatTemplateGemma, ModelRoleAndFoldedSystem) {
  const ChatTemplate t = make(ChatTemplateKind::kGemma);
  EXPECT_EQ(render(t, kWithSystem, true),
            "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
            "<start_of_turn>model\nHello!<end_of_turn>\n"
            "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
            "<start_of_turn>model\n");
  EXPECT_EQ(render(t, kNoSystem, false),
            "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
            "<start_of_turn>model\nHello!<end_of_turn>\n"
            "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n");
  EXPECT_EQ(render(t, {{"system", " sys \n"}, {"user", "\tq "}}, true),
            "<bos><start_of_turn>user\nsys\n\nq<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(t.stop_strings(), std::vector<std::string>{"<end_of_turn>"});
}

TEST(ChatTemplateErrors, RolesAndOrder) {
  struct Case {
    ChatTemplateKind kind;
    std::vector<ChatMessage> messages;
    const char* needle;
  };
  const Case cases[] = {
      {ChatTemplateKind::kChatML, {}, "empty"},
      {ChatTemplateKind::kChatML,
       {{"user", "a"}, {"narrator", "b"}},
       "message 1: unknown role 'narrator'"},
      {ChatTemplateKind::kLlama3, {{"bot", "a"}}, "unknown role 'bot'"},
      {ChatTemplateKind::kMistral, {{"tool", "a"}}, "unknown role 'tool'"},
      {ChatTemplateKind::kMistral, {{"user", "a"}, {"system", "b"}}, "only as the first message"},
      {ChatTemplateKind::kMistral,
       {{"user", "a"}, {"user", "b"}},
       "message 1: expected role 'assistant'"},
      {ChatTemplateKind::kMistral, {{"system", "a"}}, "no user message"},
      {ChatTemplateKind::kGemma, {{"assistant", "a"}}, "message 0: expected role 'user'"},
      {ChatTemplateKind::kGemma, {{"system", "a"}, {"assistant", "b"}}, "expected role 'user'"},
      {ChatTemplateKind::kGemma,
       {{"user", "a"}, {"assistant", "b"}, {"system", "c"}},
       "only as the first"},
  };
  for (const Case& c : cases) {
    const ChatTemplate t = make(c.kind);
    auto r = t.render(c.messages, true);
    ASSERT_FALSE(r.ok()) << c.needle;
    EXPECT_EQ(r.error().code, Errc::kInvalidArgument);
    EXPECT_NE(r.error().message.find(c.needle), std::string::npos) << r.error().message;
  }
}

}  // namespace
}  // namespace kvstack

// kvstack_chat_render: prints the prompt a chat template renders, byte for
// byte, to stdout (no trailing newline). Test tool for the Python cross-check.
//
//   kvstack_chat_render (--kind NAME | --template-file PATH) [--gen]
//                       ROLE CONTENT [ROLE CONTENT ...]
//   kvstack_chat_render --template-file PATH --detect     prints the family name
//
// --template-file detects the family from the Jinja source and takes its
// defaults (the chatml default system message); --kind uses no source.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/chat_template.h"

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "kvstack_chat_render: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvstack;
  std::string kind_name, template_file;
  bool gen = false, detect = false;
  std::vector<ChatMessage> messages;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--kind" && i + 1 < argc) {
      kind_name = argv[++i];
    } else if (arg == "--template-file" && i + 1 < argc) {
      template_file = argv[++i];
    } else if (arg == "--gen") {
      gen = true;
    } else if (arg == "--detect") {
      detect = true;
    } else {
      positional.push_back(arg);
    }
  }
  if (kind_name.empty() == template_file.empty()) {
    return fail("give exactly one of --kind NAME or --template-file PATH");
  }
  if (positional.size() % 2 != 0) return fail("messages are ROLE CONTENT pairs");
  for (size_t i = 0; i < positional.size(); i += 2) {
    messages.push_back({positional[i], positional[i + 1]});
  }

  Result<ChatTemplate> tmpl = make_error(Errc::kInternal, "unset");
  if (!template_file.empty()) {
    std::ifstream in(template_file, std::ios::binary);
    if (!in) return fail("cannot read " + template_file);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string source = ss.str();
    if (detect) {
      auto kind = detect_chat_template(source);
      if (!kind.ok()) return fail(kind.error().message);
      std::fputs(std::string(chat_template_name(*kind)).c_str(), stdout);
      return 0;
    }
    tmpl = ChatTemplate::from_jinja(source);
  } else {
    auto kind = parse_chat_template_name(kind_name);
    if (!kind.ok()) return fail(kind.error().message);
    tmpl = ChatTemplate::create(*kind);
  }
  if (!tmpl.ok()) return fail(tmpl.error().message);
  auto text = tmpl->render(messages, gen);
  if (!text.ok()) return fail(text.error().message);
  std::fwrite(text->data(), 1, text->size(), stdout);
  return 0;
}

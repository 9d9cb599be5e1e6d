// `kvstack`: one executable, one subcommand per cmd_*.cpp file.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/args.h"

namespace {

void print_usage(FILE* out) {
  auto commands = kvstack::cli::registered_commands();
  std::sort(commands.begin(), commands.end(),
            [](const auto& a, const auto& b) { return std::strcmp(a.name, b.name) < 0; });
  std::fprintf(out,
               "usage: kvstack <command> [options]\n\n"
               "kvstack: an LLM inference engine built around its KV cache.\n\ncommands:\n");
  for (const auto& c : commands) std::fprintf(out, "  %-14s %s\n", c.name, c.summary);
  std::fprintf(out,
               "\nRun 'kvstack <command> --help' for a command's options, 'kvstack --version' "
               "for the version.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_usage(stdout);
    return 0;
  }
  if (name == "--version" || name == "-V" || name == "version") {
    std::printf("kvstack %s\n", KVSTACK_VERSION);
    return 0;
  }
  const std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& c : kvstack::cli::registered_commands()) {
    if (name == c.name) return c.run(args);
  }
  std::fprintf(stderr, "kvstack: unknown command '%s'\n\n", name.c_str());
  print_usage(stderr);
  return 2;
}

#include "cli/eval_input.h"

#include <cstdio>

#include "cli/engine_options.h"
#include "cli/text_input.h"

namespace kvstack::cli {

Result<std::optional<EvalInput>> parse_eval_input(const std::vector<std::string>& argv,
                                                  const std::vector<OptionSpec>& own,
                                                  const std::string& usage,
                                                  const std::string& about) {
  std::vector<OptionSpec> specs = engine_options();
  specs.insert(specs.end(), own.begin(), own.end());
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return args.error();
  if (args->flag("help")) {
    std::fputs(format_help(usage, about, specs).c_str(), stdout);
    return std::optional<EvalInput>{};
  }
  if (!args->has("file")) return make_error(Errc::kInvalidArgument, "-f FILE is required");
  const std::string file = *args->get("file");
  auto text = read_file(file);
  if (!text) return text.error();
  auto config = engine_config_from(*args);
  if (!config) return config.error();
  return std::optional<EvalInput>(EvalInput{.args = std::move(*args),
                                            .file = file,
                                            .text = std::move(*text),
                                            .config = std::move(*config)});
}

Result<std::vector<int32_t>> eval_tokens(const Engine& engine, const EvalInput& in,
                                         int64_t min_tokens) {
  std::vector<int32_t> tokens =
      engine.tokenizer().tokenize(in.text, {.add_special = false, .parse_special = false});
  if (static_cast<int64_t>(tokens.size()) < min_tokens) {
    return make_error(Errc::kInvalidArgument, in.file + " has " + std::to_string(tokens.size()) +
                                                  " tokens, fewer than one window of " +
                                                  std::to_string(min_tokens));
  }
  return tokens;
}

}  // namespace kvstack::cli

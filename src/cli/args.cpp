#include "cli/args.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "core/units.h"

namespace kvstack::cli {

Result<Args> Args::parse(const std::vector<std::string>& argv, const std::vector<OptionSpec>& specs,
                         bool allow_positional) {
  Args out;
  auto find_long = [&](const std::string& n) -> const OptionSpec* {
    for (const auto& s : specs) {
      if (s.name == n) return &s;
    }
    return nullptr;
  };
  auto find_short = [&](char c) -> const OptionSpec* {
    for (const auto& s : specs) {
      if (s.short_name != 0 && s.short_name == c) return &s;
    }
    return nullptr;
  };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    const OptionSpec* spec = nullptr;
    std::optional<std::string> inline_value;
    if (a.size() > 2 && a[0] == '-' && a[1] == '-') {
      std::string name = a.substr(2);
      const auto eq = name.find('=');
      if (eq != std::string::npos) {
        inline_value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      spec = find_long(name);
      if (spec == nullptr) return make_error(Errc::kInvalidArgument, "unknown option --" + name);
    } else if (a.size() == 2 && a[0] == '-' && a[1] != '-') {
      spec = find_short(a[1]);
      if (spec == nullptr) return make_error(Errc::kInvalidArgument, "unknown option " + a);
    } else if (a == "--") {
      for (++i; i < argv.size(); ++i) out.positional_.push_back(argv[i]);
      break;
    } else {
      if (!allow_positional) {
        return make_error(Errc::kInvalidArgument, "unexpected argument '" + a + "'");
      }
      out.positional_.push_back(a);
      continue;
    }
    std::string value;
    if (spec->value_name.empty()) {
      if (inline_value) {
        return make_error(Errc::kInvalidArgument, "option --" + spec->name + " takes no value");
      }
      value = "1";
    } else if (inline_value) {
      value = *inline_value;
    } else {
      if (i + 1 >= argv.size()) {
        return make_error(Errc::kInvalidArgument,
                          "option --" + spec->name + " needs a value (" + spec->value_name + ")");
      }
      value = argv[++i];
    }
    auto& slot = out.values_[spec->name];
    if (!spec->repeatable) slot.clear();
    slot.push_back(std::move(value));
  }
  return out;
}

std::optional<std::string> Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

std::string Args::get_or(const std::string& name, const std::string& def) const {
  auto v = get(name);
  return v ? *v : def;
}

const std::vector<std::string>& Args::all(const std::string& name) const {
  static const std::vector<std::string> kEmpty;
  auto it = values_.find(name);
  return it == values_.end() ? kEmpty : it->second;
}

Result<int64_t> Args::get_int(const std::string& name, int64_t def, int64_t min,
                              int64_t max) const {
  auto v = get(name);
  if (!v) return def;
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0' || errno == ERANGE) {
    return make_error(Errc::kInvalidArgument, "--" + name + ": '" + *v + "' is not an integer");
  }
  if (x < min || x > max) {
    return make_error(Errc::kInvalidArgument, "--" + name + ": " + *v + " is out of range [" +
                                                  std::to_string(min) + ", " + std::to_string(max) +
                                                  "]");
  }
  return static_cast<int64_t>(x);
}

Result<double> Args::get_double(const std::string& name, double def, double min, double max) const {
  auto v = get(name);
  if (!v) return def;
  char* end = nullptr;
  const double x = std::strtod(v->c_str(), &end);
  if (v->empty() || *end != '\0' || !std::isfinite(x)) {
    return make_error(Errc::kInvalidArgument, "--" + name + ": '" + *v + "' is not a number");
  }
  if (x < min || x > max) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), " is out of range [%g, %g]", min, max);
    return make_error(Errc::kInvalidArgument, "--" + name + ": " + *v + buf);
  }
  return x;
}

Result<uint64_t> Args::get_bytes(const std::string& name, uint64_t def) const {
  auto v = get(name);
  if (!v) return def;
  auto b = parse_bytes(*v);
  if (!b) return make_error(Errc::kInvalidArgument, "--" + name + ": " + b.error().message);
  return *b;
}

std::string format_help(const std::string& usage, const std::string& description,
                        const std::vector<OptionSpec>& specs) {
  std::string out = "usage: " + usage + "\n\n" + description + "\n\noptions:\n";
  for (const auto& s : specs) {
    std::string left = "  ";
    left += s.short_name ? std::string("-") + s.short_name + ", " : "    ";
    left += "--" + s.name;
    if (!s.value_name.empty()) left += " " + s.value_name;
    if (left.size() < 32)
      left.resize(32, ' ');
    else
      left += "\n" + std::string(32, ' ');
    out += left + s.help + "\n";
  }
  return out;
}

std::string resolve_model_path(const Args& args) {
  if (auto m = args.get("model")) return *m;
  if (const char* env = std::getenv("KVSTACK_MODEL"); env != nullptr && *env != '\0') return env;
  std::string rel = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
#ifdef KVSTACK_SOURCE_DIR
  std::string in_tree = std::string(KVSTACK_SOURCE_DIR) + "/" + rel;
  if (std::filesystem::exists(in_tree)) return in_tree;
#endif
  return rel;
}

Result<std::vector<int32_t>> parse_token_list(const std::string& text) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < text.size()) {
    const char ch = text[i];
    if (ch == ',' || ch == '[' || ch == ']' || ch == ' ' || ch == '\n' || ch == '\t') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
    if (j == i || j - i > 10) {
      return make_error(Errc::kInvalidArgument,
                        "token list: '" + text.substr(i, 12) + "' is not a non-negative token id");
    }
    const long long v = std::stoll(text.substr(i, j - i));
    if (v > INT32_MAX) {
      return make_error(Errc::kInvalidArgument,
                        "token list: " + text.substr(i, j - i) + " is too large for a token id");
    }
    out.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return out;
}

OptionSpec model_option() {
  return {"model", 'm', "FILE",
          "GGUF model (default: $KVSTACK_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf)"};
}
OptionSpec help_option() {
  return {"help", 'h', "", "show this help and exit"};
}

namespace {
std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace

CommandRegistrar::CommandRegistrar(Command command) {
  registry().push_back(command);
}
const std::vector<Command>& registered_commands() {
  return registry();
}

int fail(const std::string& command, const std::string& message) {
  std::fprintf(stderr, "kvstack %s: error: %s\n", command.c_str(), message.c_str());
  return 2;
}

}  // namespace kvstack::cli

// Minimal command-line parsing shared by every `kvstack` subcommand.
// Each subcommand declares its options (with help text and units) and gets
// --help for free; unknown flags and missing values are clear errors.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/result.h"

namespace kvstack::cli {

struct OptionSpec {
  std::string name;        // long name without dashes, e.g. "model"
  char short_name = 0;     // e.g. 'm', or 0
  std::string value_name;  // e.g. "FILE"; empty for a boolean flag
  std::string help;        // one line; include the unit and the default
  bool repeatable = false;
};

class Args {
 public:
  // Parses argv after the subcommand name. Returns an error for unknown
  // options, missing values or positional arguments when none are allowed.
  static Result<Args> parse(const std::vector<std::string>& argv,
                            const std::vector<OptionSpec>& specs, bool allow_positional = false);

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  bool flag(const std::string& name) const { return has(name); }
  // Last value given for an option.
  std::optional<std::string> get(const std::string& name) const;
  std::string get_or(const std::string& name, const std::string& def) const;
  const std::vector<std::string>& all(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }

  // Typed accessors: error names the flag and the offending value.
  Result<int64_t> get_int(const std::string& name, int64_t def, int64_t min, int64_t max) const;
  Result<double> get_double(const std::string& name, double def, double min, double max) const;
  Result<uint64_t> get_bytes(const std::string& name, uint64_t def) const;

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
};

// Text for --help: usage line, description and the option table.
std::string format_help(const std::string& usage, const std::string& description,
                        const std::vector<OptionSpec>& specs);

// The model path: --model/-m if given, else $KVSTACK_MODEL, else the default
// model under models/ next to the executable's source tree or the CWD.
std::string resolve_model_path(const Args& args);

// Parses "1,2,3", "1 2 3" or "[1, 2, 3]" into token ids (>= 0).
Result<std::vector<int32_t>> parse_token_list(const std::string& text);

// Common option specs.
OptionSpec model_option();
OptionSpec help_option();

// A subcommand: name, one-line summary, entry point (args after the name).
struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

// Registers a command at static-initialisation time (cmd_*.cpp files are
// compiled straight into the executable, so registrars are never dropped).
struct CommandRegistrar {
  explicit CommandRegistrar(Command command);
};
const std::vector<Command>& registered_commands();

// Prints "kvstack <cmd>: error: <message>" to stderr and returns exit code 2.
int fail(const std::string& command, const std::string& message);

}  // namespace kvstack::cli

#define KVSTACK_COMMAND(var, name, summary, fn)       \
  static const ::kvstack::cli::CommandRegistrar var { \
    ::kvstack::cli::Command {                         \
      name, summary, fn                               \
    }                                                 \
  }

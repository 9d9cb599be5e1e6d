#include "core/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kvstack {
namespace {

struct Suffix {
  const char* name;
  double factor;
};

// Splits "12.5GiB" into 12.5 and "GiB"; rejects what is not a finite number >= 0.
Result<double> split_number(std::string_view text, std::string* suffix, const char* what) {
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  s = s.substr(start);
  if (s.empty()) return make_error(Errc::kInvalidArgument, std::string("empty ") + what);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) {
    return make_error(Errc::kInvalidArgument,
                      std::string(what) + " '" + s + "' must start with a non-negative number");
  }
  char* end = nullptr;
  const std::string num = s.substr(0, i);
  const double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || !std::isfinite(v)) {
    return make_error(Errc::kInvalidArgument, std::string(what) + " '" + s + "' is not a number");
  }
  *suffix = s.substr(i);
  while (!suffix->empty() && std::isspace(static_cast<unsigned char>(suffix->front()))) {
    suffix->erase(suffix->begin());
  }
  return v;
}

}  // namespace

Result<uint64_t> parse_bytes(std::string_view text) {
  static const Suffix kSuffixes[] = {
      {"", 1},
      {"B", 1},
      {"k", 1e3},
      {"K", 1e3},
      {"kB", 1e3},
      {"KB", 1e3},
      {"M", 1e6},
      {"MB", 1e6},
      {"G", 1e9},
      {"GB", 1e9},
      {"T", 1e12},
      {"TB", 1e12},
      {"KiB", 1024.0},
      {"MiB", 1048576.0},
      {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0},
  };
  std::string suffix;
  auto num = split_number(text, &suffix, "size");
  if (!num) return num.error();
  for (const auto& s : kSuffixes) {
    if (suffix == s.name) {
      const double bytes = *num * s.factor;
      if (bytes >= 1.8e19) {
        return make_error(Errc::kInvalidArgument, "size '" + std::string(text) + "' is too large");
      }
      return static_cast<uint64_t>(std::llround(bytes));
    }
  }
  return make_error(Errc::kInvalidArgument, "size '" + std::string(text) + "' has unknown unit '" +
                                                suffix +
                                                "' (use B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)");
}

Result<double> parse_rate(std::string_view text) {
  std::string t(text);
  const auto slash = t.find("/s");
  if (slash == std::string::npos || slash + 2 != t.size()) {
    return make_error(Errc::kInvalidArgument,
                      "rate '" + t + "' must end in /s (e.g. 25GiB/s, 200Gbit/s)");
  }
  t = t.substr(0, slash);
  static const Suffix kBits[] = {{"bit", 1 / 8.0},  {"kbit", 1e3 / 8}, {"Kbit", 1e3 / 8},
                                 {"Mbit", 1e6 / 8}, {"Gbit", 1e9 / 8}, {"Tbit", 1e12 / 8},
                                 {"b", 1 / 8.0},    {"Kb", 1e3 / 8},   {"kb", 1e3 / 8},
                                 {"Mb", 1e6 / 8},   {"Gb", 1e9 / 8},   {"Tb", 1e12 / 8}};
  std::string suffix;
  auto num = split_number(t, &suffix, "rate");
  if (!num) return num.error();
  for (const auto& s : kBits) {
    if (suffix == s.name) return *num * s.factor;
  }
  auto bytes = parse_bytes(t);
  if (!bytes) {
    return make_error(Errc::kInvalidArgument,
                      "rate '" + std::string(text) + "': " + bytes.error().message);
  }
  return static_cast<double>(*bytes);
}

std::string format_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%.0f B", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[u]);
  }
  return buf;
}

}  // namespace kvstack

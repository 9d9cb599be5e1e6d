// JSON string literals from arbitrary bytes: the one escaper behind every
// JSON line the CLI and the engine print (run --json, plan --json,
// detokenize --jsonl, --kv-stats, --kv-events). The HTTP server builds its
// JSON with nlohmann-json instead; this layer does not link it.
#pragma once

#include <string>
#include <string_view>

namespace kvstack {

// What becomes of bytes that are not well-formed UTF-8 (overlongs, encoded
// surrogates, > U+10FFFF, truncated sequences, stray continuation bytes).
enum class InvalidUtf8 {
  // Each maximal ill-formed subsequence becomes one U+FFFD (Unicode's
  // recommended practice), so the output is always valid UTF-8 and JSON.
  kReplace,
  // Each invalid byte b (0x80-0xFF) becomes \udcXX with XX = b, as Python's
  // "surrogateescape" error handler writes it, so that a Python reader can
  // recover the exact bytes with .encode("utf-8", "surrogateescape"). Lone
  // surrogates are legal JSON syntax, but strict parsers may reject them.
  kSurrogateEscape,
};

struct JsonStringOptions {
  // true: everything outside printable ASCII (0x20-0x7E) is a \uXXXX escape
  // (UTF-16 surrogate pairs above U+FFFF), so the output is pure ASCII.
  // false: valid non-ASCII UTF-8 and DEL (0x7F) are copied as they are.
  bool ascii_only = false;
  InvalidUtf8 invalid_utf8 = InvalidUtf8::kReplace;
};

// Appends the body of a JSON string literal for `bytes` (no quotes) to *out:
// '"' and '\' escaped, \n \r \t as short escapes, other bytes below 0x20 as
// \u00xx (lower-case hex), everything else as `options` says. '/' is not
// escaped.
void append_json_escaped(std::string_view bytes, std::string* out,
                         const JsonStringOptions& options = {});

// The body of the literal (no quotes).
std::string json_escape(std::string_view bytes, const JsonStringOptions& options = {});

// The whole literal, with its quotes.
std::string json_quote(std::string_view bytes, const JsonStringOptions& options = {});

}  // namespace kvstack

#include "core/json_string.h"

#include <cstdint>

namespace kvstack {
namespace {

// Length of the well-formed UTF-8 sequence at the start of `s` (2-4) and its
// codepoint in *cp, or the negated length (-1 to -3) of the maximal
// ill-formed subsequence there. REQUIRES: s non-empty, s[0] >= 0x80.
int decode_utf8(std::string_view s, uint32_t* cp) {
  const auto* b = reinterpret_cast<const uint8_t*>(s.data());
  const uint8_t lead = b[0];
  int len = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed second byte: excludes overlongs,
                                 // surrogates and values past U+10FFFF
  if (lead >= 0xC2 && lead <= 0xDF) {
    len = 2;
  } else if (lead == 0xE0) {
    len = 3, lo = 0xA0;
  } else if (lead == 0xED) {
    len = 3, hi = 0x9F;
  } else if (lead >= 0xE1 && lead <= 0xEF) {
    len = 3;
  } else if (lead == 0xF0) {
    len = 4, lo = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    len = 4;
  } else if (lead == 0xF4) {
    len = 4, hi = 0x8F;
  } else {
    return -1;  // continuation byte, C0/C1 or F5-FF
  }
  uint32_t v = lead & (0x7F >> len);
  for (int k = 1; k < len; ++k) {
    if (static_cast<size_t>(k) >= s.size()) return -k;
    const uint8_t c = b[k];
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c & 0xC0) == 0x80;
    if (!ok) return -k;
    v = (v << 6) | (c & 0x3F);
  }
  *cp = v;
  return len;
}

void append_u_escape(uint32_t u, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  const char e[6] = {
      '\\', 'u', kHex[(u >> 12) & 0xF], kHex[(u >> 8) & 0xF], kHex[(u >> 4) & 0xF], kHex[u & 0xF]};
  out->append(e, 6);
}

}  // namespace

void append_json_escaped(std::string_view bytes, std::string* out,
                         const JsonStringOptions& options) {
  out->reserve(out->size() + bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<uint8_t>(bytes[i]);
    if (c < 0x80) {
      switch (c) {
        case '"':
          *out += "\\\"";
          break;
        case '\\':
          *out += "\\\\";
          break;
        case '\n':
          *out += "\\n";
          break;
        case '\r':
          *out += "\\r";
          break;
        case '\t':
          *out += "\\t";
          break;
        default:
          if (c < 0x20 || (c == 0x7F && options.ascii_only)) {
            append_u_escape(c, out);
          } else {
            out->push_back(static_cast<char>(c));
          }
      }
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const int len = decode_utf8(bytes.substr(i), &cp);
    if (len < 0) {
      if (options.invalid_utf8 == InvalidUtf8::kSurrogateEscape) {
        append_u_escape(0xDC00 + c, out);  // this byte alone; the next is decoded afresh
        ++i;
      } else {
        if (options.ascii_only) {
          append_u_escape(0xFFFD, out);
        } else {
          *out += "\xEF\xBF\xBD";
        }
        i += static_cast<size_t>(-len);
      }
      continue;
    }
    if (!options.ascii_only) {
      out->append(bytes.data() + i, static_cast<size_t>(len));
    } else if (cp >= 0x10000) {
      append_u_escape(0xD800 + ((cp - 0x10000) >> 10), out);
      append_u_escape(0xDC00 + ((cp - 0x10000) & 0x3FF), out);
    } else {
      append_u_escape(cp, out);
    }
    i += static_cast<size_t>(len);
  }
}

std::string json_escape(std::string_view bytes, const JsonStringOptions& options) {
  std::string out;
  append_json_escaped(bytes, &out, options);
  return out;
}

std::string json_quote(std::string_view bytes, const JsonStringOptions& options) {
  std::string out = "\"";
  append_json_escaped(bytes, &out, options);
  out += '"';
  return out;
}

}  // namespace kvstack

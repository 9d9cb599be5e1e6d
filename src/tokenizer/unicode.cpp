#include "tokenizer/unicode.h"

#include <algorithm>
#include <array>

namespace kvstack::unicode {

namespace {

// Flags of every Basic Multilingual Plane codepoint, expanded once from the
// range table so the hot path is one load; other planes binary-search.
struct BmpFlags {
  std::vector<uint16_t> flags;
  BmpFlags() : flags(0x10000) {
    for (size_t i = 0; i < kNumCpRanges; ++i) {
      const uint32_t begin = kCpRanges[i].start;
      if (begin >= 0x10000) break;
      const uint32_t end =
          i + 1 < kNumCpRanges ? std::min<uint32_t>(kCpRanges[i + 1].start, 0x10000) : 0x10000;
      std::fill(flags.begin() + begin, flags.begin() + end, kCpRanges[i].flags);
    }
  }
};

struct ByteMap {
  std::array<uint32_t, 256> to_cp{};
  std::array<std::string, 256> to_utf8;
  std::array<int16_t, 0x144> from_cp{};  // every image codepoint is < U+0144
  ByteMap() {
    from_cp.fill(-1);
    auto printable = [](int b) {
      return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      to_cp[b] = printable(b) ? static_cast<uint32_t>(b) : next++;
      append_utf8(to_cp[b], to_utf8[b]);
      from_cp[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

}  // namespace

uint16_t cp_flags(uint32_t cp) {
  static const BmpFlags bmp;
  if (cp < 0x10000) return bmp.flags[cp];
  if (cp > kMaxCodepoint) return 0;
  const CpRange* end = kCpRanges + kNumCpRanges;
  const CpRange* it = std::upper_bound(kCpRanges, end, cp,
                                       [](uint32_t c, const CpRange& r) { return c < r.start; });
  return (it - 1)->flags;
}

void decode_utf8_lenient(std::string_view text, std::vector<uint32_t>& out) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  out.reserve(out.size() + n);
  size_t i = 0;
  auto cont = [&](size_t k) { return k < n && (s[k] & 0xC0) == 0x80; };
  while (i < n) {
    const uint8_t b = s[i];
    if (b < 0x80) {
      out.push_back(b);
      i += 1;
    } else if ((b & 0xE0) == 0xC0 && cont(i + 1)) {
      out.push_back((uint32_t(b & 0x1F) << 6) | (s[i + 1] & 0x3F));
      i += 2;
    } else if ((b & 0xF0) == 0xE0 && cont(i + 1) && cont(i + 2)) {
      out.push_back((uint32_t(b & 0x0F) << 12) | (uint32_t(s[i + 1] & 0x3F) << 6) |
                    (s[i + 2] & 0x3F));
      i += 3;
    } else if ((b & 0xF8) == 0xF0 && cont(i + 1) && cont(i + 2) && cont(i + 3)) {
      const uint32_t cp = (uint32_t(b & 0x07) << 18) | (uint32_t(s[i + 1] & 0x3F) << 12) |
                          (uint32_t(s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
      if (cp <= kMaxCodepoint) {
        out.push_back(cp);
        i += 4;
      } else {
        out.push_back(kReplacementChar);
        i += 1;
      }
    } else {
      out.push_back(kReplacementChar);
      i += 1;
    }
  }
}

Utf8Char decode_utf8_char(std::string_view bytes) {
  const auto* s = reinterpret_cast<const uint8_t*>(bytes.data());
  const uint8_t lead = s[0];
  if (lead < 0x80) return {.cp = lead, .len = 1, .valid = true};
  // Sequence length and the allowed range of the second byte by lead byte
  // (the range is what excludes overlongs, surrogates and > U+10FFFF).
  size_t len = 0;
  uint8_t lo = 0x80;
  uint8_t hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    len = 2;
  } else if (lead == 0xE0) {
    len = 3;
    lo = 0xA0;
  } else if (lead == 0xED) {
    len = 3;
    hi = 0x9F;
  } else if (lead >= 0xE1 && lead <= 0xEF) {
    len = 3;
  } else if (lead == 0xF0) {
    len = 4;
    lo = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    len = 4;
  } else if (lead == 0xF4) {
    len = 4;
    hi = 0x8F;
  } else {
    return {.len = 1};  // continuation byte, C0/C1 or F5..FF
  }
  uint32_t cp = lead & (0x7F >> len);
  size_t k = 1;
  for (; k < len && k < bytes.size(); ++k) {
    const uint8_t c = s[k];
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c & 0xC0) == 0x80;
    if (!ok) return {.len = k};
    cp = (cp << 6) | (c & 0x3F);
  }
  if (k < len) return {.len = k, .truncated = true};
  return {.cp = cp, .len = len, .valid = true};
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

uint32_t byte_to_cp(uint8_t byte) {
  return byte_map().to_cp[byte];
}

const std::string& byte_to_utf8(uint8_t byte) {
  return byte_map().to_utf8[byte];
}

int cp_to_byte(uint32_t cp) {
  const auto& m = byte_map();
  return cp < m.from_cp.size() ? m.from_cp[cp] : -1;
}

}  // namespace kvstack::unicode

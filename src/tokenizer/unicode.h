// Unicode helpers for the tokenizer: codepoint category flags (from the
// generated range table in unicode_tables.cpp), UTF-8 decoding/encoding with
// llama.cpp's leniency rules, and GPT-2's byte <-> printable-codepoint map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvstack::unicode {

// Category class bits (exactly one per codepoint) plus the White_Space bit.
// Values are shared with scripts/gen_unicode_tables.py.
enum CpFlag : uint16_t {
  kUndefined = 0x0001,    // Cn: unassigned or noncharacter
  kNumber = 0x0002,       // \p{N}
  kLetter = 0x0004,       // \p{L}
  kSeparator = 0x0008,    // \p{Z}
  kMark = 0x0010,         // \p{M}
  kPunctuation = 0x0020,  // \p{P}
  kSymbol = 0x0040,       // \p{S}
  kControl = 0x0080,      // \p{C} except Cn (Cc, Cf, Co, Cs)
  kCategoryMask = 0x00FF,
  kWhitespace = 0x0100,  // White_Space property (\s)
};

struct CpRange {
  uint32_t start;  // first codepoint of the run
  uint16_t flags;  // CpFlag bits for every codepoint up to the next start
};

extern const CpRange kCpRanges[];  // sorted by start, kCpRanges[0].start == 0
extern const size_t kNumCpRanges;
extern const char kUnicodeVersion[];  // e.g. "15.1.0"

constexpr uint32_t kMaxCodepoint = 0x10FFFF;
constexpr uint32_t kReplacementChar = 0xFFFD;

// CpFlag bits of `cp`; 0 for values above U+10FFFF.
uint16_t cp_flags(uint32_t cp);

// Length of the UTF-8 sequence announced by `lead` (1 for ASCII and for
// continuation bytes, 2/3/4 by the high nibble), as llama.cpp computes it.
inline size_t utf8_len_from_lead(uint8_t lead) {
  static constexpr uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

// Decodes UTF-8 leniently, exactly as llama.cpp does before pre-tokenizing:
// a lead byte followed by the right number of continuation bytes is accepted
// (overlong forms and surrogates included); any other byte becomes one
// U+FFFD and decoding resumes at the next byte. Sequences that would decode
// above U+10FFFF are treated as invalid too (llama.cpp would throw).
void decode_utf8_lenient(std::string_view text, std::vector<uint32_t>& out);

// One character of strict UTF-8 at the start of a byte string: well-formed
// sequences only (Unicode Table 3-7: no overlong forms, no surrogates,
// nothing above U+10FFFF).
struct Utf8Char {
  uint32_t cp = 0;  // the codepoint; meaningful only if `valid`
  // valid: the sequence's length (1-4). Invalid: the length (>= 1) of the
  // maximal well-formed prefix, i.e. the bytes one U+FFFD stands for under
  // the "maximal subpart" replacement practice.
  size_t len = 0;
  bool valid = false;
  // Invalid only because the bytes end inside a sequence that is
  // well-formed so far (more input could complete it).
  bool truncated = false;
};

// Decodes the character at the start of `bytes`. REQUIRES: !bytes.empty().
Utf8Char decode_utf8_char(std::string_view bytes);

// Appends the UTF-8 encoding of `cp`. REQUIRES: cp <= U+10FFFF.
void append_utf8(uint32_t cp, std::string& out);

// GPT-2 byte-level mapping: every byte value maps to one printable codepoint
// (printable Latin-1 bytes map to themselves, the other 68 to U+0100..U+0143
// in byte order). byte_to_cp/byte_to_utf8 are total; cp_to_byte returns -1
// for codepoints outside the image of the map.
uint32_t byte_to_cp(uint8_t byte);
const std::string& byte_to_utf8(uint8_t byte);
int cp_to_byte(uint32_t cp);

}  // namespace kvstack::unicode

// The JSON string escaper against nlohmann-json's parser (an independent
// reader; header-only, the server's dependency): every output must parse as
// a JSON string and decode to the input (valid UTF-8) or to the input with
// U+FFFD for its ill-formed parts.
#include "core/json_string.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>

namespace kvstack {
namespace {

// The string a strict JSON parser reads back from `literal` (with quotes).
std::string parse_json(const std::string& literal) {
  const nlohmann::json j = nlohmann::json::parse(literal);
  EXPECT_TRUE(j.is_string()) << literal;
  return j.get<std::string>();
}

const JsonStringOptions kAscii{.ascii_only = true};
const JsonStringOptions kAsciiSurrogates{.ascii_only = true,
                                         .invalid_utf8 = InvalidUtf8::kSurrogateEscape};

TEST(JsonString, QuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_escape("a\"b\\c/d"), "a\\\"b\\\\c/d");
  EXPECT_EQ(json_escape("\n\r\t"), "\\n\\r\\t");
  EXPECT_EQ(json_escape(std::string("\0\x01\x08\x0c\x1f", 5)),
            "\\u0000\\u0001\\u0008\\u000c\\u001f");
  EXPECT_EQ(json_quote(""), "\"\"");
  EXPECT_EQ(json_quote("x"), "\"x\"");
  // DEL is legal inside a JSON string: escaped only when asked for ASCII.
  EXPECT_EQ(json_escape("\x7f"), "\x7f");
  EXPECT_EQ(json_escape("\x7f", kAscii), "\\u007f");
  // Every byte below 0x80 round-trips through a strict parser.
  std::string all;
  for (int c = 0; c < 0x80; ++c) all.push_back(static_cast<char>(c));
  for (const auto& o : {JsonStringOptions{}, kAscii}) {
    const std::string lit = json_quote(all, o);
    for (char c : lit) EXPECT_GE(static_cast<unsigned char>(c), 0x20) << "raw control byte";
    EXPECT_EQ(parse_json(lit), all);
  }
}

TEST(JsonString, NonAsciiUtf8CopiedOrEscaped) {
  const std::string s = "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80 \xEF\xBF\xBF";  // é € 😀 U+FFFF
  EXPECT_EQ(json_escape(s), s);
  EXPECT_EQ(json_escape(s, kAscii), "caf\\u00e9 \\u20ac \\ud83d\\ude00 \\uffff");
  EXPECT_EQ(parse_json(json_quote(s)), s);
  EXPECT_EQ(parse_json(json_quote(s, kAscii)), s);
  EXPECT_EQ(parse_json(json_quote(s, kAsciiSurrogates)), s);  // valid input: no surrogates
}

TEST(JsonString, InvalidUtf8ReplacedPerMaximalSubpart) {
  struct Case {
    std::string in, want;
  };
  const std::string r = "\xEF\xBF\xBD";  // U+FFFD
  const Case cases[] = {
      {"a\x80z", "a" + r + "z"},            // stray continuation byte
      {"\xC0\xAF", r + r},                  // overlong lead C0: each byte alone
      {"\xE0\x80\xAF", r + r + r},          // overlong 3-byte: second byte out of range
      {"\xED\xA0\x80", r + r + r},          // encoded surrogate U+D800
      {"\xF4\x90\x80\x80", r + r + r + r},  // past U+10FFFF
      {"\xF5", r},                          // never a lead byte
      {"\xE2\x82", r},                      // truncated at the end: one U+FFFD
      {"\xE2\x82z", r + "z"},               // truncated before ASCII
      {"\xF0\x9F\x98\xE2\x82\xAC", r + "\xE2\x82\xAC"},  // truncated 4-byte, then a valid €
  };
  for (const Case& c : cases) {
    EXPECT_EQ(json_escape(c.in), c.want);
    EXPECT_EQ(parse_json(json_quote(c.in)), c.want);
    EXPECT_EQ(parse_json(json_quote(c.in, kAscii)), c.want);
  }
  EXPECT_EQ(json_escape("\xE2\x82", kAscii), "\\ufffd");
}

TEST(JsonString, InvalidUtf8SurrogateEscapedPerByte) {
  const JsonStringOptions raw_surrogates{.invalid_utf8 = InvalidUtf8::kSurrogateEscape};
  EXPECT_EQ(json_escape("a\x80z", kAsciiSurrogates), "a\\udc80z");
  EXPECT_EQ(json_escape("\xE2\x82", kAsciiSurrogates), "\\udce2\\udc82");
  EXPECT_EQ(json_escape("\xED\xA0\x80", kAsciiSurrogates), "\\udced\\udca0\\udc80");
  // A truncated sequence does not swallow the valid character after it.
  EXPECT_EQ(json_escape("\xF0\x9F\xE2\x82\xAC", kAsciiSurrogates), "\\udcf0\\udc9f\\u20ac");
  EXPECT_EQ(json_escape("\xFF\xC3\xA9", raw_surrogates), "\\udcff\xC3\xA9");
}

TEST(JsonString, RandomBytesAlwaysParse) {
  std::mt19937 rng(7);
  // Biased towards the interesting bytes: controls, quotes, leads, continuations.
  const std::string pool = std::string("\0\x01\x1f\"\\/\n\r\t\x7f a", 12) +
                           "\x80\xbf\xc2\xc3\xdf\xe0\xe2\xed\xef\xf0\xf4\xf5\xff\x9f\xa0";
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1), len(0, 24);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string s(len(rng), '\0');
    for (char& c : s) c = pool[pick(rng)];
    const std::string a = parse_json(json_quote(s));
    EXPECT_EQ(parse_json(json_quote(s, kAscii)), a);
    // The replacement keeps every valid part: re-escaping the result is lossless.
    EXPECT_EQ(parse_json(json_quote(a)), a);
    const std::string ascii = json_quote(s, kAsciiSurrogates);
    for (char c : ascii) ASSERT_TRUE(c >= 0x20 && c < 0x7f) << "non-ASCII output";
  }
}

}  // namespace
}  // namespace kvstack

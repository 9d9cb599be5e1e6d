// Unit tests on synthetic vocabularies: pre-tokenizer splits, BPE merge
// order, SentencePiece scores and byte fallback, special-token partitioning,
// detokenization and the streaming decoder.
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/unicode.h"

namespace kvstack {
namespace {

using Words = std::vector<std::string>;

Words split(PreTokenizer kind, std::string_view text) {
  return pre_tokenize_text(kind, text);
}

// ---------------------------------------------------------------- unicode

TEST(Unicode, CategoryFlags) {
  using namespace unicode;
  EXPECT_EQ(cp_flags('a'), kLetter);
  EXPECT_EQ(cp_flags('7'), kNumber);
  EXPECT_EQ(cp_flags(' '), kSeparator | kWhitespace);
  EXPECT_EQ(cp_flags('\n'), kControl | kWhitespace);
  EXPECT_EQ(cp_flags(0x4E2D), kLetter);  // 中
  EXPECT_EQ(cp_flags(0x0663), kNumber);  // Arabic-Indic three
  EXPECT_EQ(cp_flags(0x0301), kMark);    // combining acute
  EXPECT_EQ(cp_flags(0x3000), kSeparator | kWhitespace);
  EXPECT_EQ(cp_flags(0x1F600), kSymbol);    // 😀
  EXPECT_EQ(cp_flags(0xE000), kControl);    // private use
  EXPECT_EQ(cp_flags(0xFDD0), kUndefined);  // noncharacter
  EXPECT_EQ(cp_flags(0x10FFFF), kUndefined);
  EXPECT_EQ(cp_flags(0x110000), 0);
  EXPECT_EQ(cp_flags(0x2EBF0), kLetter);  // CJK Ext. I (Unicode 15.1)
}

TEST(Unicode, ByteMapIsABijection) {
  std::set<uint32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = unicode::byte_to_cp(static_cast<uint8_t>(b));
    EXPECT_TRUE(seen.insert(cp).second);
    EXPECT_EQ(unicode::cp_to_byte(cp), b);
  }
  EXPECT_EQ(unicode::byte_to_utf8(' '), "\xC4\xA0");   // Ġ
  EXPECT_EQ(unicode::byte_to_utf8('\n'), "\xC4\x8A");  // Ċ
  EXPECT_EQ(unicode::byte_to_cp('A'), uint32_t('A'));
  EXPECT_EQ(unicode::cp_to_byte(0x144), -1);
}

TEST(Unicode, LenientDecodeMatchesLlamaRules) {
  std::vector<uint32_t> cp;
  unicode::decode_utf8_lenient("a\xC3\xA9\xFF\x80z\xE4\xB8", cp);
  EXPECT_EQ(cp, (std::vector<uint32_t>{'a', 0xE9, 0xFFFD, 0xFFFD, 'z', 0xFFFD, 0xFFFD}));
  cp.clear();
  unicode::decode_utf8_lenient("\xC0\x80\xED\xA0\x80", cp);  // overlong NUL, surrogate
  EXPECT_EQ(cp, (std::vector<uint32_t>{0, 0xD800}));
}

TEST(Unicode, StrictDecodeRoundTripsEveryScalarValue) {
  for (uint32_t cp = 0; cp <= unicode::kMaxCodepoint; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string utf8;
    unicode::append_utf8(cp, utf8);
    const unicode::Utf8Char c = unicode::decode_utf8_char(utf8 + "x");
    ASSERT_TRUE(c.valid) << std::hex << cp;
    ASSERT_EQ(c.cp, cp);
    ASSERT_EQ(c.len, utf8.size());
  }
}

TEST(Unicode, StrictDecodeRejectsIllFormedSequences) {
  struct Case {
    std::string_view bytes;
    size_t len;  // maximal well-formed prefix
    bool truncated;
  };
  const Case cases[] = {
      {"\x80", 1, false},              // lone continuation byte
      {"\xC0\x80", 1, false},          // overlong NUL
      {"\xC1\xBF", 1, false},          // overlong
      {"\xE0\x80\x80", 1, false},      // overlong 3-byte form
      {"\xED\xA0\x80", 1, false},      // surrogate U+D800
      {"\xF0\x80\x80\x80", 1, false},  // overlong 4-byte form
      {"\xF4\x90\x80\x80", 1, false},  // above U+10FFFF
      {"\xF5\x80\x80\x80", 1, false},  // never a lead byte
      {"\xFF", 1, false},
      {"\xE4\xB8", 2, true},  // cut short at the end of input
      {"\xF0\x9F\x98", 3, true},
      {"\xE4\xB8"
       "A",
       2, false},  // cut short by a non-continuation byte
      {"\xF0\x9F\x98"
       "A",
       3, false},
  };
  for (const Case& k : cases) {
    const unicode::Utf8Char c = unicode::decode_utf8_char(k.bytes);
    EXPECT_FALSE(c.valid) << testing::PrintToString(std::string(k.bytes));
    EXPECT_EQ(c.len, k.len) << testing::PrintToString(std::string(k.bytes));
    EXPECT_EQ(c.truncated, k.truncated) << testing::PrintToString(std::string(k.bytes));
  }
}

// ---------------------------------------------------------- pre-tokenizers

TEST(PreTokenize, Gpt2) {
  const auto k = PreTokenizer::kGpt2;
  EXPECT_EQ(split(k, "Hello world"), (Words{"Hello", " world"}));
  EXPECT_EQ(split(k, "I'm don't we'LL"), (Words{"I", "'m", " don", "'t", " we", "'", "LL"}));
  EXPECT_EQ(split(k, "x123 45"), (Words{"x", "123", " 45"}));
  EXPECT_EQ(split(k, "a   b"), (Words{"a", "  ", " b"}));
  EXPECT_EQ(split(k, "a \n\tb"), (Words{"a", " \n", "\t", "b"}));
  EXPECT_EQ(split(k, "end   "), (Words{"end", "   "}));
  EXPECT_EQ(split(k, "hi!!! ?"), (Words{"hi", "!!!", " ?"}));
  EXPECT_EQ(split(k, "日本語 テスト"), (Words{"日本語", " テスト"}));
  EXPECT_EQ(split(k, "café\u0301x"), (Words{"café", "\u0301", "x"}));
}

TEST(PreTokenize, SmollmIsolatesEveryDigit) {
  const auto k = PreTokenizer::kSmollm;
  EXPECT_EQ(split(k, "abc 123"), (Words{"abc", " ", "1", "2", "3"}));
  EXPECT_EQ(split(k, "v2.0"), (Words{"v", "2", ".", "0"}));
  EXPECT_EQ(split(k, "x\u0663\u0664"), (Words{"x", "\u0663", "\u0664"}));  // Arabic-Indic digits
  EXPECT_EQ(split(k, "½ cup"), (Words{"½", " cup"}));
  EXPECT_EQ(split(k, "  9"), (Words{"  ", "9"}));
}

TEST(PreTokenize, Llama3) {
  const auto k = PreTokenizer::kLlama3;
  EXPECT_EQ(split(k, "1234567"), (Words{"123", "456", "7"}));
  EXPECT_EQ(split(k, "Hello\n\nWorld"), (Words{"Hello", "\n\n", "World"}));
  EXPECT_EQ(split(k, "I'M HERE"), (Words{"I", "'M", " HERE"}));
  EXPECT_EQ(split(k, "a  \n  b"), (Words{"a", "  \n", " ", " b"}));
  EXPECT_EQ(split(k, "(foo)"), (Words{"(foo", ")"}));
  EXPECT_EQ(split(k, " ...\n\nx"), (Words{" ...\n\n", "x"}));
  EXPECT_EQ(split(k, "\tword"), (Words{"\tword"}));
  EXPECT_EQ(split(k, "\nword"), (Words{"\n", "word"}));
  EXPECT_EQ(split(k, "x   "), (Words{"x", "   "}));
}

TEST(PreTokenize, Qwen2SplitsDigitsSingly) {
  EXPECT_EQ(split(PreTokenizer::kQwen2, "ab 2024!"), (Words{"ab", " ", "2", "0", "2", "4", "!"}));
}

TEST(PreTokenize, Default) {
  const auto k = PreTokenizer::kDefault;
  EXPECT_EQ(split(k, "cost: $1234567"), (Words{"cost", ":", " ", "$", "123", "456", "7"}));
  EXPECT_EQ(split(k, "a+b"), (Words{"a", "+", "b"}));
  EXPECT_EQ(split(k, "x `y`"), (Words{"x", " `", "y", "`"}));
}

TEST(PreTokenize, PiecesCoverInput) {
  const std::string text = "  Mixed\t\t text 12 ½ 👍🏽 \u200d ＡＢ\r\n\r\n  end  ";
  for (auto k : {PreTokenizer::kDefault, PreTokenizer::kGpt2, PreTokenizer::kSmollm,
                 PreTokenizer::kLlama3, PreTokenizer::kQwen2}) {
    std::string joined;
    for (const auto& w : split(k, text)) {
      EXPECT_FALSE(w.empty());
      joined += w;
    }
    EXPECT_EQ(joined, text) << pre_tokenizer_name(k);
  }
}

TEST(PreTokenize, NamesMapToKinds) {
  EXPECT_EQ(pre_tokenizer_from_name("smollm")->kind, PreTokenizer::kSmollm);
  EXPECT_FALSE(pre_tokenizer_from_name("smollm")->clean_spaces);
  EXPECT_EQ(pre_tokenizer_from_name("llama-bpe")->kind, PreTokenizer::kLlama3);
  EXPECT_TRUE(pre_tokenizer_from_name("llama-bpe")->ignore_merges);
  EXPECT_EQ(pre_tokenizer_from_name("qwen2")->kind, PreTokenizer::kQwen2);
  EXPECT_EQ(pre_tokenizer_from_name("gpt-2")->kind, PreTokenizer::kGpt2);
  EXPECT_EQ(pre_tokenizer_from_name("")->kind, PreTokenizer::kDefault);
  EXPECT_FALSE(pre_tokenizer_from_name("no-such-pre").has_value());
}

// --------------------------------------------------------- byte-level BPE

// 256 byte tokens (id = byte value), then the merge results in order, then
// specials.
struct BpeFixture {
  VocabData data;
  explicit BpeFixture(std::vector<std::string> merges, std::string pre = "gpt-2") {
    data.type = VocabType::kBpe;
    data.pre = std::move(pre);
    for (int b = 0; b < 256; ++b) data.tokens.push_back(unicode::byte_to_utf8(uint8_t(b)));
    for (const auto& m : merges) {
      const size_t sp = m.find(' ');
      data.tokens.push_back(m.substr(0, sp) + m.substr(sp + 1));
    }
    data.merges = std::move(merges);
    data.token_types.assign(data.tokens.size(), int32_t(TokenType::kNormal));
  }
  TokenId add_special(const std::string& text, TokenType type = TokenType::kControl) {
    data.tokens.push_back(text);
    data.token_types.push_back(int32_t(type));
    return TokenId(data.tokens.size() - 1);
  }
  Tokenizer make() {
    auto t = Tokenizer::create(data);
    EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message);
    return std::move(t).value();
  }
};

std::vector<std::string> texts(const Tokenizer& t, const std::vector<TokenId>& ids) {
  std::vector<std::string> out;
  out.reserve(ids.size());
  for (TokenId id : ids) out.push_back(t.token_text(id));
  return out;
}

const TokenizeOptions kPlain{.add_special = false, .parse_special = false};
const TokenizeOptions kSpecial{.add_special = false, .parse_special = true};

TEST(Bpe, MergeOrderDecides) {
  {
    BpeFixture f({"a b", "b c"});
    auto t = f.make();
    EXPECT_EQ(texts(t, t.tokenize("abc", kPlain)), (Words{"ab", "c"}));
  }
  {
    BpeFixture f({"b c", "a b"});
    auto t = f.make();
    EXPECT_EQ(texts(t, t.tokenize("abc", kPlain)), (Words{"a", "bc"}));
  }
}

TEST(Bpe, EqualRanksMergeLeftmostFirst) {
  BpeFixture f({"a a"});
  auto t = f.make();
  EXPECT_EQ(texts(t, t.tokenize("aaaaa", kPlain)), (Words{"aa", "aa", "a"}));
}

TEST(Bpe, MergesChainAndRespectWords) {
  // "Ġ" is the GPT-2 character for a space.
  BpeFixture f({"h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"});
  auto t = f.make();
  EXPECT_EQ(texts(t, t.tokenize("hello world", kPlain)), (Words{"hello", "Ġworld"}));
  EXPECT_EQ(texts(t, t.tokenize("hellohello", kPlain)), (Words{"hello", "hello"}));
  // Merges never cross words: "o" and "Ġw" are in different words here.
  EXPECT_EQ(texts(t, t.tokenize("hello worl", kPlain)), (Words{"hello", "Ġworl"}));
  EXPECT_EQ(texts(t, t.tokenize("world", kPlain)), (Words{"w", "or", "l", "d"}));
}

TEST(Bpe, LaterMergeOfStaleFragmentIsSkipped) {
  // "b c" ranks first; once "bc" exists the queued "a b" pair is stale.
  BpeFixture f({"b c", "a b", "a bc"});
  auto t = f.make();
  EXPECT_EQ(texts(t, t.tokenize("abc", kPlain)), (Words{"abc"}));
}

TEST(Bpe, MultiByteCharactersAreBytes) {
  BpeFixture f({"Ã ©"});  // "é" is C3 A9 -> GPT-2 chars Ã ©
  auto t = f.make();
  const auto ids = t.tokenize("é€", kPlain);
  ASSERT_EQ(ids.size(), 4u);  // é merged, € stays three byte tokens
  EXPECT_EQ(t.token_text(ids[0]), "Ã©");
  EXPECT_EQ(ids[1], 0xE2);
  EXPECT_EQ(*t.detokenize(ids), "é€");
}

TEST(Bpe, InvalidUtf8BecomesReplacementChar) {
  BpeFixture f({});
  auto t = f.make();
  const auto ids = t.tokenize("a\xFF", kPlain);
  EXPECT_EQ(ids, (std::vector<TokenId>{'a', 0xEF, 0xBF, 0xBD}));
}

TEST(Bpe, LongWhitespaceAndWordsAreNotQuadratic) {
  BpeFixture f({"Ġ Ġ", "ĠĠ ĠĠ", "a a", "aa aa"});
  auto t = f.make();
  // 199999 spaces form one word (the last space goes with "x"): ĠĠĠĠ x 49999,
  // then ĠĠ and Ġ; then "Ġ", "x".
  const auto ids = t.tokenize(std::string(200000, ' ') + "x", kPlain);
  EXPECT_EQ(ids.size(), 49999u + 2 + 2);
  EXPECT_EQ(t.tokenize(std::string(200000, 'a'), kPlain).size(), 50000u);
}

TEST(Bpe, IgnoreMergesTakesWholeWordToken) {
  // With llama-bpe a word that is itself a token is emitted even when no merge
  // path leads to it.
  BpeFixture f({"a b"}, "llama-bpe");
  f.data.tokens.push_back("abc");
  f.data.token_types.push_back(int32_t(TokenType::kNormal));
  auto t = f.make();
  EXPECT_EQ(texts(t, t.tokenize("abc", kPlain)), (Words{"abc"}));
  BpeFixture g({"a b"}, "gpt-2");
  g.data.tokens.push_back("abc");
  g.data.token_types.push_back(int32_t(TokenType::kNormal));
  auto u = g.make();
  EXPECT_EQ(texts(u, u.tokenize("abc", kPlain)), (Words{"ab", "c"}));
}

// ----------------------------------------------------------- special tokens

TEST(Special, ParsedOnlyWhenAsked) {
  BpeFixture f({});
  const TokenId start = f.add_special("<|im_start|>");
  auto t = f.make();
  const auto on = t.tokenize("x<|im_start|>y", kSpecial);
  EXPECT_EQ(on, (std::vector<TokenId>{'x', start, 'y'}));
  const auto off = t.tokenize("x<|im_start|>y", kPlain);
  EXPECT_EQ(off.size(), 14u);
  EXPECT_EQ(*t.detokenize(off), "x<|im_start|>y");
}

TEST(Special, LongestTokenClaimsTextFirst) {
  BpeFixture f({});
  const TokenId ab = f.add_special("<ab>");
  const TokenId abx = f.add_special("<ab>x");
  auto t = f.make();
  EXPECT_EQ(t.tokenize("<ab>x<ab>", kSpecial), (std::vector<TokenId>{abx, ab}));
}

TEST(Special, UserDefinedTokensAlwaysSplit) {
  BpeFixture f({});
  const TokenId user = f.add_special("<tool>", TokenType::kUserDefined);
  auto t = f.make();
  EXPECT_EQ(t.tokenize("a<tool>", kPlain), (std::vector<TokenId>{'a', user}));
  // User-defined tokens render even without render_special.
  EXPECT_EQ(*t.detokenize(std::vector<TokenId>{'a', user}), "a<tool>");
}

TEST(Special, BosEosAndEogFromMetadata) {
  BpeFixture f({});
  const TokenId bos = f.add_special("<|begin|>");
  const TokenId end = f.add_special("<|im_end|>");
  const TokenId eos = f.add_special("<|endoftext|>");
  f.data.bos_id = bos;
  f.data.eos_id = eos;
  f.data.add_bos = true;
  f.data.add_eos = true;
  auto t = f.make();
  EXPECT_EQ(t.bos(), bos);
  EXPECT_EQ(t.eot(), end);  // lowest id among end-of-turn-looking tokens
  EXPECT_TRUE(t.is_eog(eos));
  EXPECT_TRUE(t.is_eog(end));
  EXPECT_FALSE(t.is_eog(bos));
  const auto ids = t.tokenize("hi", TokenizeOptions{.add_special = true});
  EXPECT_EQ(ids, (std::vector<TokenId>{bos, 'h', 'i', eos}));
  EXPECT_EQ(*t.detokenize(ids), "hi");
  EXPECT_EQ(*t.detokenize(ids, DetokenizeOptions{.render_special = true}),
            "<|begin|>hi<|endoftext|>");
  f.data.add_bos = false;
  f.data.add_eos = false;
  auto u = f.make();
  EXPECT_EQ(u.tokenize("hi", TokenizeOptions{.add_special = true}),
            (std::vector<TokenId>{'h', 'i'}));
}

TEST(Special, OutOfRangeIdsAreErrors) {
  BpeFixture f({});
  auto t = f.make();
  auto r = t.detokenize(std::vector<TokenId>{1, 9999});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("9999"), std::string::npos);
  EXPECT_FALSE(t.detokenize(std::vector<TokenId>{-1}).ok());
}

TEST(Detokenize, CleanSpacesForDefaultPre) {
  BpeFixture f({}, "default");
  auto t = f.make();
  const std::string s = "Hi , you ' re here ! It 's ok .";
  EXPECT_EQ(*t.detokenize(t.tokenize(s, kPlain)), "Hi, you're here! It's ok.");
  BpeFixture g({}, "smollm");  // clean_spaces off: exact round trip
  auto u = g.make();
  EXPECT_EQ(*u.detokenize(u.tokenize(s, kPlain)), s);
}

TEST(Create, RejectsBadVocabs) {
  BpeFixture f({}, "made-up");
  EXPECT_EQ(Tokenizer::create(f.data).error().code, Errc::kUnsupported);
  BpeFixture g({});
  g.data.token_types.resize(3);
  EXPECT_EQ(Tokenizer::create(g.data).error().code, Errc::kCorruptFile);
  BpeFixture h({});
  h.data.tokens.push_back("a");  // duplicate of byte token 'a'
  EXPECT_FALSE(Tokenizer::create(h.data).ok());
}

// ------------------------------------------------------ SentencePiece BPE

struct SpmFixture {
  VocabData data;
  SpmFixture() {
    data.type = VocabType::kSpm;
    auto add = [&](const std::string& t, TokenType type, float score) {
      data.tokens.push_back(t);
      data.token_types.push_back(int32_t(type));
      data.scores.push_back(score);
    };
    add("<unk>", TokenType::kUnknown, 0);
    add("<s>", TokenType::kControl, 0);
    add("</s>", TokenType::kControl, 0);
    static const char* kHex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      add(std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">", TokenType::kByte, 0);
    }
    // Pieces; higher score merges first.
    for (const char* p :
         {"▁",   "h",      "e",  "l",  "o",    "w",  "r",      "d", "▁h", "he", "ll", "▁he",
          "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "a", "b",  "c",  "ab", "bc"}) {
      add(p, TokenType::kNormal, -static_cast<float>(data.tokens.size()));
    }
  }
  Tokenizer make() { return std::move(Tokenizer::create(data)).value(); }
};

TEST(Spm, ScoresDriveMerges) {
  SpmFixture f;
  auto t = f.make();
  EXPECT_EQ(t.bos(), 1);
  EXPECT_TRUE(t.add_bos());
  const auto ids = t.tokenize("hello world", TokenizeOptions{.add_special = true});
  EXPECT_EQ(texts(t, ids), (Words{"<s>", "▁hello", "▁world"}));
  EXPECT_EQ(*t.detokenize(ids), " hello world");
  EXPECT_EQ(*t.detokenize(ids, DetokenizeOptions{.remove_special = true}), " hello world");
  EXPECT_EQ(t.token_to_piece(ids[1], false, /*lstrip=*/1), "hello");
}

TEST(Spm, HigherScoreWinsOverLeftmost) {
  SpmFixture f;
  f.data.add_space_prefix = false;
  auto set_score = [&](const std::string& piece, float score) {
    for (size_t i = 0; i < f.data.tokens.size(); ++i) {
      if (f.data.tokens[i] == piece) f.data.scores[i] = score;
    }
  };
  set_score("ab", -5);
  set_score("bc", -5);
  auto tie = f.make();  // equal scores: the leftmost pair merges first
  EXPECT_EQ(texts(tie, tie.tokenize("abc", kPlain)), (Words{"ab", "c"}));
  set_score("bc", -4);
  auto u = f.make();
  EXPECT_EQ(texts(u, u.tokenize("abc", kPlain)), (Words{"a", "bc"}));
}

TEST(Spm, ByteFallbackForUnknownCharacters) {
  SpmFixture f;
  auto t = f.make();
  const auto ids = t.tokenize("hé", kPlain);
  EXPECT_EQ(texts(t, ids), (Words{"▁h", "<0xC3>", "<0xA9>"}));
  EXPECT_EQ(*t.detokenize(ids), "hé");  // the added space prefix is stripped again
}

TEST(Spm, SpacePrefixOptionalAndAfterSpecials) {
  SpmFixture f;
  auto t = f.make();
  EXPECT_EQ(texts(t, t.tokenize("hello</s>world", kSpecial)), (Words{"▁hello", "</s>", "▁world"}));
  f.data.add_space_prefix = false;
  auto u = f.make();
  EXPECT_EQ(texts(u, u.tokenize("hello", kPlain)), (Words{"he", "llo"}));
}

// --------------------------------------------------------- stream decoder

TEST(StreamDecoder, HoldsBackSplitCharacters) {
  BpeFixture f({});
  auto t = f.make();
  StreamDecoder dec(t);
  EXPECT_EQ(dec.push('a'), "a");
  EXPECT_EQ(dec.push(0xC3), "");  // first byte of é
  EXPECT_EQ(dec.pending_bytes(), 1u);
  EXPECT_EQ(dec.push(0xA9), "é");
  // 🎉 = F0 9F 8E 89 split 1 + 3.
  EXPECT_EQ(dec.push(0xF0), "");
  EXPECT_EQ(dec.push(0x9F), "");
  EXPECT_EQ(dec.push(0x8E), "");
  EXPECT_EQ(dec.push(0x89), "🎉");
  EXPECT_EQ(dec.flush(), "");
}

TEST(StreamDecoder, MatchesDetokenizeOnWholeStream) {
  BpeFixture f({"Ã ©", "ä ¸", "Ġ ä"});
  auto t = f.make();
  const std::string text = "naïve 中文 é 👍🏽 ok";
  const auto ids = t.tokenize(text, kPlain);
  StreamDecoder dec(t);
  std::string streamed;
  for (TokenId id : ids) streamed += dec.push(id);
  streamed += dec.flush();
  EXPECT_EQ(streamed, text);
}

TEST(StreamDecoder, InvalidAndTruncatedBytesBecomeReplacement) {
  BpeFixture f({});
  auto t = f.make();
  StreamDecoder dec(t);
  EXPECT_EQ(dec.push(0x80), "\uFFFD");  // stray continuation byte
  EXPECT_EQ(dec.push(0xE4), "");
  EXPECT_EQ(dec.push('x'), "\uFFFDx");                              // E4 cut short by 'x'
  EXPECT_EQ(dec.push_bytes("\xC0\xAF"), "\uFFFD\uFFFD");            // overlong
  EXPECT_EQ(dec.push_bytes("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate
  EXPECT_EQ(dec.push(0xF0), "");
  EXPECT_EQ(dec.push(0x9F), "");
  EXPECT_EQ(dec.flush(), "\uFFFD");  // incomplete tail at the end
  EXPECT_EQ(dec.pending_bytes(), 0u);
}

}  // namespace
}  // namespace kvstack

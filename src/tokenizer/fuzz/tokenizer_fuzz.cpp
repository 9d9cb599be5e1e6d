// libFuzzer target for Tokenizer::tokenize / detokenize / StreamDecoder on
// the default model's vocabulary. Any byte string must tokenize (invalid
// UTF-8 becomes U+FFFD) into ids inside the vocabulary, in every option
// combination, and the ids must detokenize. Without special-token parsing,
// on valid UTF-8, the text must round-trip, except for the bytes the
// vocabulary has no byte token for (e.g. 0x04 and 0xF2 here; llama.cpp
// drops them too) and unless a token's piece is hidden. Streaming the ids
// through StreamDecoder must give the bytes detokenize gives (when those are
// valid UTF-8). No crash, no sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/fuzz/fuzz_tokenizer_model.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/unicode.h"

namespace {

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid.
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      return false;
    }
    i += n;
  }
  return true;
}

// `text` without the bytes whose byte-level symbol is not in the vocabulary.
std::string representable(const kvstack::Tokenizer& tok, std::string_view text) {
  static const std::vector<bool> has = [&] {
    std::vector<bool> v(256);
    for (int b = 0; b < 256; ++b) {
      v[b] = tok.find_token(kvstack::unicode::byte_to_utf8(static_cast<uint8_t>(b))) !=
             kvstack::kNoToken;
    }
    return v;
  }();
  std::string out;
  for (char c : text) {
    if (has[static_cast<unsigned char>(c)]) out += c;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvstack;
  const Tokenizer& tok = fuzz::model_tokenizer();
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (int mode = 0; mode < 4; ++mode) {
    const TokenizeOptions opt{.add_special = (mode & 1) != 0, .parse_special = (mode & 2) != 0};
    const std::vector<TokenId> ids = tok.tokenize(text, opt);
    if (!tok.validate(ids).ok()) __builtin_trap();
    auto back = tok.detokenize(ids);
    if (!back) __builtin_trap();
    // Plain text (no special-token parsing, nothing added) comes back byte
    // for byte: byte-level BPE loses nothing on valid UTF-8.
    bool visible = true;
    for (TokenId id : ids) visible = visible && !tok.token_to_piece(id).empty();
    const bool plain = mode == 0 && valid_utf8(text) && visible;
    if (plain && *back != representable(tok, text)) __builtin_trap();
    // Streaming the same ids gives what detokenize gives, when that is valid
    // UTF-8 (a dropped lead byte leaves stray continuation bytes, which the
    // stream decoder, whose output goes into JSON, does not pass through).
    if (plain && valid_utf8(*back)) {
      StreamDecoder dec(tok, false);
      std::string streamed;
      for (TokenId id : ids) streamed += dec.push(id);
      streamed += dec.flush();
      if (streamed != *back) __builtin_trap();
    }
  }
  return 0;
}

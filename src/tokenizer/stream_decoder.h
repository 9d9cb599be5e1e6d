// StreamDecoder: turns a token stream into text one token at a time,
// returning only complete UTF-8 characters.
//
// A token's piece may end inside a multi-byte character (byte-level BPE and
// <0xXX> byte tokens split characters freely); those bytes are held back
// until the character completes. Bytes that can never start or continue a
// valid character (stray continuation bytes, overlong forms, surrogates,
// > U+10FFFF) are replaced by U+FFFD at once, one per maximal invalid
// subsequence, so every returned string is valid UTF-8.
//
// Thread-safety: none; one decoder per sequence. Lifetime: keep the
// Tokenizer alive while the decoder is used.
#pragma once

#include <string>

#include "tokenizer/tokenizer.h"

namespace kvstack {

class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool render_special = false)
      : tokenizer_(&tokenizer), render_special_(render_special) {}

  // Appends `id`'s piece; returns the text that is now complete (maybe "").
  // REQUIRES: tokenizer.is_valid(id).
  std::string push(TokenId id);

  // Raw bytes instead of a token (used by tests and for byte streams).
  std::string push_bytes(std::string_view bytes);

  // Ends the stream: returns the held-back bytes, an incomplete character
  // becoming U+FFFD. The decoder is then empty and reusable.
  std::string flush();

  void reset() { pending_.clear(); }
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool render_special_;
  std::string pending_;  // bytes of an incomplete trailing character
};

// Validates `bytes` as UTF-8 and appends them to `out`, invalid sequences
// replaced by U+FFFD. If `final_chunk` is false, a valid but incomplete
// sequence at the end is left unconsumed; returns the number of bytes
// consumed.
size_t append_valid_utf8(std::string_view bytes, bool final_chunk, std::string& out);

}  // namespace kvstack

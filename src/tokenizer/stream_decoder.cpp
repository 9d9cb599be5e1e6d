#include "tokenizer/stream_decoder.h"

#include "tokenizer/unicode.h"

namespace kvstack {

namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";

}  // namespace

size_t append_valid_utf8(std::string_view bytes, bool final_chunk, std::string& out) {
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    const unicode::Utf8Char c = unicode::decode_utf8_char(bytes.substr(i));
    if (c.valid) {
      out.append(bytes.substr(i, c.len));
    } else if (c.truncated && !final_chunk) {
      return i;  // valid so far, waiting for more bytes
    } else {
      out += kReplacement;  // maximal invalid (or truncated) subsequence
    }
    i += c.len;
  }
  return n;
}

std::string StreamDecoder::push(TokenId id) {
  std::string piece;
  tokenizer_->append_piece(id, render_special_, piece);
  return push_bytes(piece);
}

std::string StreamDecoder::push_bytes(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  const size_t used = append_valid_utf8(pending_, /*final_chunk=*/false, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_valid_utf8(pending_, /*final_chunk=*/true, out);
  pending_.clear();
  return out;
}

}  // namespace kvstack

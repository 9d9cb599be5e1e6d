#include "tokenizer/stream_decoder.h"

namespace kvstack {

namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";

// For a lead byte: total sequence length (0 if the byte cannot start one)
// and the allowed range of the second byte (excludes overlongs, surrogates
// and values above U+10FFFF).
struct LeadInfo {
  int len;
  uint8_t lo, hi;
};

LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

}  // namespace

size_t append_valid_utf8(std::string_view bytes, bool final_chunk, std::string& out) {
  const auto* s = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    const LeadInfo info = lead_info(s[i]);
    if (info.len == 1) {
      out.push_back(static_cast<char>(s[i++]));
      continue;
    }
    if (info.len == 0) {
      out += kReplacement;
      ++i;
      continue;
    }
    // Count how many bytes of the sequence are present and valid.
    size_t k = 1;
    while (k < static_cast<size_t>(info.len) && i + k < n) {
      const uint8_t c = s[i + k];
      const bool ok = k == 1 ? (c >= info.lo && c <= info.hi) : (c & 0xC0) == 0x80;
      if (!ok) break;
      ++k;
    }
    if (k == static_cast<size_t>(info.len)) {
      out.append(bytes.substr(i, k));
      i += k;
    } else if (i + k == n && !final_chunk) {
      return i;  // valid so far, waiting for more bytes
    } else {
      out += kReplacement;  // maximal invalid (or truncated) subsequence
      i += k;
    }
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

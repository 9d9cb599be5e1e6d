#include "server/request_head.h"

#include <cctype>
#include <cstdint>

namespace kvstack::server {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

HeadCheck fail(int status, std::string message) {
  return HeadCheck{status, std::move(message)};
}

}  // namespace

HeadCheck check_request_head(std::string_view head, size_t max_body_bytes) {
  // Lines: every '\n' preceded by '\r', no other '\r'.
  for (size_t i = 0; i < head.size(); ++i) {
    if (head[i] == '\n' && (i == 0 || head[i - 1] != '\r')) {
      return fail(400, "a line of the request head ends with a bare LF (CRLF required)");
    }
    if (head[i] == '\r' && (i + 1 >= head.size() || head[i + 1] != '\n')) {
      return fail(400, "a bare CR in the request head");
    }
  }
  size_t eol = head.find("\r\n");
  if (eol == std::string_view::npos) return fail(400, "the request head has no request line");
  const std::string_view request_line = head.substr(0, eol);
  const std::string method(request_line.substr(0, request_line.find(' ')));

  int n_length = 0, n_te = 0;
  uint64_t length = 0;
  std::string te;
  for (size_t pos = eol + 2; pos < head.size();) {
    const size_t end = head.find("\r\n", pos);
    if (end == std::string_view::npos || end == pos) break;  // the blank line
    const std::string_view line = head.substr(pos, end - pos);
    pos = end + 2;
    if (line.front() == ' ' || line.front() == '\t') {
      return fail(400, "obsolete line folding in the request head");
    }
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      return fail(400, "a header line without a name and a colon");
    }
    const std::string_view name = line.substr(0, colon);
    if (name.find_first_of(" \t") != std::string_view::npos) {
      return fail(400, "whitespace in the header name '" + std::string(trim(name)) + "'");
    }
    const std::string key = lower(name);
    const std::string_view value = trim(line.substr(colon + 1));
    if (key == "content-length") {
      if (++n_length > 1) return fail(400, "more than one Content-Length header");
      if (value.empty() || value.size() > 19 ||
          value.find_first_not_of("0123456789") != std::string_view::npos) {
        return fail(400, "Content-Length '" + std::string(value.substr(0, 32)) +
                             "' is not a non-negative decimal number");
      }
      for (char c : value) length = length * 10 + static_cast<uint64_t>(c - '0');
    } else if (key == "transfer-encoding") {
      n_te++;
      te = lower(value);
    } else if (key == "content-encoding") {
      const std::string enc = lower(value);
      if (!enc.empty() && enc != "identity") {
        return fail(415, "Content-Encoding '" + std::string(value.substr(0, 32)) +
                             "' is not accepted: send the body uncompressed");
      }
    }
  }
  if (n_te > 0 && n_length > 0) {
    return fail(400, "both Content-Length and Transfer-Encoding: the body's length is ambiguous");
  }
  if (n_te > 1 || (n_te == 1 && te != "chunked")) {
    return fail(501, "Transfer-Encoding '" + te.substr(0, 32) +
                         "' is not supported (only a single 'chunked')");
  }
  if (n_length == 1 && length > max_body_bytes) {
    return fail(413, "the request body is " + std::to_string(length) + " bytes, over the " +
                         std::to_string(max_body_bytes) + "-byte limit");
  }
  if (n_length == 0 && n_te == 0 && (method == "POST" || method == "PUT" || method == "PATCH")) {
    const size_t sp = request_line.find(' ');
    std::string_view target =
        sp == std::string_view::npos ? std::string_view() : request_line.substr(sp + 1);
    target = target.substr(0, target.find_first_of(" ?"));
    if (method == "POST" && (target == "/flush_cache" || target == "/reset_prefix_cache")) {
      return HeadCheck{0, {}, true};
    }
    return fail(411, method + " needs a Content-Length (or chunked Transfer-Encoding)");
  }
  return {};
}

}  // namespace kvstack::server

// check_request_head: the framing rules GuardedServer (connection_guard.h)
// applies to a complete HTTP/1.x request head before httplib parses it, so
// that the server and any proxy in front of it agree on where a request
// ends (no request smuggling) and no body is read without a bound.
//
// REQUIRES: `head` is the request line, the header lines and the blank line
// ("...\r\n\r\n"). Returns status 0 when the request may go on, else the
// HTTP status to answer and a message naming what is wrong:
//   400  a line not ended by CRLF, obsolete line folding, a header line
//        without a colon or with whitespace before it, more than one
//        Content-Length, a Content-Length that is not a plain decimal number,
//        Content-Length together with Transfer-Encoding
//   411  POST/PUT/PATCH with neither Content-Length nor chunking, except a
//        POST to a path that takes no body (/flush_cache,
//        /reset_prefix_cache: vllm-router sends its flush without either):
//        accepted with frame_empty set, and the caller frames it as
//        Content-Length: 0 (what RFC 9112 section 6.3 says such a request has)
//   413  Content-Length over max_body_bytes
//   415  a Content-Encoding other than identity (bodies are never inflated)
//   501  a Transfer-Encoding other than a single "chunked"
//
// Thread-safety: a pure function.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvstack::server {

struct HeadCheck {
  int status = 0;  // 0 = acceptable
  std::string message;
  bool frame_empty = false;  // a body-less POST without framing: add Content-Length: 0
};

HeadCheck check_request_head(std::string_view head, size_t max_body_bytes);

}  // namespace kvstack::server

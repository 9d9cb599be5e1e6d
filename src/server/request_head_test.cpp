#include "server/request_head.h"

#include <gtest/gtest.h>

#include <string>

namespace kvstack::server {
namespace {

constexpr size_t kMax = 1000;

int status_of(const std::string& headers, const std::string& method = "POST") {
  return check_request_head(method + " /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + "\r\n",
                            kMax)
      .status;
}

TEST(RequestHead, AcceptsOrdinaryRequests) {
  EXPECT_EQ(status_of("Content-Length: 10\r\n"), 0);
  EXPECT_EQ(status_of("content-length:10\r\n"), 0);
  EXPECT_EQ(status_of("Transfer-Encoding: chunked\r\n"), 0);
  EXPECT_EQ(status_of("Transfer-Encoding: Chunked\r\n"), 0);
  EXPECT_EQ(status_of("Content-Length: 1000\r\nContent-Encoding: identity\r\n"), 0);
  EXPECT_EQ(status_of("", "GET"), 0);
  EXPECT_EQ(status_of("Range: bytes=0-,0-\r\n", "GET"), 0);  // ignored later, not refused
}

// The cache-clear paths take no body: routers POST them without framing.
TEST(RequestHead, BodylessCacheClearPostIsFramedEmpty) {
  for (const char* path : {"/flush_cache", "/reset_prefix_cache", "/flush_cache?x=1"}) {
    const HeadCheck c =
        check_request_head(std::string("POST ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n", kMax);
    EXPECT_EQ(c.status, 0) << path;
    EXPECT_TRUE(c.frame_empty) << path;
  }
  // Only POST, only those paths, only without framing.
  EXPECT_EQ(check_request_head("PUT /flush_cache HTTP/1.1\r\n\r\n", kMax).status, 411);
  EXPECT_EQ(check_request_head("POST /flush_cache_x HTTP/1.1\r\n\r\n", kMax).status, 411);
  EXPECT_EQ(check_request_head("POST /v1/flush_cache HTTP/1.1\r\n\r\n", kMax).status, 411);
  const HeadCheck framed =
      check_request_head("POST /flush_cache HTTP/1.1\r\nContent-Length: 2\r\n\r\n", kMax);
  EXPECT_EQ(framed.status, 0);
  EXPECT_FALSE(framed.frame_empty);
  EXPECT_FALSE(check_request_head("GET /flush_cache HTTP/1.1\r\n\r\n", kMax).frame_empty);
}

TEST(RequestHead, RefusesAmbiguousLengths) {
  EXPECT_EQ(status_of("Content-Length: 10\r\nTransfer-Encoding: chunked\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: 10\r\nContent-Length: 10\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: -1\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: +5\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: 1e3\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: \r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: 99999999999999999999999\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length : 10\r\n"), 400);
  EXPECT_EQ(status_of("Content-Length: 10\r\n X: folded\r\n"), 400);
  EXPECT_EQ(status_of("NoColonHere\r\n"), 400);
  EXPECT_EQ(check_request_head("POST / HTTP/1.1\nContent-Length: 1\r\n\r\n", kMax).status, 400);
  EXPECT_EQ(check_request_head("POST / HTTP/1.1\r\nContent-Length: 1\rX: y\r\n\r\n", kMax).status,
            400);
}

TEST(RequestHead, RefusesUnboundedOrEncodedBodies) {
  EXPECT_EQ(status_of("Content-Length: 1001\r\n"), 413);
  EXPECT_EQ(status_of(""), 411);
  EXPECT_EQ(status_of("", "PUT"), 411);
  EXPECT_EQ(status_of("Transfer-Encoding: gzip, chunked\r\n"), 501);
  EXPECT_EQ(status_of("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n"), 501);
  EXPECT_EQ(status_of("Content-Length: 10\r\nContent-Encoding: gzip\r\n"), 415);
  EXPECT_EQ(status_of("Content-Length: 10\r\nContent-Encoding: br\r\n"), 415);
  const HeadCheck c = check_request_head(
      "POST / HTTP/1.1\r\nContent-Length: 10\r\nContent-Encoding: deflate\r\n\r\n", kMax);
  EXPECT_NE(c.message.find("deflate"), std::string::npos) << c.message;
}

}  // namespace
}  // namespace kvstack::server

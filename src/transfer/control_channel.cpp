#include "transfer/control_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvstack::transfer {

namespace {

using Clock = std::chrono::steady_clock;

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

Result<sockaddr_in> make_addr(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return make_error(Errc::kInvalidArgument,
                      "'" + host +
                          "' is not a numeric IPv4 address (the transfer endpoint is "
                          "never resolved by name)");
  }
  return a;
}

void set_nonblocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Result<Socket> Socket::connect(const std::string& host, int port,
                               std::chrono::milliseconds timeout) {
  auto a = make_addr(host, port);
  if (!a) return a.error();
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return make_error(Errc::kIo, std::string("socket: ") + std::strerror(errno));
  set_nonblocking(s.fd());
  const int one = 1;
  setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const std::string where = host + ":" + std::to_string(port);
  if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&*a), sizeof(*a)) != 0) {
    if (errno != EINPROGRESS) {
      return make_error(Errc::kIo, "connect " + where + ": " + std::strerror(errno));
    }
    pollfd p{s.fd(), POLLOUT, 0};
    const int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
    if (r <= 0) {
      return make_error(Errc::kIo, "connect " + where + ": no answer within " +
                                       std::to_string(timeout.count()) + " ms");
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return make_error(Errc::kIo, "connect " + where + ": " + std::strerror(err));
  }
  return s;
}

Result<Socket> Socket::listen(const std::string& host, int port) {
  auto a = make_addr(host, port);
  if (!a) return a.error();
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return make_error(Errc::kIo, std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const std::string where = host + ":" + std::to_string(port);
  if (::bind(s.fd(), reinterpret_cast<const sockaddr*>(&*a), sizeof(*a)) != 0) {
    return make_error(Errc::kIo, "bind " + where + ": " + std::strerror(errno));
  }
  if (::listen(s.fd(), 64) != 0) {
    return make_error(Errc::kIo, "listen " + where + ": " + std::strerror(errno));
  }
  set_nonblocking(s.fd());
  return s;
}

int Socket::local_port() const {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  return ntohs(a.sin_port);
}

Result<Socket> Socket::accept(std::chrono::milliseconds timeout) const {
  pollfd p{fd_, POLLIN, 0};
  const int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
  if (r <= 0) return Socket();
  Socket c(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!c.valid()) {
    if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return Socket();
    return make_error(Errc::kIo, std::string("accept: ") + std::strerror(errno));
  }
  const int one = 1;
  setsockopt(c.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return c;
}

Status Socket::write_all(const void* data, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EINTR) {
      return make_error(Errc::kIo, std::string("control channel write: ") + std::strerror(errno));
    }
    pollfd pf{fd_, POLLOUT, 0};
    const int left = ms_left(deadline);
    if (left == 0 || ::poll(&pf, 1, left) == 0) {
      return make_error(Errc::kIo, "control channel write: timed out");
    }
  }
  return {};
}

Status Socket::read_all(void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd_, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0)
      return make_error(Errc::kIo, "control channel read: the peer closed the connection");
    if (errno != EAGAIN && errno != EINTR) {
      return make_error(Errc::kIo, std::string("control channel read: ") + std::strerror(errno));
    }
    pollfd pf{fd_, POLLIN, 0};
    const int left = ms_left(deadline);
    if (left == 0 || ::poll(&pf, 1, left) == 0) {
      return make_error(Errc::kIo, "control channel read: timed out");
    }
  }
  return {};
}

Status Socket::send_frame(FrameType type, const std::vector<uint8_t>& payload,
                          Clock::time_point deadline) {
  Writer w;
  w.put(kFrameMagic);
  w.put(static_cast<uint32_t>(type));
  w.put(static_cast<uint64_t>(payload.size()));
  KV_TRY_STATUS(write_all(w.buf.data(), w.buf.size(), deadline));
  return write_all(payload.data(), payload.size(), deadline);
}

Result<std::pair<FrameType, std::vector<uint8_t>>> Socket::recv_frame(Clock::time_point deadline) {
  uint8_t head[16];
  KV_TRY_STATUS(read_all(head, sizeof(head), deadline));
  uint32_t magic = 0;
  uint32_t type = 0;
  uint64_t n = 0;
  std::memcpy(&magic, head, 4);
  std::memcpy(&type, head + 4, 4);
  std::memcpy(&n, head + 8, 8);
  if (magic != kFrameMagic) {
    return make_error(Errc::kCorruptFile, "control channel: not a kvstack transfer frame");
  }
  if (n > kMaxFrameBytes) {
    return make_error(Errc::kCorruptFile,
                      "control channel: a " + std::to_string(n) + "-byte frame is over the limit");
  }
  std::vector<uint8_t> payload(n);
  KV_TRY_STATUS(read_all(payload.data(), n, deadline));
  return std::make_pair(static_cast<FrameType>(type), std::move(payload));
}

bool Socket::peer_closed() const {
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  if (p.revents & POLLIN) {
    uint8_t b;
    const ssize_t r = ::recv(fd_, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0;
  }
  return false;
}

}  // namespace kvstack::transfer

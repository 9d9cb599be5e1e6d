#include "server/connection_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "server/request_head.h"

namespace kvstack::server {

using Clock = std::chrono::steady_clock;

struct GuardedServer::Conn {
  int fd = -1;
  std::string client;  // peer address (the per-client limits' key)
  Clock::time_point accepted;
  std::string buf;       // bytes received by the waiter: the head, maybe some body
  size_t head_end = 0;   // head length including its blank line (0 = incomplete)
  size_t scanned = 0;    // bytes of buf searched for the blank line
  bool waiting = false;  // in the waiter's epoll set
  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

thread_local const GuardedServer::Conn* t_current = nullptr;

int ms_until(Clock::time_point t) {
  const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(d, 0, 1 << 30));
}

// poll() one fd for `events`, retrying on EINTR: > 0 ready, 0 timeout, < 0 error.
int wait_fd(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r > 0 && (p.revents & (POLLERR | POLLNVAL)) != 0) return -1;
    return r;
  }
}

// False once the peer closed or reset its side (a pending byte keeps it alive).
bool socket_alive(int fd) {
  pollfd p{fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return true;
  if ((p.revents & (POLLHUP | POLLERR | POLLNVAL | POLLRDHUP)) != 0) return false;
  char b = 0;
  const ssize_t n = ::recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
}

std::string peer_address(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char ip[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, ip, sizeof(ip));
  } else if (addr.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, ip, sizeof(ip));
  }
  return ip;
}

void ip_and_port(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int r = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                     : ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ip.clear();
  port = 0;
  if (r != 0) return;
  char buf[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    port = ntohs(a->sin6_port);
  }
  ip = buf;
}

// The socket httplib reads and writes: the waiter's buffered bytes first,
// then the (non-blocking) socket under a deadline and a raw byte budget.
class GuardedStream final : public httplib::Stream {
 public:
  GuardedStream(const GuardedServer::Conn& c, int fd, time_t read_timeout_s, time_t write_timeout_s,
                Clock::time_point deadline, uint64_t max_raw, std::atomic<int64_t>* n_timeouts)
      : c_(c),
        fd_(fd),
        read_ms_(static_cast<int>(read_timeout_s * 1000)),
        write_ms_(static_cast<int>(write_timeout_s * 1000)),
        deadline_(deadline),
        max_raw_(max_raw),
        raw_(c.buf.size() - c.head_end),
        n_timeouts_(n_timeouts) {}

  bool is_readable() const override {
    return off_ < c_.buf.size() || wait_fd(fd_, POLLIN, read_ms_) > 0;
  }
  bool is_writable() const override {
    return wait_fd(fd_, POLLOUT, write_ms_) > 0 && socket_alive(fd_);
  }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ < c_.buf.size()) {
      const size_t n = std::min(size, c_.buf.size() - off_);
      std::memcpy(ptr, c_.buf.data() + off_, n);
      off_ += n;
      return static_cast<ssize_t>(n);
    }
    if (raw_ >= max_raw_) return -1;
    for (;;) {
      if (Clock::now() >= deadline_) {
        n_timeouts_->fetch_add(1, std::memory_order_relaxed);
        return -1;
      }
      const int r = wait_fd(fd_, POLLIN, std::min(read_ms_, ms_until(deadline_) + 1));
      if (r < 0) return -1;
      if (r == 0) {
        if (Clock::now() < deadline_) return -1;  // the per-read timeout
        continue;                                 // counted above
      }
      const size_t want = static_cast<size_t>(std::min<uint64_t>(size, max_raw_ - raw_));
      const ssize_t n = ::recv(fd_, ptr, want, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n > 0) raw_ += static_cast<uint64_t>(n);
      return n;
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    for (;;) {
      if (wait_fd(fd_, POLLOUT, write_ms_) <= 0) return -1;
      const ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      return n;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip_and_port(fd_, true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip_and_port(fd_, false, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  const GuardedServer::Conn& c_;
  const int fd_;
  const int read_ms_;
  const int write_ms_;
  const Clock::time_point deadline_;
  const uint64_t max_raw_;
  uint64_t raw_;  // body bytes read (the waiter's extra bytes included)
  size_t off_ = 0;
  std::atomic<int64_t>* n_timeouts_;
};

const char* reason_phrase(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 411:
      return "Length Required";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

}  // namespace

bool current_connection_alive() {
  return t_current == nullptr || socket_alive(t_current->fd);
}

GuardedServer::GuardedServer(GuardLimits limits) : limits_(std::move(limits)) {
  const int n = std::max(1, limits_.n_threads);
  new_task_queue = [this, n] {
    auto* q = new httplib::ThreadPool(static_cast<size_t>(n));
    std::lock_guard<std::mutex> lock(mu_);
    pool_ = q;
    return q;
  };
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  waiter_ = std::thread([this] { waiter_loop(); });
}

GuardedServer::~GuardedServer() {
  stop_guard();
  ::close(wake_fd_);
  ::close(epoll_fd_);
}

void GuardedServer::stop_guard() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (waiter_.joinable()) waiter_.join();
}

bool GuardedServer::trusted(const std::string& client) const {
  return std::find(limits_.trusted_proxies.begin(), limits_.trusted_proxies.end(), client) !=
         limits_.trusted_proxies.end();
}

GuardStats GuardedServer::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  GuardStats s = stats_;
  s.body_timeouts = body_timeouts_.load(std::memory_order_relaxed);
  return s;
}

void GuardedServer::widen_backlog(int backlog) {
  ::listen(svr_sock_, backlog);
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  // On a worker thread, right after accept: hand the socket to the waiter.
  auto c = std::make_shared<Conn>();
  c->fd = sock;
  c->accepted = Clock::now();
  c->client = peer_address(sock);
  ::fcntl(sock, F_SETFL, ::fcntl(sock, F_GETFL, 0) | O_NONBLOCK);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return true;  // c closes the socket
    incoming_.push_back(std::move(c));
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  return true;
}

void GuardedServer::waiter_loop() {
  std::vector<epoll_event> evs(256);
  const auto head_timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(limits_.head_timeout_s));
  for (;;) {
    int timeout_ms = 1000;
    while (!waiting_order_.empty()) {
      auto front = waiting_order_.front().lock();
      if (front && front->waiting) {
        timeout_ms = std::min(timeout_ms, ms_until(front->accepted + head_timeout) + 1);
        break;
      }
      waiting_order_.pop_front();
    }
    const int n = ::epoll_wait(epoll_fd_, evs.data(), static_cast<int>(evs.size()), timeout_ms);
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == wake_fd_) {
        uint64_t v = 0;
        (void)!::read(wake_fd_, &v, sizeof(v));
        continue;
      }
      auto it = waiting_.find(evs[i].data.fd);
      if (it != waiting_.end()) on_readable(std::shared_ptr<Conn>(it->second));
    }
    std::deque<std::shared_ptr<Conn>> fresh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
      fresh.swap(incoming_);
    }
    for (auto& c : fresh) {
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
      ev.data.fd = c->fd;
      if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev) != 0) continue;  // c closes it
      c->waiting = true;
      waiting_[c->fd] = c;
      waiting_order_.push_back(c);
      int& mine = waiting_per_client_[c->client];
      mine++;
      // Over a cap: close the oldest waiting connection (of this client first).
      if (mine > limits_.max_waiting_per_client && !trusted(c->client)) {
        for (auto& w : waiting_order_) {
          auto o = w.lock();
          if (o && o->waiting && o->client == c->client) {
            close_waiting(o);
            std::lock_guard<std::mutex> lock(mu_);
            stats_.evicted++;
            break;
          }
        }
      }
      while (static_cast<int>(waiting_.size()) > limits_.max_waiting && !waiting_order_.empty()) {
        auto o = waiting_order_.front().lock();
        waiting_order_.pop_front();
        if (o && o->waiting) {
          close_waiting(o);
          std::lock_guard<std::mutex> lock(mu_);
          stats_.evicted++;
        }
      }
      if (c->waiting) on_readable(c);  // bytes that came before the epoll registration
    }
    // Head deadlines, oldest first.
    const auto now = Clock::now();
    while (!waiting_order_.empty()) {
      auto o = waiting_order_.front().lock();
      if (o && o->waiting) {
        if (now < o->accepted + head_timeout) break;
        close_waiting(o);
        std::lock_guard<std::mutex> lock(mu_);
        stats_.head_timeouts++;
      }
      waiting_order_.pop_front();
    }
  }
  // Stopping: drop every connection still waiting (nothing of theirs started).
  for (auto& [fd, c] : waiting_) c->waiting = false;
  waiting_.clear();
  waiting_order_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  incoming_.clear();
}

void GuardedServer::close_waiting(const std::shared_ptr<Conn>& c) {
  if (!c->waiting) return;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  c->waiting = false;
  waiting_.erase(c->fd);  // the last owner: closes the socket unless handed over
  if (auto it = waiting_per_client_.find(c->client); it != waiting_per_client_.end()) {
    if (--it->second <= 0) waiting_per_client_.erase(it);
  }
}

bool GuardedServer::on_readable(const std::shared_ptr<Conn>& c) {
  char tmp[4096];
  for (;;) {
    const size_t room = limits_.max_head_bytes - std::min(limits_.max_head_bytes, c->buf.size());
    if (room == 0) {
      close_waiting(c);
      reject(c, 431,
             "the request head (request line and headers) is over " +
                 std::to_string(limits_.max_head_bytes) + " bytes");
      return true;
    }
    const ssize_t n = ::recv(c->fd, tmp, std::min(room, sizeof(tmp)), 0);
    if (n > 0) {
      c->buf.append(tmp, static_cast<size_t>(n));
      const size_t from = c->scanned >= 3 ? c->scanned - 3 : 0;
      const size_t pos = c->buf.find("\r\n\r\n", from);
      c->scanned = c->buf.size();
      if (pos != std::string::npos) {
        c->head_end = pos + 4;
        close_waiting(c);
        hand_over(c);
        return true;
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    close_waiting(c);  // closed or reset before its head was complete
    return true;
  }
}

void GuardedServer::hand_over(const std::shared_ptr<Conn>& c) {
  const HeadCheck check =
      check_request_head(std::string_view(c->buf).substr(0, c->head_end), limits_.max_body_bytes);
  if (check.status != 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.bad_framing++;
    }
    reject(c, check.status, check.message);
    return;
  }
  if (check.frame_empty) {  // before the head's blank line: httplib must not read to EOF
    constexpr std::string_view kEmpty = "Content-Length: 0\r\n";
    c->buf.insert(c->head_end - 2, kEmpty);
    c->head_end += kEmpty.size();
  }
  const int per_client = limits_.max_active_per_client > 0 ? limits_.max_active_per_client
                                                           : std::max(1, limits_.n_threads / 2);
  int status = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    int& mine = active_per_client_[c->client];
    if (mine >= per_client && !trusted(c->client)) {
      stats_.client_limit++;
      status = 429;
    } else if (n_active_ >= limits_.n_threads || pool_ == nullptr) {
      stats_.busy++;
      status = 503;
    } else {
      mine++;
      n_active_++;
      stats_.served++;
      pool_->enqueue([this, c] { serve(c); });
      return;
    }
    if (mine == 0) active_per_client_.erase(c->client);
  }
  if (status == 503) {
    reject(c, 503, "every HTTP worker is busy; retry later");
  } else {
    reject(c, 429,
           "too many concurrent connections from " + c->client + " (limit " +
               std::to_string(per_client) + "); retry later");
  }
}

void GuardedServer::serve(const std::shared_ptr<Conn>& c) {
  const auto deadline = c->accepted + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(limits_.request_timeout_s));
  const uint64_t max_raw = 2 * static_cast<uint64_t>(limits_.max_body_bytes) + (64u << 10);
  {
    GuardedStream strm(*c, c->fd, read_timeout_sec_, write_timeout_sec_, deadline, max_raw,
                       &body_timeouts_);
    t_current = c.get();
    bool connection_closed = false;
    // Range requests are not served: every response is whole.
    process_request(strm, /*close_connection=*/true, connection_closed,
                    [](httplib::Request& req) { req.ranges.clear(); });
    t_current = nullptr;
  }
  ::shutdown(c->fd, SHUT_RDWR);
  ::close(c->fd);
  c->fd = -1;
  std::lock_guard<std::mutex> lock(mu_);
  n_active_--;
  if (auto it = active_per_client_.find(c->client); it != active_per_client_.end()) {
    if (--it->second <= 0) active_per_client_.erase(it);
  }
}

void GuardedServer::reject(const std::shared_ptr<Conn>& c, int status, const std::string& message) {
  nlohmann::json err = {{"message", message},
                        {"type", status == 429   ? "rate_limit_error"
                                 : status == 503 ? "service_unavailable"
                                                 : "invalid_request_error"},
                        {"param", nullptr},
                        {"code", nullptr}};
  const std::string body =
      nlohmann::json{{"error", err}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out =
      "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n";
  if (status == 429 || status == 503) out += "Retry-After: 1\r\n";
  out += "\r\n" + body;
  (void)::send(c->fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(c->fd, SHUT_WR);
  // Read what the client already sent so that closing does not reset the
  // connection before it read the answer (bounded: the socket is non-blocking).
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(c->fd, sink, sizeof(sink), MSG_DONTWAIT) > 0; ++i) {
  }
}

}  // namespace kvstack::server

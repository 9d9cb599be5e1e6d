// The control channel of a KV transfer: framed messages over one TCP
// connection from the decode worker (puller) to the prefill worker, with a
// deadline on every read and write (a dead or silent peer is an error
// after the deadline, never a hang).
//
// Frame: [u32 magic "KVTX"][u32 type][u64 payload bytes][payload]; payloads
// over kMaxFrameBytes are refused before anything is allocated.
// Units: bytes; integers little-endian (kvstack builds for x86-64 only).
//
// Thread-safety: a Socket belongs to one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/result.h"

namespace kvstack::transfer {

inline constexpr uint32_t kFrameMagic = 0x5854564bu;  // "KVTX"
inline constexpr uint64_t kMaxFrameBytes = 256ull << 20;

enum class FrameType : uint32_t {
  kPull = 1,   // puller -> server: u64 transfer id
  kOffer = 2,  // server -> puller: the lease's description (transfer_server.cpp) or an error
  kDone = 3,   // puller -> server: u8 1 = verified, 0 = failed (lease ends either way)
  // Layer-wise streaming (decode-initiated; server/pd_agent.h):
  kStream = 4,        // puller -> server: the prefill to run (PdAgent's payload)
  kStreamBlocks = 5,  // server -> puller: worker address, rkey, the reserved blocks' addresses
  kLayerReady = 6,    // server -> puller: u32 layers computed so far (1..L)
  // then kOffer (the published blocks' lease, as for kPull) and kDone.
};

// RAII file descriptor of a TCP socket.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { reset(); }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset();

  // Connects to host:port (a numeric IPv4 address) within `timeout`.
  static Result<Socket> connect(const std::string& host, int port,
                                std::chrono::milliseconds timeout);
  // A listening socket on host:port (port 0: any free one; see local_port).
  static Result<Socket> listen(const std::string& host, int port);
  int local_port() const;
  // Waits up to `timeout` for a connection; an invalid Socket when none came.
  Result<Socket> accept(std::chrono::milliseconds timeout) const;

  // Whole-buffer I/O before `deadline`; kIo naming what failed (peer closed,
  // timed out, error).
  Status write_all(const void* data, size_t n, std::chrono::steady_clock::time_point deadline);
  Status read_all(void* data, size_t n, std::chrono::steady_clock::time_point deadline);

  Status send_frame(FrameType type, const std::vector<uint8_t>& payload,
                    std::chrono::steady_clock::time_point deadline);
  // Reads one frame; kCorruptFile for a bad magic or a payload over the cap.
  Result<std::pair<FrameType, std::vector<uint8_t>>> recv_frame(
      std::chrono::steady_clock::time_point deadline);
  // True when the peer has closed (or reset) the connection; never blocks.
  bool peer_closed() const;

 private:
  int fd_ = -1;
};

// Little-endian append/read helpers for frame payloads.
class Writer {
 public:
  template <class T>
  void put(const T& v) {
    bytes(&v, sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = buf.size();
    buf.resize(at + n);
    std::memcpy(buf.data() + at, p, n);
  }
  std::vector<uint8_t> buf;
};

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& b) : buf_(b) {}
  template <class T>
  bool get(T* v) {
    if (pos_ + sizeof(T) > buf_.size()) return false;
    std::memcpy(v, buf_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool bytes(size_t n, std::vector<uint8_t>* out) {
    if (n > buf_.size() - pos_) return false;
    out->assign(buf_.begin() + static_cast<std::ptrdiff_t>(pos_),
                buf_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == buf_.size(); }

 private:
  const std::vector<uint8_t>& buf_;
  size_t pos_ = 0;
};

}  // namespace kvstack::transfer

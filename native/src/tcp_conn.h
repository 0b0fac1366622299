// The TCP engine's private parts, shared by its two halves: tcp_handshake.cpp (listening, connecting and
// authenticating peers) and tcp_channel.cpp (the epoll loop that moves frames). The wire constants, the
// handshake's messages, the socket helpers and the per-connection state live here so that neither half
// reaches into the other; nothing outside the TCP engine includes this header.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "tcp_channel.h"
#include "wire.h"

namespace lmt {
namespace tcp {

constexpr uint32_t kHelloMagic = 0x4c4c4548u;  // "HELL"
constexpr uint32_t kAckMagic = 0x4b434341u;    // "ACCK"
constexpr uint32_t kProtoVersion = 1;
constexpr size_t kTokenBytes = 32;
constexpr size_t kReadBuf = 256 * 1024;
constexpr size_t kDirectRead = 64 * 1024;  // payload remainders above this are read straight into the block
constexpr size_t kMaxReadPerEvent = 16u << 20;  // fairness between connections

struct Hello {
  uint32_t magic, version;
  int32_t src, dst;
  uint8_t token[kTokenBytes];
};
struct Ack {
  uint32_t magic;
  int32_t rank;
};

// The epoll user data of the two special fds; connections use their fd (>= 0).
constexpr uint64_t kListenerKey = ~uint64_t(0);
constexpr uint64_t kEventKey = ~uint64_t(0) - 1;

// Constant-time comparison of the presented token (no early exit that would time the match).
bool equal_const_time(const uint8_t* a, const uint8_t* b, size_t n);
// A numeric IPv4/IPv6 address and port as a sockaddr (no name lookups: the store publishes addresses).
sockaddr_storage resolve(const std::string& ip, int port, socklen_t* len);
// TCP_NODELAY, keep-alives and TCP_USER_TIMEOUT (a vanished host is noticed), and the buffer sizes.
void tune(int fd, int bufsize);
// Blocking-with-deadline helpers for the connector's handshake (runs in the caller's thread, GIL released).
void io_exact(int fd, void* buf, size_t n, bool write, double deadline, const std::string& what);

}  // namespace tcp

struct TcpEngine::Conn {
  int fd = -1;
  int peer = -1;  // -1 until authenticated
  double deadline = 0;
  // handshake (listener side)
  tcp::Hello hello{};
  size_t hello_got = 0;
  // receive state (epoll thread only)
  std::vector<uint8_t> rbuf;
  size_t rpos = 0, rlen = 0;
  int stage = 0;  // 0 frame header, 1 python header, 2 payload
  FrameHeader fh{};
  Message msg;
  size_t got = 0;
  bool bye = false;
  // send state (callers and the epoll thread, under mu)
  std::mutex mu;
  std::deque<SendOpPtr> queue;
  bool want_out = false;
  bool failed = false;
  ErrKind fail_kind = ErrKind::PeerLost;
  std::string fail_why;
};

}  // namespace lmt

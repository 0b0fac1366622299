// Half of the TCP engine (the contract is in tcp_channel.h): how connections come to exist. The lower rank
// connects to the higher rank's listener and presents the listener's token; the listener accepts a
// connection only after a hello with that token (compared in constant time) from a rank it expects, within
// the handshake timeout, and answers with an ack. Then the connection is handed to the epoll loop
// (tcp_channel.cpp) for good.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "common.h"
#include "tcp_conn.h"

namespace lmt {
namespace tcp {

bool equal_const_time(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= uint8_t(a[i] ^ b[i]);
  return diff == 0;
}

sockaddr_storage resolve(const std::string& ip, int port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(ip.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr)
    fail("tcp transport: '" + ip + "' is not a numeric IPv4/IPv6 address (" + gai_strerror(rc) + ")");
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  if (ss.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(uint16_t(port));
  else
    reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(uint16_t(port));
  return ss;
}

void tune(int fd, int bufsize) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  int idle = 10, intvl = 2, cnt = 5;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  unsigned user_timeout_ms = 30000;  // unacknowledged data for this long: the host is gone
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
  if (bufsize > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsize, sizeof bufsize);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufsize, sizeof bufsize);
  }
}

// Blocking-with-deadline helpers for the connector's handshake (runs in the caller's thread, GIL released).
void io_exact(int fd, void* buf, size_t n, bool write, double deadline, const std::string& what) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    const ssize_t r = write ? ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= size_t(r);
      continue;
    }
    if (r == 0) fail(ErrKind::PeerLost, what + ": the peer closed the connection during the handshake (wrong token?)");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) fail(ErrKind::PeerLost, what + ": " + errno_str(errno));
    const double left = deadline - now_s();
    if (left <= 0) fail(ErrKind::Timeout, what + ": handshake timed out");
    pollfd pfd{fd, short(write ? POLLOUT : POLLIN), 0};
    poll(&pfd, 1, int(std::min(left, kWaitSlice) * 1000) + 1);
  }
}

}  // namespace tcp

using namespace tcp;

void TcpEngine::expect(int peer) {
  check_peer(peer);
  std::lock_guard<std::mutex> lock(mu_);
  expected_.insert(peer);
}

void TcpEngine::connect_peer(int peer, const std::string& ip, int port, const std::string& peer_token, double timeout) {
  check_peer(peer);
  if (peer_token.size() != kTokenBytes) fail("tcp transport: the peer's token must be 32 bytes");
  const std::string what = label() + ": connecting to rank " + std::to_string(peer) + " at " + ip + ":" + std::to_string(port);
  const double deadline = now_s() + timeout;
  socklen_t len;
  sockaddr_storage addr = resolve(ip, port, &len);
  int fd = -1;
  while (true) {
    fd = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) fail(what + ": socket() failed: " + errno_str(errno));
    tune(fd, opts_.socket_buffer);
    int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      const double left = deadline - now_s();
      if (poll(&pfd, 1, int(std::max(left, 0.0) * 1000) + 1) <= 0) {
        ::close(fd);
        fail(ErrKind::Timeout, what + ": connect timed out after " + std::to_string(timeout) + " s");
      }
      socklen_t el = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    }
    if (err == 0) break;
    ::close(fd);
    if ((err == ECONNREFUSED || err == EINTR) && now_s() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    fail(ErrKind::PeerLost, what + ": " + errno_str(err));
  }
  try {
    Hello h{kHelloMagic, kProtoVersion, rank_, peer, {}};
    std::memcpy(h.token, peer_token.data(), kTokenBytes);
    io_exact(fd, &h, sizeof h, true, deadline, what);
    Ack a{};
    io_exact(fd, &a, sizeof a, false, deadline, what);
    if (a.magic != kAckMagic || a.rank != peer) fail(what + ": unexpected handshake reply (is that port another service?)");
  } catch (...) {
    ::close(fd);
    throw;
  }
  auto c = std::make_shared<Conn>();
  c->fd = fd;
  establish(c, peer);
}

// Register an authenticated connection with the epoll loop (either side).
void TcpEngine::establish(const std::shared_ptr<Conn>& c, int peer) {
  c->peer = peer;
  c->rbuf.resize(kReadBuf);
  {
    std::lock_guard<std::mutex> lock(mu_);
    by_fd_[c->fd] = c;
    by_peer_[size_t(peer)] = c;
    expected_.erase(peer);
  }
  mailbox_.set_connected(peer);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = uint64_t(c->fd);
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev) != 0 && errno == EEXIST) epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &ev);
  cv_.notify_all();
}

bool TcpEngine::wait_connected(int peer, double timeout) {
  check_peer(peer);
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout),
                      [&] { return stop_.load() || by_peer_[size_t(peer)] != nullptr; }) &&
         by_peer_[size_t(peer)] != nullptr;
}

void TcpEngine::accept_all() {
  while (true) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a transient error: epoll reports the listener again
    tune(fd, opts_.socket_buffer);
    auto c = std::make_shared<Conn>();
    c->fd = fd;
    c->deadline = now_s() + opts_.handshake_timeout;
    {
      std::lock_guard<std::mutex> lock(mu_);
      by_fd_[fd] = c;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = uint64_t(fd);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
}

void TcpEngine::on_hello(const std::shared_ptr<Conn>& c) {
  auto* p = reinterpret_cast<uint8_t*>(&c->hello);
  while (c->hello_got < sizeof(Hello)) {
    const ssize_t r = ::recv(c->fd, p + c->hello_got, sizeof(Hello) - c->hello_got, MSG_DONTWAIT);
    if (r > 0) {
      c->hello_got += size_t(r);
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    rejected_++;
    drop(c, false, "closed during the handshake");
    return;
  }
  const Hello& h = c->hello;
  bool ok = h.magic == kHelloMagic && h.version == kProtoVersion && h.dst == rank_ &&
            equal_const_time(h.token, reinterpret_cast<const uint8_t*>(token_.data()), kTokenBytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ok = ok && expected_.count(h.src) == 1;
  }
  Ack a{kAckMagic, rank_};
  if (ok) ok = ::send(c->fd, &a, sizeof a, MSG_NOSIGNAL | MSG_DONTWAIT) == ssize_t(sizeof a);
  if (!ok) {
    rejected_++;
    drop(c, false, "rejected");
    return;
  }
  establish(c, h.src);
}

}  // namespace lmt

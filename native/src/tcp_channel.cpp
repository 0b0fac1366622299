#include "tcp_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common.h"
#include "wire.h"

namespace lmt {

namespace {

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

}  // namespace

struct TcpEngine::Conn {
  int fd = -1;
  int peer = -1;  // -1 until authenticated
  double deadline = 0;
  // handshake (listener side)
  Hello hello{};
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

TcpEngine::TcpEngine(std::string label, int rank, int world_size, const std::string& bind_ip, std::string token,
                     TcpOptions opts)
    : Engine(std::move(label), rank, world_size, opts.pool_bytes),
      opts_(opts),
      token_(std::move(token)),
      by_peer_(size_t(world_size)) {
  if (token_.size() != kTokenBytes) fail("tcp transport: the token must be 32 bytes");
  socklen_t len;
  sockaddr_storage addr = resolve(bind_ip, 0, &len);
  listen_fd_ = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) fail("tcp transport: socket() failed: " + errno_str(errno));
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(listen_fd_, 128) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    fail(this->label() + ": cannot listen on " + bind_ip + ": " + errno_str(err) +
         ". Set LM_TRANSPORT_IFADDR (or the transport's `ifaddr`) to an address of this host that peers can reach.");
  }
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&addr)->sin_port
                                          : reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenerKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.u64 = kEventKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd_, &ev);
  thread_ = std::thread([this] { loop(); });
}

TcpEngine::~TcpEngine() { close(); }

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

// ---------------------------------------------------------------------------------------------- epoll loop

void TcpEngine::loop() {
  epoll_event events[64];
  while (!stop_.load()) {
    const int n = epoll_wait(epoll_fd_, events, 64, int(kWaitSlice * 1000));
    for (int i = 0; i < n && !stop_.load(); ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kListenerKey) {
        accept_all();
        continue;
      }
      if (key == kEventKey) {
        uint64_t v;
        while (read(event_fd_, &v, sizeof v) > 0) {
        }
        continue;
      }
      std::shared_ptr<Conn> c;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = by_fd_.find(int(key));
        if (it != by_fd_.end()) c = it->second;
      }
      if (!c) continue;
      if (events[i].events & EPOLLOUT) on_writable(c);
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        if (c->peer < 0)
          on_hello(c);
        else
          on_readable(c);
      }
    }
    // Unauthenticated connections get a deadline: a stranger that connects and says nothing is dropped.
    const double now = now_s();
    std::vector<std::shared_ptr<Conn>> expired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [fd, c] : by_fd_)
        if (c->peer < 0 && now > c->deadline) expired.push_back(c);
    }
    for (auto& c : expired) {
      rejected_++;
      drop(c, false, "handshake timed out");
    }
  }
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

// ---------------------------------------------------------------------------------------------- receiving

// Consume buffered bytes; returns false once the stream is unusable (corrupt).
bool TcpEngine::parse(const std::shared_ptr<Conn>& c) {
  while (true) {
    const size_t avail = c->rlen - c->rpos;
    if (c->stage == 0) {
      if (avail < sizeof(FrameHeader)) return true;
      std::memcpy(&c->fh, c->rbuf.data() + c->rpos, sizeof(FrameHeader));
      c->rpos += sizeof(FrameHeader);
      if (c->fh.magic == kByeMagic) {
        c->bye = true;
        continue;
      }
      if (c->fh.magic != kFrameMagic || c->fh.header_len > kMaxHeaderLen) return false;
      c->msg = Message();
      c->msg.header.resize(c->fh.header_len);
      c->got = 0;
      c->stage = 1;
    } else if (c->stage == 1) {
      const size_t k = std::min(avail, c->msg.header.size() - c->got);
      std::memcpy(&c->msg.header[c->got], c->rbuf.data() + c->rpos, k);
      c->rpos += k;
      c->got += k;
      if (c->got < c->msg.header.size()) return true;
      c->msg.payload = pool_->get(size_t(c->fh.payload_len));
      c->got = 0;
      c->stage = 2;
    } else {
      const size_t k = std::min(avail, size_t(c->fh.payload_len) - c->got);
      if (k) std::memcpy(c->msg.payload->data + c->got, c->rbuf.data() + c->rpos, k);
      c->rpos += k;
      c->got += k;
      if (c->got < c->fh.payload_len) return true;
      mailbox_.deliver(c->peer, c->fh.tag, std::move(c->msg));
      c->msg = Message();
      c->stage = 0;
    }
  }
}

void TcpEngine::on_readable(const std::shared_ptr<Conn>& c) {
  size_t budget = kMaxReadPerEvent;
  while (budget > 0) {
    if (!parse(c)) {
      drop(c, true, "corrupt stream from rank " + std::to_string(c->peer));
      return;
    }
    if (c->rpos == c->rlen) c->rpos = c->rlen = 0;
    ssize_t r;
    if (c->stage == 2 && c->rpos == c->rlen && c->fh.payload_len - c->got >= kDirectRead) {
      // Large payload: read it straight into its receive buffer, no staging copy.
      r = ::recv(c->fd, c->msg.payload->data + c->got, std::min(size_t(c->fh.payload_len - c->got), budget), MSG_DONTWAIT);
      if (r > 0) {
        c->got += size_t(r);
        budget -= std::min(budget, size_t(r));
        continue;
      }
    } else {
      if (c->rpos > 0 && c->rbuf.size() - c->rlen < sizeof(FrameHeader)) {
        std::memmove(c->rbuf.data(), c->rbuf.data() + c->rpos, c->rlen - c->rpos);
        c->rlen -= c->rpos;
        c->rpos = 0;
      }
      r = ::recv(c->fd, c->rbuf.data() + c->rlen, c->rbuf.size() - c->rlen, MSG_DONTWAIT);
      if (r > 0) {
        c->rlen += size_t(r);
        budget -= std::min(budget, size_t(r));
        continue;
      }
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    const bool mid_frame = c->stage != 0 || c->rpos != c->rlen;
    if (r == 0 && c->bye && !mid_frame)
      drop(c, false, "rank " + std::to_string(c->peer) + " closed its transport");
    else
      drop(c, true, "connection to rank " + std::to_string(c->peer) + " was lost (" +
                        (r == 0 ? std::string("closed without goodbye: the process died?") : errno_str(errno)) + ")");
    return;
  }
}

// Close a socket (epoll thread only, or close() after the thread stopped).
void TcpEngine::drop(const std::shared_ptr<Conn>& c, bool lost, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (by_fd_.erase(c->fd) == 0) return;
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  {
    std::lock_guard<std::mutex> lock(c->mu);
    send_failed_locked(*c, label() + ": " + why);
    ::close(c->fd);
  }
  if (c->peer >= 0) {
    if (lost)
      mailbox_.set_lost(c->peer, why);
    else
      mailbox_.set_closed(c->peer, why);
  }
}

// ---------------------------------------------------------------------------------------------- sending

SendOpPtr TcpEngine::isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) {
  check_peer(peer);
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) fail(label() + " is closed");
    c = by_peer_[size_t(peer)];
  }
  if (!c) fail(label() + ": rank " + std::to_string(peer) + " is not connected");
  auto op = std::make_shared<SendOp>();
  op->peer = peer;
  op->tag = tag;
  op->header = std::move(header);
  op->data = data;
  op->size = size;
  FrameHeader fh{kFrameMagic, uint32_t(op->header.size()), tag, size};
  std::memcpy(op->frame, &fh, sizeof fh);
  std::lock_guard<std::mutex> lock(c->mu);
  if (c->failed) {
    op->fail(c->fail_kind, c->fail_why);
    return op;
  }
  c->queue.push_back(op);
  // Write right away if nothing is ahead of us (no thread hand-off for small messages); the epoll thread
  // finishes whatever the socket buffer did not take.
  if (c->queue.size() == 1 && flush_locked(*c) && !c->queue.empty()) set_events(*c, true);
  return op;
}

void TcpEngine::set_events(Conn& c, bool want_out) {
  if (c.want_out == want_out) return;
  c.want_out = want_out;
  epoll_event ev{};
  ev.events = want_out ? uint32_t(EPOLLIN | EPOLLOUT) : uint32_t(EPOLLIN);
  ev.data.u64 = uint64_t(c.fd);
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
}

void TcpEngine::send_failed_locked(Conn& c, const std::string& why) {
  if (!c.failed) {
    c.failed = true;
    c.fail_kind = ErrKind::PeerLost;
    c.fail_why = why;
  }
  for (auto& op : c.queue) op->fail(c.fail_kind, c.fail_why);
  c.queue.clear();
}

bool TcpEngine::flush_locked(Conn& c) {
  while (!c.queue.empty()) {
    iovec iov[48];
    int n = 0;
    for (size_t i = 0; i < c.queue.size() && n + 3 <= 48; ++i) {
      SendOp& op = *c.queue[i];
      const size_t parts[3] = {sizeof(FrameHeader), op.header.size(), op.size};
      const uint8_t* bases[3] = {op.frame, reinterpret_cast<const uint8_t*>(op.header.data()), op.data};
      size_t skip = i == 0 ? op.progress : 0;
      for (int j = 0; j < 3; ++j) {
        if (skip >= parts[j]) {
          skip -= parts[j];
          continue;
        }
        iov[n].iov_base = const_cast<uint8_t*>(bases[j] + skip);
        iov[n].iov_len = parts[j] - skip;
        skip = 0;
        n++;
      }
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = size_t(n);
    const ssize_t r = sendmsg(c.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      send_failed_locked(c, label() + ": sending to rank " + std::to_string(c.peer) + " failed: " + errno_str(errno) +
                                " (the peer died or closed?)");
      return false;
    }
    size_t left = size_t(r);
    while (left > 0 && !c.queue.empty()) {
      SendOp& op = *c.queue.front();
      const size_t total = sizeof(FrameHeader) + op.header.size() + op.size;
      const size_t k = std::min(left, total - op.progress);
      op.progress += k;
      left -= k;
      if (op.progress < total) break;
      op.complete();
      c.queue.pop_front();
    }
  }
  return true;
}

void TcpEngine::on_writable(const std::shared_ptr<Conn>& c) {
  std::lock_guard<std::mutex> lock(c->mu);
  if (c->failed) return;
  flush_locked(*c);
  if (c->queue.empty() || c->failed) set_events(*c, false);
}

// ---------------------------------------------------------------------------------------------- closing

void TcpEngine::abandon() {
  // The sockets are shared with the parent: no BYE, no shutdown(); they close when the child exits.
  abandoned_ = true;
  leak_thread(thread_);
}

void TcpEngine::close() {
  if (abandoned_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  stop_.store(true);
  uint64_t one = 1;
  (void)!write(event_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  cv_.notify_all();
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [fd, c] : by_fd_) conns.push_back(c);
  }
  for (auto& c : conns) {
    {
      std::lock_guard<std::mutex> lock(c->mu);
      // Say goodbye unless a frame is half written (the peer then sees the connection end mid-frame).
      const bool mid_frame = !c->queue.empty() && c->queue.front()->progress > 0;
      if (c->peer >= 0 && !c->failed && !mid_frame) {
        FrameHeader bye{kByeMagic, 0, 0, 0};
        try {
          io_exact(c->fd, &bye, sizeof bye, true, now_s() + 1.0, label());
        } catch (const Error&) {
        }
      }
      for (auto& op : c->queue) op->fail(ErrKind::Transport, label() + " was closed before this message was sent");
      c->queue.clear();
      c->failed = true;
      c->fail_kind = ErrKind::Transport;
      c->fail_why = label() + " is closed";
    }
    shutdown(c->fd, SHUT_RDWR);
    ::close(c->fd);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    by_fd_.clear();
    for (auto& c : by_peer_) c.reset();
  }
  ::close(listen_fd_);
  ::close(epoll_fd_);
  ::close(event_fd_);
  mailbox_.shutdown();
}

}  // namespace lmt

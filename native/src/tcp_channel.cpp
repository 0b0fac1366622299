// Half of the TCP engine (the contract is in tcp_channel.h): the listener, the epoll progress thread, and the
// frames it moves on authenticated connections: receiving into pooled buffers, sending straight from the source,
// and closing. How connections are made and authenticated is tcp_handshake.cpp.
#include "tcp_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common.h"
#include "tcp_conn.h"

namespace lmt {

using namespace tcp;

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

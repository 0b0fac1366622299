#include "rdma_channel.h"

#include "common.h"

#ifndef LMT_HAVE_IBVERBS

namespace lmt {

bool rdma_compiled() { return false; }
struct RdmaEngine::Impl {};

RdmaEngine::RdmaEngine(std::string label, int rank, int world_size, RdmaOptions opts)
    : Engine(label, rank, world_size, opts.pool_bytes) {
  fail(label + ": this build of the native transport has no RDMA support: rdma-core's headers were not found "
       "when it was compiled. Install them (Debian/Ubuntu: apt-get install libibverbs-dev) and rebuild "
       "(make setup, or pip install -e .).");
}
RdmaEngine::~RdmaEngine() = default;
std::string RdmaEngine::device_name() const { return ""; }
std::string RdmaEngine::local_info(int) { fail("no RDMA support"); }
void RdmaEngine::connect_peer(int, const std::string&) { fail("no RDMA support"); }
SendOpPtr RdmaEngine::isend(int, uint64_t, std::string, const uint8_t*, size_t) { fail("no RDMA support"); }
void RdmaEngine::close() {}
void RdmaEngine::abandon() {}

}  // namespace lmt

#else  // LMT_HAVE_IBVERBS

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "rdma_impl.h"
#include "wire.h"

namespace lmt {

bool rdma_compiled() { return true; }

void RdmaEngine::Impl::wake() {
  uint64_t one = 1;
  (void)!write(event_fd, &one, sizeof one);
}

void RdmaEngine::Impl::post_recv(Peer* p, uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(p->recv_mem + size_t(slot) * opts.slot_bytes), uint32_t(opts.slot_bytes), p->recv_mr->lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(kRecv, p->rank, slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (ibv_post_recv(p->qp, &wr, &bad) != 0) peer_failed(p, "ibv_post_recv failed: " + errno_str(errno));
}

void RdmaEngine::Impl::post_credit_write(Peer* p) {
  if (p->writes_out >= kMaxWrites || p->dead) return;
  ctrl[2 * p->rank + 1] = p->consumed;
  ibv_sge sge{reinterpret_cast<uint64_t>(&ctrl[2 * p->rank + 1]), 8, ctrl_mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(kWrite, p->rank, 0);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = p->remote_credit_addr;
  wr.wr.rdma.rkey = p->remote_rkey;
  if (ibv_post_send(p->qp, &wr, &bad) != 0) {
    wr.send_flags = IBV_SEND_SIGNALED;  // the device may not support inline data
    if (ibv_post_send(p->qp, &wr, &bad) != 0) return peer_failed(p, "posting a credit update failed: " + errno_str(errno));
  }
  p->writes_out++;
  p->reported = p->consumed;
  p->last_write = now_s();
}

int RdmaEngine::Impl::credits(Peer* p) {
  const uint64_t freed = __atomic_load_n(&ctrl[2 * p->rank], __ATOMIC_ACQUIRE);
  return p->remote_slots - int(p->sent - freed);
}

// One signalled SEND of the first `bytes` of send slot `slot` (its fragment already written there); ibv_post_send's
// result.
int RdmaEngine::Impl::post_send(Peer* p, uint32_t slot, uint32_t bytes) {
  ibv_sge sge{reinterpret_cast<uint64_t>(p->send_mem + size_t(slot) * opts.slot_bytes), bytes, p->send_mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(kSend, p->rank, slot);
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_send(p->qp, &wr, &bad);
}

// Copy as many queued fragments as credits and free slots allow. True if work remains that waits on credits.
bool RdmaEngine::Impl::push_sends(Peer* p) {
  std::lock_guard<std::mutex> lock(p->mu);
  while (!p->queue.empty() && !p->failed) {
    if (credits(p) <= 0 || p->free_send.empty()) return true;
    SendOp& op = *p->queue.front();
    const uint32_t slot = p->free_send.back();
    uint8_t* base = p->send_mem + size_t(slot) * opts.slot_bytes;
    FragHeader fh{kFragMagic, 0, op.tag, op.size, 0, 0};
    size_t room = opts.slot_bytes - sizeof fh;
    uint8_t* dst = base + sizeof fh;
    if (op.progress == 0) {
      if (op.header.size() > room) {
        op.fail(ErrKind::Transport, L() + ": message header larger than an RDMA slot");
        p->queue.pop_front();
        continue;
      }
      fh.flags |= kFirst;
      fh.header_len = uint32_t(op.header.size());
      std::memcpy(dst, op.header.data(), op.header.size());
      dst += op.header.size();
      room -= op.header.size();
    }
    const size_t k = std::min(room, op.size - p->offset);
    if (k) std::memcpy(dst, op.data + p->offset, k);
    p->offset += k;
    op.progress = 1;
    fh.frag_len = uint32_t(k);
    const bool last = p->offset == op.size;
    if (last) fh.flags |= kLast;
    std::memcpy(base, &fh, sizeof fh);
    if (post_send(p, slot, uint32_t(sizeof fh + fh.header_len + k)) != 0) {
      fail_sends_locked(p, L() + ": ibv_post_send to rank " + std::to_string(p->rank) + " failed: " + errno_str(errno));
      return false;
    }
    p->free_send.pop_back();
    p->sent++;
    if (last) {
      op.complete();  // the data is in a registered slot: the source tensor is free
      p->queue.pop_front();
      p->offset = 0;
    }
  }
  return false;
}

void RdmaEngine::Impl::fail_sends_locked(Peer* p, const std::string& why) {
  if (!p->failed) {
    p->failed = true;
    p->fail_why = why;
  }
  for (auto& op : p->queue) op->fail(p->fail_kind, p->fail_why);
  p->queue.clear();
}

void RdmaEngine::Impl::peer_failed(Peer* p, const std::string& why) {
  if (p->dead) return;
  p->dead = true;
  {
    std::lock_guard<std::mutex> lock(p->mu);
    fail_sends_locked(p, L() + ": " + why);
  }
  if (p->bye)
    eng->mailbox().set_closed(p->rank, "rank " + std::to_string(p->rank) + " closed its transport");
  else
    eng->mailbox().set_lost(p->rank, why);
}

void RdmaEngine::Impl::on_recv(Peer* p, uint32_t slot, uint32_t len) {
  const uint8_t* base = p->recv_mem + size_t(slot) * opts.slot_bytes;
  FragHeader fh;
  std::memcpy(&fh, base, sizeof fh);
  const uint8_t* src = base + sizeof fh;
  if (len < sizeof fh || fh.magic != kFragMagic || sizeof fh + fh.header_len + fh.frag_len > len) {
    peer_failed(p, "corrupt RDMA fragment from rank " + std::to_string(p->rank));
    return;
  }
  if (fh.flags & kBye) {
    p->bye = true;
    eng->mailbox().set_closed(p->rank, "rank " + std::to_string(p->rank) + " closed its transport");
  } else {
    if (fh.flags & kFirst) {
      p->msg = Message();
      p->msg.header.assign(reinterpret_cast<const char*>(src), fh.header_len);
      p->msg.payload = eng->pool().get(size_t(fh.total));
      p->tag = fh.tag;
      p->got = 0;
      p->in_msg = true;
      src += fh.header_len;
    }
    if (!p->in_msg || p->got + fh.frag_len > p->msg.payload->size) {
      peer_failed(p, "out-of-order RDMA fragment from rank " + std::to_string(p->rank));
      return;
    }
    if (fh.frag_len) std::memcpy(p->msg.payload->data + p->got, src, fh.frag_len);
    p->got += fh.frag_len;
    if (fh.flags & kLast) {
      p->in_msg = false;
      eng->mailbox().deliver(p->rank, p->tag, std::move(p->msg));
      p->msg = Message();
    }
  }
  post_recv(p, slot);
  p->consumed++;
}

void RdmaEngine::Impl::handle(const ibv_wc& wc) {
  const uint64_t kind = wc.wr_id >> 56;
  const int rank = int((wc.wr_id >> 32) & 0xffffff);
  const uint32_t slot = uint32_t(wc.wr_id & 0xffffffff);
  Peer* p;
  {
    std::lock_guard<std::mutex> lock(peers_mu);
    p = peers.at(size_t(rank)).get();
  }
  if (p == nullptr) return;
  if (wc.status != IBV_WC_SUCCESS) {
    if (!stop.load())
      peer_failed(p, std::string("RDMA completion error from rank ") + std::to_string(rank) + ": " +
                         ibv_wc_status_str(wc.status) + " (the peer died or its port went down?)");
    return;
  }
  if (kind == kRecv) {
    on_recv(p, slot, wc.byte_len);
  } else if (kind == kSend) {
    std::lock_guard<std::mutex> lock(p->mu);
    p->free_send.push_back(slot);
  } else if (kind == kWrite) {
    p->writes_out--;
  }
}

int RdmaEngine::Impl::poll_and_handle() {
  ibv_wc wcs[32];
  const int n = ibv_poll_cq(cq, 32, wcs);
  for (int i = 0; i < n; ++i) handle(wcs[i]);
  return n;
}

void RdmaEngine::Impl::loop() {
  while (!stop.load()) {
    const int n = poll_and_handle();
    bool waiting_credit = false;
    const double now = now_s();
    std::vector<Peer*> live;
    {
      std::lock_guard<std::mutex> lock(peers_mu);  // connect_peer may add peers while we run
      for (auto& up : peers) live.push_back(up.get());
    }
    for (Peer* p : live) {
      if (p == nullptr || !p->connected || p->dead) continue;
      waiting_credit |= push_sends(p);
      const uint64_t unreported = p->consumed - p->reported;
      if (unreported >= uint64_t(std::max(1, opts.slots / 4)) || (unreported > 0 && n == 0) ||
          now - p->last_write > kHeartbeat)
        post_credit_write(p);
    }
    if (n > 0) continue;
    if (waiting_credit) {  // credits arrive by RDMA WRITE, which raises no completion: poll briefly
      pollfd pfd{event_fd, POLLIN, 0};
      poll(&pfd, 1, 1);
    } else {
      // Arm the completion channel, then look once more: a completion that arrived before arming would
      // otherwise wait for the next event.
      ibv_req_notify_cq(cq, 0);
      if (poll_and_handle() > 0) continue;
      pollfd pfds[2] = {{chan->fd, POLLIN, 0}, {event_fd, POLLIN, 0}};
      poll(pfds, 2, int(kHeartbeat * 1000 / 2));
      if (pfds[0].revents & POLLIN) {
        ibv_cq* ev_cq;
        void* ev_ctx;
        if (ibv_get_cq_event(chan, &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
      }
    }
    uint64_t v;
    while (read(event_fd, &v, sizeof v) > 0) {
    }
  }
}

RdmaEngine::RdmaEngine(std::string label, int rank, int world_size, RdmaOptions opts)
    : Engine(std::move(label), rank, world_size, opts.pool_bytes), impl_(new Impl()) {
  impl_->eng = this;
  impl_->opts = opts;
  if (opts.slot_bytes < 4096 || opts.slots < 2) fail(this->label() + ": RDMA slots must be >= 4096 bytes and >= 2 of them");
  impl_->open(world_size);
}

RdmaEngine::~RdmaEngine() { close(); }

std::string RdmaEngine::device_name() const { return impl_->dev_name; }

std::string RdmaEngine::local_info(int peer) {
  check_peer(peer);
  return impl_->local_info(peer);
}

void RdmaEngine::connect_peer(int peer, const std::string& info) {
  check_peer(peer);
  impl_->connect_peer(peer, info);
}

SendOpPtr RdmaEngine::isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) {
  check_peer(peer);
  Impl::Peer* p;
  {
    std::lock_guard<std::mutex> lock(impl_->peers_mu);
    if (impl_->closed) fail(label() + " is closed");
    p = impl_->peers.at(size_t(peer)).get();
  }
  if (p == nullptr || !p->connected) fail(label() + ": rank " + std::to_string(peer) + " is not connected");
  auto op = std::make_shared<SendOp>();
  op->peer = peer;
  op->tag = tag;
  op->header = std::move(header);
  op->data = data;
  op->size = size;
  {
    std::lock_guard<std::mutex> lock(p->mu);
    if (p->failed) {
      op->fail(p->fail_kind, p->fail_why);
      return op;
    }
    p->queue.push_back(op);
  }
  impl_->wake();
  return op;
}

void RdmaEngine::abandon() {
  // Verbs objects belong to the file description shared with the parent: destroying them here would break
  // the parent's connections. Leak them all.
  if (!impl_) return;
  leak_thread(impl_->thread);
  (void)impl_.release();
}

void RdmaEngine::close() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lock(impl_->peers_mu);
    if (impl_->closed) return;
    impl_->closed = true;
  }
  // Goodbye: a BYE fragment to every live peer that has a credit left (best effort).
  for (auto& up : impl_->peers) {
    Impl::Peer* p = up.get();
    if (p == nullptr || !p->connected || p->dead) continue;
    std::lock_guard<std::mutex> lock(p->mu);
    if (impl_->credits(p) <= 0 || p->free_send.empty() || (!p->queue.empty() && p->offset > 0)) continue;
    const uint32_t slot = p->free_send.back();
    uint8_t* base = p->send_mem + size_t(slot) * impl_->opts.slot_bytes;
    FragHeader fh{kFragMagic, kBye, 0, 0, 0, 0};
    std::memcpy(base, &fh, sizeof fh);
    if (impl_->post_send(p, slot, uint32_t(sizeof fh)) == 0) p->free_send.pop_back();
  }
  // Give the goodbyes a moment to leave before the queue pairs are destroyed.
  const double deadline = now_s() + 0.2;
  while (now_s() < deadline) {
    bool pending = false;
    for (auto& up : impl_->peers)
      if (up && up->connected && !up->dead) {
        std::lock_guard<std::mutex> lock(up->mu);
        pending |= int(up->free_send.size()) < impl_->opts.slots;
      }
    if (!pending || !impl_->thread.joinable()) break;
    usleep(1000);
  }
  impl_->stop.store(true);
  impl_->wake();
  if (impl_->thread.joinable()) impl_->thread.join();
  for (auto& up : impl_->peers)
    if (up) {
      std::lock_guard<std::mutex> lock(up->mu);
      for (auto& op : up->queue) op->fail(ErrKind::Transport, label() + " was closed before this message was sent");
      up->queue.clear();
      up->failed = true;
      up->fail_kind = ErrKind::Transport;
      up->fail_why = label() + " is closed";
    }
  mailbox_.shutdown();
  // impl_ (queue pairs, memory regions) is released with the engine: a racing call may still hold a Peer*.
}

}  // namespace lmt

#endif  // LMT_HAVE_IBVERBS

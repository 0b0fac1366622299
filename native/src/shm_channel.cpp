#include "shm_channel.h"

#include <unistd.h>

#include <chrono>

#include "common.h"
#include "wire.h"

namespace lmt {

ShmEngine::ShmEngine(std::string label, int rank, int world_size, ShmOptions opts)
    : Engine(std::move(label), rank, world_size, opts.pool_bytes),
      opts_(opts),
      peers_(size_t(world_size)),
      copy_pool_(opts.copy_threads) {
  if (opts_.chunk_bytes < 4096) opts_.chunk_bytes = 4096;
}

ShmEngine::~ShmEngine() {
  close();
  for (auto& p : peers_) p.reset();  // unmaps the rings (and unlinks any name left from a failed connect)
}

ShmEngine::Peer* ShmEngine::peer_or_fail(int peer) {
  check_peer(peer);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) fail(label() + " is closed");
  Peer* p = peers_[size_t(peer)].get();
  if (p == nullptr) fail(label() + ": rank " + std::to_string(peer) + " is not connected");
  return p;
}

void ShmEngine::create_ring(int peer, const std::string& name, size_t capacity) {
  check_peer(peer);
  auto ring = Ring::create(name, capacity, opts_.heap_bytes, opts_.heap_page);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) fail(label() + " is closed");
  auto& slot = peers_[size_t(peer)];
  if (slot && slot->receiver.joinable()) fail(label() + ": rank " + std::to_string(peer) + " is already connected");
  slot = std::make_unique<Peer>();
  slot->rank = peer;
  slot->in = std::move(ring);
}

void ShmEngine::open_ring(int peer, const std::string& name, int peer_pid) {
  check_peer(peer);
  auto ring = Ring::open(name);
  auto watch = std::make_unique<PeerWatch>(peer_pid);
  std::lock_guard<std::mutex> lock(mu_);
  Peer* p = peers_[size_t(peer)].get();
  if (p == nullptr || !p->in) fail(label() + ": create_ring before open_ring for rank " + std::to_string(peer));
  p->out = std::move(ring);
  p->watch = std::move(watch);
}

void ShmEngine::finish_connect(int peer, double timeout) {
  Peer* p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    p = peers_.at(size_t(peer)).get();
    if (p == nullptr || !p->in || !p->out) fail(label() + ": open_ring before finish_connect for rank " + std::to_string(peer));
  }
  const double deadline = now_s() + timeout;
  double delay = 1e-5;
  while (p->in->ctl()->opener_mapped.load(std::memory_order_acquire) == 0) {
    if (!p->watch->alive()) {
      p->in->unlink();
      fail(ErrKind::PeerLost, label() + ": rank " + std::to_string(peer) + " (pid " + std::to_string(p->watch->pid()) +
                                  ") died while connecting");
    }
    if (now_s() > deadline) {
      p->in->unlink();
      fail(ErrKind::Timeout, label() + ": rank " + std::to_string(peer) + " did not map shared-memory segment " +
                                 p->in->name() + " within " + std::to_string(timeout) + " s");
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    delay = std::min(delay * 2, 5e-3);
  }
  p->in->unlink();  // the peer unlinked it already; this covers a peer that crashed between map and unlink
  mailbox_.set_connected(peer);
  p->receiver = std::thread([this, p] { receiver_loop(p); });
}

std::vector<std::string> ShmEngine::linked_names() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (auto& p : peers_)
    if (p && p->in && !p->receiver.joinable()) names.push_back(p->in->name());
  return names;
}

std::string ShmEngine::dead_reason(Peer* p) {
  return "rank " + std::to_string(p->rank) + " (pid " + std::to_string(p->watch->pid()) + ") died";
}

// ---------------------------------------------------------------------------------------------- sending

SendOpPtr ShmEngine::isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) {
  Peer* p = peer_or_fail(peer);
  auto op = std::make_shared<SendOp>();
  op->peer = peer;
  op->tag = tag;
  op->header = std::move(header);
  op->data = data;
  op->size = size;
  const size_t total = sizeof(FrameHeader) + op->header.size() + size;
  std::lock_guard<std::mutex> lock(p->send_mu);
  if (p->send_error.empty() && p->out->consumer_closed()) {
    p->send_error_kind = ErrKind::PeerLost;
    p->send_error = label() + ": rank " + std::to_string(peer) + " closed its transport";
  }
  if (!p->send_error.empty()) {
    op->fail(p->send_error_kind, p->send_error);
    return op;
  }
  if (p->queue.empty() && !p->scheduled && total <= opts_.inline_bytes && p->out->free_space() >= total &&
      !p->out->consumer_closed()) {
    // Fast path: the ring is idle and has room, so copying here beats waking a pool thread.
    FrameHeader fh{kFrameMagic, uint32_t(op->header.size()), tag, size};
    p->out->put(reinterpret_cast<const uint8_t*>(&fh), sizeof fh);
    p->out->put(reinterpret_cast<const uint8_t*>(op->header.data()), op->header.size());
    if (size) p->out->put(data, size);
    p->out->publish();
    op->complete();
    return op;
  }
  p->queue.push_back(op);
  if (!p->scheduled) {
    p->scheduled = true;
    copy_pool_.submit([this, p] { drain_sends(p); });
  }
  return op;
}

void ShmEngine::drain_sends(Peer* p) {
  while (true) {
    SendOpPtr op;
    {
      std::lock_guard<std::mutex> lock(p->send_mu);
      if (p->queue.empty() || stop_.load()) {
        p->scheduled = false;
        return;
      }
      if (!p->send_error.empty()) {
        for (auto& q : p->queue) q->fail(p->send_error_kind, p->send_error);
        p->queue.clear();
        p->scheduled = false;
        return;
      }
      op = p->queue.front();
    }
    try {
      write_op(p, *op);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(p->send_mu);
      if (p->send_error.empty()) {
        p->send_error_kind = e.kind;
        p->send_error = e.what();
      }
      for (auto& q : p->queue) q->fail(e.kind, e.what());
      p->queue.clear();
      p->scheduled = false;
      return;
    }
    std::lock_guard<std::mutex> lock(p->send_mu);
    p->queue.pop_front();
    op->complete();
  }
}

void ShmEngine::write_op(Peer* p, SendOp& op) {
  if (p->out->consumer_closed()) fail(ErrKind::PeerLost, label() + ": rank " + std::to_string(p->rank) + " closed its transport");
  const auto& heap = p->out->heap();
  uint8_t* dst = heap && op.size >= opts_.heap_min_bytes ? heap->alloc(op.size) : nullptr;
  if (dst != nullptr) {
    // One copy, straight into the receiver's heap (split over the copy pool), then a small record.
    copy_pool_.parallel_copy(dst, op.data, op.size, opts_.copy_slice, op.size >= opts_.streaming_bytes);
    FrameHeader fh{kHeapMagic, uint32_t(op.header.size()), op.tag, op.size};
    const uint64_t off = heap->offset_of(dst);
    write_bytes(p, reinterpret_cast<const uint8_t*>(&fh), sizeof fh);
    write_bytes(p, reinterpret_cast<const uint8_t*>(op.header.data()), op.header.size());
    write_bytes(p, reinterpret_cast<const uint8_t*>(&off), sizeof off);
    p->out->publish();
    return;
  }
  FrameHeader fh{kFrameMagic, uint32_t(op.header.size()), op.tag, op.size};
  write_bytes(p, reinterpret_cast<const uint8_t*>(&fh), sizeof fh);
  write_bytes(p, reinterpret_cast<const uint8_t*>(op.header.data()), op.header.size());
  write_bytes(p, op.data, op.size);
  p->out->publish();
}

// Stream n bytes into the outbound ring, publishing every chunk so the receiver copies while we copy.
void ShmEngine::write_bytes(Peer* p, const uint8_t* src, size_t n) {
  Ring& r = *p->out;
  const size_t chunk = opts_.chunk_bytes;
  while (n > 0) {
    size_t free = r.free_space();
    if (free == 0 || (free < chunk && free < n)) {
      // Wait for a useful amount of room rather than trickling a few bytes at a time.
      r.publish();
      const size_t want = std::min(std::min(n, chunk), r.capacity() / 2);
      while (!r.wait_space(want, kWaitSlice)) {
        if (stop_.load()) fail(label() + " closed while sending to rank " + std::to_string(p->rank));
        if (r.consumer_closed()) fail(ErrKind::PeerLost, label() + ": rank " + std::to_string(p->rank) + " closed its transport");
        if (!p->watch->alive()) fail(ErrKind::PeerLost, label() + ": " + dead_reason(p) + " while a message was being sent to it");
      }
      if (r.consumer_closed()) fail(ErrKind::PeerLost, label() + ": rank " + std::to_string(p->rank) + " closed its transport");
      free = r.free_space();
    }
    if (stop_.load()) fail(label() + " closed while sending to rank " + std::to_string(p->rank));
    const size_t k = std::min(std::min(n, free), chunk);
    r.put(src, k);
    src += k;
    n -= k;
    if (r.unpublished() >= chunk) r.publish();
  }
}

// ---------------------------------------------------------------------------------------------- receiving

ShmEngine::ReadStatus ShmEngine::read_exact(Peer* p, uint8_t* dst, size_t n, bool streaming) {
  Ring& r = *p->in;
  const size_t chunk = opts_.chunk_bytes;
  while (n > 0) {
    size_t avail = r.available();
    if (avail == 0) {
      r.release();
      if (r.wait_data(1, kWaitSlice)) continue;
      if (stop_.load()) return ReadStatus::Stopped;
      if (r.available() > 0) continue;
      if (r.producer_closed()) return r.available() > 0 ? ReadStatus::Ok : ReadStatus::Closed;
      if (!p->watch->alive()) return r.available() > 0 ? ReadStatus::Ok : ReadStatus::Dead;
      continue;
    }
    const size_t k = std::min(std::min(avail, n), chunk);
    r.get(dst, k, streaming);
    dst += k;
    n -= k;
    if (r.unreleased() >= chunk) r.release();
  }
  return ReadStatus::Ok;
}

void ShmEngine::receiver_loop(Peer* p) {
  ReadStatus st = ReadStatus::Ok;
  std::string error;
  try {
    while (st == ReadStatus::Ok) {
      FrameHeader fh;
      st = read_exact(p, reinterpret_cast<uint8_t*>(&fh), sizeof fh);
      if (st != ReadStatus::Ok) break;
      if ((fh.magic != kFrameMagic && fh.magic != kHeapMagic) || fh.header_len > kMaxHeaderLen) {
        error = "corrupt shared-memory stream from rank " + std::to_string(p->rank);
        break;
      }
      Message msg;
      msg.header.resize(fh.header_len);
      st = read_exact(p, reinterpret_cast<uint8_t*>(msg.header.data()), fh.header_len);
      if (st != ReadStatus::Ok) break;
      if (fh.magic == kHeapMagic) {
        // The payload is already in our heap: hand it over in place (freed when the tensor dies).
        uint64_t off = 0;
        st = read_exact(p, reinterpret_cast<uint8_t*>(&off), sizeof off);
        if (st != ReadStatus::Ok) break;
        const auto& heap = p->in->heap();
        if (!heap || off > (uint64_t(1) << 48) || !heap->contains(heap->at(off), size_t(fh.payload_len))) {
          error = "corrupt shared-memory record from rank " + std::to_string(p->rank) + " (heap offset out of range)";
          break;
        }
        msg.payload = std::make_shared<Block>();
        msg.payload->data = heap->at(off);
        msg.payload->size = size_t(fh.payload_len);
        msg.payload->capacity = heap->rounded(size_t(fh.payload_len));
        msg.payload->heap = heap;
        in_place_++;
      } else {
        msg.payload = pool_->get(size_t(fh.payload_len));
        st = read_exact(p, msg.payload->data, size_t(fh.payload_len), fh.payload_len >= opts_.streaming_bytes);
        if (st != ReadStatus::Ok) break;
        streamed_++;
      }
      p->in->release();
      mailbox_.deliver(p->rank, fh.tag, std::move(msg));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Sends to the peer fail from now on -- set before the mailbox says so, so that a caller who has seen
  // PeerLost from a receive can never see a later send to the same peer "complete".
  if (!error.empty() || st == ReadStatus::Closed || st == ReadStatus::Dead) {
    const std::string why = label() + ": " +
                            (!error.empty() ? error
                             : st == ReadStatus::Dead ? dead_reason(p)
                                                      : "rank " + std::to_string(p->rank) + " closed its transport");
    std::lock_guard<std::mutex> lock(p->send_mu);
    if (p->send_error.empty()) {
      p->send_error_kind = ErrKind::PeerLost;
      p->send_error = why;
    }
    // Queued sends fail when the copy worker next looks (it checks send_error); those not started fail here.
    if (!p->scheduled) {
      for (auto& op : p->queue) op->fail(ErrKind::PeerLost, why);
      p->queue.clear();
    }
  }
  if (!error.empty())
    mailbox_.set_lost(p->rank, error);
  else if (st == ReadStatus::Closed)
    mailbox_.set_closed(p->rank, "rank " + std::to_string(p->rank) + " closed its transport");
  else if (st == ReadStatus::Dead)
    mailbox_.set_lost(p->rank, dead_reason(p));
}

// ---------------------------------------------------------------------------------------------- closing

void ShmEngine::abandon() {
  abandoned_ = true;
  copy_pool_.abandon();
  for (auto& p : peers_)
    if (p) leak_thread(p->receiver);
}

void ShmEngine::close() {
  if (abandoned_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  stop_.store(true);
  // Wake every sleeper, then join: copy workers first (they are the producers of the outbound rings),
  // then the receivers.
  for (auto& p : peers_) {
    if (!p) continue;
    if (p->out) p->out->wake_all();
    if (p->in) p->in->wake_all();
  }
  copy_pool_.stop();
  for (auto& p : peers_) {
    if (!p) continue;
    if (p->out) p->out->close_producer();  // tells the peer: orderly close
    if (p->in) p->in->close_consumer();
    if (p->receiver.joinable()) p->receiver.join();
    std::lock_guard<std::mutex> lock(p->send_mu);
    for (auto& op : p->queue) op->fail(ErrKind::Transport, label() + " was closed before this message was sent");
    p->queue.clear();
  }
  mailbox_.shutdown();
  // The rings stay mapped until the engine is destroyed: a call that raced with close() may still touch them.
  for (auto& p : peers_)
    if (p && p->in) p->in->unlink();
}

}  // namespace lmt

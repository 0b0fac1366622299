// The receive side of the ucx engine (ucx_channel.h): active messages in, eager data copied and rendezvous data
// received straight into pooled blocks, and everything handed to the mailbox in the sender's order. All of it
// runs on the progress thread, inside ucp_worker_progress.
#include <cstring>
#include <exception>

#include "ucx_channel.h"
#include "wire.h"

namespace lmt {

using namespace ucxwire;

ucs_status_t UcxEngine::am_callback(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  return static_cast<UcxEngine*>(arg)->on_am(header, header_length, data, length, param);
}

ucs_status_t UcxEngine::on_am(const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
  AmFrame frame;
  if (header_length < sizeof frame) return UCS_OK;  // not ours: dropped
  std::memcpy(&frame, header, sizeof frame);
  const bool in_data = (frame.flags & kFlagHeaderInData) != 0;
  if (frame.src < 0 || frame.src >= world_size_ || frame.src == rank_ || frame.header_len > kMaxHeaderLen ||
      (in_data ? length < frame.header_len : header_length < sizeof frame + frame.header_len))
    return UCS_OK;
  Peer& p = *peers_[size_t(frame.src)];
  if (frame.seq < p.next_seq) return UCS_OK;  // a duplicate: a well-behaved sender never sends one
  // No exception may cross into UCX (C): a failure here (out of memory) loses the peer instead.
  try {
    Pending m;
    m.magic = frame.magic;
    m.flags = frame.flags;
    m.header_len = frame.header_len;
    m.tag = frame.tag;
    if (!in_data) m.msg.header.assign(static_cast<const char*>(header) + sizeof frame, frame.header_len);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && (frame.flags & kFlagDeviceData) && !in_data &&
        frame.magic == kFrameMagic && device_mode_.load() && m.msg.header.size() >= kKindOffset + 8 && length > 0) {
      // Device memory to a transport on a GPU: keep the descriptor; Python pulls it into a tensor on its device
      // (UcxEngine::pull). Filed now, marked (kind word kKindPull, trailer token + length), in its place in the order.
      const uint64_t token = next_token_++;
      const uint64_t len64 = length;
      std::memcpy(&m.msg.header[kKindOffset], &kKindPull, 8);
      m.msg.header.append(reinterpret_cast<const char*>(&token), 8);
      m.msg.header.append(reinterpret_cast<const char*>(&len64), 8);
      m.msg.payload = pool_->get(0);
      m.ready = true;
      deferred_[token] = Deferred{data, length, frame.src};
      try {
        file(p, frame.seq, std::move(m));
      } catch (...) {
        deferred_.erase(token);  // UCS_OK below drops the descriptor
        throw;
      }
      return UCS_INPROGRESS;  // the descriptor persists until the pull (or close releases it)
    }
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      // Rendezvous: the data is still at the sender. Receive it straight into a pooled block; the message keeps
      // its place in the order meanwhile.
      m.msg.payload = pool_->get(length);
      uint8_t* dst = m.msg.payload->data;
      auto* f = new InFlight();
      f->engine = this;
      f->peer = frame.src;
      f->seq = frame.seq;
      file(p, frame.seq, std::move(m));
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      prm.cb.recv_am = &UcxEngine::recv_cb;
      prm.user_data = f;
      prm.memory_type = UCS_MEMORY_TYPE_HOST;
      void* req = api_.am_recv_data_nbx(worker_, data, dst, length, &prm);
      if (req == nullptr)
        on_recv_done(f, UCS_OK);
      else if (UCS_PTR_IS_ERR(req))
        on_recv_done(f, UCS_PTR_STATUS(req));
      else
        track(f);
      return UCS_OK;
    }
    // Eager: the data is here and valid during this callback only.
    const uint8_t* src = static_cast<const uint8_t*>(data);
    if (in_data) {
      m.msg.header.assign(reinterpret_cast<const char*>(src), frame.header_len);
      src += frame.header_len;
      length -= frame.header_len;
    }
    m.msg.payload = pool_->get(length);
    if (length > 0) std::memcpy(m.msg.payload->data, src, length);
    m.ready = true;
    file(p, frame.seq, std::move(m));
  } catch (const std::exception& e) {
    peer_failed(p, true, std::string("receiving a message from rank ") + std::to_string(p.rank) + " failed: " + e.what());
  }
  return UCS_OK;
}

void UcxEngine::on_recv_done(InFlight* f, ucs_status_t status) {
  untrack(f);
  Peer& p = *peers_[size_t(f->peer)];
  const uint64_t seq = f->seq;
  delete f;
  auto it = p.waiting.find(seq);
  if (it == p.waiting.end()) return;
  if (status != UCS_OK) {
    peer_failed(p, true, "receiving a message from rank " + std::to_string(p.rank) + " failed: " + status_str(status));
    return;
  }
  Pending& m = it->second;
  if (m.flags & kFlagHeaderInData) {  // split the Python header off the received bytes
    std::shared_ptr<Block> all = std::move(m.msg.payload);
    m.msg.header.assign(reinterpret_cast<const char*>(all->data), m.header_len);
    m.msg.payload = pool_->get(all->size - m.header_len);
    if (m.msg.payload->size > 0) std::memcpy(m.msg.payload->data, all->data + m.header_len, m.msg.payload->size);
  }
  m.ready = true;
  drain(p);
}

// Hand messages to the mailbox in the sender's order (FIFO per peer, hence per (peer, tag)).
void UcxEngine::file(Peer& p, uint64_t seq, Pending&& m) {
  if (seq == p.next_seq && m.ready && p.waiting.empty()) {  // the common case: in order and complete
    deliver(p, m);
    p.next_seq++;
    return;
  }
  p.waiting.emplace(seq, std::move(m));
  drain(p);
}

void UcxEngine::drain(Peer& p) {
  while (!p.waiting.empty() && p.waiting.begin()->first == p.next_seq && p.waiting.begin()->second.ready) {
    deliver(p, p.waiting.begin()->second);
    p.waiting.erase(p.waiting.begin());
    p.next_seq++;
  }
}

void UcxEngine::deliver(Peer& p, Pending& m) {
  if (m.magic == kFrameMagic) {
    mailbox_.deliver(p.rank, m.tag, std::move(m.msg));
  } else if (m.magic == kHelloMagic) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      p.hello = true;
    }
    mailbox_.set_connected(p.rank);
    cv_.notify_all();
  } else if (m.magic == kByeMagic) {
    peer_failed(p, false, "rank " + std::to_string(p.rank) + " closed its transport");
  }
}

}  // namespace lmt

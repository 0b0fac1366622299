// The ucx engine's CUDA memory path (see ucx_channel.h): device sends flagged in their frame, device mode (the
// progress thread current on the GPU's primary context, rendezvous device messages kept for a pull), and the
// pull itself, which receives a kept message straight into memory Python allocated on its GPU.
#include <dlfcn.h>

#include <cstring>

#include "common.h"
#include "ucx_channel.h"

namespace lmt {

using namespace ucxwire;

namespace {
// SendOp::progress is the stream engines' (bytes of the frame written); ucx never streams, so it marks a
// device send there: 1 + its ucs_memory_type_t (0: an ordinary host send).
ucs_memory_type_t checked_memory_type(const std::string& label, uint32_t value) {
  if (value != UCS_MEMORY_TYPE_HOST && value != UCS_MEMORY_TYPE_CUDA)
    fail(label + ": memory type " + std::to_string(value) + " is not host (0) or CUDA (1)");
  return ucs_memory_type_t(value);
}
}  // namespace

// CUDA memory, driven from Python (transport/ucx.py). A device send is queued like any send; SendOp::progress,
// unused by sends before they are posted, carries its memory type + 1 (0: host memory, the default path).
SendOpPtr UcxEngine::isend_device(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size,
                                  uint32_t memory_type) {
  check_peer(peer);
  auto op = std::make_shared<SendOp>();
  op->peer = peer, op->tag = tag, op->header = std::move(header), op->data = data, op->size = size;
  op->progress = 1 + size_t(checked_memory_type(label(), memory_type));
  return queue_send(op);
}

SendOpPtr UcxEngine::pull(int peer, uint64_t token, uint8_t* data, size_t size, uint32_t memory_type) {
  check_peer(peer);
  auto op = std::make_shared<SendOp>();
  op->peer = peer, op->data = data, op->size = size;
  const ucs_memory_type_t mt = checked_memory_type(label(), memory_type);
  return queue_task(op, [this, op, token, mt] { start_pull(op, token, mt); });
}

SendOpPtr UcxEngine::device_mode(int device, uint32_t flags) {
  auto op = std::make_shared<SendOp>();
  return queue_task(op, [this, op, device, flags] { enter_device_mode(op, device, flags); });
}

std::vector<std::pair<uint64_t, Message>> UcxEngine::take_deferred(int peer, size_t limit) {
  check_peer(peer);
  return mailbox_.take_heads(peer, limit, [](const Message& m) {
    int64_t kind = 0;
    if (m.header.size() < kKindOffset + sizeof kind) return false;
    std::memcpy(&kind, &m.header[kKindOffset], sizeof kind);
    return kind == kKindPull;
  });
}

// Progress thread. The CUDA driver is the one torch loaded (libcuda.so.1, already in the process): make this
// thread current on the device's primary context (the one torch's runtime uses), so UCX's CUDA transports find
// a context wherever they look for one. Device mode is on whatever happens; the op fails only to tell Python
// what went wrong (it warns: UCX may still manage, as it retains primary contexts itself in recent versions).
void UcxEngine::enter_device_mode(const SendOpPtr& op, int device, uint32_t flags) {
  device_mode_.store(true);
  if (flags & kDeviceModeNoContext) {
    op->complete();
    return;
  }
  using CuInit = int (*)(unsigned);
  using CuDeviceGet = int (*)(int*, int);
  using CuPrimaryCtxRetain = int (*)(void**, int);
  using CuCtxSetCurrent = int (*)(void*);
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) {
    const char* why = dlerror();
    op->fail(ErrKind::Transport, label() + ": cannot load libcuda.so.1 (" + (why ? why : "?") + ")");
    return;
  }
  auto cu_init = reinterpret_cast<CuInit>(dlsym(lib, "cuInit"));
  auto cu_device_get = reinterpret_cast<CuDeviceGet>(dlsym(lib, "cuDeviceGet"));
  auto cu_retain = reinterpret_cast<CuPrimaryCtxRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
  auto cu_set = reinterpret_cast<CuCtxSetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
  if (!cu_init || !cu_device_get || !cu_retain || !cu_set) {
    op->fail(ErrKind::Transport, label() + ": libcuda.so.1 lacks cuInit/cuDeviceGet/cuDevicePrimaryCtxRetain/cuCtxSetCurrent");
    return;
  }
  int dev = 0, rc = 0;
  void* ctx = nullptr;
  const char* step = "cuInit";
  if ((rc = cu_init(0)) == 0) {
    step = "cuDeviceGet";
    if ((rc = cu_device_get(&dev, device)) == 0) {
      step = "cuDevicePrimaryCtxRetain";  // released never: the context lives as long as the process uses CUDA
      if ((rc = cu_retain(&ctx, dev)) == 0) {
        step = "cuCtxSetCurrent";
        rc = cu_set(ctx);
      }
    }
  }
  if (rc != 0) {
    op->fail(ErrKind::Transport, label() + ": " + step + " for CUDA device " + std::to_string(device) +
                                     " on the progress thread failed (CUresult " + std::to_string(rc) + ")");
    return;
  }
  op->complete();
}

// Progress thread: receive the deferred message `token` into op->data (op->size bytes of `memory_type`).
void UcxEngine::start_pull(const SendOpPtr& op, uint64_t token, ucs_memory_type_t memory_type) {
  auto it = deferred_.find(token);
  if (it == deferred_.end()) {
    op->fail(ErrKind::Transport, label() + ": no deferred message " + std::to_string(token) + " from rank " +
                                     std::to_string(op->peer) + " (received already, or dropped)");
    return;
  }
  Deferred d = it->second;
  deferred_.erase(it);
  if (d.peer != op->peer || d.length != op->size || op->data == nullptr) {
    api_.am_data_release(worker_, d.desc);
    op->fail(ErrKind::Transport, label() + ": pull of message " + std::to_string(token) + " from rank " +
                                     std::to_string(op->peer) + " into " + std::to_string(op->size) +
                                     " bytes, but it has " + std::to_string(d.length) + " bytes from rank " +
                                     std::to_string(d.peer));
    return;
  }
  auto* f = new InFlight();
  f->engine = this;
  f->op = op;
  f->peer = d.peer;
  f->pull = true;
  f->device = true;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.cb.recv_am = &UcxEngine::recv_cb;
  prm.user_data = f;
  prm.memory_type = memory_type;
  void* req = api_.am_recv_data_nbx(worker_, d.desc, const_cast<uint8_t*>(op->data), d.length, &prm);
  if (req == nullptr) {
    on_pull_done(f, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    on_pull_done(f, UCS_PTR_STATUS(req));
  } else {
    track(f);
  }
}

// A failed pull loses that one message (the sequence is intact: it was filed in order), not the peer; if the
// peer died, its error callback has said so already.
void UcxEngine::on_pull_done(InFlight* f, ucs_status_t status) {
  untrack(f);
  if (status == UCS_OK) {
    f->op->complete();
  } else {
    const Peer& p = *peers_[size_t(f->peer)];
    bool gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gone = p.gone;
    }
    f->op->fail(gone ? ErrKind::PeerLost : ErrKind::Transport,
                label() + ": receiving the data of a message from rank " + std::to_string(f->peer) +
                    " into device memory failed: " + status_str(status));
  }
  delete f;
}

}  // namespace lmt

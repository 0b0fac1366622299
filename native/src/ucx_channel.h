// Any host, any fabric UCX supports: one UCP worker per transport, driven by one progress thread. Messages are
// UCP active messages: the AM header carries the frame (tag, per-peer sequence number, sender rank) and the
// Python header; the payload is the AM data, sent straight from the tensor. UCX picks the protocol per size:
// small payloads arrive eagerly (copied into a pooled block in the receive callback, ucx_receive.cpp), large
// ones by rendezvous (ucp_am_recv_data_nbx straight into a pooled block). Active messages fit the mailbox model
// every engine shares (nothing is pre-posted: arrivals are filed until Python asks), where tagged receives would
// need the receive buffer before the message.
//
// Ordering: a rendezvous message completes after later eager ones, so the receiver files messages by sequence
// number, per peer: FIFO per (peer, tag) holds whatever order UCX completes them in.
// CUDA memory (a transport on a CUDA device; Python drives it through isend_device, pull, enter_device_mode): a
// send of device
// memory is posted with UCS_MEMORY_TYPE_CUDA and flagged kFlagDeviceData in its frame, so UCX moves it with its
// own CUDA transports (cuda_ipc, cuda_copy). On a receiver in device mode, a flagged message that comes by
// rendezvous is not received at once: its descriptor is kept (the AM callback returns UCS_INPROGRESS) and the
// message is filed with its Python header's kind word set to kKindPull and a trailer (token, length); Python
// allocates the destination on its GPU (torch's allocator) and calls pull(), which receives the data straight
// into it (ucp_am_recv_data_nbx, UCS_MEMORY_TYPE_CUDA) and completes a SendOp when it has landed. Flagged eager
// messages (small) arrive in host memory like any other; Python copies them to the GPU.
//
// Set-up: each rank publishes its worker address through the rendezvous store (no ports); both ends create an
// endpoint to the other and exchange a HELLO. Death: endpoints use UCP_ERR_HANDLING_MODE_PEER, whose error
// callback (a transport error, UCX's keep-alive) marks the peer lost; a same-host peer is also watched by pidfd.
// An orderly close sends BYE (ordered after every message) and flushes the endpoints. Threads: only the progress
// thread touches the worker (UCS_THREAD_MODE_SERIALIZED); callers queue sends and control tasks to it and wake
// it through an eventfd, and it sleeps in epoll on the worker's event fd when idle, after a short spin.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "copy_pool.h"
#include "mailbox.h"
#include "ucx_api.h"

namespace lmt {

// The ucx engine's wire format (both of its source files).
namespace ucxwire {

constexpr unsigned kAmId = 7;                   // our one active-message id (UCX sizes a table by the largest id)
constexpr uint32_t kHelloMagic = 0x4f4c4548u;  // "HELO": sequence number 0 of every peer
constexpr uint32_t kFlagHeaderInData = 1;      // the Python header did not fit the AM header: it leads the data
constexpr uint32_t kFlagDeviceData = 2;        // the payload was sent from CUDA memory (older receivers ignore it)

// (Memory types are ucs_memory_type_t values: UCS_MEMORY_TYPE_CUDA in use; tests on machines without GPUs drive
// the same path with UCS_MEMORY_TYPE_HOST.)
constexpr uint32_t kDeviceModeNoContext = 1;
// The kind word (offset 8 of the Python header, transport/header.py) of a deferred message as filed: Python's
// UcxTransport recognises it and pulls. Its trailer after the Python header: token (u64), length (u64).
constexpr int64_t kKindPull = 0x4C4C5550;  // "PULL"
constexpr size_t kKindOffset = 8;

// The AM header: this frame, then the Python header (unless kFlagHeaderInData).
struct AmFrame {
  uint32_t magic;  // kFrameMagic (a message), kHelloMagic, kByeMagic (wire.h)
  uint32_t header_len;
  uint64_t tag;
  uint64_t seq;  // per ordered pair of ranks, from 0
  int32_t src;
  uint32_t flags;
};
static_assert(sizeof(AmFrame) == 32, "wire format");

}  // namespace ucxwire

struct UcxOptions {
  size_t pool_bytes = size_t(1) << 30;
  double spin_seconds = 20e-6;  // busy-poll this long after the last event before sleeping on the event fd
  double close_timeout = 5.0;   // an orderly close waits this long for the BYEs and endpoint flushes
  // UCX settings for this context, e.g. {"KEEPALIVE_INTERVAL", "1s", false}; a UCX_* environment variable of
  // the same name wins. A setting UCX refuses is an error if `required` (the user's), else skipped (a default
  // an older or differently built UCX does not know).
  struct Setting {
    std::string name, value;
    bool required;
  };
  std::vector<Setting> config;
};

class UcxEngine : public Engine {
 public:
  UcxEngine(std::string label, int rank, int world_size, UcxOptions opts);
  ~UcxEngine() override;

  // This worker's address: publish it to the peers (opaque bytes; includes every transport's address).
  const std::string& address() const { return address_; }
  // Create the endpoint to `peer` at its worker address and send it HELLO. Blocking (up to `timeout`).
  // `pid` >= 0: the peer runs on this host with that pid; its death is then noticed by a pidfd within ~0.1 s
  // (UCX's keep-alive alone missed a same-host peer that died during a CMA rendezvous: the survivor waited on).
  void connect_peer(int peer, const std::string& address, int pid, double timeout);
  // Whether the peer's HELLO has arrived (it has an endpoint to us and its messages flow), within `timeout`.
  bool wait_connected(int peer, double timeout);
  // "transport/device" of each lane of the endpoint to `peer` (what UCX chose), e.g. {"posix/memory", ...}.
  std::vector<std::string> transports(int peer, double timeout);
  size_t max_am_header() const { return max_am_header_; }

  SendOpPtr isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) override;
  // Send `size` bytes of memory of type `memory_type` (CUDA: the caller made sure the data is computed) with the
  // frame flagged as device data.
  SendOpPtr isend_device(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size,
                         uint32_t memory_type);
  // Receive the deferred message `token` from `peer` into `data` (exactly its length); the op completes when the
  // data is there.
  SendOpPtr pull(int peer, uint64_t token, uint8_t* data, size_t size, uint32_t memory_type);
  // Make the progress thread current on CUDA device `device`'s primary context (unless flags has
  // kDeviceModeNoContext) and defer flagged rendezvous messages from then on; the op completes when it has.
  SendOpPtr device_mode(int device, uint32_t flags);
  // Take-ahead across tags: deferred messages from `peer` that head their (peer, tag) queue, oldest first, up to
  // `limit` (Python starts their pulls before it is asked for them). Never blocks.
  std::vector<std::pair<uint64_t, Message>> take_deferred(int peer, size_t limit);
  void close() override;
  void abandon() override;

 private:
  // A message filed by sequence number: arrived out of order, or its rendezvous data is still coming.
  struct Pending {
    uint32_t magic = 0;
    uint32_t flags = 0;
    uint32_t header_len = 0;
    uint64_t tag = 0;
    Message msg;
    bool ready = false;
  };

  struct Peer {
    UcxEngine* engine = nullptr;
    int rank = -1;
    // progress thread only
    ucp_ep_h ep = nullptr;
    std::unique_ptr<PeerWatch> watch;  // same-host peers
    bool close_ep = false;  // lost or closed: force-close the endpoint outside UCX's callbacks
    uint64_t send_seq = 0;
    uint64_t next_seq = 0;  // the next sequence number to hand to the mailbox
    std::map<uint64_t, Pending> waiting;
    // guarded by UcxEngine::mu_
    bool hello = false;
    bool gone = false;
    std::string why;  // set with `gone`: the failure every later send reports
  };

  // A UCX request we must hear back from: a send (op set), a rendezvous receive (peer, seq) or a pull (op set,
  // pull true).
  struct InFlight {
    UcxEngine* engine = nullptr;
    SendOpPtr op;
    std::string staging;  // header + payload of a send whose Python header did not fit the AM header
    int peer = -1;
    uint64_t seq = 0;
    bool pull = false;
    bool device = false;  // a pull: the copy's completion wakes no file descriptor (see loop())
  };

  // A rendezvous message kept for Python to pull into device memory (progress thread only).
  struct Deferred {
    void* desc = nullptr;  // UCX's data descriptor (held: the AM callback returned UCS_INPROGRESS)
    size_t length = 0;
    int peer = -1;
  };

  void loop();
  void wake(bool always = false);
  void run_on_thread(std::function<void()> task, double timeout, const std::string& what);
  void post(const SendOpPtr& op, uint32_t magic);
  static void send_cb(void* request, ucs_status_t status, void* user_data);
  static void recv_cb(void* request, ucs_status_t status, size_t length, void* user_data);
  static void finish(void* request, ucs_status_t status, void* user_data);
  static void ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void on_send_done(InFlight* f, ucs_status_t status);
  void send_failed(const SendOpPtr& op, ucs_status_t status);
  static ucs_status_t am_callback(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param);
  ucs_status_t on_am(const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param);
  void on_recv_done(InFlight* f, ucs_status_t status);
  void track(InFlight* f);
  void untrack(InFlight* f);
  void file(Peer& p, uint64_t seq, Pending&& m);
  void drain(Peer& p);
  void deliver(Peer& p, Pending& m);
  void peer_failed(Peer& p, bool lost, const std::string& why);
  void check_peers();
  void close_lost_endpoints();
  void shutdown_on_thread();
  SendOpPtr queue_send(const SendOpPtr& op);
  SendOpPtr queue_task(const SendOpPtr& op, std::function<void()> task);
  void start_pull(const SendOpPtr& op, uint64_t token, ucs_memory_type_t memory_type);
  void on_pull_done(InFlight* f, ucs_status_t status);
  void enter_device_mode(const SendOpPtr& op, int device, uint32_t flags);
  std::string status_str(ucs_status_t s) const { return api_.status_string(s); }

  const UcxApi& api_;
  UcxOptions opts_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  size_t max_am_header_ = 0;
  double next_check_ = 0;  // progress thread: when check_peers() runs next
  int epoll_fd_ = -1, event_fd_ = -1, worker_fd_ = -1;

  std::vector<std::unique_ptr<Peer>> peers_;  // index: rank (fixed size: the error callback holds a Peer*)
  std::set<InFlight*> in_flight_;             // progress thread only: requests UCX still holds
  size_t device_in_flight_ = 0;               // progress thread only: pulls among them (InFlight::device)
  std::map<uint64_t, Deferred> deferred_;      // progress thread only: rendezvous messages awaiting a pull
  uint64_t next_token_ = 1;                    // progress thread only
  std::atomic<bool> device_mode_{false};        // set by device_mode() (on the progress thread)

  std::mutex mu_;  // guards the queues below, closed_, and Peer::hello/gone/why
  std::deque<SendOpPtr> sends_;
  std::deque<std::function<void()>> tasks_;
  std::condition_variable cv_;  // HELLOs and task completions
  bool closed_ = false;
  bool abandoned_ = false;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::thread thread_;
};

}  // namespace lmt

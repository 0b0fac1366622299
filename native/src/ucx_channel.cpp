#include "ucx_channel.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "common.h"
#include "wire.h"

namespace lmt {

using namespace ucxwire;

UcxEngine::UcxEngine(std::string label, int rank, int world_size, UcxOptions opts)
    : Engine(std::move(label), rank, world_size, opts.pool_bytes), api_(ucx_api()), opts_(std::move(opts)) {
  auto check = [&](ucs_status_t st, const std::string& what) {
    if (st == UCS_OK) return;
    std::string msg = this->label() + ": " + what + " failed: " + status_str(st);
    const char* tls = std::getenv("UCX_TLS");
    if (tls != nullptr && what == "ucp_init") msg += std::string(" (UCX_TLS=") + tls + ": are those transports here?)";
    if (worker_) api_.worker_destroy(worker_);
    if (context_) api_.cleanup(context_);
    if (event_fd_ >= 0) ::close(event_fd_);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    fail(msg);
  };
  ucp_config_t* config = nullptr;
  check(api_.config_read(nullptr, nullptr, &config), "ucp_config_read");
  for (const auto& [key, value, required] : opts_.config) {
    if (std::getenv(("UCX_" + key).c_str()) != nullptr) continue;  // the user's setting wins
    const ucs_status_t st = api_.config_modify(config, key.c_str(), value.c_str());
    if (st != UCS_OK && required) {
      api_.config_release(config);
      // ValueError in Python (a configuration error, not a transport failure)
      throw std::invalid_argument(this->label() + ": UCX refused the setting " + key + "=" + value + ": " + status_str(st));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "lightning_megatron";
  const ucs_status_t st = api_.init_version(UCP_API_MAJOR, kUcpMinMinor, &params, config, &context_);
  api_.config_release(config);
  check(st, "ucp_init");

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // one thread at a time: the progress thread, or set-up/teardown
  check(api_.worker_create(context_, &wp, &worker_), "ucp_worker_create");
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  check(api_.worker_query(worker_, &attr), "ucp_worker_query");
  max_am_header_ = attr.max_am_header;
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = &UcxEngine::am_callback;
  hp.arg = this;
  check(api_.worker_set_am_recv_handler(worker_, &hp), "ucp_worker_set_am_recv_handler");
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  check(api_.worker_get_address(worker_, &addr, &addr_len), "ucp_worker_get_address");
  address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  api_.worker_release_address(worker_, addr);
  check(api_.worker_get_efd(worker_, &worker_fd_), "ucp_worker_get_efd");

  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || event_fd_ < 0) check(UCS_ERR_IO_ERROR, "epoll/eventfd (" + errno_str(errno) + ")");
  for (int fd : {worker_fd_, event_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) check(UCS_ERR_IO_ERROR, "epoll_ctl (" + errno_str(errno) + ")");
  }
  for (int r = 0; r < world_size; ++r) {
    peers_.push_back(std::make_unique<Peer>());
    peers_.back()->engine = this;
    peers_.back()->rank = r;
  }
  thread_ = std::thread([this] { loop(); });
}

UcxEngine::~UcxEngine() { close(); }

// ---------------------------------------------------------------------------------------------- progress thread

void UcxEngine::wake(bool always) {
  if (!always && !sleeping_.load()) return;  // it is spinning or running: it will see the queue
  uint64_t one = 1;
  (void)!write(event_fd_, &one, sizeof one);
}

void UcxEngine::loop() {
  pthread_setname_np(pthread_self(), "lmt-ucx");  // tells it from UCX's own "async" thread in a debugger
  double last_busy = now_s();
  while (true) {
    std::deque<std::function<void()>> tasks;
    std::deque<SendOpPtr> sends;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks.swap(tasks_);
      sends.swap(sends_);
    }
    bool busy = !tasks.empty() || !sends.empty();
    for (auto& task : tasks) task();
    for (auto& op : sends) post(op, kFrameMagic);
    while (api_.worker_progress(worker_) != 0) busy = true;
    if (now_s() >= next_check_) check_peers();
    close_lost_endpoints();
    if (stop_.load()) break;
    if (busy) {
      last_busy = now_s();
      continue;
    }
    if (device_in_flight_ > 0) {
      // UCX's CUDA transports (cuda_ipc, cuda_copy) finish a copy by polling its CUDA event, which wakes no file
      // descriptor: asleep, this thread would hear of it only at its next wake-up. So poll while a pull is in
      // flight (the receiver makes the copy; a sender waits for the receiver's acknowledgement, a message that
      // does wake it, so a send waiting for a busy receiver costs no core).
      last_busy = now_s();
      cpu_relax();
      continue;
    }
    if (now_s() - last_busy < opts_.spin_seconds) {
      cpu_relax();
      continue;
    }
    // Idle: sleep until UCX or a caller has something. `sleeping_` first, then the queues: a caller that queued
    // after we looked sees sleeping_ and writes the eventfd.
    sleeping_.store(true);
    bool queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued = !tasks_.empty() || !sends_.empty();
    }
    if (!queued && !stop_.load() && api_.worker_arm(worker_) == UCS_OK) {
      epoll_event events[4];
      // Wake at least every slice: UCX's keep-alive (dead-peer detection) runs inside worker progress.
      epoll_wait(epoll_fd_, events, 4, int(kWaitSlice * 1000));
      uint64_t v;
      while (read(event_fd_, &v, sizeof v) > 0) {
      }
    }
    sleeping_.store(false);
    last_busy = now_s();  // spin briefly after a wake-up: the next event often follows
  }
  shutdown_on_thread();
}

void UcxEngine::run_on_thread(std::function<void()> task, double timeout, const std::string& what) {
  struct State {
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) fail(label() + " is closed");
    tasks_.push_back([this, state, task = std::move(task)] {
      try {
        task();
      } catch (...) {
        state->error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        state->done = true;
      }
      cv_.notify_all();
    });
  }
  wake();
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return state->done; }))
    fail(ErrKind::Timeout, label() + ": " + what + " did not finish within " + std::to_string(timeout) + " s");
  if (state->error) std::rethrow_exception(state->error);
}

// ---------------------------------------------------------------------------------------------- connecting

void UcxEngine::connect_peer(int peer, const std::string& address, int pid, double timeout) {
  check_peer(peer);
  run_on_thread(
      [this, peer, address, pid] {
        Peer& p = *peers_[size_t(peer)];
        if (p.ep != nullptr) return;
        if (pid >= 0) p.watch = std::make_unique<PeerWatch>(pid);
        ucp_ep_params_t ep{};
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails this endpoint, not the process
        ep.err_handler.cb = &UcxEngine::ep_error;
        ep.err_handler.arg = &p;
        const ucs_status_t st = api_.ep_create(worker_, &ep, &p.ep);
        if (st != UCS_OK) {
          p.ep = nullptr;
          fail(ErrKind::PeerLost, label() + ": cannot reach rank " + std::to_string(peer) + " (ucp_ep_create: " +
                                      status_str(st) + "); check UCX_TLS and UCX_NET_DEVICES");
        }
        auto hello = std::make_shared<SendOp>();
        hello->peer = peer;
        post(hello, kHelloMagic);
      },
      timeout, "creating the endpoint to rank " + std::to_string(peer));
}

bool UcxEngine::wait_connected(int peer, double timeout) {
  check_peer(peer);
  Peer& p = *peers_[size_t(peer)];
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return p.hello || p.gone || closed_; });
  if (!p.hello && p.gone) fail(ErrKind::PeerLost, p.why);
  return p.hello;
}

std::vector<std::string> UcxEngine::transports(int peer, double timeout) {
  check_peer(peer);
  auto out = std::make_shared<std::vector<std::string>>();
  if (api_.ep_query == nullptr) return *out;
  run_on_thread(
      [this, peer, out] {
        const Peer& p = *peers_[size_t(peer)];
        if (p.ep == nullptr) return;
        ucp_transport_entry_t entries[32];
        ucp_ep_attr_t attr{};
        attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
        attr.transports.entries = entries;
        attr.transports.num_entries = 32;
        attr.transports.entry_size = sizeof(ucp_transport_entry_t);
        if (api_.ep_query(p.ep, &attr) != UCS_OK) return;
        for (unsigned i = 0; i < attr.transports.num_entries; ++i)
          out->push_back(std::string(entries[i].transport_name) + "/" + entries[i].device_name);
      },
      timeout, "querying the endpoint to rank " + std::to_string(peer));
  return *out;
}

void UcxEngine::ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  if (p->ep != ep) return;  // an endpoint we are closing ourselves
  p->engine->peer_failed(*p, true,
                         "connection to rank " + std::to_string(p->rank) + " was lost (UCX: " +
                             p->engine->status_str(status) + "): the process died or its host is unreachable");
}

// Same-host peers, by pid (a few times per wait slice, busy or idle).
void UcxEngine::check_peers() {
  next_check_ = now_s() + kWaitSlice / 2;
  for (auto& p : peers_)
    if (p->watch && !p->watch->alive())
      peer_failed(*p, true, "rank " + std::to_string(p->rank) + " (pid " + std::to_string(p->watch->pid()) +
                                ") died");
}

// The endpoints of peers that died or closed, outside UCX's callbacks (they may not close endpoints).
void UcxEngine::close_lost_endpoints() {
  for (auto& p : peers_) {
    if (!p->close_ep || p->ep == nullptr) continue;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;  // the peer is gone: cancel what is outstanding
    void* req = api_.ep_close_nbx(p->ep, &prm);
    p->ep = nullptr;
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      const double deadline = now_s() + 1.0;  // a forced close completes locally; bounded all the same
      while (api_.request_check_status(req) == UCS_INPROGRESS && now_s() < deadline) api_.worker_progress(worker_);
      api_.request_free(req);
    }
  }
}

// Progress thread only (UCX callbacks included). Messages already filed stay receivable; sends still in
// flight to the peer fail now (UCX may never complete a rendezvous whose peer died).
void UcxEngine::peer_failed(Peer& p, bool lost, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.gone) return;
    p.gone = true;
    p.why = label() + ": " + why;
  }
  if (lost)
    mailbox_.set_lost(p.rank, why);
  else
    mailbox_.set_closed(p.rank, why);
  p.close_ep = true;  // not from inside a UCX callback: the loop closes it
  p.watch.reset();
  for (InFlight* f : in_flight_)
    if (f->op && f->op->peer == p.rank) f->op->fail(ErrKind::PeerLost, label() + ": " + why);
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------- sending

SendOpPtr UcxEngine::isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) {
  check_peer(peer);
  auto op = std::make_shared<SendOp>();
  op->peer = peer, op->tag = tag, op->header = std::move(header), op->data = data, op->size = size;
  return queue_send(op);
}

// Hands a send to the progress thread (or fails it at once if its peer is gone).
SendOpPtr UcxEngine::queue_send(const SendOpPtr& op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) fail(label() + " is closed");
    const Peer& p = *peers_[size_t(op->peer)];
    if (p.gone) {
      op->fail(ErrKind::PeerLost, p.why);
      return op;
    }
    sends_.push_back(op);
  }
  wake();
  return op;
}

// Runs `task` on the progress thread (the only one that touches the worker); `op` reports its outcome.
SendOpPtr UcxEngine::queue_task(const SendOpPtr& op, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) fail(label() + " is closed");
    tasks_.push_back(std::move(task));
  }
  wake();
  return op;
}

void UcxEngine::post(const SendOpPtr& op, uint32_t magic) {
  Peer& p = *peers_[size_t(op->peer)];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.gone) {
      op->fail(ErrKind::PeerLost, p.why);
      return;
    }
  }
  if (p.ep == nullptr) {
    op->fail(ErrKind::Transport, label() + ": rank " + std::to_string(op->peer) + " is not connected");
    return;
  }
  const bool device = op->progress != 0 && op->size > 0;
  if (device && sizeof(AmFrame) + op->header.size() > max_am_header_) {
    // Checked before a sequence number is used: the staging copy below cannot read device memory.
    op->fail(ErrKind::Transport, label() + ": a device send needs the header in the AM header (" +
                                     std::to_string(sizeof(AmFrame) + op->header.size()) + " > " +
                                     std::to_string(max_am_header_) + " bytes)");
    return;
  }
  AmFrame frame{magic, uint32_t(op->header.size()), op->tag, p.send_seq++, rank_, device ? kFlagDeviceData : 0};
  auto* f = new InFlight();
  f->engine = this;
  f->op = op;
  const void* data = op->data;
  size_t size = op->size;
  std::string am_header;
  if (sizeof frame + op->header.size() <= max_am_header_) {
    am_header.assign(reinterpret_cast<const char*>(&frame), sizeof frame);
    am_header += op->header;
  } else {  // rare (a large control message): one staging copy, the Python header first
    frame.flags = kFlagHeaderInData;
    am_header.assign(reinterpret_cast<const char*>(&frame), sizeof frame);
    f->staging = op->header;
    if (op->size > 0) f->staging.append(reinterpret_cast<const char*>(op->data), op->size);
    data = f->staging.data();
    size = f->staging.size();
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.flags = UCP_AM_SEND_FLAG_COPY_HEADER;  // am_header is a local: UCX keeps its own copy
  prm.cb.send = &UcxEngine::send_cb;
  prm.user_data = f;
  // No detection per send: Python says which memory it is (isend_device for CUDA memory).
  prm.memory_type = device ? ucs_memory_type_t(op->progress - 1) : UCS_MEMORY_TYPE_HOST;
  void* req = api_.am_send_nbx(p.ep, kAmId, am_header.data(), am_header.size(), data, size, &prm);
  if (req == nullptr) {  // done already (eager): the callback is not called
    op->complete();
    delete f;
  } else if (UCS_PTR_IS_ERR(req)) {
    delete f;
    send_failed(op, UCS_PTR_STATUS(req));
  } else {
    track(f);
  }
}

void UcxEngine::track(InFlight* f) {
  in_flight_.insert(f);
  if (f->device) device_in_flight_++;
}

void UcxEngine::untrack(InFlight* f) {
  if (in_flight_.erase(f) != 0 && f->device) device_in_flight_--;
}

void UcxEngine::send_cb(void* request, ucs_status_t status, void* user_data) { finish(request, status, user_data); }

void UcxEngine::recv_cb(void* request, ucs_status_t status, size_t, void* user_data) {
  finish(request, status, user_data);
}

// Completion of a request UCX did not finish at once (progress thread, inside worker progress).
void UcxEngine::finish(void* request, ucs_status_t status, void* user_data) {
  auto* f = static_cast<InFlight*>(user_data);
  UcxEngine* e = f->engine;
  if (f->pull)
    e->on_pull_done(f, status);
  else if (f->op)
    e->on_send_done(f, status);
  else
    e->on_recv_done(f, status);
  e->api_.request_free(request);
}

void UcxEngine::on_send_done(InFlight* f, ucs_status_t status) {
  untrack(f);
  if (status == UCS_OK)
    f->op->complete();
  else
    send_failed(f->op, status);
  delete f;
}

// A message that did not go out leaves a hole in the peer's sequence: nothing after it could be delivered in
// order, so the peer is lost (unless this transport is closing, which cancels what is outstanding).
void UcxEngine::send_failed(const SendOpPtr& op, ucs_status_t status) {
  bool closing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing = closed_;
  }
  if (closing) {
    op->fail(ErrKind::Transport, label() + " was closed before this message was sent");
    return;
  }
  Peer& p = *peers_[size_t(op->peer)];
  peer_failed(p, true, "sending to rank " + std::to_string(p.rank) + " failed: " + status_str(status));
  std::lock_guard<std::mutex> lock(mu_);
  op->fail(ErrKind::PeerLost, p.why);
}

// ---------------------------------------------------------------------------------------------- closing

// Last act of the progress thread: drop unsent messages, say BYE (ordered after every message sent), close the
// endpoints with a flush, and progress until they are closed or close_timeout passes.
void UcxEngine::shutdown_on_thread() {
  std::deque<std::function<void()>> tasks;
  std::deque<SendOpPtr> sends;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks.swap(tasks_);
    sends.swap(sends_);
  }
  for (auto& task : tasks) task();  // a connect racing close finishes (its endpoint is closed below)
  for (auto& op : sends) op->fail(ErrKind::Transport, label() + " was closed before this message was sent");
  for (auto& [token, d] : deferred_) api_.am_data_release(worker_, d.desc);  // messages never pulled
  deferred_.clear();
  std::vector<void*> closing;
  for (auto& p : peers_) {
    if (p->ep == nullptr) continue;
    bool gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gone = p->gone;
    }
    if (!gone) {
      auto bye = std::make_shared<SendOp>();
      bye->peer = p->rank;
      post(bye, kByeMagic);
    }
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = gone ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // 0: flush (the BYE and every send before it) first
    void* req = api_.ep_close_nbx(p->ep, &prm);
    p->ep = nullptr;
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) closing.push_back(req);
  }
  const double deadline = now_s() + opts_.close_timeout;
  while (!closing.empty() && now_s() < deadline) {
    const bool progressed = api_.worker_progress(worker_) != 0;
    for (size_t i = 0; i < closing.size();) {
      if (api_.request_check_status(closing[i]) != UCS_INPROGRESS) {
        api_.request_free(closing[i]);
        closing[i] = closing.back();
        closing.pop_back();
      } else {
        ++i;
      }
    }
    if (!progressed && !closing.empty() && api_.worker_arm(worker_) == UCS_OK) {
      epoll_event events[4];
      epoll_wait(epoll_fd_, events, 4, 10);
    }
  }
  for (void* req : closing) api_.request_free(req);  // released by UCX when (if) it completes
}

void UcxEngine::close() {
  if (abandoned_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;  // isend and run_on_thread refuse from now on; what they queued before, the thread fails
  }
  if (stop_.exchange(true)) return;  // the first close does the rest
  wake(true);
  if (thread_.joinable()) thread_.join();
  api_.worker_destroy(worker_);  // may complete leftover requests (their callbacks run here)
  worker_ = nullptr;
  for (InFlight* f : in_flight_) {
    if (f->op) f->op->fail(ErrKind::Transport, label() + " was closed before this message was sent");
    delete f;
  }
  in_flight_.clear();
  device_in_flight_ = 0;
  api_.cleanup(context_);
  context_ = nullptr;
  for (auto& p : peers_) p->watch.reset();  // their pidfds
  ::close(epoll_fd_);
  ::close(event_fd_);
  cv_.notify_all();
  mailbox_.shutdown();
}

void UcxEngine::abandon() {
  // A forked child: UCX's state (shared memory, sockets, the worker) is the parent's; touch none of it.
  abandoned_ = true;
  leak_thread(thread_);
}

}  // namespace lmt

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

#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "wire.h"

namespace lmt {

bool rdma_compiled() { return true; }

namespace {

constexpr uint32_t kFragMagic = 0x4d445246u;  // "FRDM"
constexpr uint32_t kFirst = 1, kLast = 2, kBye = 4;
constexpr uint64_t kRecv = 1, kSend = 2, kWrite = 3;
constexpr int kMaxWrites = 4;         // outstanding credit writes per peer
constexpr double kHeartbeat = 0.5;    // seconds between credit writes when idle

struct FragHeader {
  uint32_t magic, flags;
  uint64_t tag, total;
  uint32_t header_len, frag_len;
};
static_assert(sizeof(FragHeader) == 32, "wire format");

struct ConnInfo {
  uint32_t magic, qpn, psn, slots;
  uint16_t lid;
  uint8_t mtu, pad;
  uint32_t rkey;
  uint64_t credit_addr;
  uint8_t gid[16];
};

uint64_t wr_id(uint64_t kind, int peer, uint32_t slot) { return (kind << 56) | (uint64_t(peer) << 32) | slot; }

}  // namespace

struct RdmaEngine::Impl {
  struct Peer {
    int rank = -1;
    ibv_qp* qp = nullptr;
    uint8_t* recv_mem = nullptr;
    uint8_t* send_mem = nullptr;
    ibv_mr* recv_mr = nullptr;
    ibv_mr* send_mr = nullptr;
    std::vector<uint32_t> free_send;
    uint64_t remote_credit_addr = 0;
    uint32_t remote_rkey = 0;
    int remote_slots = 0;
    uint64_t sent = 0;           // fragments posted to the peer
    uint64_t consumed = 0;       // peer fragments we processed and re-posted
    uint64_t reported = 0;       // `consumed` as last written to the peer
    int writes_out = 0;
    double last_write = 0;
    bool connected = false, dead = false;
    // sends (callers push, progress thread pops)
    std::mutex mu;
    std::deque<SendOpPtr> queue;
    size_t offset = 0;  // bytes of the front op's payload already copied into slots
    bool failed = false;
    ErrKind fail_kind = ErrKind::PeerLost;
    std::string fail_why;
    // reassembly (progress thread)
    Message msg;
    uint64_t tag = 0;
    size_t got = 0;
    bool in_msg = false, bye = false;
  };

  RdmaEngine* eng;
  RdmaOptions opts;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* chan = nullptr;
  ibv_cq* cq = nullptr;
  ibv_port_attr port_attr{};
  ibv_gid gid{};
  int gid_index = 0;
  bool use_grh = false;
  std::string dev_name;
  uint64_t* ctrl = nullptr;  // [2*peer] credit word the peer writes, [2*peer+1] our source word
  ibv_mr* ctrl_mr = nullptr;
  std::vector<std::unique_ptr<Peer>> peers;
  std::mutex peers_mu;
  int event_fd = -1;
  std::atomic<bool> stop{false};
  std::thread thread;
  bool closed = false;

  std::string L() const { return eng->label(); }

  void open(int world) {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr || n == 0) {
      if (list) ibv_free_device_list(list);
      fail(L() + ": no RDMA device found (ibv_get_device_list returned none). This host needs an InfiniBand/RoCE NIC "
                 "with its rdma-core provider and /dev/infiniband; otherwise use transport='tcp'.");
    }
    ibv_device* dev = nullptr;
    for (int i = 0; i < n; ++i)
      if (opts.device.empty() || opts.device == ibv_get_device_name(list[i])) {
        dev = list[i];
        break;
      }
    if (dev == nullptr) {
      std::string names;
      for (int i = 0; i < n; ++i) names += std::string(i ? ", " : "") + ibv_get_device_name(list[i]);
      ibv_free_device_list(list);
      fail(L() + ": RDMA device '" + opts.device + "' not found; this host has: " + names);
    }
    dev_name = ibv_get_device_name(dev);
    ctx = ibv_open_device(dev);
    ibv_free_device_list(list);
    if (ctx == nullptr) fail(L() + ": ibv_open_device(" + dev_name + ") failed: " + errno_str(errno));
    if (ibv_query_port(ctx, uint8_t(opts.port), &port_attr) != 0)
      fail(L() + ": ibv_query_port(" + dev_name + ", " + std::to_string(opts.port) + ") failed");
    if (port_attr.state != IBV_PORT_ACTIVE)
      fail(L() + ": port " + std::to_string(opts.port) + " of " + dev_name + " is not active");
    use_grh = port_attr.link_layer == IBV_LINK_LAYER_ETHERNET || opts.gid_index >= 0;
    gid_index = std::max(opts.gid_index, 0);
    if (port_attr.link_layer == IBV_LINK_LAYER_ETHERNET && opts.gid_index < 0) {
      for (int i = 0; i < port_attr.gid_tbl_len && i < 16; ++i) {
        ibv_gid g{};
        if (ibv_query_gid(ctx, uint8_t(opts.port), i, &g) == 0 && (g.global.subnet_prefix || g.global.interface_id)) {
          gid_index = i;
          break;
        }
      }
    }
    if (use_grh && ibv_query_gid(ctx, uint8_t(opts.port), gid_index, &gid) != 0)
      fail(L() + ": ibv_query_gid(index " + std::to_string(gid_index) + ") failed");
    pd = ibv_alloc_pd(ctx);
    chan = ibv_create_comp_channel(ctx);
    ibv_device_attr da{};
    ibv_query_device(ctx, &da);
    const int want = std::max(1, world - 1) * (2 * opts.slots + 2 * kMaxWrites + 4);
    cq = pd && chan ? ibv_create_cq(ctx, std::min(want, da.max_cqe > 0 ? da.max_cqe : want), nullptr, chan, 0) : nullptr;
    if (pd == nullptr || chan == nullptr || cq == nullptr) fail(L() + ": allocating RDMA resources failed: " + errno_str(errno));
    ctrl = static_cast<uint64_t*>(std::aligned_alloc(4096, std::max<size_t>(4096, size_t(world) * 16 + 4095) / 4096 * 4096));
    std::memset(ctrl, 0, size_t(world) * 16);
    ctrl_mr = ibv_reg_mr(pd, ctrl, size_t(world) * 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (ctrl_mr == nullptr) fail(L() + ": ibv_reg_mr failed: " + errno_str(errno));
    peers.resize(size_t(world));
    event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  }

  ~Impl() {
    for (auto& p : peers) {
      if (!p) continue;
      if (p->qp) ibv_destroy_qp(p->qp);
      if (p->recv_mr) ibv_dereg_mr(p->recv_mr);
      if (p->send_mr) ibv_dereg_mr(p->send_mr);
      std::free(p->recv_mem);
      std::free(p->send_mem);
    }
    if (ctrl_mr) ibv_dereg_mr(ctrl_mr);
    std::free(ctrl);
    if (cq) ibv_destroy_cq(cq);
    if (chan) ibv_destroy_comp_channel(chan);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
    if (event_fd >= 0) ::close(event_fd);
  }

  std::string local_info(int peer) {
    auto p = std::make_unique<Peer>();
    p->rank = peer;
    const size_t bytes = opts.slot_bytes * size_t(opts.slots);
    p->recv_mem = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
    p->send_mem = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
    if (!p->recv_mem || !p->send_mem) fail(L() + ": out of memory for RDMA slots");
    p->recv_mr = ibv_reg_mr(pd, p->recv_mem, bytes, IBV_ACCESS_LOCAL_WRITE);
    p->send_mr = ibv_reg_mr(pd, p->send_mem, bytes, 0);
    if (!p->recv_mr || !p->send_mr) fail(L() + ": ibv_reg_mr of " + std::to_string(bytes) + " bytes failed: " + errno_str(errno));
    ibv_qp_init_attr qa{};
    qa.send_cq = cq;
    qa.recv_cq = cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = uint32_t(opts.slots + kMaxWrites + 2);
    qa.cap.max_recv_wr = uint32_t(opts.slots);
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    p->qp = ibv_create_qp(pd, &qa);
    if (p->qp == nullptr) fail(L() + ": ibv_create_qp failed: " + errno_str(errno));
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = uint8_t(opts.port);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    if (ibv_modify_qp(p->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0)
      fail(L() + ": QP to INIT failed: " + errno_str(errno));
    for (uint32_t i = 0; i < uint32_t(opts.slots); ++i) p->free_send.push_back(i);
    ConnInfo ci{};
    ci.magic = kFragMagic;
    ci.qpn = p->qp->qp_num;
    ci.psn = uint32_t(std::rand()) & 0xffffff;
    ci.slots = uint32_t(opts.slots);
    ci.lid = port_attr.lid;
    ci.mtu = uint8_t(port_attr.active_mtu);
    ci.rkey = ctrl_mr->rkey;
    ci.credit_addr = reinterpret_cast<uint64_t>(&ctrl[2 * peer]);
    std::memcpy(ci.gid, gid.raw, 16);
    p->sent = ci.psn;  // remembered until connect (our sq_psn); reset there
    std::lock_guard<std::mutex> lock(peers_mu);
    peers.at(size_t(peer)) = std::move(p);
    return std::string(reinterpret_cast<const char*>(&ci), sizeof ci);
  }

  void connect_peer(int peer, const std::string& info) {
    ConnInfo ci{};
    if (info.size() != sizeof ci) fail(L() + ": bad RDMA connection data from rank " + std::to_string(peer));
    std::memcpy(&ci, info.data(), sizeof ci);
    if (ci.magic != kFragMagic) fail(L() + ": bad RDMA connection data from rank " + std::to_string(peer));
    Peer* p;
    {
      std::lock_guard<std::mutex> lock(peers_mu);
      p = peers.at(size_t(peer)).get();
    }
    if (p == nullptr) fail(L() + ": local_info before connect_peer");
    const uint32_t my_psn = uint32_t(p->sent);
    p->sent = 0;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = ibv_mtu(std::min<int>(port_attr.active_mtu, ci.mtu));
    a.dest_qp_num = ci.qpn;
    a.rq_psn = ci.psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;  // 0.64 ms before a receiver-not-ready retry
    a.ah_attr.dlid = ci.lid;
    a.ah_attr.sl = 0;
    a.ah_attr.src_path_bits = 0;
    a.ah_attr.port_num = uint8_t(opts.port);
    if (use_grh) {
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, ci.gid, 16);
      a.ah_attr.grh.sgid_index = uint8_t(gid_index);
      a.ah_attr.grh.hop_limit = 64;
    }
    if (ibv_modify_qp(p->qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
      fail(L() + ": QP to RTR failed for rank " + std::to_string(peer) + ": " + errno_str(errno));
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;    // 4.096 us * 2^14 = 67 ms per try
    a.retry_cnt = 7;
    a.rnr_retry = 7;   // infinite: credits should prevent RNR, but never fail on it
    a.sq_psn = my_psn;
    a.max_rd_atomic = 1;
    if (ibv_modify_qp(p->qp, &a,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                          IBV_QP_MAX_QP_RD_ATOMIC) != 0)
      fail(L() + ": QP to RTS failed for rank " + std::to_string(peer) + ": " + errno_str(errno));
    for (uint32_t i = 0; i < uint32_t(opts.slots); ++i) post_recv(p, i);
    p->remote_credit_addr = ci.credit_addr;
    p->remote_rkey = ci.rkey;
    p->remote_slots = int(ci.slots);
    p->last_write = now_s();
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->connected = true;
    }
    eng->mailbox().set_connected(peer);
    if (!thread.joinable()) thread = std::thread([this] { loop(); });
    wake();
  }

  void wake() {
    uint64_t one = 1;
    (void)!write(event_fd, &one, sizeof one);
  }

  void post_recv(Peer* p, uint32_t slot) {
    ibv_sge sge{reinterpret_cast<uint64_t>(p->recv_mem + size_t(slot) * opts.slot_bytes), uint32_t(opts.slot_bytes), p->recv_mr->lkey};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = wr_id(kRecv, p->rank, slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (ibv_post_recv(p->qp, &wr, &bad) != 0) peer_failed(p, "ibv_post_recv failed: " + errno_str(errno));
  }

  void post_credit_write(Peer* p) {
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

  int credits(Peer* p) {
    const uint64_t freed = __atomic_load_n(&ctrl[2 * p->rank], __ATOMIC_ACQUIRE);
    return p->remote_slots - int(p->sent - freed);
  }

  // Copy as many queued fragments as credits and free slots allow. True if work remains that waits on credits.
  bool push_sends(Peer* p) {
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
      ibv_sge sge{reinterpret_cast<uint64_t>(base), uint32_t(sizeof fh + fh.header_len + k), p->send_mr->lkey};
      ibv_send_wr wr{}, *bad = nullptr;
      wr.wr_id = wr_id(kSend, p->rank, slot);
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      if (ibv_post_send(p->qp, &wr, &bad) != 0) {
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

  void fail_sends_locked(Peer* p, const std::string& why) {
    if (!p->failed) {
      p->failed = true;
      p->fail_why = why;
    }
    for (auto& op : p->queue) op->fail(p->fail_kind, p->fail_why);
    p->queue.clear();
  }

  void peer_failed(Peer* p, const std::string& why) {
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

  void on_recv(Peer* p, uint32_t slot, uint32_t len) {
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

  void handle(const ibv_wc& wc) {
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

  int poll_and_handle() {
    ibv_wc wcs[32];
    const int n = ibv_poll_cq(cq, 32, wcs);
    for (int i = 0; i < n; ++i) handle(wcs[i]);
    return n;
  }

  void loop() {
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
};

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
    ibv_sge sge{reinterpret_cast<uint64_t>(base), uint32_t(sizeof fh), p->send_mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = wr_id(kSend, p->rank, slot);
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (ibv_post_send(p->qp, &wr, &bad) == 0) p->free_send.pop_back();
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

// Half of the RDMA engine (the contract is in rdma_channel.h): opening the device, and the reliable-connected
// queue pair to each peer with its registered slots. Each side publishes its queue pair's number, PSN, LID/GID
// and credit word through the rendezvous store (local_info), then moves the pair to RTR and RTS with the
// peer's (connect_peer); the progress thread starts with the first connection.
#ifdef LMT_HAVE_IBVERBS

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "rdma_impl.h"

namespace lmt {


void RdmaEngine::Impl::open(int world) {
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

RdmaEngine::Impl::~Impl() {
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

std::string RdmaEngine::Impl::local_info(int peer) {
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

void RdmaEngine::Impl::connect_peer(int peer, const std::string& info) {
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

}  // namespace lmt

#endif  // LMT_HAVE_IBVERBS

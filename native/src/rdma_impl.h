// The RDMA engine's private parts, shared by its two halves: rdma_setup.cpp (the device, the queue pairs and
// connecting them) and rdma_channel.cpp (the progress thread: credits, fragments, completions, and closing).
// Only compiled with rdma-core's headers (LMT_HAVE_IBVERBS); nothing outside the RDMA engine includes it.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rdma_channel.h"

namespace lmt {
namespace rdma {

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

inline uint64_t wr_id(uint64_t kind, int peer, uint32_t slot) { return (kind << 56) | (uint64_t(peer) << 32) | slot; }

}  // namespace rdma

using namespace rdma;

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

  // rdma_setup.cpp
  void open(int world);
  ~Impl();
  std::string local_info(int peer);
  void connect_peer(int peer, const std::string& info);

  // rdma_channel.cpp
  void wake();
  void post_recv(Peer* p, uint32_t slot);
  void post_credit_write(Peer* p);
  int credits(Peer* p);
  int post_send(Peer* p, uint32_t slot, uint32_t bytes);
  bool push_sends(Peer* p);
  void fail_sends_locked(Peer* p, const std::string& why);
  void peer_failed(Peer* p, const std::string& why);
  void on_recv(Peer* p, uint32_t slot, uint32_t len);
  void handle(const ibv_wc& wc);
  int poll_and_handle();
  void loop();
};

}  // namespace lmt

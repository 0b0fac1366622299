// Between hosts over InfiniBand/RoCE: one ibverbs RC queue pair per peer, with pre-registered send and
// receive slots (no per-message registration). Flow control by receive credits: a sender posts a fragment
// only while the peer has a posted receive for it (credits = peer's slots - (fragments sent - fragments the
// peer has consumed)); the receiver reports its consumed count by RDMA WRITE into the sender's registered
// credit word, which needs no receive on the other side, so credit updates can never deadlock or cause
// RNR errors (rnr_retry is set to "infinite" anyway). The same write, repeated every 0.5 s, is the
// heartbeat that turns a dead peer into a completion error. One progress thread per engine polls the CQ
// (sleeping on the completion channel when idle) and copies sends into slots.
//
// Compiled with LMT_HAVE_IBVERBS when <infiniband/verbs.h> is found at build time; otherwise the
// constructor raises a TransportError saying how to get it.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mailbox.h"

namespace lmt {

struct RdmaOptions {
  size_t pool_bytes = size_t(1) << 30;
  std::string device;          // "" = first device
  int port = 1;
  int gid_index = -1;          // -1: 0 on InfiniBand, first non-zero GID on RoCE
  size_t slot_bytes = 256 * 1024;
  int slots = 32;              // receive slots (= credits) and send slots per peer
};

bool rdma_compiled();

class RdmaEngine : public Engine {
 public:
  RdmaEngine(std::string label, int rank, int world_size, RdmaOptions opts);
  ~RdmaEngine() override;

  std::string device_name() const;
  // Create the queue pair for `peer` and return this side's connection data (to publish via the store).
  std::string local_info(int peer);
  // Bring the queue pair to RTS with the peer's data and post the receives.
  void connect_peer(int peer, const std::string& remote_info);

  SendOpPtr isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) override;
  void close() override;
  void abandon() override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace lmt

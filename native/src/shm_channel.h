// Same-node transport over shared-memory rings (ring.h): for each peer, one inbound ring this rank created
// and drains with a receiver thread into pooled buffers, and one outbound ring the peer created, which this
// rank fills. Small sends are written inline by the calling thread when the ring is idle and has room;
// everything else goes to the copy pool, which streams the message through the ring in chunks so the
// receiver copies concurrently (a message may be far larger than the ring).
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "copy_pool.h"
#include "mailbox.h"
#include "ring.h"

namespace lmt {

struct ShmOptions {
  size_t pool_bytes = size_t(1) << 30;  // receive buffers kept for reuse
  int copy_threads = 2;
  size_t inline_bytes = 64 * 1024;   // sends up to this size are copied by the caller when the ring is idle
  size_t chunk_bytes = 256 * 1024;   // publish/release granularity of streamed messages
  size_t streaming_bytes = 8u << 20;  // payloads from this size are written with non-temporal stores
  size_t heap_bytes = 64u << 20;      // per inbound segment: the landing heap (0: stream everything)
  size_t heap_page = 64u << 10;
  size_t heap_min_bytes = 64u << 10;  // payloads from this size go through the heap when it has room
  size_t copy_slice = 1u << 20;       // heap copies are split into slices for the copy pool's threads
};

class ShmEngine : public Engine {
 public:
  ShmEngine(std::string label, int rank, int world_size, ShmOptions opts);
  ~ShmEngine() override;

  // Connection, in this order on both ranks of a pair (Python exchanges names and pids via the store):
  void create_ring(int peer, const std::string& name, size_t capacity);  // inbound segment, peer -> me
  void open_ring(int peer, const std::string& name, int peer_pid);      // outbound ring, me -> peer (unlinks it)
  // Wait until the peer has mapped our inbound ring, unlink its name, start the receiver.
  void finish_connect(int peer, double timeout);
  // Names of this engine's segments that may still be linked (empty after connect).
  std::vector<std::string> linked_names();

  SendOpPtr isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) override;
  void close() override;
  void abandon() override;
  // Messages received in place (heap) and streamed through the ring, since the start.
  uint64_t received_in_place() const { return in_place_.load(); }
  uint64_t received_streamed() const { return streamed_.load(); }

 private:
  struct Peer {
    int rank = -1;
    std::unique_ptr<Ring> in, out;
    std::unique_ptr<PeerWatch> watch;
    std::thread receiver;
    std::mutex send_mu;                 // guards queue, scheduled, send_error, and inline writes
    std::deque<SendOpPtr> queue;
    bool scheduled = false;             // a copy-pool worker owns the outbound ring
    ErrKind send_error_kind = ErrKind::Transport;
    std::string send_error;             // set once sends to this peer can no longer succeed
  };
  enum class ReadStatus { Ok, Stopped, Closed, Dead };

  Peer* peer_or_fail(int peer);
  void drain_sends(Peer* p);
  void write_op(Peer* p, SendOp& op);
  void write_bytes(Peer* p, const uint8_t* src, size_t n);
  void receiver_loop(Peer* p);
  ReadStatus read_exact(Peer* p, uint8_t* dst, size_t n, bool streaming = false);
  std::string dead_reason(Peer* p);

  ShmOptions opts_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> in_place_{0}, streamed_{0};
  bool closed_ = false;
  bool abandoned_ = false;
  CopyPool copy_pool_;
};

}  // namespace lmt

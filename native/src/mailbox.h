// Arrived messages, filed per (peer, tag), and the state of each peer. Every engine's receive side
// delivers here; Python takes messages out with take() (never blocks) or wait_take() (blocks, GIL released).
// Messages with the same (peer, tag) stay in arrival order; a peer that died or closed is remembered, so a
// receive that can no longer be satisfied raises PeerLost instead of waiting for its timeout.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "buffer_pool.h"
#include "common.h"

namespace lmt {

struct Message {
  std::string header;             // opaque to C++: Python encodes kind/dtype/shape here
  std::shared_ptr<Block> payload;  // may be an empty block (0 bytes)
  uint64_t arrival = 0;            // set by Mailbox::deliver: filing order across every (peer, tag)
};

enum class PeerState { Unknown = 0, Connected = 1, Closed = 2, Lost = 3 };

class Mailbox {
 public:
  Mailbox(std::string label, int world_size);

  void deliver(int peer, uint64_t tag, Message&& msg);
  void set_connected(int peer);
  // The peer closed its transport (orderly) or died; messages already filed stay receivable.
  void set_closed(int peer, const std::string& reason);
  void set_lost(int peer, const std::string& reason);
  void shutdown();  // this transport closes: wake every waiter

  // Non-blocking. Throws PeerLost if nothing is queued and the peer is gone.
  bool take(int peer, uint64_t tag, Message* out);
  // Blocks up to `timeout` seconds; false on timeout. Throws like take().
  bool wait_take(int peer, uint64_t tag, double timeout, Message* out);
  // Wait-any (a dynamic schedule runs whichever task's input arrives first): the first of `keys`, in the order
  // given, with a queued message; `*index` is its position in `keys`. Non-blocking. If none has a message and
  // the peer of one key is gone, throws PeerLost for that key (queued messages are always delivered first).
  bool take_any(const std::vector<std::pair<int, uint64_t>>& keys, size_t* index, Message* out);
  // Like take_any, blocking up to `timeout` seconds on the same condition variable as wait_take.
  bool wait_take_any(const std::vector<std::pair<int, uint64_t>>& keys, double timeout, size_t* index, Message* out);

  // Take-ahead across tags: the oldest messages from `peer`, oldest first, that head their (peer, tag) queue and
  // satisfy `want`, up to `limit` (a message behind one that `want` refuses stays). Never blocks or throws.
  std::vector<std::pair<uint64_t, Message>> take_heads(int peer, size_t limit,
                                                       const std::function<bool(const Message&)>& want);

  PeerState state(int peer);
  size_t queued();  // messages filed and not yet taken (all peers)
  const std::string& label() const { return label_; }

 private:
  struct Key {
    int peer;
    uint64_t tag;
    bool operator==(const Key& o) const { return peer == o.peer && tag == o.tag; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.tag * 0x9E3779B97F4A7C15ull ^ uint64_t(k.peer)); }
  };
  bool take_locked(int peer, uint64_t tag, Message* out);
  bool take_any_locked(const std::vector<std::pair<int, uint64_t>>& keys, size_t* index, Message* out);

  std::string label_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<Key, std::deque<Message>, KeyHash> boxes_;
  std::vector<PeerState> states_;
  std::vector<std::string> reasons_;
  size_t queued_ = 0;
  uint64_t arrivals_ = 0;
  bool shutdown_ = false;
};

// One posted send, shared by the Python handle and the engine thread that moves it. The engine only reads
// `data` until complete()/fail(); Python keeps the source tensor alive until done() says so.
struct SendOp {
  int peer = -1;
  uint64_t tag = 0;
  std::string header;
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t progress = 0;  // engine-private: bytes of the frame already written
  uint8_t frame[24];    // engine-private: the FrameHeader, kept here while a stream send is in flight

  void complete();
  void fail(ErrKind kind, const std::string& msg);
  bool done();                   // throws the failure
  bool wait(double timeout_s);   // false on timeout; throws the failure
  bool finished() const { return state_.load(std::memory_order_acquire) != 0; }

 private:
  std::atomic<int> state_{0};  // 0 pending, 1 done, 2 failed
  ErrKind kind_ = ErrKind::Transport;
  std::string error_;
  std::mutex mu_;
  std::condition_variable cv_;
};

using SendOpPtr = std::shared_ptr<SendOp>;

// What every engine (shm, tcp, rdma) offers to Python.
class Engine {
 public:
  Engine(std::string label, int rank, int world_size, size_t pool_bytes)
      : rank_(rank), world_size_(world_size), pool_(BufferPool::make(pool_bytes)), mailbox_(std::move(label), world_size) {}
  virtual ~Engine() = default;
  virtual SendOpPtr isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) = 0;
  virtual void close() = 0;
  // In a forked child: make close() and the destructor no-ops that neither join nor lock (see leak_thread).
  virtual void abandon() = 0;
  Mailbox& mailbox() { return mailbox_; }
  BufferPool& pool() { return *pool_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& label() const { return mailbox_.label(); }

 protected:
  void check_peer(int peer) const {
    if (peer < 0 || peer >= world_size_ || peer == rank_)
      fail(label() + ": rank " + std::to_string(peer) + " is not a peer");
  }
  int rank_, world_size_;
  std::shared_ptr<BufferPool> pool_;
  Mailbox mailbox_;
};

}  // namespace lmt

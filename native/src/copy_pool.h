// A small fixed pool of threads that copies queued sends into their channels (no thread per message).
// A channel is handed to at most one worker at a time (the channel's `scheduled` flag, see shm_channel),
// which keeps the single-producer rule of the rings and the per-(peer, tag) order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lmt {

class CopyPool {
 public:
  explicit CopyPool(int threads);
  ~CopyPool();
  void submit(std::function<void()> job);
  // Copy n bytes using the calling thread and any idle pool threads (slices of `slice` bytes). The caller
  // takes slices too, so this finishes even when every pool thread is busy (no deadlock between channels).
  void parallel_copy(uint8_t* dst, const uint8_t* src, size_t n, size_t slice, bool streaming = false);
  int threads() const { return int(threads_.size()); }
  void stop();  // finish the running jobs, drop queued ones, join
  void abandon();  // forked child: forget the threads (see leak_thread)

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
  bool abandoned_ = false;
};

// Death of a same-node peer, by pid: a pidfd (Linux >= 5.3) becomes readable when the process exits (zombies
// included, and immune to pid reuse); older kernels fall back to kill(pid, 0).
class PeerWatch {
 public:
  explicit PeerWatch(int pid);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;
  bool alive() const;
  int pid() const { return pid_; }

 private:
  int pid_;
  int pidfd_ = -1;
  bool dead_at_start_ = false;
};

}  // namespace lmt

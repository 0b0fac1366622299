#include "copy_pool.h"

#include "common.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace lmt {

CopyPool::CopyPool(int threads) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

CopyPool::~CopyPool() { stop(); }

void CopyPool::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

namespace {
struct CopyTask {
  uint8_t* dst;
  const uint8_t* src;
  size_t n, slice, slices;
  bool streaming = false;
  std::atomic<size_t> next{0};
  std::atomic<size_t> finished{0};
  std::mutex mu;
  std::condition_variable cv;
  void work() {
    size_t done = 0;
    for (size_t i; (i = next.fetch_add(1)) < slices; ++done) {
      const size_t off = i * slice;
      if (streaming)
        copy_streaming(dst + off, src + off, std::min(slice, n - off));
      else
        std::memcpy(dst + off, src + off, std::min(slice, n - off));
    }
    if (done && finished.fetch_add(done) + done == slices) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};
}  // namespace

void CopyPool::parallel_copy(uint8_t* dst, const uint8_t* src, size_t n, size_t slice, bool streaming) {
  const size_t slices = (n + slice - 1) / slice;
  if (slices <= 1 || threads_.size() <= 1) {
    if (streaming)
      copy_streaming(dst, src, n);
    else
      std::memcpy(dst, src, n);
    return;
  }
  auto task = std::make_shared<CopyTask>();
  task->dst = dst;
  task->src = src;
  task->n = n;
  task->slice = slice;
  task->slices = slices;
  task->streaming = streaming;
  const size_t helpers = std::min(slices - 1, threads_.size() - 1);
  for (size_t i = 0; i < helpers; ++i) submit([task] { task->work(); });
  task->work();
  std::unique_lock<std::mutex> lock(task->mu);
  task->cv.wait(lock, [&] { return task->finished.load() == task->slices; });
}

void CopyPool::abandon() {
  abandoned_ = true;
  for (auto& t : threads_) leak_thread(t);
  threads_.clear();
}

void CopyPool::stop() {
  if (abandoned_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && threads_.empty()) return;
    stop_ = true;
    jobs_.clear();
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void CopyPool::run() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

PeerWatch::PeerWatch(int pid) : pid_(pid) {
#ifdef SYS_pidfd_open
  pidfd_ = int(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd_ < 0 && errno == ESRCH) dead_at_start_ = true;
#endif
}

PeerWatch::~PeerWatch() {
  if (pidfd_ >= 0) close(pidfd_);
}

bool PeerWatch::alive() const {
  if (dead_at_start_) return false;
  if (pidfd_ >= 0) {
    pollfd p{pidfd_, POLLIN, 0};
    return poll(&p, 1, 0) == 0;
  }
  return !(kill(pid_, 0) != 0 && errno == ESRCH);
}

}  // namespace lmt

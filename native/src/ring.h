// A shared-memory segment per ordered pair of ranks: a lock-free single-producer/single-consumer byte ring,
// and behind it an optional "landing heap" the producer copies large payloads into directly.
//
// The consumer (receiver) creates the segment, the producer (sender) maps it; as soon as both have mapped
// it, the name is unlinked, so a crash or kill -9 afterwards leaves nothing in /dev/shm (the kernel frees the
// memory with the last mapping).
//
// Layout: a page of control words (producer and consumer words on separate cache lines), `capacity` (a power
// of two) bytes of ring data, then the heap: a page with its allocation bitmap and `heap_bytes` of pages.
// `head` and `tail` are monotonically increasing byte counts; the producer only writes head, the consumer only
// writes tail, so no locks are needed. Waiting is a short spin, then a futex wait on a sequence word (a
// shared futex: the waker is the other process), with a "waiting" flag so the other side only makes the
// wake-up syscall when someone sleeps.
//
// Why a heap: streaming through the ring costs two copies (sender into the ring, receiver out of it). A
// payload the sender writes into the heap is handed to the receiver's Python code in place: one copy, which
// the sender's copy pool can split across threads. Only the producer allocates heap pages and only the
// consumer frees them (when the tensor viewing them dies), so the bitmap needs no lock either. A full heap
// just means the message streams through the ring instead.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace lmt {

struct RingCtl {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved;
  uint64_t capacity;
  uint64_t heap_bytes;   // 0: no heap
  uint64_t heap_page;    // allocation granularity of the heap
  std::atomic<uint32_t> opener_mapped;  // set by the producer once it has mapped the segment
  int32_t creator_pid;
  int32_t opener_pid;

  alignas(64) std::atomic<uint64_t> head;  // bytes published by the producer
  std::atomic<uint32_t> data_seq;          // futex word the consumer sleeps on
  std::atomic<uint32_t> consumer_waiting;
  std::atomic<uint32_t> producer_closed;   // orderly close: no more data will come

  alignas(64) std::atomic<uint64_t> tail;  // bytes released by the consumer
  std::atomic<uint32_t> space_seq;         // futex word the producer sleeps on
  std::atomic<uint32_t> producer_waiting;
  std::atomic<uint32_t> consumer_closed;   // orderly close: nobody will read
};

// The mapped segment; shared by the Ring and by every received block that lives in its heap, so the memory
// stays mapped until the last tensor viewing it is gone.
struct Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  ~Mapping();
};

// The landing heap of one segment (a view into the Mapping).
class Heap {
 public:
  Heap(std::shared_ptr<Mapping> map, uint8_t* ctl, uint8_t* data, size_t bytes, size_t page);
  // Producer: `n` bytes of free pages (first fit), or nullptr if none.
  uint8_t* alloc(size_t n);
  // Consumer: give pages back (the tensor viewing them died).
  void free(const uint8_t* p, size_t n);
  // Consumer: whether [p, p+n) lies inside the heap and is page-aligned (validates what the producer sent).
  bool contains(const uint8_t* p, size_t n) const;
  size_t rounded(size_t n) const { return (n + page_ - 1) / page_ * page_; }
  size_t page() const { return page_; }
  size_t bytes() const { return bytes_; }
  uint64_t offset_of(const uint8_t* p) const { return uint64_t(p - data_); }
  uint8_t* at(uint64_t off) const { return data_ + off; }

 private:
  std::shared_ptr<Mapping> map_;
  std::atomic<uint64_t>* bits_;  // one bit per page, 1 = in use
  uint8_t* data_;
  size_t bytes_, page_, pages_;
};

class Ring {
 public:
  static constexpr uint64_t kMagic = 0x4c4d5452494e4732ull;  // "LMTRING2"
  static constexpr uint32_t kVersion = 2;
  static constexpr size_t kCtlBytes = 4096;

  // Consumer side: create a fresh segment (O_EXCL), reserve its memory (so a full /dev/shm is an error now,
  // not a SIGBUS later; if ring + heap do not fit, the heap is dropped) and map it.
  static std::unique_ptr<Ring> create(const std::string& name, size_t capacity, size_t heap_bytes, size_t heap_page);
  // Producer side: map an existing segment, mark it mapped and unlink the name.
  static std::unique_ptr<Ring> open(const std::string& name);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  void unlink();  // idempotent; ENOENT (the other side was first) is fine
  const std::string& name() const { return name_; }
  size_t capacity() const { return cap_; }
  RingCtl* ctl() { return ctl_; }
  const std::shared_ptr<Heap>& heap() const { return heap_; }  // null without a heap

  // ---- producer ----
  size_t free_space() const { return cap_ - size_t(head_local_ - ctl_->tail.load(std::memory_order_acquire)); }
  void put(const uint8_t* src, size_t n);  // n <= free_space(); not visible until publish()
  size_t unpublished() const { return size_t(head_local_ - head_published_); }
  void publish();
  // Wait until `need` bytes are free, the consumer closed, or `timeout` passes. True if the space is there.
  bool wait_space(size_t need, double timeout);
  void close_producer();

  // ---- consumer ----
  size_t available() const { return size_t(ctl_->head.load(std::memory_order_acquire) - tail_local_); }
  void get(uint8_t* dst, size_t n, bool streaming = false);  // n <= available(); streaming: non-temporal stores
  size_t unreleased() const { return size_t(tail_local_ - tail_released_); }
  void release();
  bool wait_data(size_t need, double timeout);
  void close_consumer();

  bool producer_closed() const { return ctl_->producer_closed.load(std::memory_order_acquire) != 0; }
  bool consumer_closed() const { return ctl_->consumer_closed.load(std::memory_order_acquire) != 0; }
  void wake_all();  // wake both sides' sleepers (used on shutdown)

  static void set_spin_seconds(double s) { spin_seconds_ = s; }

 private:
  Ring() = default;
  void attach(size_t heap_bytes, size_t heap_page);
  static double spin_seconds_;
  std::string name_;
  bool linked_ = false;
  std::shared_ptr<Mapping> map_;
  std::shared_ptr<Heap> heap_;
  RingCtl* ctl_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t cap_ = 0, mask_ = 0;
  uint64_t head_local_ = 0, head_published_ = 0;  // producer's private cursor
  uint64_t tail_local_ = 0, tail_released_ = 0;   // consumer's private cursor
};

}  // namespace lmt

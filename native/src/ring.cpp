#include "ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "common.h"

namespace lmt {

// Both sides spin this long before sleeping: while a large message streams through, the other side
// usually frees space / publishes data within microseconds, and a futex sleep + wake costs more than that.
// Short, because on a 2-core machine a spinning waiter takes the core its peer needs.
double Ring::spin_seconds_ = 20e-6;

namespace {
template <class Pred>
bool spin_then_sleep(Pred ready, std::atomic<uint32_t>* seq, std::atomic<uint32_t>* waiting, double timeout,
                     double spin_seconds) {
  if (ready()) return true;
  const double start = now_s();
  const double spin_end = start + (spin_seconds < timeout ? spin_seconds : timeout);
  for (unsigned i = 1;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if ((i & 63) == 0 && now_s() >= spin_end) break;
  }
  const double deadline = start + timeout;
  while (true) {
    const uint32_t s = seq->load(std::memory_order_acquire);
    waiting->store(1, std::memory_order_relaxed);
    // Pairs with the fence in the other side's publish/release: either it sees waiting == 1 and bumps seq
    // (so the futex wait below returns at once), or we see its update in ready().
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (ready()) {
      waiting->store(0, std::memory_order_relaxed);
      return true;
    }
    const double left = deadline - now_s();
    if (left <= 0) {
      waiting->store(0, std::memory_order_relaxed);
      return false;
    }
    futex_wait(seq, s, left);
    waiting->store(0, std::memory_order_relaxed);
  }
}

void signal(std::atomic<uint32_t>* seq, std::atomic<uint32_t>* waiting) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiting->load(std::memory_order_relaxed) != 0) {
    seq->fetch_add(1, std::memory_order_release);
    futex_wake(seq, 1);
  }
}
}  // namespace

Mapping::~Mapping() {
  if (base != nullptr) munmap(base, bytes);
}

Heap::Heap(std::shared_ptr<Mapping> map, uint8_t* ctl, uint8_t* data, size_t bytes, size_t page)
    : map_(std::move(map)), bits_(reinterpret_cast<std::atomic<uint64_t>*>(ctl)), data_(data), bytes_(bytes), page_(page),
      pages_(bytes / page) {}

uint8_t* Heap::alloc(size_t n) {
  const size_t want = (n + page_ - 1) / page_;
  if (want == 0 || want > pages_) return nullptr;
  // First fit: recently freed low pages come back first, which keeps them warm in cache.
  size_t run = 0, start = 0;
  for (size_t i = 0; i < pages_;) {
    const uint64_t word = bits_[i / 64].load(std::memory_order_acquire);  // pairs with free()'s release
    if ((i % 64) == 0 && word == ~uint64_t(0)) {
      run = 0;
      i += 64;
      continue;
    }
    if ((word >> (i % 64)) & 1) {
      run = 0;
    } else {
      if (run == 0) start = i;
      if (++run == want) {
        for (size_t j = start; j < start + want;) {  // only this side sets bits: no race on claiming
          const size_t b = j % 64, k = std::min<size_t>(64 - b, start + want - j);
          const uint64_t mask = (k == 64 ? ~uint64_t(0) : ((uint64_t(1) << k) - 1)) << b;
          bits_[j / 64].fetch_or(mask, std::memory_order_relaxed);
          j += k;
        }
        return data_ + start * page_;
      }
    }
    ++i;
  }
  return nullptr;
}

void Heap::free(const uint8_t* p, size_t n) {
  const size_t first = size_t(p - data_) / page_, count = (n + page_ - 1) / page_;
  for (size_t j = first; j < first + count;) {
    const size_t b = j % 64, k = std::min<size_t>(64 - b, first + count - j);
    const uint64_t mask = (k == 64 ? ~uint64_t(0) : ((uint64_t(1) << k) - 1)) << b;
    bits_[j / 64].fetch_and(~mask, std::memory_order_release);  // our reads of the pages happened before
    j += k;
  }
}

bool Heap::contains(const uint8_t* p, size_t n) const {
  if (p < data_ || p >= data_ + bytes_) return false;
  const size_t off = size_t(p - data_);
  return off % page_ == 0 && n <= bytes_ - off;
}

namespace {
size_t heap_ctl_bytes(size_t heap_bytes, size_t page) {
  const size_t bitmap = (heap_bytes / page + 63) / 64 * 8;
  return (bitmap + 4095) / 4096 * 4096;
}
}  // namespace

void Ring::attach(size_t heap_bytes, size_t heap_page) {
  auto* base = static_cast<uint8_t*>(map_->base);
  ctl_ = reinterpret_cast<RingCtl*>(base);
  data_ = base + kCtlBytes;
  cap_ = ctl_->capacity;
  mask_ = cap_ - 1;
  if (heap_bytes > 0) {
    uint8_t* hctl = data_ + cap_;
    heap_ = std::make_shared<Heap>(map_, hctl, hctl + heap_ctl_bytes(heap_bytes, heap_page), heap_bytes, heap_page);
  }
}

std::unique_ptr<Ring> Ring::create(const std::string& name, size_t capacity, size_t heap_bytes, size_t heap_page) {
  if (capacity < 4096 || (capacity & (capacity - 1)) != 0)
    fail("shm ring size " + std::to_string(capacity) + " must be a power of two >= 4096");
  if (heap_bytes > 0 && (heap_page < 4096 || heap_page % 4096 != 0))
    fail("shm heap page " + std::to_string(heap_page) + " must be a multiple of 4096");
  heap_bytes = heap_bytes / (heap_page ? heap_page : 1) * heap_page;
  std::unique_ptr<Ring> r(new Ring());
  r->name_ = name;
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail("shm_open(" + name + ") failed: " + errno_str(errno));
  r->linked_ = true;
  const size_t ring_only = kCtlBytes + capacity;
  size_t bytes = heap_bytes ? ring_only + heap_ctl_bytes(heap_bytes, heap_page) + heap_bytes : ring_only;
  int err = posix_fallocate(fd, 0, off_t(bytes));
  if (err == ENOSPC && heap_bytes) {
    // /dev/shm too small for the heap (docker's default is 64 MiB): run without it, streaming everything.
    heap_bytes = 0;
    bytes = ring_only;
    if (ftruncate(fd, off_t(bytes)) == 0) err = posix_fallocate(fd, 0, off_t(bytes));
  }
  if (err != 0) {
    close(fd);
    r->unlink();
    fail("cannot reserve " + std::to_string(bytes) + " bytes of shared memory for " + name + ": " + errno_str(err) +
         ". /dev/shm is too small: enlarge it (docker run --shm-size=...) or pass a smaller ring_bytes.");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    r->unlink();
    fail("mmap of " + name + " failed: " + errno_str(err));
  }
  r->map_ = std::make_shared<Mapping>();
  r->map_->base = base;
  r->map_->bytes = bytes;
  auto* ctl = new (base) RingCtl();
  ctl->version = kVersion;
  ctl->capacity = capacity;
  ctl->heap_bytes = heap_bytes;
  ctl->heap_page = heap_page;
  ctl->creator_pid = int32_t(getpid());
  ctl->head.store(0);
  ctl->tail.store(0);
  r->attach(heap_bytes, heap_page);
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&ctl->magic)->store(kMagic, std::memory_order_release);
  return r;
}

std::unique_ptr<Ring> Ring::open(const std::string& name) {
  std::unique_ptr<Ring> r(new Ring());
  r->name_ = name;
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail("shm_open(" + name + ") failed: " + errno_str(errno) + " (was the segment already unlinked?)");
  r->linked_ = true;
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < kCtlBytes + 4096) {
    close(fd);
    r->unlink();
    fail("shared-memory segment " + name + " is too small or unreadable");
  }
  const size_t bytes = size_t(st.st_size);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    r->unlink();
    fail("mmap of " + name + " failed: " + errno_str(err));
  }
  r->map_ = std::make_shared<Mapping>();
  r->map_->base = base;
  r->map_->bytes = bytes;
  r->unlink();  // both sides have it mapped now: the name is no longer needed
  auto* ctl = static_cast<RingCtl*>(base);
  const bool ok = reinterpret_cast<std::atomic<uint64_t>*>(&ctl->magic)->load(std::memory_order_acquire) == kMagic &&
                  ctl->version == kVersion &&
                  kCtlBytes + ctl->capacity +
                          (ctl->heap_bytes ? heap_ctl_bytes(ctl->heap_bytes, ctl->heap_page) + ctl->heap_bytes : 0) ==
                      bytes;
  if (!ok) fail("shared-memory segment " + name + " is not a ring of this version of lightning_megatron's native transport");
  r->attach(ctl->heap_bytes, ctl->heap_page);
  r->head_local_ = r->head_published_ = ctl->head.load();
  ctl->opener_pid = int32_t(getpid());
  ctl->opener_mapped.store(1, std::memory_order_release);
  return r;
}

Ring::~Ring() { unlink(); }

void Ring::unlink() {
  if (linked_) {
    linked_ = false;
    shm_unlink(name_.c_str());
  }
}

void Ring::put(const uint8_t* src, size_t n) {
  const size_t off = size_t(head_local_) & mask_;
  const size_t first = n < cap_ - off ? n : cap_ - off;
  std::memcpy(data_ + off, src, first);
  if (n > first) std::memcpy(data_, src + first, n - first);
  head_local_ += n;
}

void Ring::publish() {
  if (head_published_ == head_local_) return;
  head_published_ = head_local_;
  ctl_->head.store(head_local_, std::memory_order_release);
  signal(&ctl_->data_seq, &ctl_->consumer_waiting);
}

bool Ring::wait_space(size_t need, double timeout) {
  if (need > cap_) need = cap_;
  return spin_then_sleep([&] { return free_space() >= need || consumer_closed(); }, &ctl_->space_seq,
                         &ctl_->producer_waiting, timeout, spin_seconds_) &&
         free_space() >= need;
}

void Ring::close_producer() {
  publish();
  ctl_->producer_closed.store(1, std::memory_order_release);
  ctl_->data_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&ctl_->data_seq, 1 << 30);
}

void Ring::get(uint8_t* dst, size_t n, bool streaming) {
  const size_t off = size_t(tail_local_) & mask_;
  const size_t first = n < cap_ - off ? n : cap_ - off;
  auto copy = streaming ? copy_streaming : [](void* d, const void* s, size_t k) { std::memcpy(d, s, k); };
  copy(dst, data_ + off, first);
  if (n > first) copy(dst + first, data_, n - first);
  tail_local_ += n;
}

void Ring::release() {
  if (tail_released_ == tail_local_) return;
  tail_released_ = tail_local_;
  ctl_->tail.store(tail_local_, std::memory_order_release);
  signal(&ctl_->space_seq, &ctl_->producer_waiting);
}

bool Ring::wait_data(size_t need, double timeout) {
  if (need > cap_) need = cap_;
  return spin_then_sleep([&] { return available() >= need || producer_closed(); }, &ctl_->data_seq,
                         &ctl_->consumer_waiting, timeout, spin_seconds_) &&
         available() >= need;
}

void Ring::close_consumer() {
  release();
  ctl_->consumer_closed.store(1, std::memory_order_release);
  ctl_->space_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&ctl_->space_seq, 1 << 30);
}

void Ring::wake_all() {
  ctl_->data_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&ctl_->data_seq, 1 << 30);
  ctl_->space_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&ctl_->space_seq, 1 << 30);
}

}  // namespace lmt

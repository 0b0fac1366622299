#include "buffer_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "common.h"
#include "ring.h"

namespace lmt {

namespace {
// Below this, blocks come from malloc (cheap, usually already resident); above it from mmap, so that a freed
// block really returns its memory and huge pages can back it.
constexpr size_t kMmapThreshold = 256 * 1024;
constexpr size_t kHugePage = 2 * 1024 * 1024;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
}  // namespace

Block::~Block() {
  if (data == nullptr) return;
  if (heap)
    heap->free(data, capacity);
  else if (pool)
    pool->give_back(data, capacity);
}

std::shared_ptr<BufferPool> BufferPool::make(size_t max_cached_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
}

BufferPool::~BufferPool() {
  for (auto& [cap, list] : free_)
    for (uint8_t* p : list) release(p, cap);
}

size_t BufferPool::size_class(size_t nbytes) {
  if (nbytes <= 4096) {
    size_t c = 64;
    while (c < nbytes) c <<= 1;
    return c;
  }
  size_t pow = 4096;
  while (pow * 2 <= nbytes) pow <<= 1;  // pow <= nbytes < 2 * pow
  const size_t quarter = pow / 4;
  return ((nbytes + quarter - 1) / quarter) * quarter;
}

uint8_t* BufferPool::allocate(size_t capacity) {
  if (capacity < kMmapThreshold) {
    void* p = std::aligned_alloc(64, capacity);
    if (p == nullptr) fail("native transport: out of memory allocating a " + std::to_string(capacity) + "-byte receive buffer");
    return static_cast<uint8_t*>(p);
  }
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    fail("native transport: cannot map a " + std::to_string(capacity) + "-byte receive buffer: " + errno_str(errno));
  if (capacity >= kHugePage) madvise(p, capacity, MADV_HUGEPAGE);  // fewer TLB misses and faults; advisory
  // Pre-fault now, outside the copy: MADV_POPULATE_WRITE (Linux 5.14) or touching every page.
  if (madvise(p, capacity, MADV_POPULATE_WRITE) != 0) {
    const long page = sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < capacity; off += size_t(page)) static_cast<volatile uint8_t*>(p)[off] = 0;
  }
  return static_cast<uint8_t*>(p);
}

void BufferPool::release(uint8_t* data, size_t capacity) {
  if (capacity < kMmapThreshold)
    std::free(data);
  else
    munmap(data, capacity);
}

std::shared_ptr<Block> BufferPool::get(size_t nbytes) {
  auto block = std::make_shared<Block>();
  block->size = nbytes;
  if (nbytes == 0) return block;
  const size_t cap = size_class(nbytes);
  uint8_t* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(cap);
    if (it != free_.end() && !it->second.empty()) {
      data = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= cap;
      stats_.hits++;
    } else {
      stats_.misses++;
    }
    stats_.live_bytes += cap;
  }
  if (data == nullptr) {
    try {
      data = allocate(cap);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.live_bytes -= cap;
      throw;
    }
  }
  block->data = data;
  block->capacity = cap;
  block->pool = shared_from_this();
  return block;
}

void BufferPool::give_back(uint8_t* data, size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.live_bytes -= capacity;
    if (stats_.cached_bytes + capacity <= max_cached_) {
      free_[capacity].push_back(data);
      stats_.cached_bytes += capacity;
      return;
    }
  }
  release(data, capacity);
}

PoolStats BufferPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace lmt

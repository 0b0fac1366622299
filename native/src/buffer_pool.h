// Receive buffers. Every received payload lands in a pooled, pre-faulted block: faulting fresh pages in
// while copying halves the copy bandwidth, and re-mapping memory for every message costs more than the copy
// for mid-sized tensors. Python gets the block as a buffer object; when the last tensor viewing it is freed,
// the block goes back to its free list (or is unmapped if the pool already caches `max_cached` bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace lmt {

class BufferPool;
class Heap;

// One payload. `size` bytes are valid; `capacity` is its size class. Returns itself to the pool (or frees its
// shared-heap pages) on destruction; the shared_ptr keeps the pool or the shared mapping alive, so a tensor
// may outlive the transport that received it.
struct Block {
  uint8_t* data = nullptr;
  size_t size = 0;
  size_t capacity = 0;
  std::shared_ptr<BufferPool> pool;
  std::shared_ptr<Heap> heap;  // set instead of `pool` for a payload received in place in a shm heap
  Block() = default;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block();
};

struct PoolStats {
  uint64_t hits = 0;          // get() served from a free list
  uint64_t misses = 0;        // get() had to allocate (and pre-fault)
  uint64_t cached_bytes = 0;  // bytes on free lists now
  uint64_t live_bytes = 0;    // bytes handed out and not yet returned
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static std::shared_ptr<BufferPool> make(size_t max_cached_bytes);
  ~BufferPool();

  // A block of at least `nbytes`, pre-faulted. nbytes == 0 gives an empty block (no memory).
  std::shared_ptr<Block> get(size_t nbytes);
  PoolStats stats();

  // Size class of a request: 64-byte multiples rounded to 2^k * {1, 1.25, 1.5, 1.75} (at most 25% waste).
  static size_t size_class(size_t nbytes);

 private:
  explicit BufferPool(size_t max_cached_bytes) : max_cached_(max_cached_bytes) {}
  friend struct Block;
  void give_back(uint8_t* data, size_t capacity);
  static uint8_t* allocate(size_t capacity);
  static void release(uint8_t* data, size_t capacity);

  std::mutex mu_;
  std::map<size_t, std::vector<uint8_t*>> free_;
  size_t max_cached_;
  PoolStats stats_;
};

}  // namespace lmt

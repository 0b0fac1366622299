// The frame every native channel puts in front of a message: the Python header (kind, dtype, shape, opaque
// to C++) and the payload follow it. Shared by the shm ring stream, the TCP stream and RDMA fragments.
#pragma once

#include <cstdint>

namespace lmt {

struct FrameHeader {
  uint32_t magic;       // kFrameMagic, or kByeMagic for an orderly close
  uint32_t header_len;  // bytes of Python header that follow
  uint64_t tag;
  uint64_t payload_len;  // bytes of payload after the header
};
static_assert(sizeof(FrameHeader) == 24, "wire format");

constexpr uint32_t kFrameMagic = 0x464d544cu;  // "LTMF"
constexpr uint32_t kByeMagic = 0x45594231u;    // "1BYE"
constexpr uint32_t kHeapMagic = 0x50414548u;   // "HEAP": shm only, payload already in the segment's heap
constexpr uint32_t kMaxHeaderLen = 1u << 20;   // sanity bound: a corrupt stream must not allocate gigabytes

}  // namespace lmt

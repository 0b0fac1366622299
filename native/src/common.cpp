#include "common.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cmath>

namespace lmt {

std::string errno_str(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (maybe not buf).
  const char* msg = strerror_r(err, buf, sizeof buf);
  return std::string(msg) + " (errno " + std::to_string(err) + ")";
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be plain lock-free 32-bit atomics");

bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, double timeout_s) {
  if (timeout_s < 0) timeout_s = 0;
  timespec ts;
  ts.tv_sec = time_t(timeout_s);
  ts.tv_nsec = long((timeout_s - double(ts.tv_sec)) * 1e9);
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
  return !(rc == -1 && errno == ETIMEDOUT);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

}  // namespace lmt

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmt {

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void copy_nt_avx2(uint8_t* dst, const uint8_t* src, size_t n) {
  // Align the destination to 32 bytes with an ordinary copy of the head.
  const size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  if (head) {
    std::memcpy(dst, src, head < n ? head : n);
    if (head >= n) return;
    dst += head;
    src += head;
    n -= head;
  }
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  _mm_sfence();
  if (i < n) std::memcpy(dst + i, src + i, n - i);
}
static const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
#endif

void copy_streaming(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (kHaveAvx2 && n >= 4096) {
    copy_nt_avx2(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace lmt

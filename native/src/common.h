// Shared helpers of the native transport: error kinds (mapped to the Python exception classes of
// lightning_megatron.transport.base by module.cpp), a monotonic clock, and futex waits on shared memory.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace lmt {

// The three failure classes Python sees. C++ throws lmt::Error; module.cpp turns it into
// TransportError / PeerLost / TransportTimeout, so no C++ caller needs Python.
enum class ErrKind { Transport = 0, PeerLost = 1, Timeout = 2 };

struct Error : std::runtime_error {
  ErrKind kind;
  Error(ErrKind k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

[[noreturn]] inline void fail(ErrKind kind, const std::string& msg) { throw Error(kind, msg); }
[[noreturn]] inline void fail(const std::string& msg) { throw Error(ErrKind::Transport, msg); }

std::string errno_str(int err);

// Seconds on CLOCK_MONOTONIC.
double now_s();

// FUTEX_WAIT / FUTEX_WAKE *without* FUTEX_PRIVATE_FLAG: the word lives in a MAP_SHARED mapping and the
// waker is another process. Returns false on timeout. Spurious wake-ups are possible; callers re-check.
bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, double timeout_s);
void futex_wake(std::atomic<uint32_t>* word, int count);

// After fork() the child has copies of the engines but none of their threads: "abandon" an engine there by
// leaking its std::thread objects (no pthread call may touch them, and destroying a joinable std::thread
// would abort) and skipping every cleanup that locks or talks to the peer.
inline void leak_thread(std::thread& t) {
  if (t.joinable()) new std::thread(std::move(t));  // never joined, never destroyed
}

// One spin iteration (PAUSE on x86): lets the sibling hyper-thread run and saves power while spinning.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Wait slices: every blocking loop wakes at least this often to check for shutdown and peer death, so a
// dead peer is noticed within about this time (the contract asks for ~1 s).
constexpr double kWaitSlice = 0.1;

}  // namespace lmt

namespace lmt {
// Copy into memory that will not be read again soon (a large receive buffer): non-temporal stores skip the
// read-for-ownership of every destination line and keep the ring's lines in cache. Falls back to memcpy
// where AVX2 is missing or pointers are awkward. Ends with a store fence.
void copy_streaming(void* dst, const void* src, size_t n);
}  // namespace lmt

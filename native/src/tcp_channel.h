// Between hosts: one TCP connection per pair of ranks (the lower rank connects to the higher rank's
// listener), non-blocking sockets driven by one progress thread with epoll. The listener binds port 0 on the
// address peers can reach and its address and a random token are published through the rendezvous store;
// a connection is accepted only after a hello carrying that token (compared in constant time), so a
// stranger connecting to the port is dropped. Frames are wire.h headers + Python header + payload; the
// payload is written straight from the source tensor and read straight into a pooled buffer.
// Death: EOF or a reset on the socket (the kernel closes a killed process's sockets), keep-alives and
// TCP_USER_TIMEOUT for a vanished host; an orderly close sends a BYE frame first.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "mailbox.h"

namespace lmt {

struct TcpOptions {
  size_t pool_bytes = size_t(1) << 30;
  int socket_buffer = 4 << 20;       // SO_SNDBUF/SO_RCVBUF (0: kernel default)
  double handshake_timeout = 10.0;   // an accepted connection must authenticate within this time
};

class TcpEngine : public Engine {
 public:
  TcpEngine(std::string label, int rank, int world_size, const std::string& bind_ip, std::string token,
            TcpOptions opts);
  ~TcpEngine() override;

  int port() const { return port_; }
  // Listener side: `peer` may connect (it must present our token).
  void expect(int peer);
  // Connector side: connect to the peer's listener and authenticate with the peer's token. Blocking.
  void connect_peer(int peer, const std::string& ip, int port, const std::string& peer_token, double timeout);
  // Listener side: wait up to `timeout` for the expected peer's authenticated connection.
  bool wait_connected(int peer, double timeout);
  uint64_t rejected() const { return rejected_.load(); }

  SendOpPtr isend(int peer, uint64_t tag, std::string header, const uint8_t* data, size_t size) override;
  void close() override;
  void abandon() override;

 private:
  struct Conn;
  void loop();
  void accept_all();
  void on_readable(const std::shared_ptr<Conn>& c);
  void on_hello(const std::shared_ptr<Conn>& c);
  bool parse(const std::shared_ptr<Conn>& c);
  void on_writable(const std::shared_ptr<Conn>& c);
  bool flush_locked(Conn& c);  // false: the connection failed
  void send_failed_locked(Conn& c, const std::string& why);
  void drop(const std::shared_ptr<Conn>& c, bool lost, const std::string& why);
  void set_events(Conn& c, bool want_out);
  void establish(const std::shared_ptr<Conn>& c, int peer);

  TcpOptions opts_;
  std::string token_;
  int listen_fd_ = -1, epoll_fd_ = -1, event_fd_ = -1, port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int, std::shared_ptr<Conn>> by_fd_;  // every open socket (epoll thread closes them)
  std::vector<std::shared_ptr<Conn>> by_peer_;            // authenticated connections
  std::set<int> expected_;
  std::atomic<uint64_t> rejected_{0};
  std::atomic<bool> stop_{false};
  bool closed_ = false;
  bool abandoned_ = false;
  std::thread thread_;
};

}  // namespace lmt

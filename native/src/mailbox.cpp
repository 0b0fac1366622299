#include "mailbox.h"

#include <chrono>

#include "common.h"

namespace lmt {

Mailbox::Mailbox(std::string label, int world_size)
    : label_(std::move(label)), states_(size_t(world_size), PeerState::Unknown), reasons_(size_t(world_size)) {}

void Mailbox::deliver(int peer, uint64_t tag, Message&& msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    msg.arrival = arrivals_++;
    boxes_[Key{peer, tag}].push_back(std::move(msg));
    queued_++;
  }
  cv_.notify_all();
}

void Mailbox::set_connected(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  states_.at(size_t(peer)) = PeerState::Connected;
  reasons_.at(size_t(peer)).clear();
}

void Mailbox::set_closed(int peer, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (states_.at(size_t(peer)) == PeerState::Lost || states_.at(size_t(peer)) == PeerState::Closed) return;
    states_[size_t(peer)] = PeerState::Closed;
    reasons_[size_t(peer)] = reason;
  }
  cv_.notify_all();
}

void Mailbox::set_lost(int peer, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (states_.at(size_t(peer)) == PeerState::Lost || states_.at(size_t(peer)) == PeerState::Closed) return;
    states_[size_t(peer)] = PeerState::Lost;
    reasons_[size_t(peer)] = reason;
  }
  cv_.notify_all();
}

void Mailbox::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

bool Mailbox::take_locked(int peer, uint64_t tag, Message* out) {
  auto it = boxes_.find(Key{peer, tag});
  if (it != boxes_.end()) {
    *out = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) boxes_.erase(it);
    queued_--;
    return true;
  }
  if (shutdown_) fail(label_ + " is closed");
  const PeerState st = states_.at(size_t(peer));
  if (st == PeerState::Lost || st == PeerState::Closed)
    fail(ErrKind::PeerLost, label_ + ": no message from rank " + std::to_string(peer) + " with tag " +
                                std::to_string(tag) + " and none can come: " + reasons_[size_t(peer)]);
  return false;
}

bool Mailbox::take(int peer, uint64_t tag, Message* out) {
  std::lock_guard<std::mutex> lock(mu_);
  return take_locked(peer, tag, out);
}

bool Mailbox::wait_take(int peer, uint64_t tag, double timeout, Message* out) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  while (true) {
    if (take_locked(peer, tag, out)) return true;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) return take_locked(peer, tag, out);
  }
}

bool Mailbox::take_any_locked(const std::vector<std::pair<int, uint64_t>>& keys, size_t* index, Message* out) {
  for (size_t i = 0; i < keys.size(); i++) {
    auto it = boxes_.find(Key{keys[i].first, keys[i].second});
    if (it == boxes_.end()) continue;
    *out = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) boxes_.erase(it);
    queued_--;
    *index = i;
    return true;
  }
  if (shutdown_) fail(label_ + " is closed");
  for (const auto& key : keys) {
    const PeerState st = states_.at(size_t(key.first));
    if (st == PeerState::Lost || st == PeerState::Closed)
      fail(ErrKind::PeerLost, label_ + ": no message from rank " + std::to_string(key.first) + " with tag " +
                                  std::to_string(key.second) + " and none can come: " + reasons_[size_t(key.first)]);
  }
  return false;
}

bool Mailbox::take_any(const std::vector<std::pair<int, uint64_t>>& keys, size_t* index, Message* out) {
  std::lock_guard<std::mutex> lock(mu_);
  return take_any_locked(keys, index, out);
}

bool Mailbox::wait_take_any(const std::vector<std::pair<int, uint64_t>>& keys, double timeout, size_t* index,
                            Message* out) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  while (true) {
    if (take_any_locked(keys, index, out)) return true;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) return take_any_locked(keys, index, out);
  }
}

std::vector<std::pair<uint64_t, Message>> Mailbox::take_heads(int peer, size_t limit,
                                                              const std::function<bool(const Message&)>& want) {
  std::vector<std::pair<uint64_t, Message>> out;
  std::lock_guard<std::mutex> lock(mu_);
  while (out.size() < limit) {
    auto best = boxes_.end();
    for (auto it = boxes_.begin(); it != boxes_.end(); ++it)
      if (it->first.peer == peer && (best == boxes_.end() || it->second.front().arrival < best->second.front().arrival) &&
          want(it->second.front()))
        best = it;
    if (best == boxes_.end()) break;
    out.emplace_back(best->first.tag, std::move(best->second.front()));
    best->second.pop_front();
    if (best->second.empty()) boxes_.erase(best);
    queued_--;
  }
  return out;
}

PeerState Mailbox::state(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return states_.at(size_t(peer));
}

size_t Mailbox::queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_;
}

void SendOp::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load(std::memory_order_relaxed) != 0) return;
    state_.store(1, std::memory_order_release);
  }
  cv_.notify_all();
}

void SendOp::fail(ErrKind kind, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load(std::memory_order_relaxed) != 0) return;
    kind_ = kind;
    error_ = msg;
    state_.store(2, std::memory_order_release);
  }
  cv_.notify_all();
}

bool SendOp::done() {
  const int st = state_.load(std::memory_order_acquire);
  if (st == 2) throw Error(kind_, error_);
  return st == 1;
}

bool SendOp::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return state_.load() != 0; });
  lock.unlock();
  return done();
}

}  // namespace lmt

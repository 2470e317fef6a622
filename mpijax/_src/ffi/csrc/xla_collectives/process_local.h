// Where the members of one of XLA's communicators that live in this process
// (one thread per local device) meet: a round in which the last member to
// arrive does the work for all of them (a collective's local step and its
// one MPI call across processes), and a mailbox for point-to-point messages
// between two members of this process (all-to-all, collective-permute).
// Threads share memory, so the members hand each other pointers to XLA's
// buffers and copy directly. Waits spin briefly, then sleep (idle.h); past
// the caller's timeout they report a stall and go on waiting.
#ifndef MPIJAX_XLA_PROCESS_LOCAL_H_
#define MPIJAX_XLA_PROCESS_LOCAL_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "base/idle.h"
#include "node_local/caller.h"

namespace mpijax::bridge {

// Waits until ready(): spins for caller.SpinS(), then sleeps on `bell` (the
// waiter's own) until whoever makes ready() true rings it; past
// caller.Timeout() reports through caller.Stalled() and keeps waiting.
template <typename Ready>
void LocalWait(node_local::Caller& caller, idle::Doorbell* bell, Ready ready) {
  if (ready()) return;
  double timeout = caller.Timeout(), spin_s = caller.SpinS();
  auto start = Clock::now();
  auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(timeout));
  auto check_stall = [&] {
    auto now = Clock::now();
    if (timeout > 0 && now > deadline) {
      caller.Stalled(std::chrono::duration<double>(now - start).count());
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout));
    }
    return now;
  };
  for (uint64_t spin = 1;; ++spin) {
    if (ready()) return;
    if ((spin & 63) == 0) {
      auto now = check_stall();
      if (spin_s >= 0 && now - start >= std::chrono::duration<double>(spin_s))
        break;
      std::this_thread::yield();
    }
  }
  double nap = timeout > 0 ? std::min(timeout, 0.01) : 0.01;
  while (!idle::Sleep(bell, ready, nap)) check_stall();
}

// The local members of one communicator: `size` slots, one per member of
// this process, each used by one thread at a time (the thread running that
// member's device).
class LocalGroup {
 public:
  void Init(int size) {
    size_ = size;
    posts_.assign(size, nullptr);
    rounds_.assign(size, 0);
    bells_.reset(new idle::Doorbell[size]());
  }
  int size() const { return size_; }

  // One round: every member calls it with its slot and what it posts
  // (pointers into its own stack or XLA's buffers, valid until it returns).
  // The last member to arrive runs work(posts, text) with every post in
  // place; its return value and `text` become every member's. Returns once
  // the work is done.
  template <typename Work>
  int Round(int slot, const void* post, node_local::Caller& caller, Work work,
            std::string* text) {
    uint64_t r = ++rounds_[slot];
    posts_[slot] = post;
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      text_.clear();
      result_ = work(posts_, &text_);
      done_.store(r, std::memory_order_release);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      for (int i = 0; i < size_; ++i)
        if (i != slot) idle::Ring(&bells_[i]);
    } else {
      LocalWait(caller, &bells_[slot], [&] {
        return done_.load(std::memory_order_acquire) >= r;
      });
    }
    if (text != nullptr) *text = text_;
    return result_;
  }

 private:
  int size_ = 0;
  std::vector<const void*> posts_;
  std::vector<uint64_t> rounds_;  // each slot's own count (its thread only)
  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> done_{0};
  int result_ = 0;
  std::string text_;
  std::unique_ptr<idle::Doorbell[]> bells_;
};

// A message between two members of this process: the receiver copies it
// straight from the sender's buffer, then marks it taken.
struct Letter {
  int from = 0;          // the sender's member index (its rank in the clique)
  const char* data = nullptr;
  size_t bytes = 0;
  int64_t sig = 0;       // the sender's operation, checked by the receiver
  int64_t kind = 0;
  std::atomic<int> taken{0};
};

// Letters waiting for each local member, first in first out per sender.
class Mailbox {
 public:
  void Init(int size) {
    inbox_.assign(size, {});
    bells_.reset(new idle::Doorbell[size]());
  }
  // Hands `l` to the member in slot `to` (the sender keeps `l` alive until
  // it is taken).
  void Post(int to, Letter* l) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_[to].push_back(l);
    }
    idle::Ring(&bells_[to]);
  }
  // The member in slot `me` waits for the first letter from member `from`.
  Letter* Take(int me, int from, node_local::Caller& caller) {
    Letter* got = nullptr;
    LocalWait(caller, &bells_[me], [&] {
      std::lock_guard<std::mutex> lock(mu_);
      auto& box = inbox_[me];
      for (auto it = box.begin(); it != box.end(); ++it) {
        if ((*it)->from == from) {
          got = *it;
          box.erase(it);
          return true;
        }
      }
      return false;
    });
    return got;
  }
  // The receiver is done with `l`; wakes its sender (in slot `sender`).
  void Taken(Letter* l, int sender) {
    l->taken.store(1, std::memory_order_release);
    idle::Ring(&bells_[sender]);
  }
  // The sender (in slot `me`) waits until `l` is taken.
  void WaitTaken(int me, Letter* l, node_local::Caller& caller) {
    LocalWait(caller, &bells_[me], [&] {
      return l->taken.load(std::memory_order_acquire) != 0;
    });
  }

 private:
  std::mutex mu_;
  std::vector<std::deque<Letter*>> inbox_;
  std::unique_ptr<idle::Doorbell[]> bells_;
};

}  // namespace mpijax::bridge

#endif  // MPIJAX_XLA_PROCESS_LOCAL_H_

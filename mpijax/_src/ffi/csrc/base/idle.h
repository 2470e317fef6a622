// Waiting without holding a core: a rank that reaches a collective before
// the others spins only briefly, then sleeps. On a node with as many cores
// as ranks, the ranks' XLA threads use every core while they compute; a
// waiter that kept spinning took a core from a rank still computing its
// step, and the step grew by more than the wait.
//
// Two tools:
// * Doorbell: a word in memory shared between processes (futex). A waiter
//   marks itself asleep and sleeps on its own bell; whoever publishes what
//   it waits for rings the bells of the sleepers only (no system call when
//   nobody sleeps).
// * Backoff: for waits polled through MPI (MPI_Testall), sleeps between
//   polls that grow with the time waited, so the latency added after the
//   wait is over stays a small fraction of the wait.
//
// Both wait first for `spin_s` seconds without sleeping (a short wait then
// costs no wake-up); spin_s < 0 never sleeps (spin, and yield the core now
// and then, as a dedicated core allows).
//
// On a node with more ranks than cores, the rank a waiter waits for may
// need the waiter's very core: a polled MPI wait then yields the core after
// every poll and spins for at least kOversubscribedSpinS before it naps, as
// MPI's own waits do there (a nap's wake-up came late: a jitted 256 KiB
// collective-permute, 4 ranks on 2 cores, 150 us napping, 91 us yielding).
#ifndef MPIJAX_FFI_IDLE_H_
#define MPIJAX_FFI_IDLE_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace mpijax::idle {

using Clock = std::chrono::steady_clock;

// The default spin before sleeping (MPIJAX_WAIT_SPIN_US): longer than a
// small collective between ranks that arrive together, far shorter than a
// step's compute.
constexpr double kDefaultSpinS = 50e-6;
// The least spin of a polled MPI wait on an oversubscribed node.
constexpr double kOversubscribedSpinS = 1e-3;

// One process's bell, in shared memory (zero-initialized memory is a valid
// bell). Lock-free 32-bit atomics: the futex word is the atomic itself.
struct Doorbell {
  std::atomic<uint32_t> rings;     // bumped by every wake-up
  std::atomic<uint32_t> sleeping;  // its owner is about to sleep, or sleeps
};

// Sleeps on `bell` (the caller's own) until ready() or `max_s` seconds have
// passed (then returns, to let the caller check its deadline). Returns
// ready()'s last value.
template <typename Ready>
bool Sleep(Doorbell* bell, Ready ready, double max_s);
// Wakes the owner of `bell` if it sleeps; call after publishing (with
// release or stronger) what the owner may wait for.
void Ring(Doorbell* bell);
// The futex calls, and a full fence (the sleeper's mark and the ringer's
// publication must not pass each other's read).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double max_s);
void FutexWakeAll(std::atomic<uint32_t>* word);

template <typename Ready>
bool Sleep(Doorbell* bell, Ready ready, double max_s) {
  uint32_t seen = bell->rings.load(std::memory_order_acquire);
  bell->sleeping.store(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  bool done = ready();
  // A ring after `seen` was read changes `rings`: the futex returns at once.
  if (!done) FutexWait(&bell->rings, seen, max_s);
  bell->sleeping.store(0, std::memory_order_relaxed);
  return done || ready();
}

inline void Ring(Doorbell* bell) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (bell->sleeping.load(std::memory_order_relaxed) == 0) return;
  bell->rings.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&bell->rings);
}

// Polls with sleeps in between once `spin_s` has passed (see the top);
// `oversubscribed`: the node has more ranks than cores.
class Backoff {
 public:
  Backoff(double spin_s, bool oversubscribed)
      : spin_s_(oversubscribed && spin_s >= 0 && spin_s < kOversubscribedSpinS
                    ? kOversubscribedSpinS
                    : spin_s),
        yield_each_poll_(oversubscribed),
        start_(Clock::now()) {}
  // Called after each unsuccessful poll; `spin` counts them.
  void Pause(uint64_t spin);

 private:
  double spin_s_;
  bool yield_each_poll_;
  Clock::time_point start_;
  bool napping_ = false;
};

}  // namespace mpijax::idle

#endif  // MPIJAX_FFI_IDLE_H_

// Flag waits (private to the node-local all-reduce): a participant
// publishes a call's progress in its header's flags and waits until every
// participant's flag has reached the call, spinning briefly, then asleep on
// its doorbell (idle.h).
#ifndef MPIJAX_FFI_NODE_LOCAL_FLAGS_H_
#define MPIJAX_FFI_NODE_LOCAL_FLAGS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "base/common.h"
#include "base/idle.h"
#include "node_local/caller.h"
#include "node_local/layout.h"
#include "node_local/segment.h"

namespace mpijax::node_local::internal {

using idle::Doorbell;
// A sleeping wait wakes at least this often (a missed ring costs no more).
constexpr double kMaxSleepS = 0.01;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waits until ready(): spins for the caller's SpinS(), then sleeps on this
// rank's doorbell until a rank that publishes a flag rings it (idle.h).
// Past the caller's timeout it reports (Stalled) and goes on waiting; the
// clock is read every few dozen spins only. While spinning it yields the CPU
// now and then, and at once when ranks outnumber cores (the rank being
// waited for may need this core).
template <typename Ready>
void Wait(const Comm& c, Caller& caller, Ready ready) {
  if (ready()) return;
  bool oversubscribed = c.oversubscribed;
  double timeout = caller.Timeout(), spin_s = caller.SpinS();
  auto period = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout > 0 ? timeout : 0));
  auto spin_for = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(spin_s > 0 ? spin_s : 0));
  auto start = Clock::now(), deadline = start + period;
  auto check_stall = [&](Clock::time_point now) {
    if (timeout > 0 && now > deadline) {
      caller.Stalled(std::chrono::duration<double>(now - start).count());
      deadline = Clock::now() + period;
    }
  };
  for (uint64_t spin = 1;; ++spin) {
    CpuRelax();
    if (ready()) return;
    if ((spin & 63) == 0) {
      auto now = Clock::now();
      check_stall(now);
      if (spin_s >= 0 && now - start >= spin_for) break;
    }
    if (oversubscribed || (spin > 1024 && (spin & 15) == 0))
      std::this_thread::yield();
  }
  // Asleep: woken by a ring, or every few ms to check the deadline.
  Doorbell* bell = &Head(c, c.rank)->bell;
  double nap = timeout > 0 ? std::min(timeout, kMaxSleepS) : kMaxSleepS;
  while (!idle::Sleep(bell, ready, nap)) check_stall(Clock::now());
}

// Sets this rank's `flag` to k and wakes the ranks asleep in Wait.
inline void Publish(const Comm& c, std::atomic<uint64_t> Header::*flag,
                    uint64_t k) {
  (Head(c, c.rank)->*flag).store(k, std::memory_order_release);
  for (int i = 0; i < c.size; ++i)
    if (i != c.rank) idle::Ring(&Head(c, i)->bell);
}

// A wait condition: `flag` of every rank's header is at least `at_least`.
inline auto AllAtLeast(const Comm& c, std::atomic<uint64_t> Header::*flag,
                       uint64_t at_least) {
  return [&c, flag, at_least] {
    for (int i = 0; i < c.size; ++i)
      if ((Head(c, i)->*flag).load(std::memory_order_acquire) < at_least)
        return false;
    return true;
  };
}

// Call k's arrival: once every rank is done with call k - 1, publishes what
// this rank reduces (`bytes` by `path`), marks it arrived (after whatever the
// caller published first), waits for every rank, then checks that all of
// them reduce the same thing the same way (the same comparison on every
// rank, so all of them fail together, after marking the call finished so
// none waits).
inline Status Arrive(Comm& c, Caller& caller, uint64_t k, size_t bytes,
                     int64_t path) {
  // Not before every rank is done with call k - 1: a rank that reduced a
  // small message whole leaves it early, while another may still be
  // comparing the headers this overwrites.
  Wait(c, caller, AllAtLeast(c, &Header::done, k - 1));
  Header* me = Head(c, c.rank);
  me->sig = caller.sig;
  me->bytes = static_cast<int64_t>(bytes);
  me->path = path;
  Publish(c, &Header::arrived, k);
  Wait(c, caller, AllAtLeast(c, &Header::arrived, k));
  for (int i = 0; i < c.size; ++i) {
    Header* h = Head(c, i);
    if (h->sig == caller.sig && h->bytes == me->bytes && h->path == me->path)
      continue;
    Publish(c, &Header::reduced, k);
    Publish(c, &Header::done, k);
    return caller.Mismatch(i, h->sig, h->bytes, me->bytes);
  }
  return {};
}

}  // namespace mpijax::node_local::internal

#endif  // MPIJAX_FFI_NODE_LOCAL_FLAGS_H_

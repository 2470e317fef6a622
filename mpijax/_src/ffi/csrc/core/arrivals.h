// The straggler report's record of arrivals: when on, every collective call
// stamps the time it entered into a small ring of its (communicator, device),
// at the slot of its collective number, so that the k-th call pairs across
// ranks. A background exchange (mpijax/_src/timeline/straggler_watch.py)
// drains the rings and finds, per collective, the rank that arrived last.
// The handler thread writes a slot with three relaxed stores; nothing waits.
#ifndef MPIJAX_FFI_ARRIVALS_H_
#define MPIJAX_FFI_ARRIVALS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "core/registry.h"

namespace mpijax::detail {

// Collectives kept per (communicator, device) between two drains: the most
// recent ones (a power of two).
constexpr int64_t kArrivalSlots = 4096;

struct ArrivalRing {
  // A seqlock slot: `seq` is -1 while the writer fills it.
  struct Slot {
    std::atomic<int64_t> seq{-1};
    std::atomic<int64_t> ns{0};
  };
  int64_t comm_size = 0;
  int64_t drained = -1;  // the last collective number drained (drain only)
  Slot slots[kArrivalSlots];
};

// Allocates dc's ring (once; it is never freed: a drain may read it).
ArrivalRing* NewArrivalRing(DevComm* dc, int64_t comm_size);

// Stamps collective `seq` of dc as entered at `ns`.
inline void RecordArrival(DevComm* dc, int64_t seq, int64_t ns,
                          int64_t comm_size) {
  ArrivalRing* r = dc->arrivals.load(std::memory_order_acquire);
  if (r == nullptr) r = NewArrivalRing(dc, comm_size);
  ArrivalRing::Slot& s = r->slots[seq & (kArrivalSlots - 1)];
  s.seq.store(-1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.ns.store(ns, std::memory_order_relaxed);
  s.seq.store(seq, std::memory_order_release);
}

// Columns of a drained row.
constexpr int kArrivalColumns = 7;  // key, leader, device, per_device,
                                    // comm_size, seq, enter ns

// The arrivals stamped since the last drain (at most kArrivalSlots per
// communicator and device, the most recent), as rows of kArrivalColumns
// int64 values: the communicator's key, its leader (the job rank of its rank
// 0: two communicators of one key never share it), the local device index,
// 1 if the device's calls are a collective of their own (0: one collective
// spans the process's devices, XLA's with several devices per process), the
// communicator's size, the collective number and the enter time (NowNs).
std::string DrainArrivals();

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_ARRIVALS_H_

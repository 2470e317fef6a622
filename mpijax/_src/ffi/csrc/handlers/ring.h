// mpijax's own ring all-reduce over MPI point-to-point messages, for large
// all-reduces where it beats MPI's own algorithm.
#ifndef MPIJAX_FFI_RING_H_
#define MPIJAX_FFI_RING_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>

#include "core/call.h"
#include "core/settings.h"
#include "base/spans.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// The ring's messages carry this tag on the collective communicator (the
// handlers' other point-to-point messages use larger ones).
constexpr int kRingTag = 1;

// Whether an all-reduce of `bytes` runs the ring: when each rank's share is
// at least ring_min_bytes, or ring_in_place_min_bytes if a buffer is reduced
// in place and MPI's call would block. (In place, the ring only beats MPI's
// blocking algorithm from a few MiB; where MPI's call would be polled, with
// several local devices, it beats it from ring_min_bytes: hierarchical psum,
// 4 MiB per device, 1.7-1.9 vs 2.0-2.2 ms.) Allocation-free: it is on every
// all-reduce's path.
inline bool UseRing(const CallInfo& info, size_t bytes, bool in_place) {
  size_t p = static_cast<size_t>(info.comm_size);
  bool mpi_blocks = info.dc == nullptr || info.dc->local_devices == 1;
  int64_t ring_min = (in_place && mpi_blocks
                          ? g_settings.ring_in_place_min_bytes
                          : g_settings.ring_min_bytes)
                         .load(std::memory_order_relaxed);
  return p > 1 && ring_min > 0 && bytes / p >= static_cast<size_t>(ring_min);
}

// Runs the ring over all of `spans` (one dtype), in segments that keep every
// block within one MPI count and, in place, within the scratch. Its waits are
// WaitAll's (polled, inspected): several local devices may run rings at
// once, and threads blocked inside MPI at the same time were measured
// several times slower here. With a divisor (op "mean") each rank divides
// the block it finished.
ffi::Error RingSegments(const CallInfo& info, MPI_Comm comm,
                        const Spans& spans, ffi::DataType type,
                        MPI_Datatype dt, MPI_Op mop, int64_t divisor);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_RING_H_

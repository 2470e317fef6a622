// Which path an all-reduce takes: cross-memory attach, the ring, node-local
// shared memory, or MPI's own all-reduce (chunked, blocking or polled by
// size), for one buffer or several of one dtype, and the node-local paths
// run under the stall inspector.
#ifndef MPIJAX_FFI_ALLREDUCE_H_
#define MPIJAX_FFI_ALLREDUCE_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/call.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// The path an all-reduce of `bytes` in `buffers` buffers of one dtype takes
// (a kPath* bit), in this order: cross-memory attach (UseCma), the ring
// (UseRing; `in_place`: some buffer is reduced in place), node-local shared
// memory (one buffer that fits the segment), else MPI's all-reduce
// (kPathMpi), buffer by buffer. The one place the order is decided: both
// AllreduceBuffer and AllreduceBuffers ask it. The first call that could
// take a node-local path sets them up (collective).
ffi::ErrorOr<int> AllreducePath(const CallInfo& info, size_t bytes,
                                size_t buffers, bool in_place);

// One buffer's all-reduce, on the path AllreducePath chooses; MPI's is
// chunked, each chunk blocking or polled by size. With a divisor (op
// "mean") each chunk is divided right after its MPI call.
ffi::Error AllreduceBuffer(const CallInfo& info, MPI_Comm comm,
                           ffi::AnyBuffer x, ffi::AnyBuffer out, int64_t op,
                           int64_t divisor);

// Buffers of one dtype (the buckets of a gradient tree), inputs and results:
// all of them in one cross-memory all-reduce or one ring when AllreducePath
// chooses either for their total, else one after another as
// AllreduceBuffer. Sets info's dtype, and its dims to the buffer at hand.
ffi::Error AllreduceBuffers(
    CallInfo& info, MPI_Comm comm,
    const std::vector<std::pair<ffi::AnyBuffer, ffi::AnyBuffer>>& bufs,
    int64_t op);

// The all-reduce over every local device of every rank of the communicator
// (a psum over a mesh axis spanning all of them), as participant
// rank * local_devices + local index of the node-local paths: cross-memory
// attach from cma_min_bytes (or beyond the segment), shared memory below.
// Every participant gets the same bits: each block is reduced by one
// participant, the terms in participant order. Needs SetupDeviceGroup.
ffi::Error DeviceAllreduce(const CallInfo& info, ffi::AnyBuffer x,
                           ffi::AnyBuffer out, int64_t op);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_ALLREDUCE_H_

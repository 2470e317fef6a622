// Which path an all-reduce takes: cross-memory attach, the ring, node-local
// shared memory, or MPI's own all-reduce (chunked, blocking or polled by
// size), and the node-local paths run under the stall inspector.
#ifndef MPIJAX_FFI_ALLREDUCE_H_
#define MPIJAX_FFI_ALLREDUCE_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>

#include "call.h"
#include "spans.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// One buffer's all-reduce: by cross-memory attach (UseCma), the ring
// (UseRing), shared memory or MPI's, chunked, each chunk blocking or polled
// by size; with a divisor (op "mean") each chunk is divided right after its
// MPI call.
ffi::Error AllreduceBuffer(const CallInfo& info, MPI_Comm comm,
                           ffi::AnyBuffer x, ffi::AnyBuffer out, int64_t op,
                           int64_t divisor);

// Whether an all-reduce of `bytes` in `buffers` buffers runs CmaAllreduce:
// from cma_min_bytes on, up to node_local::kCmaMaxBuffers buffers, with
// all ranks on one node, and cross-memory attach
// allowed between them (setting up the node-local paths at the first call
// that could use them: collective; with several local devices, each on its
// own communicator). Allocation-free, like UseRing.
ffi::ErrorOr<bool> UseCma(const CallInfo& info, size_t bytes, size_t buffers);

// The all-reduce of `spans` by cross-memory attach (after UseCma).
ffi::Error CmaAllreduce(const CallInfo& info, const Spans& spans,
                        ffi::DataType type, MPI_Datatype dt, MPI_Op mop,
                        int64_t divisor);

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

// The node-local all-reduce by cross-memory attach, for large messages.
// Part of node_local.h.
#ifndef MPIJAX_FFI_NODE_LOCAL_CMA_H_
#define MPIJAX_FFI_NODE_LOCAL_CMA_H_

#include <mpi.h>

#include "node_local/caller.h"
#include "node_local/segment.h"
#include "base/spans.h"

namespace mpijax::node_local {

// All-reduce of `spans` (up to kCmaMaxBuffers buffers) by cross-memory
// attach (needs Ready and c.cma_ok).
Status CmaAllreduce(Comm& c, Caller& caller, const Spans& spans,
                    MPI_Datatype datatype, MPI_Op op);

// Reduce-scatter by cross-memory attach: `src` holds c.size blocks of
// `count` elements of `es` bytes on every rank; this rank's reduced block
// goes to `dst` (which must not overlap `src`). Each rank reads only its
// block of the others' inputs and writes only its own output.
Status CmaReduceScatter(Comm& c, Caller& caller, const char* src, char* dst,
                        size_t count, size_t es, MPI_Datatype datatype,
                        MPI_Op op);

// All-gather by cross-memory attach: every rank's `block` bytes at `src`
// go to [rank * block, (rank + 1) * block) of every rank's `dst`. Each rank
// reads the others' blocks straight into its output; `src` may be this
// rank's own block of `dst` (in place), and must not overlap another block
// of it.
Status CmaAllgather(Comm& c, Caller& caller, const char* src, char* dst,
                    size_t block);

namespace internal {

// Whether every rank of c's communicator can read and write every other
// rank's memory with cross-memory attach (collective; after the segments
// are mapped). Each rank publishes its process id, and the address and
// value of its private nonce; every other rank reads the nonce there and,
// only if it found it, writes the same value back. That fails, and
// CmaAllreduce stays off for this communicator, where the kernel refuses
// (ranks of different users; Yama's ptrace_scope 1 without
// prctl(PR_SET_PTRACER), which Open MPI's own CMA support calls, 2 without
// CAP_SYS_PTRACE, or 3; container seccomp profiles that block
// process_vm_readv) or where a rank's process id names another process
// (ranks in different PID namespaces, e.g. one container each sharing
// /dev/shm).
Status CmaProbe(Comm& c, Caller& caller);

}  // namespace internal
}  // namespace mpijax::node_local

#endif  // MPIJAX_FFI_NODE_LOCAL_CMA_H_

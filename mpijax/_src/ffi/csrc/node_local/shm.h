// The node-local all-reduce through shared memory, for small messages.
// Part of node_local.h.
#ifndef MPIJAX_FFI_NODE_LOCAL_SHM_H_
#define MPIJAX_FFI_NODE_LOCAL_SHM_H_

#include <mpi.h>

#include <cstddef>

#include "node_local/caller.h"
#include "node_local/segment.h"

namespace mpijax::node_local {

// All-reduce of n elements of elem_bytes each through the shared segments
// (needs Ready, n * elem_bytes <= c.segment_bytes()); src may be dst.
Status ShmAllreduce(Comm& c, Caller& caller, const char* src, char* dst,
                    size_t n, size_t elem_bytes, MPI_Datatype datatype,
                    MPI_Op op);

}  // namespace mpijax::node_local

#endif  // MPIJAX_FFI_NODE_LOCAL_SHM_H_

// The node-local all-reduce's standalone API: MPI_Allreduce's arguments,
// with a Comm the caller keeps per communicator. Part of node_local.h.
#ifndef MPIJAX_FFI_NODE_LOCAL_STANDALONE_H_
#define MPIJAX_FFI_NODE_LOCAL_STANDALONE_H_

#include <mpi.h>

#include "node_local/segment.h"

namespace mpijax::node_local {

// An MPI_Allreduce(sendbuf, recvbuf, count, datatype, op, c.comm) that runs
// on a node-local path when every rank of c.comm is on one node: cross-memory
// attach from c.limits.cma_min_bytes (if the kernel lets the ranks reach each
// other's memory), else shared memory up to c.limits.shm_max_bytes, else
// MPI_Allreduce itself; also MPI_Allreduce for an inter-communicator, one
// rank, a datatype whose extent is not its size (not contiguous), or an op
// that is not commutative. sendbuf may be MPI_IN_PLACE. Collective, like
// MPI_Allreduce: every rank calls it with the same count, datatype and op,
// in the same order as its other collectives on c.comm (the first call that
// could take a node-local path sets up c, with MPI collectives on c.comm).
// Every rank gets the same bits. Returns MPI_SUCCESS or an MPI error code
// (MPI_ERR_OTHER for a node-local failure, described in c.last_error; after
// a failed cross-memory copy that path stays off for c).
int Allreduce(Comm& c, const void* sendbuf, void* recvbuf, int count,
              MPI_Datatype datatype, MPI_Op op);

}  // namespace mpijax::node_local

#endif  // MPIJAX_FFI_NODE_LOCAL_STANDALONE_H_

// Node-local all-reduce: when every rank of a communicator runs on one node,
// the ranks reduce through a POSIX shared-memory file (small messages) or by
// reading and writing each other's buffers with cross-memory attach (large
// ones) instead of sending MPI messages. Depends on MPI and the C++ library
// only (node_local/, idle.cc, spans.cc), so C++ code outside mpijax's FFI
// handlers can call it on any intra-communicator.
//
// Two ways in:
// * node_local::Allreduce(): MPI_Allreduce's arguments, with a
//   node_local::Comm the caller keeps per communicator. It takes a
//   node-local path when one applies and calls MPI_Allreduce otherwise.
// * Ready() + ShmAllreduce() / CmaAllreduce() with a Caller, for callers
//   that choose the path themselves, report stalls and word errors their own
//   way (mpijax's handlers: allreduce.cc).
//
// Example (a library forwarding MPI_Allreduce):
//
//   node_local::Comm& nc = StateOf(comm);  // e.g. a map kept by the caller,
//                                          // node_local::Comm nc(comm) once
//   int rc = node_local::Allreduce(nc, sendbuf, recvbuf, count, type, op);
//
// This header includes the parts, one concept each (node_local/):
//   caller.h      Status, and the Caller's hooks (stalls, error wording)
//   segment.h     Comm, the shared segments, Ready() and View()
//   shm.h         ShmAllreduce(): through the segments (small messages)
//   cma.h         CmaAllreduce(): by cross-memory attach (large messages)
//   standalone.h  Allreduce(): the path by size, MPI_Allreduce otherwise
// and, private to them, layout.h (a slot's header) and flags.h (flag waits).
//
// Building it into another target: compile ${MPIJAX_NODE_LOCAL_SOURCES}
// (CMakeLists.txt) with MPI's include directories and this directory on the
// include path. mpijax's module tests this API through node_allreduce().
#ifndef MPIJAX_FFI_NODE_LOCAL_H_
#define MPIJAX_FFI_NODE_LOCAL_H_

#include "node_local/caller.h"
#include "node_local/cma.h"
#include "node_local/segment.h"
#include "node_local/shm.h"
#include "node_local/standalone.h"

#endif  // MPIJAX_FFI_NODE_LOCAL_H_

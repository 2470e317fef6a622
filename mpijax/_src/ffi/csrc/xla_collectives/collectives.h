// The MPI calls XLA's CPU collectives make through the bridge, run under the
// guards of mpijax's own collectives: every call marks its communicator busy
// for the stall inspector (a wait past MPIJAX_TIMEOUT is reported with the
// ranks that did not arrive, then MPIJAX_STALL_ACTION applies), is compared
// across ranks before any data moves (kind, dtype, count, op: a mismatch is an
// error naming every rank's operation, never corrupted memory), is recorded
// in the collective timeline, and takes mpijax's node-local paths where the
// ranks share a node.
//
// XLA's operations and the MPI calls it makes for them:
//   all-reduce          MPI_Allreduce (one per operand)
//   all-gather          MPI_Allgather
//   reduce-scatter      MPI_Reduce_scatter
//   all-to-all          MPI_Sendrecv with each other rank in turn
//   collective-permute  MPI_Irecv, MPI_Isend, MPI_Wait
#ifndef MPIJAX_XLA_COLLECTIVES_H_
#define MPIJAX_XLA_COLLECTIVES_H_

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "xla_collectives/communicator.h"

namespace mpijax::bridge {

// The error code the operations below return for a failure mpijax found
// (a mismatch, a bad argument); ErrorText gives its text to MPI_Error_string,
// which XLA turns into the exception's message. MPI's own failures inside an
// operation stop the job instead (MPI may still write into XLA's buffers).
constexpr int kErrXla = 0x6d6a2001;
// The text of the last kErrXla on this thread.
std::string ErrorText();

// Type and op codes are bridge_table.h's MJB_*; `send` null: in place.
int Allreduce(XlaComm& c, const void* send, void* recv, int count, int type,
              int op);
int Allgather(XlaComm& c, const void* send, int send_count, int send_type,
              void* recv, int recv_count, int recv_type);
int ReduceScatter(XlaComm& c, const void* send, void* recv,
                  const int* recv_counts, int type, int op);
int Sendrecv(XlaComm& c, const void* send, int send_count, int send_type,
             int dest, int send_tag, void* recv, int recv_count,
             int recv_type, int source, int recv_tag, int* status3);
// Requests are the bridge's own (the request's 8 bytes hold a pointer).
int Isend(XlaComm& c, const void* buf, int count, int type, int dest, int tag,
          uint64_t* request);
int Irecv(XlaComm& c, void* buf, int count, int type, int source, int tag,
          uint64_t* request);
int Wait(uint64_t* request, int* status3);

// Names XLA's operations in stall reports, mismatch errors and the
// timeline: what Python found in a compiled program (its HLO), by kind
// ("all-reduce", ...), dtype name, the elements of the operation's result,
// and op name ("sum", ... or "" where there is none).
void AddLabel(const std::string& kind, const std::string& dtype,
              int64_t elements, const std::string& op,
              const std::string& label);
// A compiled program with collectives across processes, named by `text`
// (the same on every rank that compiled the same program: its name and the
// shapes of its arguments), and its collectives as AddLabel takes them. The
// first operation of it on a communicator carries its fingerprint in the
// ranks' check (operation.h, Op).
void AddProgram(const std::string& text,
                const std::vector<std::tuple<std::string, std::string, int64_t,
                                             std::string>>& collectives);

}  // namespace mpijax::bridge

#endif  // MPIJAX_XLA_COLLECTIVES_H_

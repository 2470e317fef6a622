// XLA's all-reduce, all-gather and reduce-scatter through the bridge
// (collectives.h): the paths' choice, each under the operation's guard.
#include "xla_collectives/collectives.h"

#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "xla_collectives/operation.h"

namespace mpijax::bridge {

using detail::g_settings;

int Allreduce(XlaComm& c, const void* send, void* recv, int count, int type,
              int op_code) {
  if (!c.failed.empty()) return FailedOp(c);
  Op op(c, kAllReduce, type, count, op_code);
  op.Enter();
  const Type& t = op.type();
  MPI_Op mop = OpOf(op_code, op.type());
  char* dst = static_cast<char*>(recv);
  const char* src = send ? static_cast<const char*>(send) : dst;
  size_t bytes = static_cast<size_t>(count) * t.bytes;
  if (c.size == 1) {
    if (src != dst) std::memcpy(dst, src, bytes);
    return 0;
  }
  if (c.clique != nullptr)
    return MemberAllreduce(c, op, src, dst, static_cast<size_t>(count), mop);
  bool every = g_settings.check_every.load(std::memory_order_relaxed);
  if (NodeReady(c)) {
    if (every) {
      if (int rc = Compare(c, op); rc != 0) return rc;
    }
    return NodeAllreduce(c, op, src, dst, static_cast<size_t>(count), mop);
  }
  op.info().path |= detail::kPathMpi;
  if (bytes <= kInlineBytes && !every) {
    SmallAllreduce(c, op, src, dst, static_cast<size_t>(count), mop);
    return 0;
  }
  if (int rc = Compare(c, op); rc != 0) return rc;
  // MPI's own algorithm, not mpijax's ring: across two hosts on a 1 Gbit/s
  // link, 4 MiB took 36 ms (the link bound 33.5) against the ring's 71.
  MPI_Comm comm = c.comm;
  const void* in = send ? send : MPI_IN_PLACE;
  RunCollective(
      c, op, bytes,
      [&] { return MPI_Allreduce(in, recv, count, t.mpi, mop, comm); },
      [&](MPI_Request* req) {
        return MPI_Iallreduce(in, recv, count, t.mpi, mop, comm, req);
      });
  return 0;
}

int Allgather(XlaComm& c, const void* send, int send_count, int send_type,
              void* recv, int recv_count, int recv_type) {
  if (!c.failed.empty()) return FailedOp(c);
  Op op(c, kAllGather, recv_type, recv_count, 0);
  op.Enter();
  const Type& t = op.type();
  size_t bytes = static_cast<size_t>(recv_count) * t.bytes;
  if (send != nullptr &&
      (send_count != recv_count || TypeOf(send_type).mpi != t.mpi)) {
    return Fail(c, "mpijax: " + op.Describe() + " on " + Where(c) +
                       ": XLA sends " + std::to_string(send_count) + " " +
                       TypeOf(send_type).name + " but receives " +
                       std::to_string(recv_count) + " " + t.name +
                       " per rank; the bridge only moves equal blocks.",
                false);
  }
  if (c.clique != nullptr) {
    return MemberAllgather(c, op, static_cast<const char*>(send),
                           static_cast<char*>(recv),
                           static_cast<size_t>(recv_count));
  }
  if (int rc = Compare(c, op); rc != 0) return rc;
  // Ranks on one node read each other's blocks (4 ranks on 2 cores, 256 KiB
  // per rank: MPI's ring took 270-900 us per jitted call).
  if (UseNodeAllgather(c, bytes * c.size)) {
    char* dst = static_cast<char*>(recv);
    const char* src = send ? static_cast<const char*>(send) : dst + c.rank * bytes;
    return NodeAllgather(c, op, src, dst, bytes);
  }
  op.info().path |= detail::kPathMpi;
  MPI_Comm comm = c.comm;
  const void* in = send ? send : MPI_IN_PLACE;
  MPI_Datatype st = send ? t.mpi : MPI_DATATYPE_NULL;
  int sc = send ? recv_count : 0;
  RunCollective(
      c, op, bytes * c.size,
      [&] { return MPI_Allgather(in, sc, st, recv, recv_count, t.mpi, comm); },
      [&](MPI_Request* req) {
        return MPI_Iallgather(in, sc, st, recv, recv_count, t.mpi, comm, req);
      });
  return 0;
}

int ReduceScatter(XlaComm& c, const void* send, void* recv,
                  const int* recv_counts, int type, int op_code) {
  if (!c.failed.empty()) return FailedOp(c);
  int count = recv_counts[c.rank];
  Op op(c, kReduceScatter, type, count, op_code);
  op.Enter();
  for (int i = 0; i < c.size; ++i) {
    if (recv_counts[i] != count) {
      return Fail(c, "mpijax: " + op.Describe() + " on " + Where(c) +
                         ": XLA asks for blocks of different sizes; the "
                         "bridge only reduces equal blocks.",
                  false);
    }
  }
  if (c.clique != nullptr) {
    return MemberReduceScatter(c, op, static_cast<const char*>(send),
                               static_cast<char*>(recv),
                               static_cast<size_t>(count), OpOf(op_code, op.type()));
  }
  const Type& t = op.type();
  MPI_Op mop = OpOf(op_code, op.type());
  size_t block = static_cast<size_t>(count) * t.bytes;
  size_t bytes = block * c.size;
  bool every = g_settings.check_every.load(std::memory_order_relaxed);
  if (NodeReady(c)) {
    if (every) {
      if (int rc = Compare(c, op); rc != 0) return rc;
    }
    return NodeReduceScatter(c, op,
                             static_cast<const char*>(send ? send : recv),
                             static_cast<char*>(recv),
                             static_cast<size_t>(count), mop);
  }
  if (int rc = Compare(c, op); rc != 0) return rc;
  op.info().path |= detail::kPathMpi;
  MPI_Comm comm = c.comm;
  const void* in = send ? send : MPI_IN_PLACE;
  RunCollective(
      c, op, bytes,
      [&] {
        return MPI_Reduce_scatter_block(in, recv, count, t.mpi, mop, comm);
      },
      [&](MPI_Request* req) {
        return MPI_Ireduce_scatter_block(in, recv, count, t.mpi, mop, comm,
                                         req);
      });
  return 0;
}

}  // namespace mpijax::bridge

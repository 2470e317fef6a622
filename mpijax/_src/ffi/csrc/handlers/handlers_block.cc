// The block handlers: collectives that move one block per rank between all
// ranks (allgather, alltoall, reduce_scatter), in one MPI call or, beyond
// max_chunk_bytes, chunk by chunk (chunks.h).
#include <mpi.h>

#include <algorithm>

#include "core/call.h"
#include "handlers/chunks.h"
#include "handlers/handler.h"
#include "handlers/handlers.h"
#include "core/reduce_ops.h"
#include "core/wait.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {
namespace {

ffi::Error AllgatherImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> /*token_out*/,
                         int64_t comm_id, int64_t site, int64_t sig) {
  return RunCall(
      Kind::kCollective, "allgather", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        size_t nb = x.size_bytes();
        char* src = static_cast<char*>(x.untyped_data());
        char* dst = static_cast<char*>(out->untyped_data());
        return BlockCollective(
            info, nb,
            [&](int len) -> ffi::Error {
              MPIJAX_COLLECTIVE(
                  info, comm, nb * CommSize(comm),
                  MPI_Allgather(src, len, MPI_BYTE, dst, len, MPI_BYTE, comm),
                  MPI_Iallgather(src, len, MPI_BYTE, dst, len, MPI_BYTE, comm,
                                 &req_));
              return ffi::Error::Success();
            },
            [&](size_t off, size_t len, const StridedBytes& recv_type,
                MPI_Request& req) -> ffi::Error {
              MPIJAX_CHECK_MPI(
                  MPI_Iallgather(src + off, static_cast<int>(len), MPI_BYTE,
                                 dst + off, 1, recv_type.type, comm, &req),
                  info);
              return ffi::Error::Success();
            });
      });
}

ffi::Error AlltoallImpl(int64_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer /*token_in*/,
                        ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> /*token_out*/,
                        int64_t comm_id, int64_t site, int64_t sig) {
  return RunCall(
      Kind::kCollective, "alltoall", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        // Bytes per block.
        size_t nb = x.size_bytes() / std::max(info.comm_size, 1);
        char* src = static_cast<char*>(x.untyped_data());
        char* dst = static_cast<char*>(out->untyped_data());
        return BlockCollective(
            info, nb,
            [&](int len) -> ffi::Error {
              const void* send = src == dst ? MPI_IN_PLACE : src;
              MPIJAX_COLLECTIVE(
                  info, comm, x.size_bytes(),
                  MPI_Alltoall(send, len, MPI_BYTE, dst, len, MPI_BYTE, comm),
                  MPI_Ialltoall(send, len, MPI_BYTE, dst, len, MPI_BYTE, comm,
                                &req_));
              return ffi::Error::Success();
            },
            [&](size_t off, size_t /*len*/, const StridedBytes& block,
                MPI_Request& req) -> ffi::Error {
              // Before the first piece is posted.
              if (src == dst) {
                return ffi::Error::InvalidArgument(
                    info.Describe() + ": in-place alltoall of blocks larger "
                    "than max_chunk_bytes is not supported; do not alias "
                    "this output.");
              }
              MPIJAX_CHECK_MPI(MPI_Ialltoall(src + off, 1, block.type,
                                             dst + off, 1, block.type, comm,
                                             &req),
                               info);
              return ffi::Error::Success();
            });
      });
}

ffi::Error ReduceScatterImpl(int64_t device, ffi::AnyBuffer x,
                             ffi::AnyBuffer /*token_in*/,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> /*token_out*/,
                             int64_t comm_id, int64_t op, int64_t site,
                             int64_t sig) {
  return RunCall(
      Kind::kCollective, "reduce_scatter", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        int size = info.comm_size, rank = CommRank(comm);
        MPI_Datatype dt;
        MPI_Op mop;
        if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop);
            e.failure())
          return e;
        size_t es = ffi::ByteWidth(x.element_type());
        size_t n = out->element_count();  // elements per rank
        char* src = static_cast<char*>(x.untyped_data());
        char* dst = static_cast<char*>(out->untyped_data());
        size_t chunk = ChunkElems(es);
        if (n == 0) return ffi::Error::Success();
        if (n <= chunk) {
          int count = static_cast<int>(n);
          MPIJAX_COLLECTIVE(
              info, comm, x.size_bytes(),
              MPI_Reduce_scatter_block(src, dst, count, dt, mop, comm),
              MPI_Ireduce_scatter_block(src, dst, count, dt, mop, comm,
                                        &req_));
          return ffi::Error::Success();
        }
        // Huge blocks: one contiguous reduce per (destination, chunk);
        // reductions over strided derived types are not portable for
        // user-defined ops.
        for (int r = 0; r < size; ++r) {
          auto e = ForEachChunk(
              n, es, [&](size_t off, int count) -> ffi::Error {
                MPI_Request req;
                MPIJAX_CHECK_MPI(
                    MPI_Ireduce(src + (r * n + off) * es,
                                rank == r ? dst + off * es : nullptr, count,
                                dt, mop, r, comm, &req),
                    info);
                return Wait(&req, info);
              });
          if (e.failure()) return e;
        }
        return ffi::Error::Success();
      });
}

}  // namespace

MPIJAX_DEFINE_HANDLER(kAllgather, AllgatherImpl, OneBufferOp());
MPIJAX_DEFINE_HANDLER(kAlltoall, AlltoallImpl, OneBufferOp());
MPIJAX_DEFINE_HANDLER(kReduceScatter, ReduceScatterImpl,
                      OneBufferOp().Attr<int64_t>("op"));

}  // namespace mpijax::detail

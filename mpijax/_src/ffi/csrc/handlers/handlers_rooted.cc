// The rooted handlers: collectives to or from one root rank (bcast, reduce,
// gather, scatter). The root is an attribute, checked against the
// communicator on every rank (CheckRoot).
#include <mpi.h>

#include <cstring>

#include "core/call.h"
#include "handlers/chunks.h"
#include "handlers/handler.h"
#include "handlers/handlers.h"
#include "core/reduce_ops.h"
#include "core/wait.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {
namespace {

ffi::Error BcastImpl(int64_t device, ffi::AnyBuffer x,
                     ffi::AnyBuffer /*token_in*/,
                     ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> /*token_out*/, int64_t comm_id,
                     int64_t root, int64_t site, int64_t sig) {
  return RunCall(
      Kind::kCollective, "bcast", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        if (auto e = CheckRoot(info, root); e.failure()) return e;
        size_t nb = x.size_bytes();
        char* src = static_cast<char*>(x.untyped_data());
        char* dst = static_cast<char*>(out->untyped_data());
        if (CommRank(comm) == root && src != dst) std::memcpy(dst, src, nb);
        int r = static_cast<int>(root);
        return ForEachChunk(nb, 1, [&](size_t off, int len) -> ffi::Error {
          MPIJAX_COLLECTIVE(
              info, comm, len, MPI_Bcast(dst + off, len, MPI_BYTE, r, comm),
              MPI_Ibcast(dst + off, len, MPI_BYTE, r, comm, &req_));
          return ffi::Error::Success();
        });
      });
}

// Sum (or op) to root; zeros on the other ranks. The transpose of bcast.
ffi::Error ReduceImpl(int64_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer /*token_in*/,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> /*token_out*/,
                      int64_t comm_id, int64_t op, int64_t root, int64_t site,
                      int64_t sig) {
  return RunCall(
      Kind::kCollective, "reduce", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        bool is_root = CommRank(comm) == root;
        if (auto e = CheckRoot(info, root); e.failure()) return e;
        MPI_Datatype dt;
        MPI_Op mop;
        if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop);
            e.failure())
          return e;
        size_t n = x.element_count(), es = ffi::ByteWidth(x.element_type());
        char* src = static_cast<char*>(x.untyped_data());
        char* dst = static_cast<char*>(out->untyped_data());
        auto e = ForEachChunk(n, es, [&](size_t off, int count) -> ffi::Error {
          const void* send =
              (is_root && src == dst) ? MPI_IN_PLACE : src + off * es;
          MPI_Request req;
          MPIJAX_CHECK_MPI(MPI_Ireduce(send, dst + off * es, count, dt, mop,
                                       static_cast<int>(root), comm, &req),
                           info);
          return Wait(&req, info);
        });
        if (e.failure()) return e;
        if (!is_root) std::memset(dst, 0, n * es);
        return ffi::Error::Success();
      });
}

// Rank r's x lands in block r of root's result, of shape (size, *x.shape);
// the other ranks' result is empty.
ffi::Error GatherImpl(int64_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer /*token_in*/,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> /*token_out*/,
                      int64_t comm_id, int64_t root, int64_t site,
                      int64_t sig) {
  return RunCall(
      Kind::kCollective, "gather", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        int size = info.comm_size;
        if (auto e = CheckRoot(info, root); e.failure()) return e;
        bool is_root = CommRank(comm) == root;
        size_t nb = x.size_bytes();
        if (is_root && out->size_bytes() != nb * size) {
          return ffi::Error::InvalidArgument(
              info.Describe() + ": root's result is not size x input");
        }
        char* src = static_cast<char*>(x.untyped_data());
        char* dst = is_root ? static_cast<char*>(out->untyped_data()) : nullptr;
        int r = static_cast<int>(root);
        return BlockCollective(
            info, nb,
            [&](int len) -> ffi::Error {
              MPIJAX_COLLECTIVE(
                  info, comm, nb * size,
                  MPI_Gather(src, len, MPI_BYTE, dst, len, MPI_BYTE, r, comm),
                  MPI_Igather(src, len, MPI_BYTE, dst, len, MPI_BYTE, r, comm,
                              &req_));
              return ffi::Error::Success();
            },
            [&](size_t off, size_t len, const StridedBytes& recv_type,
                MPI_Request& req) -> ffi::Error {
              MPIJAX_CHECK_MPI(
                  MPI_Igather(src + off, static_cast<int>(len), MPI_BYTE,
                              dst == nullptr ? nullptr : dst + off, 1,
                              recv_type.type, r, comm, &req),
                  info);
              return ffi::Error::Success();
            });
      });
}

// Block r of root's x, of shape (size, *out.shape), lands on rank r. The
// other ranks' x only gives the shape (it is not read).
ffi::Error ScatterImpl(int64_t device, ffi::AnyBuffer x,
                       ffi::AnyBuffer /*token_in*/,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> /*token_out*/,
                       int64_t comm_id, int64_t root, int64_t site,
                       int64_t sig) {
  // Described by the block, the same on every rank.
  return RunCall(
      Kind::kCollective, "scatter", *out, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        int size = info.comm_size;
        if (auto e = CheckRoot(info, root); e.failure()) return e;
        bool is_root = CommRank(comm) == root;
        size_t nb = out->size_bytes();
        if (is_root && x.size_bytes() != nb * size) {
          return ffi::Error::InvalidArgument(
              info.Describe() + ": root's input is not size x result");
        }
        char* src = is_root ? static_cast<char*>(x.untyped_data()) : nullptr;
        char* dst = static_cast<char*>(out->untyped_data());
        int r = static_cast<int>(root);
        return BlockCollective(
            info, nb,
            [&](int len) -> ffi::Error {
              MPIJAX_COLLECTIVE(
                  info, comm, nb * size,
                  MPI_Scatter(src, len, MPI_BYTE, dst, len, MPI_BYTE, r, comm),
                  MPI_Iscatter(src, len, MPI_BYTE, dst, len, MPI_BYTE, r, comm,
                               &req_));
              return ffi::Error::Success();
            },
            [&](size_t off, size_t len, const StridedBytes& send_type,
                MPI_Request& req) -> ffi::Error {
              MPIJAX_CHECK_MPI(
                  MPI_Iscatter(src == nullptr ? nullptr : src + off, 1,
                               send_type.type, dst + off,
                               static_cast<int>(len), MPI_BYTE, r, comm, &req),
                  info);
              return ffi::Error::Success();
            });
      });
}

}  // namespace

MPIJAX_DEFINE_HANDLER(kBcast, BcastImpl, OneBufferOp().Attr<int64_t>("root"));
MPIJAX_DEFINE_HANDLER(kReduce, ReduceImpl,
                      OneBufferOp().Attr<int64_t>("op").Attr<int64_t>("root"));
MPIJAX_DEFINE_HANDLER(kGather, GatherImpl, OneBufferOp().Attr<int64_t>("root"));
MPIJAX_DEFINE_HANDLER(kScatter, ScatterImpl,
                      OneBufferOp().Attr<int64_t>("root"));

}  // namespace mpijax::detail

// The XLA FFI handlers: each looks up its private communicator, marks the
// call for the stall inspector, checks signatures when due, and runs its MPI
// collective on XLA's own buffers (zero-copy).
#include "handlers.h"

#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "allreduce.h"
#include "call.h"
#include "chunks.h"
#include "reduce_ops.h"
#include "registry.h"
#include "ring.h"
#include "settings.h"
#include "signature.h"
#include "spans.h"
#include "timeline.h"
#include "wait.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {
namespace {

// ppermute's messages: tags kPpermuteTagBase + (call count % kPpermuteTags),
// above the ring's and within the 32767 every MPI allows.
constexpr int kPpermuteTagBase = kRingTag + 1;
constexpr int kPpermuteTags = 16384;

// `device` (XLA's ordinal) becomes the local device index from here on.
#define MPIJAX_GET_COMM(var, comm_id, device)          \
  auto var##_or = GetComm(comm_id, device);            \
  if (var##_or.has_error()) return var##_or.error();   \
  DevComm* var##_dc = var##_or.value();                \
  device = var##_dc->index;                            \
  MPI_Comm var = var##_dc->comm;

// After `info` is built: marks the call in the status table and compares
// signatures across ranks when due.
#define MPIJAX_ENTER(info_, var, site_id, signature)                   \
  info_.dc = var##_dc;                                                \
  info_.site = site_id;                                               \
  info_.sig = signature;                                              \
  TimelineScope timeline_(info_, true);                               \
  CallScope scope_(var##_dc->status, site_id);                        \
  if (auto e_ = CheckSignature(info_, signature); e_.failure()) return e_;

ffi::Error AllreduceImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> /*token_out*/,
                         int64_t comm_id, int64_t op, int64_t divisor,
                         int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allreduce", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  return AllreduceBuffer(info, comm, x, *out, op, divisor);
}

// The all-reduce over every local device of every rank (DeviceAllreduce):
// each device's handler takes part with its own buffer.
ffi::Error DeviceAllreduceImpl(int64_t device, ffi::AnyBuffer x,
                               ffi::AnyBuffer /*token_in*/,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> /*token_out*/,
                               int64_t comm_id, int64_t op, int64_t site,
                               int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"device_allreduce", x.element_type(), x.dimensions(),
                CommSize(comm), comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  return DeviceAllreduce(info, x, *out, op);
}

// Several buffers (the buckets of a gradient tree) reduced in one call: those
// of one dtype in one cross-memory all-reduce (UseCma) or one ring (UseRing)
// when either applies, else one after another as `allreduce` would; the last
// operand and result are the order token. One custom call instead of one per
// bucket: one signature check on the first run, no per-bucket thunk, and XLA
// cannot interleave a bucket's packing with another's MPI call. (Posting
// every bucket as an MPI_Iallreduce and awaiting them together was measured
// slower inside a training step: 90 vs 76 ms with 4 ranks on 2 cores, 42 vs
// 34 ms with 2.)
ffi::Error AllreduceManyImpl(int64_t device, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, int64_t comm_id,
                             int64_t op, int64_t site, int64_t sig) {
  if (args.size() < 2 || rets.size() != args.size()) {
    return ffi::Error::InvalidArgument(
        "mpijax: allreduce_many needs buffers plus an order token, with one "
        "result per operand; got " + std::to_string(args.size()) +
        " operands and " + std::to_string(rets.size()) + " results");
  }
  auto first = args.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return first.error();
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allreduce", first->element_type(), first->dimensions(),
                CommSize(comm), comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  info.bytes = 0;
  MPI_Datatype dt;
  MPI_Op mop;
  // Buffers of one dtype share one ring (UseRing); the dtypes go in order
  // of first appearance, the same on every rank.
  std::vector<ffi::DataType> types;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (std::find(types.begin(), types.end(), x->element_type()) == types.end())
      types.push_back(x->element_type());
    info.bytes += static_cast<int64_t>(x->size_bytes());
  }
  for (ffi::DataType type : types) {
    if (auto e = ReductionTypes(type, op, &dt, &mop); e.failure()) return e;
    Spans spans(ffi::ByteWidth(type));
    std::vector<std::pair<ffi::AnyBuffer, ffi::AnyBuffer>> bufs;
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      auto x = args.get<ffi::AnyBuffer>(i);
      auto out = rets.get<ffi::AnyBuffer>(i);
      if (out.has_error()) return out.error();
      if (x->element_type() != type) continue;
      spans.Add(static_cast<const char*>(x->untyped_data()),
                static_cast<char*>((*out)->untyped_data()), x->element_count());
      bufs.emplace_back(*x, **out);
    }
    info.dtype = type;
    info.dims = bufs.front().first.dimensions();
    auto cma =
        UseCma(info, spans.size() * spans.elem_bytes(), spans.buffers());
    if (cma.has_error()) return cma.error();
    if (*cma) {
      info.path |= kPathCma;
      if (auto e = CmaAllreduce(info, spans, type, dt, mop, 1); e.failure())
        return e;
      continue;
    }
    if (UseRing(info, spans.size() * spans.elem_bytes(),
                spans.any_in_place())) {
      info.path |= kPathRing;
      if (auto e = RingSegments(info, comm, spans, type, dt, mop, 1);
          e.failure())
        return e;
      continue;
    }
    for (size_t i = 0; i < bufs.size(); ++i) {
      info.dims = bufs[i].first.dimensions();
      if (auto e = AllreduceBuffer(info, comm, bufs[i].first, bufs[i].second,
                                   op, 1);
          e.failure())
        return e;
    }
  }
  return ffi::Error::Success();
}

ffi::Error AllgatherImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> /*token_out*/,
                         int64_t comm_id, int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allgather", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  return BlockCollective(
      info, nb,
      [&](int len) -> ffi::Error {
        MPIJAX_COLLECTIVE(
            info, comm, nb * CommSize(comm),
            MPI_Allgather(src, len, MPI_BYTE, dst, len, MPI_BYTE, comm),
            MPI_Iallgather(src, len, MPI_BYTE, dst, len, MPI_BYTE, comm, &req_));
        return ffi::Error::Success();
      },
      [&](size_t off, size_t len, const StridedBytes& recv_type,
          MPI_Request& req) -> ffi::Error {
        MPIJAX_CHECK_MPI(MPI_Iallgather(src + off, static_cast<int>(len), MPI_BYTE,
                                        dst + off, 1, recv_type.type, comm, &req),
                         info);
        return ffi::Error::Success();
      });
}

ffi::Error ReduceScatterImpl(int64_t device, ffi::AnyBuffer x,
                             ffi::AnyBuffer /*token_in*/,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> /*token_out*/,
                             int64_t comm_id, int64_t op, int64_t site,
                             int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm), rank = CommRank(comm);
  CallInfo info{"reduce_scatter", x.element_type(), x.dimensions(), size,
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop); e.failure())
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
        MPI_Ireduce_scatter_block(src, dst, count, dt, mop, comm, &req_));
    return ffi::Error::Success();
  }
  // Huge blocks: one contiguous reduce per (destination, chunk); reductions
  // over strided derived types are not portable for user-defined ops.
  for (int r = 0; r < size; ++r) {
    auto e = ForEachChunk(n, es, [&](size_t off, int count) -> ffi::Error {
      MPI_Request req;
      MPIJAX_CHECK_MPI(MPI_Ireduce(src + (r * n + off) * es,
                                   rank == r ? dst + off * es : nullptr, count,
                                   dt, mop, r, comm, &req),
                       info);
      return Wait(&req, info);
    });
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error AlltoallImpl(int64_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer /*token_in*/,
                        ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> /*token_out*/,
                        int64_t comm_id, int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"alltoall", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  size_t nb = x.size_bytes() / std::max(size, 1);  // bytes per block
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  return BlockCollective(
      info, nb,
      [&](int len) -> ffi::Error {
        const void* send = src == dst ? MPI_IN_PLACE : src;
        MPIJAX_COLLECTIVE(
            info, comm, x.size_bytes(),
            MPI_Alltoall(send, len, MPI_BYTE, dst, len, MPI_BYTE, comm),
            MPI_Ialltoall(send, len, MPI_BYTE, dst, len, MPI_BYTE, comm, &req_));
        return ffi::Error::Success();
      },
      [&](size_t off, size_t /*len*/, const StridedBytes& block,
          MPI_Request& req) -> ffi::Error {
        // Before the first piece is posted.
        if (src == dst) {
          return ffi::Error::InvalidArgument(
              info.Describe() + ": in-place alltoall of blocks larger than "
              "max_chunk_bytes is not supported; do not alias this output.");
        }
        MPIJAX_CHECK_MPI(MPI_Ialltoall(src + off, 1, block.type, dst + off, 1,
                                       block.type, comm, &req),
                         info);
        return ffi::Error::Success();
      });
}

ffi::Error BcastImpl(int64_t device, ffi::AnyBuffer x,
                     ffi::AnyBuffer /*token_in*/,
                     ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> /*token_out*/, int64_t comm_id,
                     int64_t root, int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"bcast", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  if (auto e = CheckRoot(info, root); e.failure()) return e;
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  if (CommRank(comm) == root && src != dst) std::memcpy(dst, src, nb);
  int r = static_cast<int>(root);
  return ForEachChunk(nb, 1, [&](size_t off, int len) -> ffi::Error {
    MPIJAX_COLLECTIVE(info, comm, len,
                      MPI_Bcast(dst + off, len, MPI_BYTE, r, comm),
                      MPI_Ibcast(dst + off, len, MPI_BYTE, r, comm, &req_));
    return ffi::Error::Success();
  });
}

// Sum (or op) to root; zeros on the other ranks. The transpose of bcast.
ffi::Error ReduceImpl(int64_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer /*token_in*/,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> /*token_out*/,
                      int64_t comm_id, int64_t op, int64_t root, int64_t site,
                      int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  bool is_root = CommRank(comm) == root;
  CallInfo info{"reduce", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  if (auto e = CheckRoot(info, root); e.failure()) return e;
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop); e.failure())
    return e;
  size_t n = x.element_count(), es = ffi::ByteWidth(x.element_type());
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  auto e = ForEachChunk(n, es, [&](size_t off, int count) -> ffi::Error {
    const void* send = (is_root && src == dst) ? MPI_IN_PLACE : src + off * es;
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Ireduce(send, dst + off * es, count, dt, mop,
                                 static_cast<int>(root), comm, &req),
                     info);
    return Wait(&req, info);
  });
  if (e.failure()) return e;
  if (!is_root) std::memset(dst, 0, n * es);
  return ffi::Error::Success();
}

// Point-to-point by a permutation given as (srcs[i] -> dsts[i]) rank pairs.
// A rank nobody sends to gets zeros (jax.lax.ppermute semantics).
ffi::Error PpermuteImpl(int64_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer /*token_in*/,
                        ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> /*token_out*/,
                        int64_t comm_id, ffi::Span<const int64_t> srcs,
                        ffi::Span<const int64_t> dsts, int64_t site,
                        int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm), rank = CommRank(comm);
  CallInfo info{"ppermute", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  if (srcs.size() != dsts.size()) {
    return ffi::Error::InvalidArgument(info.Describe() +
                                       ": srcs and dsts differ in length");
  }
  int send_to = -1, recv_from = -1;
  for (size_t i = 0; i < srcs.size(); ++i) {
    if (srcs[i] < 0 || srcs[i] >= size || dsts[i] < 0 || dsts[i] >= size) {
      return ffi::Error::InvalidArgument(info.Describe() +
                                         ": permutation names a rank outside "
                                         "the communicator");
    }
    if (srcs[i] == rank) send_to = static_cast<int>(dsts[i]);
    if (dsts[i] == rank) recv_from = static_cast<int>(srcs[i]);
  }
  // Each exchange has its own tag (every rank counts its ppermute calls on
  // this communicator), so a message nobody received -- ranks whose sendrecv
  // arguments do not match up -- can never be taken by a later exchange.
  int tag = kPpermuteTagBase + static_cast<int>(comm_dc->p2p_seq++ % kPpermuteTags);
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  if (send_to == rank && recv_from == rank) {
    if (src != dst) std::memcpy(dst, src, nb);
    return ffi::Error::Success();
  }
  auto e = ForEachChunk(nb, 1, [&](size_t off, int len) -> ffi::Error {
    MPI_Request reqs[2];
    int nreq = 0;
    if (recv_from >= 0) {
      MPIJAX_CHECK_MPI(MPI_Irecv(dst + off, len, MPI_BYTE, recv_from, tag, comm,
                                 &reqs[nreq++]),
                       info);
    }
    if (send_to >= 0) {
      MPIJAX_CHECK_MPI(MPI_Isend(src + off, len, MPI_BYTE, send_to, tag, comm,
                                 &reqs[nreq++]),
                       info);
    }
    return WaitAll(nreq, reqs, info);
  });
  if (e.failure()) return e;
  if (recv_from < 0) std::memset(dst, 0, nb);
  return ffi::Error::Success();
}

ffi::Error BarrierImpl(int64_t device, ffi::AnyBuffer /*token_in*/,
                       ffi::Result<ffi::AnyBuffer> /*token_out*/,
                       int64_t comm_id, int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"barrier", ffi::DataType::INVALID, {}, CommSize(comm), comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  MPI_Request req;
  MPIJAX_CHECK_MPI(MPI_Ibarrier(comm, &req), info);
  return Wait(&req, info);
}

// Orders the next mpijax call of a block after a control-flow op (or an
// isolated region) that contains mpijax calls: it reads one of that op's
// results, so XLA runs it (and what consumes its token) only once the op has
// finished. It makes no MPI call and touches no data.
ffi::Error JoinImpl(ffi::AnyBuffer /*token_in*/, ffi::AnyBuffer /*after*/,
                    ffi::Result<ffi::AnyBuffer> /*token_out*/) {
  return ffi::Error::Success();
}

// Orders an XLA collective (one over this rank's local devices) after the
// mpijax calls before it: the collective reads this call's results, which
// are its operands passed through, aliased (XLA hands over one buffer, or
// copies first where the operand lives on). The last operand is the order
// token; nothing is read or written, unless XLA did not alias a result.
ffi::Error GateImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != rets.size() + 1) {
    return ffi::Error::InvalidArgument(
        "mpijax_gate: expected one result per operand before the order token, "
        "got " + std::to_string(args.size()) + " operands and " +
        std::to_string(rets.size()) + " results");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    if (in->untyped_data() != (*out)->untyped_data() && in->size_bytes() > 0) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

// The binding every one-buffer operation starts with, in its handler's
// argument order: the device, the input and the order token in, the result and
// the order token out, the communicator id. Each handler adds its own
// attributes, then "site" and "sig".
auto OneBufferOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()  // order token in
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()  // order token out
      .Attr<int64_t>("comm");
}

// Rank r's x lands in block r of root's result, of shape (size, *x.shape);
// the other ranks' result is empty.
ffi::Error GatherImpl(int64_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer /*token_in*/,
                      ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> /*token_out*/,
                      int64_t comm_id, int64_t root, int64_t site,
                      int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"gather", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  if (auto e = CheckRoot(info, root); e.failure()) return e;
  bool is_root = CommRank(comm) == root;
  size_t nb = x.size_bytes();
  if (is_root && out->size_bytes() != nb * size) {
    return ffi::Error::InvalidArgument(info.Describe() +
                                       ": root's result is not size x input");
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
            MPI_Igather(src, len, MPI_BYTE, dst, len, MPI_BYTE, r, comm, &req_));
        return ffi::Error::Success();
      },
      [&](size_t off, size_t len, const StridedBytes& recv_type,
          MPI_Request& req) -> ffi::Error {
        MPIJAX_CHECK_MPI(MPI_Igather(src + off, static_cast<int>(len), MPI_BYTE,
                                     dst == nullptr ? nullptr : dst + off, 1,
                                     recv_type.type, r, comm, &req),
                         info);
        return ffi::Error::Success();
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
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  // Described by the block, the same on every rank.
  CallInfo info{"scatter", out->element_type(), out->dimensions(), size,
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  if (auto e = CheckRoot(info, root); e.failure()) return e;
  bool is_root = CommRank(comm) == root;
  size_t nb = out->size_bytes();
  if (is_root && x.size_bytes() != nb * size) {
    return ffi::Error::InvalidArgument(info.Describe() +
                                       ": root's input is not size x result");
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
            MPI_Iscatter(src, len, MPI_BYTE, dst, len, MPI_BYTE, r, comm, &req_));
        return ffi::Error::Success();
      },
      [&](size_t off, size_t len, const StridedBytes& send_type,
          MPI_Request& req) -> ffi::Error {
        MPIJAX_CHECK_MPI(MPI_Iscatter(src == nullptr ? nullptr : src + off, 1,
                                      send_type.type, dst + off,
                                      static_cast<int>(len), MPI_BYTE, r, comm,
                                      &req),
                         info);
        return ffi::Error::Success();
      });
}

// Inclusive prefix reduction: rank r gets the reduction of ranks 0..r's x.
ffi::Error ScanImpl(int64_t device, ffi::AnyBuffer x,
                    ffi::AnyBuffer /*token_in*/,
                    ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> /*token_out*/, int64_t comm_id,
                    int64_t op, int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"scan", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop); e.failure())
    return e;
  size_t n = x.element_count(), es = ffi::ByteWidth(x.element_type());
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  return ForEachChunk(n, es, [&](size_t off, int count) -> ffi::Error {
    const void* send = src == dst ? MPI_IN_PLACE : src + off * es;
    char* recv = dst + off * es;
    MPIJAX_COLLECTIVE(info, comm, count * es,
                      MPI_Scan(send, recv, count, dt, mop, comm),
                      MPI_Iscan(send, recv, count, dt, mop, comm, &req_));
    return ffi::Error::Success();
  });
}

// Point-to-point peers and tags as Python encodes them (mpi4py's constants
// differ between MPI implementations).
constexpr int64_t kAnyPeer = -1;   // MPI_ANY_SOURCE
constexpr int64_t kNoPeer = -2;    // MPI_PROC_NULL
constexpr int64_t kAnyTagCode = -1;  // MPI_ANY_TAG

int PeerRank(int64_t code) {
  if (code == kAnyPeer) return MPI_ANY_SOURCE;
  if (code == kNoPeer) return MPI_PROC_NULL;
  return static_cast<int>(code);
}

// Tagged point-to-point messages, as MPI_Send, MPI_Recv and MPI_Sendrecv:
// only the ranks that exchange make the call, so there is no signature check
// (that is a collective). Operands: [recv template] [send buffer] order
// token; results: [received] order token. The template gives the received
// array's shape and dtype (XLA may hand its buffer over as the result's); a
// receive from no peer (MPI_PROC_NULL) returns it unchanged. `status`, when
// nonzero, is the address of an MPI_Status (mpi4py's MPI.Status) that gets
// the receive's status.
ffi::Error P2pImpl(int64_t device, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, int64_t comm_id, int64_t dest,
                   int64_t sendtag, int64_t source, int64_t recvtag,
                   int64_t status_addr, int64_t site, int64_t sig) {
  bool has_recv = rets.size() == 2;
  bool has_send = args.size() == (has_recv ? 3u : 2u);
  if (rets.size() < 1 || rets.size() > 2 || !(has_send || (has_recv && args.size() == 2))) {
    return ffi::Error::InvalidArgument(
        "mpijax p2p: unexpected operands (" + std::to_string(args.size()) +
        ") and results (" + std::to_string(rets.size()) + ")");
  }
  std::optional<ffi::AnyBuffer> templ, sendbuf, recvbuf;
  if (has_recv) {
    auto a = args.get<ffi::AnyBuffer>(0);
    auto r = rets.get<ffi::AnyBuffer>(0);
    if (a.has_error()) return a.error();
    if (r.has_error()) return r.error();
    templ.emplace(*a);
    recvbuf.emplace(**r);
  }
  if (has_send) {
    auto a = args.get<ffi::AnyBuffer>(has_recv ? 1 : 0);
    if (a.has_error()) return a.error();
    sendbuf.emplace(*a);
  }
  MPIJAX_GET_COMM(comm, comm_id, device);
  MPI_Comm p2p = comm_dc->check;  // see DevComm
  int size = CommSize(p2p);
  const ffi::AnyBuffer& described = has_recv ? *templ : *sendbuf;
  CallInfo info{has_send && has_recv ? "sendrecv" : has_send ? "send" : "recv",
                described.element_type(), described.dimensions(), size, comm_id,
                device};
  info.dc = comm_dc;
  info.site = site;
  info.sig = sig;
  TimelineScope timeline_(info, false);
  CallScope scope_(comm_dc->status, site);
  auto bad_peer = [&](int64_t code, bool any_ok) {
    return !(code == kNoPeer || (any_ok && code == kAnyPeer) ||
             (code >= 0 && code < size));
  };
  if ((has_send && bad_peer(dest, false)) || (has_recv && bad_peer(source, true))) {
    return ffi::Error::InvalidArgument(
        info.Describe() + ": peer (dest " + std::to_string(dest) + ", source " +
        std::to_string(source) + ") outside the communicator");
  }
  int to = PeerRank(dest), from = PeerRank(source);
  int rtag = recvtag == kAnyTagCode ? MPI_ANY_TAG : static_cast<int>(recvtag);
  size_t send_nb = has_send ? sendbuf->size_bytes() : 0;
  size_t recv_nb = has_recv ? recvbuf->size_bytes() : 0;
  char* src = has_send ? static_cast<char*>(sendbuf->untyped_data()) : nullptr;
  char* dst = has_recv ? static_cast<char*>(recvbuf->untyped_data()) : nullptr;
  if (has_recv && from == MPI_PROC_NULL && dst != templ->untyped_data() && recv_nb) {
    std::memcpy(dst, templ->untyped_data(), recv_nb);
  }
  // Messages above max_chunk_bytes go in pieces. MPI keeps one sender's
  // messages of one tag in order; after the first piece of a receive from any
  // peer or tag, the others are taken from its sender with its tag.
  size_t chunk = ChunkElems(1);
  auto pieces = [&](bool on, size_t nb) {
    return on ? std::max<size_t>(1, (nb + chunk - 1) / chunk) : 0;
  };
  size_t send_pieces = pieces(has_send, send_nb), recv_pieces = pieces(has_recv, recv_nb);
  MPI_Status first;
  MPI_Count received = 0;
  for (size_t i = 0; i < std::max(send_pieces, recv_pieces); ++i) {
    size_t off = i * chunk;
    MPI_Request reqs[2];
    MPI_Status sts[2];
    int nreq = 0;
    if (i < recv_pieces) {  // reqs[0]
      int len = static_cast<int>(std::min(chunk, recv_nb - std::min(off, recv_nb)));
      MPIJAX_CHECK_MPI(MPI_Irecv(dst + off, len, MPI_BYTE, i ? first.MPI_SOURCE : from,
                                 i ? first.MPI_TAG : rtag, p2p, &reqs[nreq++]),
                       info);
    }
    if (i < send_pieces) {
      int len = static_cast<int>(std::min(chunk, send_nb - std::min(off, send_nb)));
      MPIJAX_CHECK_MPI(MPI_Isend(src + off, len, MPI_BYTE, to,
                                 static_cast<int>(sendtag), p2p, &reqs[nreq++]),
                       info);
    }
    if (auto e = WaitAll(nreq, reqs, info, sts); e.failure()) return e;
    if (i < recv_pieces) {
      MPI_Count got = 0;
      MPI_Get_elements_x(&sts[0], MPI_BYTE, &got);
      received += got;
      if (i == 0) first = sts[0];
    }
  }
  if (status_addr != 0 && has_recv) {
    if (recv_pieces > 1) MPI_Status_set_elements_x(&first, MPI_BYTE, received);
    std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(status_addr)),
                &first, sizeof(MPI_Status));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoin, JoinImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Arg<ffi::AnyBuffer>()  // a result of the op to wait for
                                  .Ret<ffi::AnyBuffer>());  // order token out
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGate, GateImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()  // operands, order token
                                  .RemainingRets());  // the operands, aliased
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduce, AllreduceImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("divisor")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kDeviceAllreduce, DeviceAllreduceImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduceMany, AllreduceManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()  // buffers, order token
                                  .RemainingRets()  // results, order token
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllgather, AllgatherImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduceScatter, ReduceScatterImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAlltoall, AlltoallImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBcast, BcastImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduce, ReduceImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPpermute, PpermuteImpl,
                              OneBufferOp()
                                  .Attr<ffi::Span<const int64_t>>("srcs")
                                  .Attr<ffi::Span<const int64_t>>("dsts")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier, BarrierImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGather, GatherImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kScatter, ScatterImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kScan, ScanImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kP2p, P2pImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()  // [template], [send buffer], order token
                                  .RemainingRets()  // [received], order token
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("dest")
                                  .Attr<int64_t>("sendtag")
                                  .Attr<int64_t>("source")
                                  .Attr<int64_t>("recvtag")
                                  .Attr<int64_t>("status")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));

}  // namespace mpijax::detail

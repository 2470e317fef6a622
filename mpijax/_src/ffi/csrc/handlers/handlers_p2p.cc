// The point-to-point handlers: ppermute (a collective: every rank calls it,
// each sends to and receives from the ranks the permutation names) and the
// tagged messages send, recv and sendrecv (only the ranks that exchange
// make the call).
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "core/call.h"
#include "handlers/chunks.h"
#include "handlers/handler.h"
#include "handlers/handlers.h"
#include "handlers/ring.h"
#include "core/wait.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {
namespace {

// ppermute's messages: tags kPpermuteTagBase + (call count % kPpermuteTags),
// above the ring's and within the 32767 every MPI allows.
constexpr int kPpermuteTagBase = kRingTag + 1;
constexpr int kPpermuteTags = 16384;

// Point-to-point by a permutation given as (srcs[i] -> dsts[i]) rank pairs.
// A rank nobody sends to gets zeros (jax.lax.ppermute semantics).
ffi::Error PpermuteImpl(int64_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer /*token_in*/,
                        ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> /*token_out*/,
                        int64_t comm_id, ffi::Span<const int64_t> srcs,
                        ffi::Span<const int64_t> dsts, int64_t site,
                        int64_t sig) {
  return RunCall(
      Kind::kCollective, "ppermute", x, comm_id, device, site, sig,
      [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
        int size = info.comm_size, rank = CommRank(comm);
        if (srcs.size() != dsts.size()) {
          return ffi::Error::InvalidArgument(
              info.Describe() + ": srcs and dsts differ in length");
        }
        int send_to = -1, recv_from = -1;
        for (size_t i = 0; i < srcs.size(); ++i) {
          if (srcs[i] < 0 || srcs[i] >= size || dsts[i] < 0 ||
              dsts[i] >= size) {
            return ffi::Error::InvalidArgument(
                info.Describe() +
                ": permutation names a rank outside the communicator");
          }
          if (srcs[i] == rank) send_to = static_cast<int>(dsts[i]);
          if (dsts[i] == rank) recv_from = static_cast<int>(srcs[i]);
        }
        // Each exchange has its own tag (every rank counts its ppermute calls
        // on this communicator), so a message nobody received -- ranks whose
        // sendrecv arguments do not match up -- can never be taken by a later
        // exchange.
        int tag = kPpermuteTagBase +
                  static_cast<int>(info.dc->p2p_seq++ % kPpermuteTags);
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
            MPIJAX_CHECK_MPI(MPI_Irecv(dst + off, len, MPI_BYTE, recv_from,
                                       tag, comm, &reqs[nreq++]),
                             info);
          }
          if (send_to >= 0) {
            MPIJAX_CHECK_MPI(MPI_Isend(src + off, len, MPI_BYTE, send_to, tag,
                                       comm, &reqs[nreq++]),
                             info);
          }
          return WaitAll(nreq, reqs, info);
        });
        if (e.failure()) return e;
        if (recv_from < 0) std::memset(dst, 0, nb);
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
  if (rets.size() < 1 || rets.size() > 2 ||
      !(has_send || (has_recv && args.size() == 2))) {
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
  const char* name = has_send && has_recv ? "sendrecv"
                     : has_send           ? "send"
                                          : "recv";
  return RunCall(
      Kind::kPointToPoint, name, has_recv ? *templ : *sendbuf, comm_id,
      device, site, sig, [&](CallInfo& info, MPI_Comm p2p) -> ffi::Error {
        int size = info.comm_size;
        auto bad_peer = [&](int64_t code, bool any_ok) {
          return !(code == kNoPeer || (any_ok && code == kAnyPeer) ||
                   (code >= 0 && code < size));
        };
        if ((has_send && bad_peer(dest, false)) ||
            (has_recv && bad_peer(source, true))) {
          return ffi::Error::InvalidArgument(
              info.Describe() + ": peer (dest " + std::to_string(dest) +
              ", source " + std::to_string(source) +
              ") outside the communicator");
        }
        int to = PeerRank(dest), from = PeerRank(source);
        int rtag =
            recvtag == kAnyTagCode ? MPI_ANY_TAG : static_cast<int>(recvtag);
        size_t send_nb = has_send ? sendbuf->size_bytes() : 0;
        size_t recv_nb = has_recv ? recvbuf->size_bytes() : 0;
        char* src =
            has_send ? static_cast<char*>(sendbuf->untyped_data()) : nullptr;
        char* dst =
            has_recv ? static_cast<char*>(recvbuf->untyped_data()) : nullptr;
        if (has_recv && from == MPI_PROC_NULL &&
            dst != templ->untyped_data() && recv_nb) {
          std::memcpy(dst, templ->untyped_data(), recv_nb);
        }
        // Messages above max_chunk_bytes go in pieces. MPI keeps one
        // sender's messages of one tag in order; after the first piece of a
        // receive from any peer or tag, the others are taken from its sender
        // with its tag.
        size_t chunk = ChunkElems(1);
        auto pieces = [&](bool on, size_t nb) {
          return on ? std::max<size_t>(1, (nb + chunk - 1) / chunk) : 0;
        };
        size_t send_pieces = pieces(has_send, send_nb);
        size_t recv_pieces = pieces(has_recv, recv_nb);
        MPI_Status first;
        MPI_Count received = 0;
        for (size_t i = 0; i < std::max(send_pieces, recv_pieces); ++i) {
          size_t off = i * chunk;
          MPI_Request reqs[2];
          MPI_Status sts[2];
          int nreq = 0;
          if (i < recv_pieces) {  // reqs[0]
            int len = static_cast<int>(
                std::min(chunk, recv_nb - std::min(off, recv_nb)));
            MPIJAX_CHECK_MPI(
                MPI_Irecv(dst + off, len, MPI_BYTE,
                          i ? first.MPI_SOURCE : from,
                          i ? first.MPI_TAG : rtag, p2p, &reqs[nreq++]),
                info);
          }
          if (i < send_pieces) {
            int len = static_cast<int>(
                std::min(chunk, send_nb - std::min(off, send_nb)));
            MPIJAX_CHECK_MPI(MPI_Isend(src + off, len, MPI_BYTE, to,
                                       static_cast<int>(sendtag), p2p,
                                       &reqs[nreq++]),
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
          if (recv_pieces > 1)
            MPI_Status_set_elements_x(&first, MPI_BYTE, received);
          void* status = reinterpret_cast<void*>(
              static_cast<uintptr_t>(status_addr));
          std::memcpy(status, &first, sizeof(MPI_Status));
        }
        return ffi::Error::Success();
      });
}

}  // namespace

MPIJAX_DEFINE_HANDLER(kPpermute, PpermuteImpl,
                      OneBufferOp()
                          .Attr<ffi::Span<const int64_t>>("srcs")
                          .Attr<ffi::Span<const int64_t>>("dsts"));
// Operands [template], [send buffer], order token; results [received], order
// token.
MPIJAX_DEFINE_HANDLER(kP2p, P2pImpl,
                      ManyBufferOp()
                          .Attr<int64_t>("dest")
                          .Attr<int64_t>("sendtag")
                          .Attr<int64_t>("source")
                          .Attr<int64_t>("recvtag")
                          .Attr<int64_t>("status"));

}  // namespace mpijax::detail

// The synchronization handlers: barrier (an MPI barrier), and join and gate,
// which make no MPI call: they only order other calls in XLA's schedule.
#include <mpi.h>

#include <cstring>
#include <string>

#include "core/call.h"
#include "handlers/handler.h"
#include "handlers/handlers.h"
#include "core/wait.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {
namespace {

ffi::Error BarrierImpl(int64_t device, ffi::AnyBuffer /*token_in*/,
                       ffi::Result<ffi::AnyBuffer> /*token_out*/,
                       int64_t comm_id, int64_t site, int64_t sig) {
  return RunCall(Kind::kCollective, "barrier", Moves(), comm_id, device, site,
                 sig, [&](CallInfo& info, MPI_Comm comm) -> ffi::Error {
                   MPI_Request req;
                   MPIJAX_CHECK_MPI(MPI_Ibarrier(comm, &req), info);
                   return Wait(&req, info);
                 });
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

}  // namespace

MPIJAX_DEFINE_HANDLER(kBarrier, BarrierImpl, TokenOp());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoin, JoinImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Arg<ffi::AnyBuffer>()  // a result of the op to wait for
                                  .Ret<ffi::AnyBuffer>());  // order token out
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGate, GateImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()  // operands, order token
                                  .RemainingRets());  // the operands, aliased

}  // namespace mpijax::detail

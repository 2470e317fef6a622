// What every XLA FFI handler does before its MPI calls: it finds its private
// communicator, describes the call, marks it for the stall inspector and the
// timeline, and compares signatures across ranks when due. Each handler
// family (handlers_*.cc) runs its body inside RunCall() and defines its
// handlers with MPIJAX_DEFINE_HANDLER (the binding every call shares, written
// once here).
#ifndef MPIJAX_FFI_HANDLER_H_
#define MPIJAX_FFI_HANDLER_H_

#include <mpi.h>

#include <cstdint>
#include <utility>

#include "core/call.h"
#include "base/common.h"
#include "core/registry.h"
#include "core/call_check.h"
#include "core/timeline.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// What a call moves, as its description and the timeline show it: one
// buffer's dtype and shape, or nothing (a barrier).
struct Moves {
  ffi::DataType dtype = ffi::DataType::INVALID;
  ffi::Span<const int64_t> dims;
  Moves() = default;
  Moves(const ffi::AnyBuffer& b)  // NOLINT: implicit, a handler passes x
      : dtype(b.element_type()), dims(b.dimensions()) {}
};

// Collectives run on the communicator of their (communicator, device), and
// every rank compares signatures when due; tagged point-to-point messages
// run on its check communicator (see DevComm), with no signature check (only
// the ranks that exchange make the call) and outside the timeline's sequence
// of collectives.
enum class Kind { kCollective, kPointToPoint };

// Runs body(CallInfo& info, MPI_Comm comm) -> ffi::Error for the
// (comm_id, XLA device ordinal `device`) of a call: `info` describes it (its
// device is the local device index), the status table and the timeline mark
// it for the body's duration, and a collective's signature is compared
// across ranks first when due.
template <typename Body>
ffi::Error RunCall(Kind kind, const char* name, Moves moves, int64_t comm_id,
                   int64_t device, int64_t site, int64_t sig, Body&& body) {
  bool collective = kind == Kind::kCollective;
  auto dc_or = GetComm(comm_id, device);
  if (dc_or.has_error()) return dc_or.error();
  DevComm* dc = dc_or.value();
  MPI_Comm comm = collective ? dc->comm : dc->check;
  CallInfo info{name, moves.dtype, moves.dims, CommSize(comm), comm_id,
                dc->index};
  info.dc = dc;
  info.site = site;
  info.sig = sig;
  TimelineScope timeline(info, collective);
  CallScope scope(dc->status, site);
  if (collective) {
    if (auto e = CheckSignature(info, sig); e.failure()) return e;
  }
  return std::forward<Body>(body)(info, comm);
}

// The bindings, written once. Every call binds, in its handler's argument
// order: the device, its buffers and the order token in, its results and the
// order token out, the communicator id ("comm"); then the handler's own
// attributes; then the call site and signature RunCall takes ("site",
// "sig"). A handler states only its own part:
//   MPIJAX_DEFINE_HANDLER(kBcast, BcastImpl,
//                         OneBufferOp().Attr<int64_t>("root"));
// One buffer: the input, the order token in; the result, the token out.
inline auto OneBufferOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()  // order token in
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()  // order token out
      .Attr<int64_t>("comm");
}
// Any number of buffers, the order token last among the operands and among
// the results (the handler reads them as RemainingArgs / RemainingRets).
inline auto ManyBufferOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<int64_t>("comm");
}
// No data: the order token in and out (a barrier).
inline auto TokenOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()  // order token in
      .Ret<ffi::AnyBuffer>()  // order token out
      .Attr<int64_t>("comm");
}
// `binding` followed by the attributes every call ends with.
template <typename Binding>
auto WithCallSite(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int64_t>("site")
      .template Attr<int64_t>("sig");
}

}  // namespace mpijax::detail

// Defines the XLA FFI handler `fn` running `impl` with `binding` (one of the
// bindings above and the handler's own attributes), then "site" and "sig".
#define MPIJAX_DEFINE_HANDLER(fn, impl, binding) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(fn, impl,        \
                                ::mpijax::detail::WithCallSite(binding))

#endif  // MPIJAX_FFI_HANDLER_H_

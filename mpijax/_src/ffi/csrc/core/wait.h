// Waiting for MPI: every request a handler posts is waited for in WaitAll
// (polled under the stall deadline when there is one), and every collective
// runs blocking or nonblocking by the rules of ChooseBlocking.
#ifndef MPIJAX_FFI_WAIT_H_
#define MPIJAX_FFI_WAIT_H_

#include <mpi.h>

#include <cstddef>

#include "core/call.h"
#include "core/inspector.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// The one place every MPI request is waited for. Without a timeout it waits
// in MPI_Waitall (polled instead when several local devices wait at once:
// threads blocked in MPI together hand progress to each other through
// condition variables, measured 3-10x slower on 2 cores for a hierarchical
// psum); otherwise it polls, and past MPIJAX_TIMEOUT the stall inspector
// reports which ranks have not arrived, then aborts the job (or, with
// MPIJAX_STALL_ACTION=warn, the wait reports again one timeout later). A
// wait with no (communicator, device) to inspect fails instead. Returning an
// error on a stall is not an option: the pending request still owns XLA's
// buffers.
ffi::Error WaitAll(int n, MPI_Request* reqs, const CallInfo& info,
                   MPI_Status* statuses = MPI_STATUSES_IGNORE);

inline ffi::Error Wait(MPI_Request* req, const CallInfo& info) {
  return WaitAll(1, req, info);
}

// Whether a collective of `bytes` runs blocking. Never with several local
// devices: their threads would block in MPI together (see WaitAll).
// Otherwise, without a timeout nothing needs polling; with one, a call of at
// least MPIJAX_BLOCKING_MIN_BYTES (default: every call) runs blocking under
// the watchdog (`*watched`) and smaller ones are polled nonblocking calls.
// When the inspector (and with it the watchdog) is not running, a blocking
// call first waits in a polled MPI_Ibarrier, after which only a rank that
// dies (which the launcher handles) can hold it up; that round trip is only
// worth it from kUnwatchedBlockingMinBytes on.
ffi::Error ChooseBlocking(MPI_Comm comm, size_t bytes, const CallInfo& info,
                          bool* blocking, bool* watched);

// Runs BLOCKING_CALL or NONBLOCKING_CALL (which posts `req_`) and waits.
#define MPIJAX_COLLECTIVE(info, comm, bytes, BLOCKING_CALL, NONBLOCKING_CALL) \
  do {                                                                       \
    bool blocking_ = false, watched_ = false;                                \
    if (auto e_ = ChooseBlocking(comm, bytes, info, &blocking_, &watched_);  \
        e_.failure())                                                        \
      return e_;                                                             \
    if (blocking_) {                                                         \
      BlockingMark mark_(watched_ ? info.dc : nullptr);                      \
      MPIJAX_CHECK_MPI(BLOCKING_CALL, info);                                 \
    } else {                                                                 \
      MPI_Request req_;                                                      \
      MPIJAX_CHECK_MPI(NONBLOCKING_CALL, info);                              \
      if (auto e_ = Wait(&req_, info); e_.failure()) return e_;              \
    }                                                                        \
  } while (0)

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_WAIT_H_

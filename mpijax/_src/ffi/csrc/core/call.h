// One handler call: its description for error messages, the scope that marks
// its (communicator, device) busy for the stall inspector, and what an MPI
// error inside it does.
#ifndef MPIJAX_FFI_CALL_H_
#define MPIJAX_FFI_CALL_H_

#include <mpi.h>

#include <cstdint>
#include <string>

#include "base/common.h"
#include "core/registry.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

struct CallInfo {
  const char* name;     // e.g. "allreduce"
  ffi::DataType dtype;
  ffi::Span<const int64_t> dims;
  int comm_size;
  int64_t comm_id;
  int64_t device;
  DevComm* dc = nullptr;  // set by RunCall (handler.h)
  int64_t site = -1;
  int64_t sig = 0;
  // For the timeline: the bytes of all operands when not just dims x dtype
  // (allreduce_many), and the paths the call took (kPath* bits, set by the
  // code that chooses them on a const CallInfo, hence mutable).
  int64_t bytes = -1;
  mutable int path = 0;

  // "mpijax.ops.allreduce on float32[4] (communicator 0, size 2, ...)".
  std::string Describe() const;
};

// A root rank attribute checked against the call's communicator (every rank
// sees the same root and size, so every rank returns the same error).
ffi::Error CheckRoot(const CallInfo& info, int64_t root);

// An MPI error inside a handler leaves the communicator, and with requests
// still pending into XLA's buffers the process's memory, in an undefined
// state: returning an error would let XLA free buffers that MPI may still
// write (measured: heap corruption after MPI_ERR_TRUNCATE in the ring, and
// the other rank returning garbage as a result). So the rank reports and
// takes the job down, as a rank that raises does.
ffi::Error MpiError(int rc, const char* call, const CallInfo& info);

#define MPIJAX_CHECK_MPI(call, info)                          \
  do {                                                        \
    int rc_ = (call);                                         \
    if (rc_ != MPI_SUCCESS) return MpiError(rc_, #call, info); \
  } while (0)

// Marks the (communicator, device) busy for the handler's lifetime.
struct CallScope {
  Status& st;
  CallScope(Status& s, int64_t site) : st(s) {
    st.site.store(site, std::memory_order_relaxed);
    st.since_ns.store(NowNs(), std::memory_order_relaxed);
    st.phase.store(2, std::memory_order_relaxed);
    st.calls.fetch_add(1, std::memory_order_relaxed);
  }
  ~CallScope() {
    st.since_ns.store(NowNs(), std::memory_order_relaxed);
    st.phase.store(0, std::memory_order_relaxed);
  }
};

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_CALL_H_

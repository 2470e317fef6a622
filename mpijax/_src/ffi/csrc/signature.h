// Signature checks: the ranks of a communicator compare what they are about
// to run (a hash of op, shapes and dtypes) before the collective itself, so
// a divergence is an error that names the ranks on every rank, never a hang
// or garbage.
#ifndef MPIJAX_FFI_SIGNATURE_H_
#define MPIJAX_FFI_SIGNATURE_H_

#include <cstdint>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// Compares this call's signature across the communicator's ranks: on the
// first execution of each call site, or on every call with MPIJAX_CHECK=1.
// Runs on the separate `check` communicator (see DevComm).
ffi::Error CheckSignature(const CallInfo& info, int64_t sig);

// Gathers every rank's signature and call site and returns the error that
// groups the ranks by what they run. Collective on the check communicator:
// every rank of the communicator gets this error, from the same check.
ffi::Error MismatchError(const CallInfo& info, int64_t sig);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_SIGNATURE_H_

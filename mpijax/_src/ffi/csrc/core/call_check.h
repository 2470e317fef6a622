// Signature checks: the ranks of a communicator compare what they are about
// to run (a hash of op, shapes and dtypes) before the collective itself, so
// a divergence is an error that names the ranks on every rank, never a hang
// or garbage.
#ifndef MPIJAX_FFI_CALL_CHECK_H_
#define MPIJAX_FFI_CALL_CHECK_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/call.h"
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

// Indices 0 .. n-1 grouped by sig_of(i), the groups in order of first
// appearance: a mismatch report names each group once.
template <typename SigOf>
std::vector<std::vector<int>> GroupBySignature(int n, SigOf sig_of) {
  std::vector<int64_t> sigs;
  std::vector<std::vector<int>> groups;
  for (int i = 0; i < n; ++i) {
    auto it = std::find(sigs.begin(), sigs.end(), sig_of(i));
    if (it == sigs.end()) {
      sigs.push_back(sig_of(i));
      groups.push_back({i});
    } else {
      groups[it - sigs.begin()].push_back(i);
    }
  }
  return groups;
}

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_CALL_CHECK_H_

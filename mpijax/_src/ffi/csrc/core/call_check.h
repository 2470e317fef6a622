// The cross-rank call check, one for both transports (mpijax's own handlers
// and XLA's collectives through the bridge): the ranks of a communicator
// compare what they are about to run (a signature: a hash of op, shapes and
// dtypes, and for XLA's the program) before the collective itself, so a
// divergence is an error that names the ranks on every rank, never a hang
// or garbage. Both exchanges run on the communicator's separate `check`
// communicator (see DevComm); each transport words its own error.
#ifndef MPIJAX_FFI_CALL_CHECK_H_
#define MPIJAX_FFI_CALL_CHECK_H_

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/call.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

// How an exchange ended: MPI's error code and the call that returned it
// (the caller reports it and ends the job), or the wait's error (a stall
// action), else ok().
struct CheckExchange {
  int rc = MPI_SUCCESS;
  const char* call = "";
  ffi::Error wait;
  bool ok() const { return rc == MPI_SUCCESS && wait.success(); }
};

// Whether every rank of `check` runs calls of one signature: each rank
// passes the smallest and largest signature of its calls (the same, with
// one call per rank), one all-reduce of {hi, -lo} compares them, and *same
// says whether they are all one value. Signatures are in (0, 2^63), so -lo
// never overflows. The stall inspector sees phase 1 during the exchange, 2
// after. No allocation: it runs before every call that is compared.
CheckExchange SameSignatures(MPI_Comm check, const CallInfo& info, int64_t lo,
                             int64_t hi, bool* same);

// What every rank runs, once SameSignatures found a difference: each rank
// passes its calls' signatures and texts (`counts[r]` calls on rank r;
// empty: one per rank) and every rank gets every rank's, in rank order, in
// *sigs and *texts. Collective on `check`.
CheckExchange GatherCalls(MPI_Comm check, const CallInfo& info,
                          const std::vector<int>& counts,
                          const std::vector<int64_t>& my_sigs,
                          const std::vector<std::string>& my_texts,
                          std::vector<int64_t>* sigs,
                          std::vector<std::string>* texts);

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

// mpijax's handlers: compares this call's signature across the
// communicator's ranks on the first execution of each call site, or on every
// call with MPIJAX_CHECK=1.
ffi::Error CheckSignature(const CallInfo& info, int64_t sig);

// Gathers every rank's signature and call site and returns the error that
// groups the ranks by what they run. Collective on the check communicator:
// every rank of the communicator gets this error, from the same check.
ffi::Error MismatchError(const CallInfo& info, int64_t sig);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_CALL_CHECK_H_

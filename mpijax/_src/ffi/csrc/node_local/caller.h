// The node-local all-reduce's Status, and the Caller whose hooks it calls
// (mpijax's handlers implement them in allreduce.cc). Part of node_local.h.
#ifndef MPIJAX_FFI_NODE_LOCAL_CALLER_H_
#define MPIJAX_FFI_NODE_LOCAL_CALLER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/idle.h"

namespace mpijax::node_local {

// Success, or an error: a canonical (absl / XLA FFI) status code and text.
struct Status {
  int code = 0;
  std::string message;
  bool ok() const { return code == 0; }
};
constexpr int kInvalidArgument = 3;
constexpr int kFailedPrecondition = 9;
constexpr int kInternal = 13;

// What a node-local all-reduce asks of its caller: how long to wait before
// reporting a stall, and how to word failures. The defaults suit a plain MPI
// caller; mpijax's handlers report through the stall inspector.
class Caller {
 public:
  virtual ~Caller() = default;
  // Equal on every rank exactly when the ranks reduce the same thing;
  // compared once all have arrived.
  int64_t sig = 0;
  // Whether Finish runs on each finished piece of the result (a mean's
  // division).
  bool finishes = false;
  virtual Status Finish(char* p, size_t count);
  // Seconds a wait for the other ranks may take before Stalled(); <= 0:
  // waits are not timed.
  virtual double Timeout() const { return 0; }
  // Seconds a wait spins before it sleeps (< 0: never sleeps).
  virtual double SpinS() const { return idle::kDefaultSpinS; }
  // A wait has taken `waited_s` (called again every Timeout()); the wait
  // goes on afterwards (or this ends the process).
  virtual void Stalled(double waited_s);
  // Brackets the setup's blocking MPI calls (a watchdog may guard them).
  virtual void Blocking(bool /*inside*/) {}
  // An MPI call failed: the error to return.
  virtual Status MpiFailed(int rc, const char* call);
  // Rank `rank` arrived reducing `rank_bytes` bytes with signature
  // `rank_sig`, this rank `my_bytes` with `sig`; if both agree, it takes the
  // other path. Every rank returns the error of the first rank that differs.
  virtual Status Mismatch(int rank, int64_t rank_sig, int64_t rank_bytes,
                          int64_t my_bytes);
  // A cross-memory copy failed on rank `rank`; `how`: the call and errno.
  virtual Status CmaFailed(int rank, const std::string& how);
};

}  // namespace mpijax::node_local

#endif  // MPIJAX_FFI_NODE_LOCAL_CALLER_H_

// Small helpers every part of the transport uses: the clock and a
// communicator's rank and size. Depends on MPI only (the node-local
// all-reduce, reusable outside the extension, includes it too).
#ifndef MPIJAX_FFI_COMMON_H_
#define MPIJAX_FFI_COMMON_H_

#include <mpi.h>

#include <chrono>
#include <cstdint>

namespace mpijax {

using Clock = std::chrono::steady_clock;

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

inline int CommRank(MPI_Comm c) { int r = 0; MPI_Comm_rank(c, &r); return r; }
inline int CommSize(MPI_Comm c) { int s = 0; MPI_Comm_size(c, &s); return s; }

}  // namespace mpijax

#endif  // MPIJAX_FFI_COMMON_H_

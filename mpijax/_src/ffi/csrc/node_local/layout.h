// Inside the shared segments (private to the node-local all-reduce): the
// layout of a participant's slot (its header of flags, what it reduces and
// its buffers' addresses, then its data), and how a failed MPI call becomes
// the Caller's error.
#ifndef MPIJAX_FFI_NODE_LOCAL_LAYOUT_H_
#define MPIJAX_FFI_NODE_LOCAL_LAYOUT_H_

#include <mpi.h>

#include <atomic>
#include <cstdint>

#include "base/idle.h"
#include "node_local/segment.h"

namespace mpijax::node_local::internal {

struct alignas(64) Header {
  std::atomic<uint64_t> arrived;  // this call's input is in the segment
  char pad0[56];
  std::atomic<uint64_t> reduced;  // its block of the result is published
  char pad1[56];
  std::atomic<uint64_t> done;     // it has read every other segment
  char pad2[56];
  idle::Doorbell bell;            // rung when a flag above changes
  char pad3[56];
  int64_t sig, bytes;             // what it is reducing (mismatch check)
  int64_t path;                   // kPathShm or kPathCma (mismatch check)
  int64_t failed;                 // CmaAllreduce: the call that failed here
  int64_t failed_errno;           // ... and the errno of its kernel copy
  int64_t pid;                    // set up once: this rank's process id,
  uint64_t probe;                 // ... the address of its CMA nonce there
  uint64_t nonce;                 // ... and the nonce's value
  // CmaAllreduce: this call's buffers here, input and output of each.
  uint64_t addr[kCmaMaxBuffers][2];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory flags need lock-free 64-bit atomics");
static_assert(sizeof(Header) <= kHeaderBytes, "header exceeds its page");
constexpr int64_t kPathShm = 1, kPathCma = 2;  // Header::path

inline Header* Head(const Comm& c, int i) {
  return reinterpret_cast<Header*>(c.base + i * c.stride);
}
inline char* Data(const Comm& c, int i) {
  return c.base + i * c.stride + kHeaderBytes;
}

#define NODE_CHECK_MPI(caller, call)                          \
  do {                                                        \
    int rc_ = (call);                                         \
    if (rc_ != MPI_SUCCESS) return (caller).MpiFailed(rc_, #call); \
  } while (0)

}  // namespace mpijax::node_local::internal

#endif  // MPIJAX_FFI_NODE_LOCAL_LAYOUT_H_

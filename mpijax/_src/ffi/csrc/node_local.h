// Node-local all-reduce: when every rank of a communicator runs on one node,
// the ranks reduce through a POSIX shared-memory file (small messages) or by
// reading and writing each other's buffers with cross-memory attach (large
// ones) instead of sending MPI messages. Depends on MPI and the C++ library
// only (node_local.cc, spans.cc), so C++ code outside mpijax's FFI handlers
// can call it on any intra-communicator.
//
// Two ways in:
// * node_local::Allreduce(): MPI_Allreduce's arguments, with a
//   node_local::Comm the caller keeps per communicator. It takes a
//   node-local path when one applies and calls MPI_Allreduce otherwise.
// * Ready() + ShmAllreduce() / CmaAllreduce() with a Caller, for callers
//   that choose the path themselves, report stalls and word errors their own
//   way (mpijax's handlers: allreduce.cc).
//
// Example (a library forwarding MPI_Allreduce):
//
//   node_local::Comm& nc = StateOf(comm);  // e.g. a map kept by the caller,
//                                          // node_local::Comm nc(comm) once
//   int rc = node_local::Allreduce(nc, sendbuf, recvbuf, count, type, op);
//
// Building it into another target: compile ${MPIJAX_NODE_LOCAL_SOURCES}
// (CMakeLists.txt) with MPI's include directories and this directory on the
// include path. mpijax's module tests this API through node_allreduce().
#ifndef MPIJAX_FFI_NODE_LOCAL_H_
#define MPIJAX_FFI_NODE_LOCAL_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "idle.h"
#include "spans.h"

namespace mpijax::node_local {

// The most buffers one CmaAllreduce takes (their addresses fill the rest of
// the header's page).
constexpr size_t kCmaMaxBuffers = 224;
// Each rank's slot starts with a page of flags and buffer addresses.
constexpr size_t kHeaderBytes = 4096;

// Success, or an error: a canonical (absl / XLA FFI) status code and text.
struct Status {
  int code = 0;
  std::string message;
  bool ok() const { return code == 0; }
};
constexpr int kInvalidArgument = 3;
constexpr int kFailedPrecondition = 9;
constexpr int kInternal = 13;

// Where node_local::Allreduce switches paths (mpijax's defaults, the same as
// MPIJAX_SHM_MAX_BYTES and MPIJAX_CMA_MIN_BYTES). Must be equal on every rank.
struct Limits {
  // Up to this many bytes: shared memory (<= 0: never). Also each rank's
  // segment size, fixed at setup.
  int64_t shm_max_bytes = int64_t{1} << 20;
  // From this many bytes: cross-memory attach, where the kernel allows it
  // (<= 0: never).
  int64_t cma_min_bytes = int64_t{64} << 10;
  // Seconds a wait for the other ranks may take before a report on stderr,
  // repeated every timeout_s (<= 0: none). The wait itself never gives up:
  // the other ranks may still write into this rank's buffers.
  double timeout_s = 0;
  // Seconds a wait for the other ranks spins before it sleeps until a rank
  // wakes it (< 0: never sleeps; idle.h).
  double wait_spin_s = idle::kDefaultSpinS;
};

// One communicator's node-local state. Set up by the first all-reduce that
// could use it (collective over `comm`), then used by one thread at a time.
// Keep it as long as the communicator is used; destroy (or Release) it
// before the communicator is freed.
struct Comm {
  explicit Comm(MPI_Comm c = MPI_COMM_NULL, Limits l = {})
      : comm(c), limits(l) {}
  ~Comm() { Release(); }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // Unmaps the segments (a view only forgets them); the node-local paths
  // stay off from then on.
  void Release();
  // Bytes one reduction may have on the shared-memory path (once mapped).
  size_t segment_bytes() const { return stride - kHeaderBytes; }

  MPI_Comm comm;
  Limits limits;  // node_local::Allreduce's; Ready() callers pass their own

  int state = 0;  // 0 not tried yet, 1 mapped, -1 unavailable
  // Participants: `size` slots, `slots` per rank of `comm`; this one is
  // slot `rank` (the rank's first slot, or its device's in a View).
  int rank = 0, size = 0, slots = 1;
  bool owns = true;  // false in a View: the owner unmaps
  char* base = nullptr;
  size_t stride = 0, map_bytes = 0;  // header + segment; all slots
  bool oversubscribed = false;       // more ranks on the node than cores
  // Every rank can read and write every other's memory with cross-memory
  // attach (probed at setup): CmaAllreduce may run.
  bool cma_ok = false;
  uint64_t seq = 0;  // node-local calls so far: the same on every rank

  // node_local::Allreduce's last call: its path (0 MPI_Allreduce, 1 shared
  // memory, 2 cross-memory attach) and, after a failure, what went wrong.
  int last_path = 0;
  std::string last_error;
};

// An MPI_Allreduce(sendbuf, recvbuf, count, datatype, op, c.comm) that runs
// on a node-local path when every rank of c.comm is on one node: cross-memory
// attach from c.limits.cma_min_bytes (if the kernel lets the ranks reach each
// other's memory), else shared memory up to c.limits.shm_max_bytes, else
// MPI_Allreduce itself; also MPI_Allreduce for an inter-communicator, one
// rank, a datatype whose extent is not its size (not contiguous), or an op
// that is not commutative. sendbuf may be MPI_IN_PLACE. Collective, like
// MPI_Allreduce: every rank calls it with the same count, datatype and op,
// in the same order as its other collectives on c.comm (the first call that
// could take a node-local path sets up c, with MPI collectives on c.comm).
// Every rank gets the same bits. Returns MPI_SUCCESS or an MPI error code
// (MPI_ERR_OTHER for a node-local failure, described in c.last_error; after
// a failed cross-memory copy that path stays off for c).
int Allreduce(Comm& c, const void* sendbuf, void* recvbuf, int count,
              MPI_Datatype datatype, MPI_Op op);

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

// Maps c's shared segments (`segment_bytes` each, rounded up to pages) and
// probes cross-memory attach if no call has tried yet: collective over
// c.comm, at the same call on every rank; any failure on any rank (ranks on
// several nodes, no /dev/shm, no space) leaves the paths off everywhere.
// *ready: whether they are mapped.
Status Ready(Comm& c, Caller& caller, int64_t segment_bytes, bool* ready);

// Ready() for `slots` participants per rank (e.g. one per local device of
// each rank, each taking part from its own thread through a View).
Status Ready(Comm& c, Caller& caller, int64_t segment_bytes, int slots,
             bool* ready);

// Makes `view` participant `slot` (0 <= slot < owner.slots) of this rank in
// owner's mapping, with its own call count: several threads of one process
// then all-reduce with each other and with the other ranks' participants,
// each on its own view. `owner` must be mapped and outlive the view.
void View(Comm& view, const Comm& owner, int slot);

// All-reduce of n elements of elem_bytes each through the shared segments
// (needs Ready, n * elem_bytes <= c.segment_bytes()); src may be dst.
Status ShmAllreduce(Comm& c, Caller& caller, const char* src, char* dst,
                    size_t n, size_t elem_bytes, MPI_Datatype datatype,
                    MPI_Op op);

// All-reduce of `spans` (up to kCmaMaxBuffers buffers) by cross-memory
// attach (needs Ready and c.cma_ok).
Status CmaAllreduce(Comm& c, Caller& caller, const Spans& spans,
                    MPI_Datatype datatype, MPI_Op op);

}  // namespace mpijax::node_local

#endif  // MPIJAX_FFI_NODE_LOCAL_H_

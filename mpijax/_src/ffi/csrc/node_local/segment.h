// The node-local all-reduce's shared memory: one POSIX shared-memory file
// per communicator, mapped by every rank, with one slot per participant: a
// page of flags and buffer addresses, then a data segment. Comm is a
// communicator's state; Ready() maps the segments (and probes cross-memory
// attach), View() makes several threads of one process participants. Part
// of node_local.h.
#ifndef MPIJAX_FFI_NODE_LOCAL_SEGMENT_H_
#define MPIJAX_FFI_NODE_LOCAL_SEGMENT_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/idle.h"
#include "node_local/caller.h"

namespace mpijax::node_local {

// The most buffers one CmaAllreduce takes (their addresses fill the rest of
// the header's page).
constexpr size_t kCmaMaxBuffers = 224;
// Each rank's slot starts with a page of flags and buffer addresses.
constexpr size_t kHeaderBytes = 4096;

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

}  // namespace mpijax::node_local

#endif  // MPIJAX_FFI_NODE_LOCAL_SEGMENT_H_

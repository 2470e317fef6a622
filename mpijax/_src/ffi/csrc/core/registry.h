// What Python registers and the handlers look up: the communicator table
// (one private communicator per user communicator and local device index,
// with its status for the stall inspector) and the call sites.
//
// Every handler runs on a private communicator: Python registers, per user
// communicator, one clone per local device index; the handler picks the one
// of its local device (ffi::DeviceOrdinal), so several local devices calling
// MPI at once pair up by local index across ranks.
#ifndef MPIJAX_FFI_REGISTRY_H_
#define MPIJAX_FFI_REGISTRY_H_

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "node_local/node_local.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

namespace ffi = ::xla::ffi;

struct ArrivalRing;  // arrivals.h

// What one (communicator, local device) is doing, for the stall inspector.
// Written by the handler thread with relaxed atomics (a few stores per call:
// the fast path stays lean), read by the responder thread.
struct Status {
  std::atomic<int64_t> calls{0};     // calls entered so far
  std::atomic<int64_t> site{-1};     // site id of the current / last call
  std::atomic<int64_t> since_ns{0};  // entered (in a call) or left (idle)
  std::atomic<int> phase{0};         // 0 idle, 1 mismatch check, 2 collective
  // Nonzero while in a blocking MPI call the watchdog guards: when it entered.
  std::atomic<int64_t> blocking_since_ns{0};
};

// One local device's private communicators: `comm` carries the collectives,
// `check` only the signature checks, so a check on one rank can never pair
// up with (and corrupt) a real collective on another: a divergence there is
// a stall the inspector reports, never silent garbage. `check` also carries
// the user-tagged point-to-point messages (send, recv): MPI never matches
// point-to-point messages with collectives, and on `comm` a receive from any
// tag could take the ring's or ppermute's messages.
struct DevComm {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm check = MPI_COMM_NULL;
  int64_t key = -1;  // the communicator's id, agreed by all its ranks
  // How reports name it; empty: "communicator <key>" (XLA's through the
  // bridge have a label of their own).
  std::string label;
  // Local devices of the communicator: with more than one, their threads
  // call MPI at the same time, and every wait is polled (see WaitAll).
  int local_devices = 1;
  int64_t index = 0;  // its local device index (XLA's ordinal may differ)
  Status status;
  // The node-local all-reduce's state on `comm`, set up by the first call
  // that can use it; touched only by this device's handler thread.
  node_local::Comm node;
  // This device's place in the all-reduce over every local device of every
  // rank (a view of CommEntry::group; see SetupDeviceGroup).
  node_local::Comm group;
  uint64_t p2p_seq = 0;  // ppermute calls so far: the same on every rank
  // Collective calls so far (every handler but send/recv): the same on every
  // rank, so the timeline pairs the k-th call across ranks.
  uint64_t coll_seq = 0;
  // The straggler report's arrival stamps (arrivals.h), allocated by the
  // first collective recorded; and the job rank of the communicator's rank
  // 0, which tells apart communicators that share a key.
  std::atomic<ArrivalRing*> arrivals{nullptr};
  int64_t leader = -1;
  // A member of one of XLA's communicators with several devices per process
  // (set by the bridge's side): the other members, as the stall inspector
  // asks them (job rank, local device index). Empty: ask this device index
  // of every rank of `comm`.
  std::vector<std::pair<int, int64_t>> peers;
};

struct CommEntry {
  int64_t key = -1;
  // unique_ptr: DevComm holds atomics; entries are never deleted (a freed
  // communicator keeps its memory so the responder never reads freed state).
  std::vector<std::unique_ptr<DevComm>> devs;
  // XLA's device ordinal of each local device index: the device's id, which
  // is the local index in a single-process JAX but a global id (e.g. 2048 on
  // the second process) under jax.distributed.
  std::vector<int64_t> ordinals;
  // The node-local segments of the all-reduce over every local device of
  // every rank: one slot per (rank, local device); null until set up.
  std::unique_ptr<node_local::Comm> group;
  bool freed = false;
};

extern std::mutex g_comms_mu;
extern std::vector<CommEntry> g_comms;  // comm id -> one DevComm per device

// Registers one communicator (and one signature-check communicator) per
// local device index; returns its comm id. The sizes must agree.
int64_t RegisterComms(const std::vector<MPI_Comm>& comms,
                      const std::vector<MPI_Comm>& checks, int64_t key,
                      const std::vector<int64_t>& ordinals);
// Marks comm_id freed and unmaps its node-local segments.
void UnregisterComms(int64_t comm_id);
// Per local device: 0 node-local paths not set up yet, -1 unavailable, 1
// shared memory, 2 shared memory and cross-memory attach.
std::vector<int> NodePaths(int64_t comm_id);

// Sets up the all-reduce over every local device of every rank of comm_id
// (once; collective over `setup_comm`, a private communicator of the same
// ranks, from one thread of each rank): a node-local segment of
// `segment_bytes` per (rank, local device) and cross-memory attach between
// the ranks where allowed. Returns {state (1 ready, -1 unavailable: ranks on
// several nodes, no shared memory), segment bytes, cross-memory attach ok}.
// Throws std::runtime_error on an MPI failure.
std::vector<int64_t> SetupDeviceGroup(int64_t comm_id, MPI_Comm setup_comm,
                                      int64_t segment_bytes);

// The DevComm of (comm id, XLA device ordinal), or an error naming the fix.
ffi::ErrorOr<DevComm*> GetComm(int64_t comm_id, int64_t device);
// The DevComm of (communicator key, local device index), or nullptr.
DevComm* FindDev(int64_t key, int64_t device);

// Call sites: id -> "allreduce(float32[4], sum) at train.py:42", registered
// by Python at lowering time, and which local devices already checked them.
// "Checked" flags belong to a check slot, i.e. to a (signature,
// communicator) pair, not to the site text: whether a call is compared must
// depend only on what every rank agrees on (the sequence of signatures), never
// on per-rank compilation history (e.g. a program cached on one rank under
// another call site).
struct Site {
  std::string text;
  std::atomic<uint64_t>* checked = nullptr;  // bit d: device d compared it
};

// A slot < 0: a slot of its own (XLA's operations through the bridge, which
// are compared on every call).
int64_t RegisterSite(const std::string& text, int64_t slot);
std::string SiteText(int64_t site);
// Every registered site's text, indexed by site id (the timeline's legend).
std::vector<std::string> SiteTexts();
Site* GetSite(int64_t site);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_REGISTRY_H_

// XLA's communicators as mpijax knows them: every communicator XLA's CPU
// collectives split through the bridge becomes one mpijax communicator in the
// registry (core/registry.h), with a key every member rank agrees on, a
// private duplicate for signature checks, and a status the stall inspector
// reads and answers about. The calls XLA makes on it (collectives.h) run under
// the same guards as mpijax's own handlers.
#ifndef MPIJAX_XLA_COMMUNICATOR_H_
#define MPIJAX_XLA_COMMUNICATOR_H_

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/registry.h"

namespace mpijax::bridge {

// Keys of XLA's communicators: above any key mpijax's Python side assigns
// (a counter from 0), so the stall inspector tells the two apart.
constexpr int64_t kXlaKeyBase = int64_t{1} << 40;

struct XlaClique;  // members.h

// One communicator XLA holds (the `ext` of the bridge's struct bcomm): a
// split of its own (one device per process), or one member of a clique with
// several devices per process (`clique` set; members.h).
struct XlaComm {
  MPI_Comm comm = MPI_COMM_NULL;   // what the split made; XLA's traffic
  detail::DevComm* dc = nullptr;   // registered: status, check, node-local
  int64_t comm_id = -1;            // its index in the registry
  int64_t number = 0;              // 1 for XLA's first split, 2 ...
  int rank = 0, size = 0;
  std::string ranks;  // its members' ranks in the job, "0-3" or "0,2"

  // Each distinct operation (kind, dtype, count, op) gets a call site, named
  // again only when the programs that hold it changed (see SiteFor).
  struct Site {
    int64_t id = -1;
    uint64_t generation = 0;  // LabelGeneration() when named
    size_t programs = 0;      // ProgramCount() then: the newer ones are unseen
  };
  std::mutex sites_mu;
  std::unordered_map<uint64_t, Site> sites;
  std::atomic<uint64_t> last_sig{0};  // the last lookup, without the lock
  std::atomic<int64_t> last_site{-1};
  std::atomic<uint64_t> last_generation{0};
  // The node-local paths' state (dc->node) is used by one thread at a time.
  std::mutex node_mu;

  // Point-to-point operations (all-to-all, collective-permute) are made of
  // several MPI calls: the open operation's guard lives here (p2p.cc).
  void* p2p = nullptr;
  int pending = 0;  // requests posted and not yet waited for
  int sendrecvs = 0;  // MPI_Sendrecv calls of the open all-to-all
  // Its exchanges, posted and completed together at its last one.
  std::shared_ptr<void> exchanges;

  // A member: its clique, its place among this process's members, and its
  // local device index (for reports and the timeline).
  XlaClique* clique = nullptr;
  int slot = 0;
  int64_t device = 0;
  // How messages name it (empty: "XLA communicator #N (ranks ...)").
  std::string where;
  // Not empty: a communicator mpijax could not give XLA; every operation on
  // it fails with this text.
  std::string failed;
};

// The split of `base` (the job's communicator for XLA, or one XLA split)
// XLA asks for: collective over `base`; waits at most `timeout_s` for the
// other ranks first (then stops the job with the reason). *out is null for
// MPI_UNDEFINED. Returns an MPI error code.
int Split(MPI_Comm base, int world_rank, int world_size, double timeout_s,
          int color, int key, XlaComm** out);

// Frees `c` (after MPI is finalized: only forgets it).
int Free(XlaComm* c);

// Grows with every label and program added (xla_labels.py names each
// compiled program's collectives; operation.cc).
uint64_t LabelGeneration();

// Of the programs added after the first `since` (AddProgram), the newest
// that holds an operation filed under `key`: its fingerprint in *program and
// its text ("jit_f (f32[2,4])->f32[4]") in *text; false if none does.
// *count is the number of programs now.
bool NewestProgramSince(const std::string& key, size_t since, size_t* count,
                        uint64_t* program, std::string* text);

// The call site of signature `sig` on `c`, named with the text `describe()`
// makes, and named again once a program compiled since may hold it too.
// The first call of `sig` on `c` since a program holding it (by `key()`)
// was compiled gets that program in *program (its fingerprint) and
// *program_text; every other call leaves them alone.
int64_t SiteFor(XlaComm& c, uint64_t sig,
                const std::function<std::string()>& describe,
                const std::function<std::string()>& key, uint64_t* program,
                std::string* program_text);

}  // namespace mpijax::bridge

#endif  // MPIJAX_XLA_COMMUNICATOR_H_

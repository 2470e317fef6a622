#include "xla_collectives/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "base/common.h"
#include "node_local/node_local.h"
#include "core/settings.h"

namespace mpijax::bridge {
namespace {

std::mutex g_split_mu;     // one split at a time per process, in call order
int64_t g_splits = 0;      // splits so far: the same count on every rank

// "0-3", "0,2,5": the world ranks of `comm`'s members, for messages.
std::string WorldRanks(MPI_Comm comm, MPI_Comm world) {
  int n = CommSize(comm);
  std::vector<int> mine(n), theirs(n);
  for (int i = 0; i < n; ++i) mine[i] = i;
  MPI_Group g, wg;
  MPI_Comm_group(comm, &g);
  MPI_Comm_group(world, &wg);
  MPI_Group_translate_ranks(g, n, mine.data(), wg, theirs.data());
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  bool contiguous = true;
  for (int i = 1; i < n; ++i) contiguous &= theirs[i] == theirs[i - 1] + 1;
  if (contiguous && n > 2)
    return std::to_string(theirs[0]) + "-" + std::to_string(theirs[n - 1]);
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(theirs[i]);
  return s;
}

// Waits (polled) until every rank of `comm` has arrived, at most `timeout_s`
// (<= 0: no limit); past it, stops the job with what went wrong.
int ArriveOrAbort(MPI_Comm comm, int world_rank, int world_size,
                  double timeout_s, int color) {
  if (timeout_s <= 0) return MPI_SUCCESS;
  MPI_Request req;
  int rc = MPI_Ibarrier(comm, &req);
  if (rc != MPI_SUCCESS) return rc;
  auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    int done = 0;
    rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    double waited = std::chrono::duration<double>(
        std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s) {
      std::fprintf(stderr,
          "mpijax: rank %d of %d waited %.0f s for the other ranks to create "
          "a communicator for XLA's MPI collectives (MPI_Comm_split of all "
          "ranks, for the devices from %d on). XLA makes it at the first "
          "collective of each device group, on every process: every rank must "
          "run the same jitted programs in the same order, and a jitted "
          "program over the devices of some processes only cannot use XLA's "
          "MPI collectives (set MPIJAX_XLA_COLLECTIVES=gloo). Raise the wait "
          "with MPIJAX_TIMEOUT. Stopping the job.\n",
          world_rank, world_size, waited, color);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
}

// Maps the node-local segments of a new communicator (collective: right
// after the split, where every member is), so that every later call knows
// its path without another collective; any failure leaves MPI's paths.
void SetUpNode(XlaComm& c) {
  const auto& s = detail::g_settings;
  int64_t shm_max = s.shm_max_bytes.load();
  node_local::Comm& node = c.dc->node;
  if (c.size < 2 || (shm_max <= 0 && s.cma_min_bytes.load() <= 0)) {
    node.state = -1;
    return;
  }
  node.limits.shm_max_bytes = shm_max;
  node.limits.cma_min_bytes = s.cma_min_bytes.load();
  node.limits.timeout_s = s.timeout_s.load();
  node.limits.wait_spin_s = s.wait_spin_s.load();
  node_local::Caller caller;
  bool ready = false;
  node_local::Status st = node_local::Ready(
      node, caller, std::max<int64_t>(shm_max, 4096), &ready);
  if (!st.ok()) {
    std::fprintf(stderr,
                 "mpijax: XLA communicator #%lld keeps to MPI: setting up its "
                 "node-local paths failed: %s\n",
                 static_cast<long long>(c.number), st.message.c_str());
    node.state = -1;
  }
}

}  // namespace

int Split(MPI_Comm base, int world_rank, int world_size, double timeout_s,
          int color, int key, XlaComm** out) {
  std::lock_guard<std::mutex> lock(g_split_mu);
  *out = nullptr;
  int rc = ArriveOrAbort(base, world_rank, world_size, timeout_s, color);
  if (rc != MPI_SUCCESS) return rc;
  MPI_Comm made = MPI_COMM_NULL;
  rc = MPI_Comm_split(base, color < 0 ? MPI_UNDEFINED : color, key, &made);
  int64_t number = ++g_splits;  // counted on every rank, member or not
  if (rc != MPI_SUCCESS || made == MPI_COMM_NULL) return rc;
  // Signature checks and mismatch reports travel on a duplicate, so they
  // can never pair with XLA's own traffic.
  MPI_Comm check = MPI_COMM_NULL;
  rc = MPI_Comm_dup(made, &check);
  if (rc != MPI_SUCCESS) return rc;
  MPI_Comm_set_name(made, "mpijax-xla-split");
  auto* c = new XlaComm;
  c->comm = made;
  c->number = number;
  c->rank = CommRank(made);
  c->size = CommSize(made);
  c->ranks = WorldRanks(made, base);
  c->comm_id = detail::RegisterComms({made}, {check}, kXlaKeyBase + number,
                                     {0});
  {
    std::lock_guard<std::mutex> reg(detail::g_comms_mu);
    c->dc = detail::g_comms[c->comm_id].devs[0].get();
  }
  c->dc->label = "XLA communicator #" + std::to_string(number) + " (ranks " +
                 c->ranks + ")";
  SetUpNode(*c);
  *out = c;
  return MPI_SUCCESS;
}

int Free(XlaComm* c) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  int rc = MPI_SUCCESS;
  // Unmaps its node-local segments; the status stays for the inspector.
  detail::UnregisterComms(c->comm_id);
  if (!finalized) {
    MPI_Comm check = c->dc->check;
    rc = MPI_Comm_free(&c->comm);
    if (check != MPI_COMM_NULL) MPI_Comm_free(&check);
  }
  delete c;
  return rc;
}

int64_t SiteFor(XlaComm& c, uint64_t sig,
                const std::function<std::string()>& describe,
                const std::function<std::string()>& key, uint64_t* program,
                std::string* program_text) {
  // A program repeats its operations: usually the same as last time. The
  // fields are read racily (two threads of one process share a communicator
  // only with several local devices): a torn read misses the cache, or at
  // worst names one call as the site did before the last program compiled.
  uint64_t generation = LabelGeneration();
  if (c.last_sig.load(std::memory_order_acquire) == sig) {
    int64_t site = c.last_site.load(std::memory_order_acquire);
    if (c.last_generation.load(std::memory_order_acquire) == generation &&
        c.last_sig.load(std::memory_order_acquire) == sig && site >= 0)
      return site;
  }
  std::lock_guard<std::mutex> lock(c.sites_mu);
  XlaComm::Site& site = c.sites[sig];
  if (site.id < 0 || site.generation != generation) {
    // A program compiled since may hold this operation too (init()'s
    // warm-up of the communicators runs before the user's programs).
    std::string text = describe();
    if (site.id < 0 || text != detail::SiteText(site.id))
      site.id = detail::RegisterSite(text, -1);
    site.generation = generation;
    // This call is the first of the operation since the newest program
    // holding it was compiled: its first run (with inline dispatch a rank
    // compiles a program only after the last one it ran has finished).
    size_t count = 0;
    NewestProgramSince(key(), site.programs, &count, program, program_text);
    site.programs = count;
  }
  c.last_sig.store(0, std::memory_order_release);
  c.last_site.store(site.id, std::memory_order_release);
  c.last_generation.store(generation, std::memory_order_release);
  c.last_sig.store(sig, std::memory_order_release);
  return site.id;
}

}  // namespace mpijax::bridge

#include "xla_collectives/members.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>

#include "base/common.h"
#include "core/registry.h"

namespace mpijax::bridge {
namespace {

// MPI_Comm_create_group's tag and the handshake's (on XLA's world).
constexpr int kCreateTag = 0x4d4a;
constexpr int kHandshakeTag = 0x4d4b;

MPI_Comm g_world = MPI_COMM_NULL;
double g_timeout_s = 0;
std::atomic<bool> g_enabled{false};
std::atomic<int> g_local_devices{1};

std::mutex g_prepare_mu;  // one preparation at a time, in call order
std::mutex g_mu;          // the tables below
std::vector<std::unique_ptr<XlaClique>> g_cliques;
std::map<std::vector<int64_t>, int64_t> g_ids;  // devices -> clique id
std::vector<int64_t> g_expected;
std::vector<std::unique_ptr<XlaComm>> g_failed;  // kept: XLA holds them

// "0-3", "0,2": job ranks, for messages.
std::string RankList(const std::vector<int>& r) {
  bool contiguous = r.size() > 2;
  for (size_t i = 1; i < r.size(); ++i) contiguous &= r[i] == r[i - 1] + 1;
  if (contiguous)
    return std::to_string(r.front()) + "-" + std::to_string(r.back());
  std::string s;
  for (size_t i = 0; i < r.size(); ++i) s += (i ? "," : "") + std::to_string(r[i]);
  return s;
}

// A key every process of the clique computes alike (the stall inspector asks
// for it): above L=1's split numbers, from the clique's devices.
int64_t KeyOf(const std::vector<int64_t>& devices) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int64_t d : devices) {
    for (int i = 0; i < 8; ++i) {
      h ^= (static_cast<uint64_t>(d) >> (8 * i)) & 0xff;
      h *= 0x100000001b3ULL;
    }
  }
  constexpr int64_t kMembersBase = kXlaKeyBase + (int64_t{1} << 39);
  return kMembersBase + static_cast<int64_t>(h & ((uint64_t{1} << 39) - 1));
}

// Waits (polled) until every other process of `procs` has reached the same
// preparation, at most g_timeout_s; past it, stops the job with the reason
// (MPI_Comm_create_group itself would wait forever).
void Handshake(const std::vector<int>& procs, int my_world,
               const std::string& name) {
  std::vector<MPI_Request> reqs;
  std::vector<int> in(procs.size()), out(procs.size(), 1);
  for (size_t i = 0; i < procs.size(); ++i) {
    if (procs[i] == my_world) continue;
    reqs.emplace_back();
    MPI_Irecv(&in[i], 1, MPI_INT, procs[i], kHandshakeTag, g_world,
              &reqs.back());
    reqs.emplace_back();
    MPI_Isend(&out[i], 1, MPI_INT, procs[i], kHandshakeTag, g_world,
              &reqs.back());
  }
  auto start = Clock::now();
  for (int spins = 0;; ++spins) {
    int done = 0;
    MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done,
                MPI_STATUSES_IGNORE);
    if (done) return;
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    double waited =
        std::chrono::duration<double>(Clock::now() - start).count();
    if (g_timeout_s > 0 && waited > g_timeout_s) {
      std::fprintf(stderr,
          "mpijax: rank %d waited %.0f s for ranks %s to prepare the "
          "communicator of XLA's collectives over %s. mpijax prepares them "
          "when each process compiles a program: every rank must compile the "
          "same jitted programs, in the same order. Raise the wait with "
          "MPIJAX_TIMEOUT. Stopping the job.\n",
          my_world, waited, RankList(procs).c_str(), name.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
}

XlaComm* Failed(int key, const std::string& why) {
  auto c = std::make_unique<XlaComm>();
  c->rank = key;
  c->size = key + 1;
  c->failed = why;
  XlaComm* out = c.get();
  g_failed.push_back(std::move(c));
  return out;
}

}  // namespace

void SetMembersWorld(MPI_Comm world, double timeout_s) {
  g_world = world;
  g_timeout_s = timeout_s;
}

void EnableMembers(int local_devices) {
  g_local_devices.store(std::max(local_devices, 1));
  g_enabled.store(true);
}
bool MembersEnabled() { return g_enabled.load(std::memory_order_relaxed); }

int64_t PrepareClique(const std::vector<int64_t>& devices,
                      const std::vector<int>& world,
                      const std::vector<int>& local) {
  std::lock_guard<std::mutex> prepare(g_prepare_mu);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_ids.find(devices);
    if (it != g_ids.end())
      return g_cliques[it->second]->me >= 0 ? it->second : -1;
  }
  auto q = std::make_unique<XlaClique>();
  q->devices = devices;
  q->world = world;
  q->local = local;
  q->n = static_cast<int>(devices.size());
  std::vector<int> procs = world;
  std::sort(procs.begin(), procs.end());
  procs.erase(std::unique(procs.begin(), procs.end()), procs.end());
  int my_world = CommRank(g_world);
  q->members_of.assign(procs.size(), {});
  q->proc.assign(q->n, 0);
  q->slot.assign(q->n, 0);
  for (int k = 0; k < q->n; ++k) {
    int p = static_cast<int>(std::lower_bound(procs.begin(), procs.end(),
                                              world[k]) - procs.begin());
    q->proc[k] = p;
    q->slot[k] = static_cast<int>(q->members_of[p].size());
    q->members_of[p].push_back(k);
  }
  for (const auto& m : q->members_of) {
    q->slots_max = std::max(q->slots_max, static_cast<int>(m.size()));
    q->uniform &= m.size() == q->members_of[0].size();
  }
  auto mine = std::find(procs.begin(), procs.end(), my_world);
  q->me = mine == procs.end() ? -1 : static_cast<int>(mine - procs.begin());
  q->name = "devices ";
  for (int k = 0; k < q->n; ++k)
    q->name += (k ? "," : "") + std::to_string(devices[k]);
  q->name += procs.size() > 1 ? " on ranks " + RankList(procs)
                              : " on rank " + std::to_string(procs[0]);
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    id = static_cast<int64_t>(g_cliques.size());
    g_ids[devices] = id;
    g_cliques.push_back(nullptr);
  }
  if (q->me < 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_cliques[id] = std::move(q);
    return -1;
  }
  // The clique's own communicators: its processes only.
  if (procs.size() > 1) {
    Handshake(procs, my_world, q->name);
    MPI_Group wg, g;
    MPI_Comm_group(g_world, &wg);
    MPI_Group_incl(wg, static_cast<int>(procs.size()), procs.data(), &g);
    int rc = MPI_Comm_create_group(g_world, g, kCreateTag, &q->comm);
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    if (rc != MPI_SUCCESS || q->comm == MPI_COMM_NULL) {
      std::fprintf(stderr, "mpijax: rank %d: MPI_Comm_create_group failed "
                   "for XLA's communicator over %s. Stopping the job.\n",
                   my_world, q->name.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  } else {
    MPI_Comm_dup(MPI_COMM_SELF, &q->comm);
  }
  MPI_Comm_dup(q->comm, &q->check);
  MPI_Comm_set_name(q->comm, "mpijax-xla-members");
  q->key = KeyOf(devices);
  // One DevComm per local device (by local device index), as the stall
  // inspector and the timeline know devices; this process's members use
  // theirs.
  int local_devices = g_local_devices.load();
  for (int k = 0; k < q->n; ++k)
    if (world[k] == my_world) local_devices = std::max(local_devices, local[k] + 1);
  std::vector<int64_t> ordinals(local_devices);
  for (int d = 0; d < local_devices; ++d) ordinals[d] = d;
  q->comm_id = detail::RegisterComms(
      std::vector<MPI_Comm>(local_devices, q->comm),
      std::vector<MPI_Comm>(local_devices, q->check), q->key, ordinals);
  const auto& my_members = q->members_of[q->me];
  q->group.Init(static_cast<int>(my_members.size()));
  q->mail.Init(static_cast<int>(my_members.size()));
  q->taken.assign(my_members.size(), false);
  for (size_t s = 0; s < my_members.size(); ++s) {
    int k = my_members[s];
    detail::DevComm* dc;
    {
      std::lock_guard<std::mutex> reg(detail::g_comms_mu);
      dc = detail::g_comms[q->comm_id].devs[local[k]].get();
    }
    dc->label = "XLA communicator of " + q->name;
    for (int j = 0; j < q->n; ++j)
      if (j != k) dc->peers.push_back({world[j], local[j]});
    auto h = std::make_unique<XlaComm>();
    h->comm = q->comm;
    h->dc = dc;
    h->comm_id = q->comm_id;
    h->rank = k;
    h->size = q->n;
    h->ranks = RankList(procs);
    h->clique = q.get();
    h->slot = static_cast<int>(s);
    h->device = local[k];
    h->where = "XLA communicator of " + q->name;
    q->handles.push_back(std::move(h));
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_cliques[id] = std::move(q);
  return id;
}

void ExpectCliques(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_expected = ids;
}

XlaComm* TakeMember(int color, int key) {
  std::lock_guard<std::mutex> lock(g_mu);
  int my_world = CommRank(g_world);
  auto fits = [&](const XlaClique* q) {
    return q != nullptr && q->me >= 0 && key >= 0 && key < q->n &&
           q->devices[0] == color && q->world[key] == my_world &&
           !q->taken[q->slot[key]];
  };
  auto take = [&](XlaClique* q) {
    q->taken[q->slot[key]] = true;
    return q->handles[q->slot[key]].get();
  };
  for (int64_t id : g_expected)
    if (id >= 0 && fits(g_cliques[id].get())) return take(g_cliques[id].get());
  XlaClique* only = nullptr;
  int fitting = 0;
  for (auto& q : g_cliques) {
    if (fits(q.get())) {
      only = q.get();
      ++fitting;
    }
  }
  if (fitting == 1) return take(only);
  std::string why =
      "mpijax: XLA asked for a communicator (MPI_Comm_split color " +
      std::to_string(color) + ", key " + std::to_string(key) + ") that " +
      (fitting == 0 ? std::string("mpijax did not prepare")
                    : std::to_string(fitting) +
                          " prepared communicators fit, and nothing tells "
                          "them apart") +
      ". mpijax prepares XLA's communicators from each compiled program "
      "with several devices per process; this program's collectives were "
      "not read right. Please report it; MPIJAX_XLA_COLLECTIVES=gloo avoids "
      "it.";
  std::fprintf(stderr, "%s\n", why.c_str());
  std::fflush(stderr);
  return Failed(key, why);
}

int FreeMember(XlaComm* c) {
  // XLA drops its communicators with its backend; the clique's stay for the
  // process's life (the stall inspector may still name them).
  if (c->clique != nullptr) ++c->clique->freed;
  return MPI_SUCCESS;
}

bool MemberReportsStall(XlaComm& c) {
  XlaClique& q = *c.clique;
  int64_t call = c.dc->status.calls.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(q.stall_mu);
  if (q.stall_call != call) {
    q.stall_call = call;
    q.stall_slot = c.slot;
  }
  return q.stall_slot == c.slot;
}

}  // namespace mpijax::bridge

#include "core/registry.h"

#include <stdexcept>

namespace mpijax::detail {

std::mutex g_comms_mu;
std::vector<CommEntry> g_comms;

namespace {
std::mutex g_sites_mu;
std::deque<Site> g_sites;
std::deque<std::atomic<uint64_t>> g_check_slots;  // stable addresses

// The rank in MPI_COMM_WORLD of c's rank 0.
int64_t LeaderOf(MPI_Comm c) {
  MPI_Group g, wg;
  int zero = 0, world = MPI_UNDEFINED;
  MPI_Comm_group(c, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  MPI_Group_translate_ranks(g, 1, &zero, wg, &world);
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  return world == MPI_UNDEFINED ? -1 : world;
}
}  // namespace

int64_t RegisterComms(const std::vector<MPI_Comm>& comms,
                      const std::vector<MPI_Comm>& checks, int64_t key,
                      const std::vector<int64_t>& ordinals) {
  CommEntry entry;
  entry.key = key;
  entry.ordinals = ordinals;
  for (size_t i = 0; i < comms.size(); ++i) {
    auto dev = std::make_unique<DevComm>();
    dev->comm = comms[i];
    dev->check = checks[i];
    dev->node.comm = comms[i];
    dev->key = key;
    dev->local_devices = static_cast<int>(comms.size());
    dev->index = static_cast<int64_t>(i);
    dev->leader = LeaderOf(comms[i]);
    // Errors become ffi::Error (a Python exception), never an abort.
    MPI_Comm_set_errhandler(dev->comm, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(dev->check, MPI_ERRORS_RETURN);
    entry.devs.push_back(std::move(dev));
  }
  std::lock_guard<std::mutex> lock(g_comms_mu);
  g_comms.push_back(std::move(entry));
  return static_cast<int64_t>(g_comms.size() - 1);
}

void UnregisterComms(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  if (comm_id >= 0 && comm_id < static_cast<int64_t>(g_comms.size())) {
    // Later calls fail cleanly, never use freed comms; the DevComms stay
    // allocated so the responder thread never reads freed memory.
    g_comms[comm_id].freed = true;
    for (auto& dev : g_comms[comm_id].devs) {
      dev->node.Release();
      dev->group.Release();
    }
    if (g_comms[comm_id].group) g_comms[comm_id].group->Release();
  }
}

std::vector<int> NodePaths(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  std::vector<int> out;
  if (comm_id >= 0 && comm_id < static_cast<int64_t>(g_comms.size())) {
    for (auto& dev : g_comms[comm_id].devs) {
      const node_local::Comm& n = dev->node;
      out.push_back(n.state == 1 ? 1 + n.cma_ok : n.state);
    }
  }
  return out;
}

std::vector<int64_t> SetupDeviceGroup(int64_t comm_id, MPI_Comm setup_comm,
                                      int64_t segment_bytes) {
  node_local::Comm* group = nullptr;
  int slots = 0;
  {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    if (comm_id < 0 || comm_id >= static_cast<int64_t>(g_comms.size()) ||
        g_comms[comm_id].freed)
      throw std::runtime_error("setup_device_group: unknown or freed "
                               "communicator id " + std::to_string(comm_id));
    group = g_comms[comm_id].group.get();
    slots = static_cast<int>(g_comms[comm_id].devs.size());
  }
  if (group == nullptr) {
    // Collective; not under the lock, which the handlers take.
    auto owner = std::make_unique<node_local::Comm>(setup_comm);
    node_local::Caller caller;
    bool ready = false;
    node_local::Status s = node_local::Ready(*owner, caller, segment_bytes,
                                             slots, &ready);
    if (!s.ok()) throw std::runtime_error(s.message);
    std::lock_guard<std::mutex> lock(g_comms_mu);
    CommEntry& e = g_comms[comm_id];
    for (int d = 0; ready && d < slots; ++d)
      node_local::View(e.devs[d]->group, *owner, d);
    e.group = std::move(owner);
    group = e.group.get();
  }
  return {group->state,
          group->state == 1 ? static_cast<int64_t>(group->segment_bytes()) : 0,
          group->cma_ok ? 1 : 0};
}

ffi::ErrorOr<DevComm*> GetComm(int64_t comm_id, int64_t device) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  if (comm_id < 0 || comm_id >= static_cast<int64_t>(g_comms.size())) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: unknown communicator id " + std::to_string(comm_id) +
        " (was the program compiled in another process?)"));
  }
  const auto& entry = g_comms[comm_id];
  if (entry.freed) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: communicator " + std::to_string(comm_id) +
        " was freed by mpijax.shutdown(); this compiled program is stale. "
        "Call jax.clear_caches() after re-running mpijax.init()."));
  }
  int64_t n = static_cast<int64_t>(entry.devs.size());
  if (device >= 0 && device < n && entry.ordinals[device] == device)
    return entry.devs[device].get();  // the usual case: ordinal = local index
  for (int64_t i = 0; i < n; ++i) {
    if (entry.ordinals[i] == device) return entry.devs[i].get();
  }
  return ffi::Unexpected(ffi::Error::InvalidArgument(
      "mpijax: local device ordinal " + std::to_string(device) +
      " has no sub-communicator; communicator " + std::to_string(comm_id) +
      " was registered for " + std::to_string(entry.devs.size()) +
      " local devices. Call mpijax.init() after setting the number of "
      "local devices."));
}

DevComm* FindDev(int64_t key, int64_t device) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  for (auto& e : g_comms) {
    if (e.key == key && !e.freed && device >= 0 &&
        device < static_cast<int64_t>(e.devs.size()))
      return e.devs[device].get();
  }
  return nullptr;
}

int64_t RegisterSite(const std::string& text, int64_t slot) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  if (slot < 0) slot = static_cast<int64_t>(g_check_slots.size());
  while (static_cast<int64_t>(g_check_slots.size()) <= slot)
    g_check_slots.emplace_back(0);
  g_sites.emplace_back();
  g_sites.back().text = text;
  g_sites.back().checked = &g_check_slots[slot];
  return static_cast<int64_t>(g_sites.size() - 1);
}

std::string SiteText(int64_t site) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  if (site < 0 || site >= static_cast<int64_t>(g_sites.size()))
    return "an unknown operation";
  return g_sites[site].text;
}

std::vector<std::string> SiteTexts() {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  std::vector<std::string> texts;
  texts.reserve(g_sites.size());
  for (const Site& s : g_sites) texts.push_back(s.text);
  return texts;
}

Site* GetSite(int64_t site) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  if (site < 0 || site >= static_cast<int64_t>(g_sites.size())) return nullptr;
  return &g_sites[site];
}

}  // namespace mpijax::detail

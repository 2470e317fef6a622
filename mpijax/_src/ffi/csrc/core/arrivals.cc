#include "core/arrivals.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace mpijax::detail {

namespace {
std::mutex g_arrivals_drain_mu;  // one drain at a time; guards `drained`
}  // namespace

ArrivalRing* NewArrivalRing(DevComm* dc, int64_t comm_size) {
  auto* made = new ArrivalRing;
  made->comm_size = comm_size;
  ArrivalRing* expected = nullptr;
  if (!dc->arrivals.compare_exchange_strong(expected, made,
                                            std::memory_order_acq_rel)) {
    delete made;
    return expected;
  }
  return made;
}

std::string DrainArrivals() {
  std::lock_guard<std::mutex> lock(g_arrivals_drain_mu);
  std::vector<DevComm*> devs;
  {
    std::lock_guard<std::mutex> comms(g_comms_mu);
    for (auto& e : g_comms)
      for (auto& d : e.devs)
        if (d->arrivals.load(std::memory_order_acquire) != nullptr)
          devs.push_back(d.get());
  }
  std::vector<int64_t> rows;
  std::vector<std::pair<int64_t, int64_t>> got;
  for (DevComm* dc : devs) {
    ArrivalRing* r = dc->arrivals.load(std::memory_order_acquire);
    got.clear();
    for (ArrivalRing::Slot& s : r->slots) {
      int64_t a = s.seq.load(std::memory_order_acquire);
      if (a <= r->drained) continue;
      int64_t ns = s.ns.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.seq.load(std::memory_order_relaxed) != a) continue;  // rewritten
      got.emplace_back(a, ns);
    }
    if (got.empty()) continue;
    std::sort(got.begin(), got.end());
    r->drained = got.back().first;
    int64_t per_device = dc->peers.empty() ? 1 : 0;
    for (const auto& [seq, ns] : got) {
      for (int64_t v : {dc->key, dc->leader, dc->index, per_device,
                        r->comm_size, seq, ns})
        rows.push_back(v);
    }
  }
  return std::string(reinterpret_cast<const char*>(rows.data()),
                     rows.size() * sizeof(int64_t));
}

}  // namespace mpijax::detail

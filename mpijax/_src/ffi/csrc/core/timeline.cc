#include "core/timeline.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <thread>

namespace mpijax::detail {

std::atomic<int> g_recording{0};

namespace {

// A seqlock slot: `stamp` is the event's index + 1 once written, 0 while a
// writer fills it, so the drain can tell a complete event from one being
// overwritten.
struct Slot {
  std::atomic<uint64_t> stamp{0};
  TimelineEvent ev;
};

// Allocated once and never freed: a handler still recording after the
// timeline was turned off keeps writing into valid memory.
std::atomic<Slot*> g_ring{nullptr};
uint64_t g_capacity = 0;  // a power of two; set before g_ring is published
std::atomic<uint64_t> g_next{0};  // index of the next event to write

std::mutex g_drain_mu;  // one drain at a time; also guards g_drained
uint64_t g_drained = 0;  // index of the next event to drain

}  // namespace

void TimelineScope::Record() {
  Slot* ring = g_ring.load(std::memory_order_acquire);
  if (ring == nullptr) return;
  TimelineEvent ev;
  ev.name = info_.name;
  ev.dtype = static_cast<int>(info_.dtype);
  ev.ndim = info_.bytes >= 0 ? -1 : static_cast<int>(info_.dims.size());
  ev.path = info_.path != 0 ? info_.path : kPathMpi;
  int64_t elems = 1;
  for (size_t i = 0; i < info_.dims.size(); ++i) {
    elems *= info_.dims[i];
    if (i < kTimelineMaxDims) ev.dims[i] = info_.dims[i];
  }
  ev.bytes = info_.bytes >= 0
                 ? info_.bytes
                 : elems * static_cast<int64_t>(ffi::ByteWidth(info_.dtype));
  ev.site = info_.site;
  ev.key = info_.dc != nullptr ? info_.dc->key : -1;
  ev.device = info_.device;
  ev.comm_size = info_.comm_size;
  ev.seq = seq_;
  ev.enter_ns = enter_ns_;
  ev.exit_ns = NowNs();
  uint64_t i = g_next.fetch_add(1, std::memory_order_relaxed);
  Slot& s = ring[i & (g_capacity - 1)];
  s.stamp.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.ev = ev;
  s.stamp.store(i + 1, std::memory_order_release);
}

void TimelineStart(int64_t capacity) {
  std::lock_guard<std::mutex> lock(g_drain_mu);
  if (g_ring.load() == nullptr) {
    uint64_t n = 1024;
    while (n < static_cast<uint64_t>(std::max<int64_t>(capacity, 1))) n <<= 1;
    g_capacity = n;
    g_ring.store(new Slot[n], std::memory_order_release);
  }
  g_drained = g_next.load();  // events from before this start are not wanted
  g_recording.fetch_or(kRecordTimeline, std::memory_order_release);
}

void TimelineStop() {
  g_recording.fetch_and(~kRecordTimeline, std::memory_order_release);
}

void ArrivalsRecord(bool on) {
  if (on) {
    g_recording.fetch_or(kRecordArrivals, std::memory_order_release);
  } else {
    g_recording.fetch_and(~kRecordArrivals, std::memory_order_release);
  }
}

std::vector<TimelineEvent> TimelineDrain(int64_t* lost) {
  std::lock_guard<std::mutex> lock(g_drain_mu);
  std::vector<TimelineEvent> out;
  *lost = 0;
  Slot* ring = g_ring.load(std::memory_order_acquire);
  if (ring == nullptr) return out;
  uint64_t end = g_next.load(std::memory_order_acquire);
  uint64_t start = std::max(g_drained, end > g_capacity ? end - g_capacity : 0);
  *lost += static_cast<int64_t>(start - g_drained);
  out.reserve(end - start);
  uint64_t i = start;
  for (; i < end; ++i) {
    Slot& s = ring[i & (g_capacity - 1)];
    uint64_t stamp = s.stamp.load(std::memory_order_acquire);
    // A writer that took index i is a few stores from done: wait briefly.
    for (int spin = 0; stamp < i + 1 && spin < 100000; ++spin) {
      std::this_thread::yield();
      stamp = s.stamp.load(std::memory_order_acquire);
    }
    if (stamp < i + 1) break;  // still unwritten: the next drain takes it
    TimelineEvent ev = s.ev;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (stamp != i + 1 || s.stamp.load(std::memory_order_relaxed) != stamp) {
      ++*lost;  // overwritten by a newer event
      continue;
    }
    out.push_back(ev);
  }
  g_drained = i;
  return out;
}

}  // namespace mpijax::detail

// The collective timeline: when on (MPIJAX_TIMELINE), every handler call
// leaves one event (enter and exit times, what it moved, the path it took,
// its place in its communicator's sequence of collectives) in a fixed-size,
// lock-free ring that Python drains (mpijax/_src/timeline.py). The straggler
// report's arrival stamps (arrivals.h) are taken here too. With both off, a
// call pays one relaxed atomic load and a counter increment.
#ifndef MPIJAX_FFI_TIMELINE_H_
#define MPIJAX_FFI_TIMELINE_H_

#include <atomic>
#include <cstdint>
#include <vector>

#include "core/arrivals.h"
#include "core/call.h"
#include "base/common.h"

namespace mpijax::detail {

// Paths a call took (bits: an allreduce_many may take several).
enum : int {
  kPathMpi = 1,   // MPI's own collective
  kPathRing = 2,  // mpijax's ring over MPI point-to-point
  kPathShm = 4,   // node-local shared memory
  kPathCma = 8,   // cross-memory attach
};

constexpr int kTimelineMaxDims = 6;

// One call as Python reads it.
struct TimelineEvent {
  const char* name;   // static text, e.g. "allreduce"
  int dtype;          // ffi::DataType
  int ndim;           // dims beyond kTimelineMaxDims are not kept; -1:
                      // several arrays (allreduce_many: the site names them)
  int path;           // kPath* bits, 0 when the call moved nothing
  int64_t dims[kTimelineMaxDims];
  int64_t bytes;      // this rank's operand bytes
  int64_t site;
  int64_t key;        // the communicator's key, agreed by its ranks
  int64_t device;     // local device index
  int64_t comm_size;  // ranks of the communicator
  int64_t seq;        // collective number on (key, device); -1: point-to-point
  int64_t enter_ns;   // NowNs()
  int64_t exit_ns;
};

// What the calls record (bits): the timeline's events, the straggler
// report's arrival stamps. One load tells a call both.
enum : int { kRecordTimeline = 1, kRecordArrivals = 2 };
extern std::atomic<int> g_recording;

// Marks one handler call: stamps entry when the timeline or the straggler
// report is on, records a collective's arrival for the report at once and,
// at the end of the scope, the timeline's event. `seq` numbers the
// collectives of (communicator, device) whether or not anything records, so
// the k-th call pairs across ranks even when ranks turned recording on at
// different calls.
class TimelineScope {
 public:
  TimelineScope(const CallInfo& info, bool collective)
      : info_(info),
        seq_(collective ? static_cast<int64_t>(info.dc->coll_seq++) : -1),
        what_(g_recording.load(std::memory_order_relaxed)),
        enter_ns_(what_ != 0 ? NowNs() : 0) {
    if ((what_ & kRecordArrivals) && seq_ >= 0)
      RecordArrival(info.dc, seq_, enter_ns_, info.comm_size);
  }
  ~TimelineScope() {
    if (what_ & kRecordTimeline) Record();
  }
  TimelineScope(const TimelineScope&) = delete;
  TimelineScope& operator=(const TimelineScope&) = delete;

 private:
  void Record();
  const CallInfo& info_;
  int64_t seq_;
  int what_;
  int64_t enter_ns_;
};

// Turns recording on with a ring of `capacity` events (kept when already
// allocated with that capacity); events older than the last `capacity` not
// yet drained are lost and counted.
void TimelineStart(int64_t capacity);
void TimelineStop();
// The events recorded since the last drain, oldest first, and how many were
// lost (overwritten before they were drained).
std::vector<TimelineEvent> TimelineDrain(int64_t* lost);
// Turns the straggler report's arrival stamps on or off.
void ArrivalsRecord(bool on);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_TIMELINE_H_

// The stall inspector: no wait hangs silently. Each process runs one
// responder thread on a private clone of the runtime's communicator; it polls
// for status queries (MPI_Iprobe, then sleeps, so it costs nothing
// measurable) and answers with what its (communicator, device) is doing. A
// rank whose wait passes MPIJAX_TIMEOUT asks the other ranks of the op's
// communicator and prints who has not arrived (ReportStall). Blocking MPI
// calls cannot poll their own deadline: a watchdog thread watches them.
#ifndef MPIJAX_FFI_INSPECTOR_H_
#define MPIJAX_FFI_INSPECTOR_H_

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "core/call.h"
#include "base/common.h"
#include "core/registry.h"

namespace mpijax::detail {

// Starts the responder and watchdog threads on `comm` (a private communicator
// spanning the job); false if they run already or MPI's thread level is
// below MPI_THREAD_MULTIPLE.
bool StartInspector(MPI_Comm comm);
// Stops and joins both threads (before their communicator is freed).
void StopInspector();

// "<calls> <phase> <activity> <human text>" for (key, device), as sent to an
// asker.
std::string DescribeStatus(int64_t key, int64_t device);

// Where this process's Python main thread is ("stall.py:19 in <module>:
// time.sleep(600)"), added to the answers of a rank that is not in the
// asked-about call; the function returns "" when it cannot tell in time.
void SetPythonPlace(std::function<std::string()> place);

// What this process does that a rank waiting for it should know of (set by
// the compile hook): kActivityCompiling a program, kActivityWaitingCompile for
// another rank's compile of one; kActivityNone: neither. `text` says which
// program ("compiling jit_step"). A collective that waits for ranks doing
// either says so and keeps waiting: a compile is progress, not a stall.
constexpr int kActivityNone = 0, kActivityCompiling = 1, kActivityWaitingCompile = 2;
void SetActivity(int kind, std::string text);

// Asks every other rank of the stalled op's communicator for its status,
// prints the report on stderr, then ends the job (MPIJAX_STALL_ACTION=abort)
// or returns so the caller keeps waiting (warn, or ranks that compile).
void ReportStall(const CallInfo& info, double waited);

// Whether the watchdog guards blocking calls (see ChooseBlocking).
extern std::atomic<bool> g_watchdog_running;

// Marks a (communicator, device) as inside a blocking call for the watchdog.
struct BlockingMark {
  DevComm* dc;
  explicit BlockingMark(DevComm* d) : dc(d) {
    if (dc) dc->status.blocking_since_ns.store(NowNs(), std::memory_order_relaxed);
  }
  ~BlockingMark() {
    if (dc) dc->status.blocking_since_ns.store(0, std::memory_order_relaxed);
  }
};

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_INSPECTOR_H_

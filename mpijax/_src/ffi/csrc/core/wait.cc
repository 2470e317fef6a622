#include "core/wait.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <thread>

#include "base/idle.h"
#include "core/settings.h"

namespace mpijax::detail {
namespace {

// Without the watchdog a blocking call must first check that every rank has
// arrived (a polled MPI_Ibarrier round trip), which only pays off from here.
constexpr int64_t kUnwatchedBlockingMinBytes = int64_t{64} << 10;

// The deadline of one polled wait. Check() (called every few polls: reading
// the clock on every poll would cost more than a small message) does nothing
// without a timeout; past it, see WaitAll.
class StallClock {
 public:
  explicit StallClock(const CallInfo& info)
      : info_(info),
        timeout_(g_settings.timeout_s.load(std::memory_order_relaxed)),
        period_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(timeout_ > 0 ? timeout_ : 0))),
        start_(Clock::now()),
        deadline_(start_ + period_) {}

  ffi::Error Check() {
    if (timeout_ <= 0) return ffi::Error::Success();
    auto now = Clock::now();
    if (now <= deadline_) return ffi::Error::Success();
    if (info_.dc == nullptr) {
      std::ostringstream s;
      s << info_.Describe() << " timed out: not complete after " << timeout_
        << " s (MPIJAX_TIMEOUT).";
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, s.str());
    }
    ReportStall(info_, std::chrono::duration<double>(now - start_).count());
    deadline_ = Clock::now() + period_;
    return ffi::Error::Success();
  }

 private:
  const CallInfo& info_;
  double timeout_;
  Clock::duration period_;
  Clock::time_point start_, deadline_;
};

}  // namespace

ffi::Error WaitAll(int n, MPI_Request* reqs, const CallInfo& info,
                   MPI_Status* statuses) {
  bool concurrent = info.dc != nullptr && info.dc->local_devices > 1;
  double spin_s = g_settings.wait_spin_s.load(std::memory_order_relaxed);
  // MPI_Waitall spins inside MPI: only where waits may hold a core.
  if (g_settings.timeout_s.load(std::memory_order_relaxed) <= 0 &&
      !concurrent && spin_s < 0) {
    MPIJAX_CHECK_MPI(MPI_Waitall(n, reqs, statuses), info);
    return ffi::Error::Success();
  }
  StallClock clock(info);
  idle::Backoff backoff(
      spin_s, g_settings.oversubscribed.load(std::memory_order_relaxed));
  for (uint64_t spin = 0;; ++spin) {
    int done = 0;
    MPIJAX_CHECK_MPI(MPI_Testall(n, reqs, &done, statuses), info);
    if (done) return ffi::Error::Success();
    if ((spin & 255) == 255) {
      if (auto e = clock.Check(); e.failure()) return e;
    }
    backoff.Pause(spin);
  }
}

ffi::Error ChooseBlocking(MPI_Comm comm, size_t bytes, const CallInfo& info,
                          bool* blocking, bool* watched) {
  *watched = false;
  if (info.dc != nullptr && info.dc->local_devices > 1) {
    *blocking = false;
    return ffi::Error::Success();
  }
  if (g_settings.timeout_s.load(std::memory_order_relaxed) <= 0) {
    *blocking = true;
    return ffi::Error::Success();
  }
  int64_t min_bytes =
      g_settings.blocking_min_bytes.load(std::memory_order_relaxed);
  if (info.dc != nullptr && g_watchdog_running.load()) {
    *blocking = *watched = static_cast<int64_t>(bytes) >= min_bytes;
    return ffi::Error::Success();
  }
  *blocking = static_cast<int64_t>(bytes) >=
              std::max(min_bytes, kUnwatchedBlockingMinBytes);
  if (!*blocking) return ffi::Error::Success();
  MPI_Request req;
  MPIJAX_CHECK_MPI(MPI_Ibarrier(comm, &req), info);
  return Wait(&req, info);
}

}  // namespace mpijax::detail

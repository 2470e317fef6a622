// Sleeping waits (see idle.h).
#include "base/idle.h"

#include <climits>
#include <ctime>
#include <thread>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mpijax::idle {
namespace {

// Between polls of MPI: at most this long asleep, at least this long (the
// kernel's timer slack rounds shorter sleeps up anyway).
constexpr double kMaxNapS = 1e-3, kMinNapS = 20e-6;
// The sleep is this fraction of the time waited so far.
constexpr double kNapFraction = 1.0 / 16;

timespec ToTimespec(double s) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(s);
  ts.tv_nsec = static_cast<long>((s - static_cast<double>(ts.tv_sec)) * 1e9);
  return ts;
}

}  // namespace

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double max_s) {
#if defined(__linux__)
  // Not FUTEX_PRIVATE_FLAG: the word is in memory other processes map.
  timespec ts = ToTimespec(max_s);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
          &ts, nullptr, 0);
#else
  (void)word, (void)expected;
  std::this_thread::sleep_for(std::chrono::duration<double>(
      max_s < kMaxNapS ? max_s : kMaxNapS));
#endif
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX,
          nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

void Backoff::Pause(uint64_t spin) {
  if (!napping_ && yield_each_poll_) std::this_thread::yield();
  if (!napping_ && (spin & 15) != 0) return;  // the clock costs more than a poll
  double waited =
      std::chrono::duration<double>(Clock::now() - start_).count();
  if (!napping_) {
    if (spin_s_ < 0 || waited < spin_s_) {
      // Oversubscribed ranks need the CPU back even while spinning.
      if (spin > 4096) std::this_thread::yield();
      return;
    }
    napping_ = true;
#if defined(__linux__)
    // The kernel's default timer slack (50 us) makes a 20 us nap last about
    // 100 us here; 1 us: 58 us. Set once per waiting thread, and kept (it
    // only makes the thread's later sleeps more precise).
    thread_local bool slack_set = false;
    if (!slack_set) {
      prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
      slack_set = true;
    }
#endif
  }
  double nap = waited * kNapFraction;
  nap = nap < kMinNapS ? kMinNapS : nap > kMaxNapS ? kMaxNapS : nap;
  std::this_thread::sleep_for(std::chrono::duration<double>(nap));
}

}  // namespace mpijax::idle

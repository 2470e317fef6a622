// The transport's settings: written by the module's setup() from mpijax's
// configuration (mpijax/_src/config.py), read by the handlers with relaxed
// loads (a few per call: the fast path stays lean).
#ifndef MPIJAX_FFI_SETTINGS_H_
#define MPIJAX_FFI_SETTINGS_H_

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>

namespace mpijax::detail {

struct Settings {
  // Messages larger than this are sent in pieces, so MPI's int counts never
  // overflow.
  std::atomic<int64_t> max_chunk_bytes{int64_t{1} << 30};
  std::atomic<double> timeout_s{0.0};  // MPIJAX_TIMEOUT; <= 0: none
  // From this size on a collective runs MPI's blocking algorithm under the
  // watchdog: Open MPI's tuned blocking collectives are faster than the
  // nonblocking (libnbc) ones a polled wait needs at every size (2 ranks,
  // same job: 4 B 10.2 vs 11.6 us per jitted call, 4 KiB 9.4 vs 15.3 us).
  std::atomic<int64_t> blocking_min_bytes{0};
  // From this many bytes per rank (a message's size over the communicator's)
  // an all-reduce runs mpijax's own ring (RingSegments); <= 0: never. In
  // place the ring saves no input copy, and MPI's own algorithm (fewer
  // steps) is as fast up to a few MiB, hence a second, larger threshold.
  std::atomic<int64_t> ring_min_bytes{int64_t{128} << 10};
  std::atomic<int64_t> ring_in_place_min_bytes{int64_t{4} << 20};
  // All-reduces of at most this many bytes, on a communicator whose ranks
  // share one node, go through node-local shared memory instead of MPI;
  // <= 0: never. Also each participant's segment size, fixed when a
  // communicator (or its reduction over every local device) first uses it.
  std::atomic<int64_t> shm_max_bytes{int64_t{1} << 20};
  // All-reduces of at least this many bytes, on such a communicator, run by
  // cross-memory attach; <= 0: never. They go before the ring and shared
  // memory.
  std::atomic<int64_t> cma_min_bytes{int64_t{64} << 10};
  // Seconds a wait spins before it sleeps (idle.h); < 0: never sleeps.
  std::atomic<double> wait_spin_s{50e-6};
  // More ranks on this node than cores: polled waits yield (idle.h).
  std::atomic<bool> oversubscribed{false};
  std::atomic<bool> stall_abort{true};   // MPIJAX_STALL_ACTION=abort
  std::atomic<bool> check_every{false};  // MPIJAX_CHECK=1
};

extern Settings g_settings;

// Elements per message: at most max_chunk_bytes and never above INT_MAX.
inline size_t ChunkElems(size_t elem_bytes) {
  int64_t max_bytes = std::max<int64_t>(g_settings.max_chunk_bytes.load(), 1);
  size_t n = std::max<size_t>(static_cast<size_t>(max_bytes) / elem_bytes, 1);
  return std::min<size_t>(n, INT_MAX);
}

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_SETTINGS_H_

// The shared segments: mapping them (one POSIX shared-memory file per
// communicator, unlinked as soon as every rank has opened it), views for
// several participants per process, and unmapping.
#include "node_local/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <thread>

#include "base/common.h"
#include "node_local/cma.h"  // CmaProbe
#include "node_local/layout.h"  // NODE_CHECK_MPI

namespace mpijax::node_local {
namespace {

using internal::CmaProbe;

std::atomic<int64_t> g_shm_files{0};  // names this process created

// Maps the shared segments of c (see Ready).
Status Setup(Comm& c, Caller& caller, int64_t segment_bytes, int slots) {
  c.state = -1;
  MPI_Comm comm = c.comm;
  int p = CommSize(comm), r = CommRank(comm);
  MPI_Comm node;
  NODE_CHECK_MPI(caller, MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, r,
                                             MPI_INFO_NULL, &node));
  int node_size = CommSize(node);
  MPI_Comm_free(&node);
  // Whether `ok` holds on every rank (each rank's answer becomes all's).
  auto everywhere = [&](int* ok) {
    return MPI_Allreduce(MPI_IN_PLACE, ok, 1, MPI_INT, MPI_MIN, comm);
  };
  int one_node = node_size == p;
  NODE_CHECK_MPI(caller, everywhere(&one_node));
  if (!one_node) return {};
  size_t seg = (static_cast<size_t>(segment_bytes) + 4095) / 4096 * 4096;
  size_t stride = kHeaderBytes + seg, total = stride * p * slots;
  char name[64] = {0};
  int fd = -1;
  if (r == 0) {
    // The counter's address tells apart two copies of this code in one
    // process (mpijax's module and another library built with it).
    std::snprintf(name, sizeof name, "/mpijax-%d-%lld-%llx",
                  static_cast<int>(getpid()),
                  static_cast<long long>(g_shm_files.fetch_add(1)),
                  static_cast<unsigned long long>(
                      reinterpret_cast<uintptr_t>(&g_shm_files)));
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(total)) != 0) {
      close(fd);
      fd = -1;
      shm_unlink(name);
    }
    if (fd < 0) name[0] = 0;
  }
  NODE_CHECK_MPI(caller, MPI_Bcast(name, sizeof name, MPI_CHAR, 0, comm));
  if (r != 0 && name[0] != 0) fd = shm_open(name, O_RDWR, 0);
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
  }
  int mapped = base != MAP_FAILED;
  NODE_CHECK_MPI(caller, everywhere(&mapped));
  // Every rank has opened it (or given up): the name can go, so nothing is
  // left in /dev/shm however the job ends.
  if (r == 0 && name[0] != 0) shm_unlink(name);
  if (!mapped) {
    if (base != MAP_FAILED) munmap(base, total);
    return {};
  }
  c.base = static_cast<char*>(base);
  c.stride = stride;
  c.map_bytes = total;
  c.slots = slots;
  c.rank = r * slots;
  c.size = p * slots;
  // Every participant spins in its own thread.
  c.oversubscribed =
      c.size > static_cast<int>(std::thread::hardware_concurrency());
  c.state = 1;
  return CmaProbe(c, caller);
}

}  // namespace

void Comm::Release() {
  if (base != nullptr && owns) munmap(base, map_bytes);
  base = nullptr;
  state = -1;
  cma_ok = false;
}

Status Ready(Comm& c, Caller& caller, int64_t segment_bytes, bool* ready) {
  return Ready(c, caller, segment_bytes, 1, ready);
}

Status Ready(Comm& c, Caller& caller, int64_t segment_bytes, int slots,
             bool* ready) {
  if (c.state == 0) {
    caller.Blocking(true);
    Status s = Setup(c, caller, segment_bytes, std::max(slots, 1));
    caller.Blocking(false);
    if (!s.ok()) return s;
  }
  *ready = c.state == 1;
  return {};
}

void View(Comm& view, const Comm& owner, int slot) {
  view.Release();
  view.comm = owner.comm;
  view.limits = owner.limits;
  view.state = owner.state;
  view.rank = owner.rank + slot;
  view.size = owner.size;
  view.slots = owner.slots;
  view.owns = false;
  view.base = owner.base;
  view.stride = owner.stride;
  view.map_bytes = owner.map_bytes;
  view.oversubscribed = owner.oversubscribed;
  view.cma_ok = owner.cma_ok;
  view.seq = 0;
}

}  // namespace mpijax::node_local

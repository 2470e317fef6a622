// Node-local all-reduce (see node_local.h).
//
// Shared memory: each rank maps one POSIX shared-memory file holding a slot
// per rank: a header of flags and a data segment. A call copies the blocks
// the other ranks reduce into its segment, reduces its own 1/P block (its
// input plus the others' segments; one rank per block, so every rank gets
// the same bits), publishes it, and copies the other ranks' finished blocks
// out: three flag waits and no MPI message, rendezvous or kernel copy.
// Measured per jitted call with 2 ranks (MPI -> shared memory): 64 KiB 24.6
// -> 17.1 us; in place 256 KiB 49.9 -> 43.4 us, 1 MiB 81.1 -> 69.0 us, 4 MiB
// 241 -> 290 us (hence MPIJAX_SHM_MAX_BYTES); 4 ranks on 2 cores, 64 KiB 127
// -> 64 us. Out of place the ring is as fast from 256 KiB at 2 ranks and
// goes first.
//
// Cross-memory attach: each rank publishes the addresses of its inputs and
// outputs in its shared-memory header, then reduces its 1/P block: for each
// cache-sized chunk it reads the other ranks' inputs there
// (process_vm_readv), folds in its own, and writes the result into every
// other rank's outputs (process_vm_writev). One flag wait to start and one to
// finish, no MPI message; each block is reduced by one rank, so every rank
// gets the same bits; in place works alike (a rank reads a chunk of
// another's buffer before it writes that chunk). Per rank that is the memory
// traffic of a copy: every input byte it needs read once, every output byte
// written once. The ring also writes each received block to memory and reads
// it back, and reads its finished block again to send it; Open MPI's
// single-copy path pays the same kernel copy. Measured per jitted call with
// 2 ranks, ring -> this: 256 KiB 32 -> 18 us, 4 MiB 507 -> 357 us (donated
// 501 -> 306), 64 MiB donated 10.7 -> 7.3 ms; 4 ranks on 2 cores, 4 MiB 1.80
// -> 1.23 ms. Below 64 KiB (cma_min_bytes) shared memory is as fast or
// faster.
#include "node_local.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>  // iovec; on Linux process_vm_readv/writev
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common.h"
#include "idle.h"

namespace mpijax::node_local {
namespace {

struct alignas(64) Header {
  std::atomic<uint64_t> arrived;  // this call's input is in the segment
  char pad0[56];
  std::atomic<uint64_t> reduced;  // its block of the result is published
  char pad1[56];
  std::atomic<uint64_t> done;     // it has read every other segment
  char pad2[56];
  idle::Doorbell bell;            // rung when a flag above changes
  char pad3[56];
  int64_t sig, bytes;             // what it is reducing (mismatch check)
  int64_t path;                   // kPathShm or kPathCma (mismatch check)
  int64_t failed;                 // CmaAllreduce: the call that failed here
  int64_t failed_errno;           // ... and the errno of its kernel copy
  int64_t pid;                    // set up once: this rank's process id,
  uint64_t probe;                 // ... the address of its CMA nonce there
  uint64_t nonce;                 // ... and the nonce's value
  // CmaAllreduce: this call's buffers here, input and output of each.
  uint64_t addr[kCmaMaxBuffers][2];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory flags need lock-free 64-bit atomics");
static_assert(sizeof(Header) <= kHeaderBytes, "header exceeds its page");
constexpr int64_t kPathShm = 1, kPathCma = 2;  // Header::path
std::atomic<int64_t> g_shm_files{0};           // names this process created

Header* Head(const Comm& c, int i) {
  return reinterpret_cast<Header*>(c.base + i * c.stride);
}
char* Data(const Comm& c, int i) {
  return c.base + i * c.stride + kHeaderBytes;
}

using idle::Doorbell;
// A sleeping wait wakes at least this often (a missed ring costs no more).
constexpr double kMaxSleepS = 0.01;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

#define NODE_CHECK_MPI(caller, call)                          \
  do {                                                        \
    int rc_ = (call);                                         \
    if (rc_ != MPI_SUCCESS) return (caller).MpiFailed(rc_, #call); \
  } while (0)

// Waits until ready(): spins for the caller's SpinS(), then sleeps on this
// rank's doorbell until a rank that publishes a flag rings it (idle.h).
// Past the caller's timeout it reports (Stalled) and goes on waiting; the
// clock is read every few dozen spins only. While spinning it yields the CPU
// now and then, and at once when ranks outnumber cores (the rank being
// waited for may need this core).
template <typename Ready>
void Wait(const Comm& c, Caller& caller, Ready ready) {
  if (ready()) return;
  bool oversubscribed = c.oversubscribed;
  double timeout = caller.Timeout(), spin_s = caller.SpinS();
  auto period = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout > 0 ? timeout : 0));
  auto spin_for = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(spin_s > 0 ? spin_s : 0));
  auto start = Clock::now(), deadline = start + period;
  auto check_stall = [&](Clock::time_point now) {
    if (timeout > 0 && now > deadline) {
      caller.Stalled(std::chrono::duration<double>(now - start).count());
      deadline = Clock::now() + period;
    }
  };
  for (uint64_t spin = 1;; ++spin) {
    CpuRelax();
    if (ready()) return;
    if ((spin & 63) == 0) {
      auto now = Clock::now();
      check_stall(now);
      if (spin_s >= 0 && now - start >= spin_for) break;
    }
    if (oversubscribed || (spin > 1024 && (spin & 15) == 0))
      std::this_thread::yield();
  }
  // Asleep: woken by a ring, or every few ms to check the deadline.
  Doorbell* bell = &Head(c, c.rank)->bell;
  double nap = timeout > 0 ? std::min(timeout, kMaxSleepS) : kMaxSleepS;
  while (!idle::Sleep(bell, ready, nap)) check_stall(Clock::now());
}

// Sets this rank's `flag` to k and wakes the ranks asleep in Wait.
void Publish(const Comm& c, std::atomic<uint64_t> Header::*flag, uint64_t k) {
  (Head(c, c.rank)->*flag).store(k, std::memory_order_release);
  for (int i = 0; i < c.size; ++i)
    if (i != c.rank) idle::Ring(&Head(c, i)->bell);
}

// A wait condition: `flag` of every rank's header is at least `at_least`.
auto AllAtLeast(const Comm& c, std::atomic<uint64_t> Header::*flag,
                uint64_t at_least) {
  return [&c, flag, at_least] {
    for (int i = 0; i < c.size; ++i)
      if ((Head(c, i)->*flag).load(std::memory_order_acquire) < at_least)
        return false;
    return true;
  };
}

// Copies `nbytes` between the `nlocal` pieces `local` of this process and
// the `nremote` pieces `remote` of process `pid` (cross-memory attach: one
// kernel copy, no staging); 0 or an errno.
int CmaCopy(int64_t pid, const iovec* local, size_t nlocal,
            const iovec* remote, size_t nremote, size_t nbytes, bool write) {
  if (pid == static_cast<int64_t>(getpid())) {
    // Another participant of this process (another device's thread): its
    // memory is ours, no kernel copy needed.
    const iovec *from = write ? local : remote, *to = write ? remote : local;
    size_t nfrom = write ? nlocal : nremote, nto = write ? nremote : nlocal;
    size_t i = 0, j = 0, fi = 0, tj = 0, left = nbytes;
    while (left > 0 && i < nfrom && j < nto) {
      size_t m = std::min({from[i].iov_len - fi, to[j].iov_len - tj, left});
      std::memcpy(static_cast<char*>(to[j].iov_base) + tj,
                  static_cast<const char*>(from[i].iov_base) + fi, m);
      left -= m;
      if ((fi += m) == from[i].iov_len) ++i, fi = 0;
      if ((tj += m) == to[j].iov_len) ++j, tj = 0;
    }
    return left == 0 ? 0 : EIO;
  }
#if defined(__linux__)
  ssize_t got = write ? process_vm_writev(static_cast<pid_t>(pid), local,
                                          nlocal, remote, nremote, 0)
                      : process_vm_readv(static_cast<pid_t>(pid), local,
                                         nlocal, remote, nremote, 0);
  if (got == static_cast<ssize_t>(nbytes)) return 0;
  return got < 0 ? errno : EIO;  // a short copy: part of the range is gone
#else
  (void)pid, (void)local, (void)nlocal, (void)remote, (void)nremote;
  (void)nbytes, (void)write;
  return ENOSYS;
#endif
}

// A random word in this process's private memory: another rank that reads
// it at its address, under this process's id, has found this very process.
// (Not const: the probe writes it back over itself.)
uint64_t& CmaNonce() {
  static uint64_t nonce = [] {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      if (read(fd, &v, sizeof v) != static_cast<ssize_t>(sizeof v)) v = 0;
      close(fd);
    }
    // No /dev/urandom: still distinct per process and per start.
    return v ^ (static_cast<uint64_t>(NowNs()) * 0x9e3779b97f4a7c15ULL) ^
           static_cast<uint64_t>(getpid());
  }();
  return nonce;
}

// Whether every rank of c's communicator can read and write every other
// rank's memory with cross-memory attach (collective; after the segments
// are mapped). Each rank publishes its process id, and the address and
// value of its private nonce; every other rank reads the nonce there and,
// only if it found it, writes the same value back. That fails, and
// CmaAllreduce stays off for this communicator, where the kernel refuses
// (ranks of different users; Yama's ptrace_scope 1 without
// prctl(PR_SET_PTRACER), which Open MPI's own CMA support calls, 2 without
// CAP_SYS_PTRACE, or 3; container seccomp profiles that block
// process_vm_readv) or where a rank's process id names another process
// (ranks in different PID namespaces, e.g. one container each sharing
// /dev/shm).
Status CmaProbe(Comm& c, Caller& caller) {
  c.cma_ok = false;
  int p = c.size / c.slots, r = c.rank / c.slots;  // ranks of c.comm
  Header* me = Head(c, c.rank);
  uint64_t& nonce = CmaNonce();
  me->pid = static_cast<int64_t>(getpid());
  me->probe = reinterpret_cast<uint64_t>(&nonce);
  me->nonce = nonce;
  // This rank's other participants are in this process too.
  for (int d = 1; d < c.slots; ++d) Head(c, c.rank + d)->pid = me->pid;
  NODE_CHECK_MPI(caller, MPI_Barrier(c.comm));  // every rank has published
  int ok = 1;
  for (int i = 0; i < p && ok; ++i) {
    if (i == r) continue;
    const Header* h = Head(c, i * c.slots);
    uint64_t word = 0;
    iovec there{reinterpret_cast<void*>(h->probe), sizeof word};
    iovec here{&word, sizeof word};
    ok = CmaCopy(h->pid, &here, 1, &there, 1, sizeof word, false) == 0 &&
         word == h->nonce &&
         CmaCopy(h->pid, &here, 1, &there, 1, sizeof word, true) == 0;
  }
  NODE_CHECK_MPI(caller, MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN,
                                       c.comm));
  c.cma_ok = ok == 1;
  return {};
}

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

// Call k's arrival: publishes what this rank reduces (`bytes` by `path`),
// marks it arrived (after whatever the caller published first), waits for
// every rank, then checks that all of them reduce the same thing the same
// way (the same comparison on every rank, so all of them fail together,
// after marking the call finished so none waits).
Status Arrive(Comm& c, Caller& caller, uint64_t k, size_t bytes,
              int64_t path) {
  Header* me = Head(c, c.rank);
  me->sig = caller.sig;
  me->bytes = static_cast<int64_t>(bytes);
  me->path = path;
  Publish(c, &Header::arrived, k);
  Wait(c, caller, AllAtLeast(c, &Header::arrived, k));
  for (int i = 0; i < c.size; ++i) {
    Header* h = Head(c, i);
    if (h->sig == caller.sig && h->bytes == me->bytes && h->path == me->path)
      continue;
    Publish(c, &Header::reduced, k);
    Publish(c, &Header::done, k);
    return caller.Mismatch(i, h->sig, h->bytes, me->bytes);
  }
  return {};
}

// The float sum of this rank's block, elements [lo, lo + cnt): its own
// input `mine` plus every other rank's segment, into the output (`out` may
// be `mine`: in place), then published in this rank's segment by memcpy.
// (Storing to the segment inside the loop, to lines the other rank read last
// call, was 20x slower here than the copy.) The terms are added in rank
// order, ((x0 + x1) + x2) + ..., whichever rank reduces the block: an
// element's sum then does not depend on how the buffers are split into
// blocks or calls (mpijax.train's overlapped buckets give the bits of its
// one-call all-reduce). With 2 ranks any order is that order.
template <typename T>
void ShmSumBlock(const Comm& c, size_t lo, size_t cnt, const T* mine, T* out,
                 T* pub) {
  int p = c.size, r = c.rank;
  auto term = [&](int i) {
    return i == r ? mine : reinterpret_cast<const T*>(Data(c, i)) + lo;
  };
  if (p == 2) {
    const T *a = term(0), *b = term(1);
    for (size_t i = 0; i < cnt; ++i) out[i] = a[i] + b[i];
  } else {
    // A tile at a time, in cache: in place, `mine` is read before `out`
    // (the same memory) is written.
    constexpr size_t kTile = 2048;
    T acc[kTile];
    for (size_t at = 0; at < cnt; at += kTile) {
      size_t m = std::min(kTile, cnt - at);
      const T *a = term(0) + at, *b = term(1) + at;
      for (size_t i = 0; i < m; ++i) acc[i] = a[i] + b[i];
      for (int j = 2; j < p; ++j) {
        const T* t = term(j) + at;
        for (size_t i = 0; i < m; ++i) acc[i] += t[i];
      }
      std::memcpy(out + at, acc, m * sizeof(T));
    }
  }
  std::memcpy(pub, out, cnt * sizeof(T));
}

// Cache-sized chunks for the cross-memory all-reduce.
constexpr size_t kCmaChunkBytes = size_t{256} << 10;

// node_local::Allreduce's caller: the defaults, plus the MPI error code of a
// failed MPI call, so that it can be returned.
class PlainCaller : public Caller {
 public:
  explicit PlainCaller(const Comm& c) : c_(c) {}
  double Timeout() const override { return c_.limits.timeout_s; }
  double SpinS() const override { return c_.limits.wait_spin_s; }
  Status MpiFailed(int rc, const char* call) override {
    mpi_error = rc;
    return Caller::MpiFailed(rc, call);
  }
  int mpi_error = MPI_SUCCESS;

 private:
  const Comm& c_;
};

}  // namespace

void Comm::Release() {
  if (base != nullptr && owns) munmap(base, map_bytes);
  base = nullptr;
  state = -1;
  cma_ok = false;
}

Status Caller::Finish(char*, size_t) { return {}; }

void Caller::Stalled(double waited_s) {
  std::fprintf(stderr,
               "mpijax: node-local all-reduce: waited %.1f s for the other "
               "ranks\n",
               waited_s);
  std::fflush(stderr);
}

Status Caller::MpiFailed(int rc, const char* call) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return {kInternal, std::string("node-local all-reduce: ") + call +
                         " failed: " + std::string(text, len)};
}

Status Caller::Mismatch(int rank, int64_t rank_sig, int64_t rank_bytes,
                        int64_t my_bytes) {
  std::string what =
      rank_sig != sig ? " reduces something else than this rank"
      : rank_bytes != my_bytes
          ? " reduces " + std::to_string(rank_bytes) + " bytes, this rank " +
                std::to_string(my_bytes)
          : std::string(" takes another node-local path (the limits must be "
                        "the same on every rank)");
  return {kInternal, "node-local all-reduce: rank " + std::to_string(rank) +
                         what};
}

Status Caller::CmaFailed(int rank, const std::string& how) {
  return {kInternal,
          "node-local all-reduce: the cross-memory all-reduce failed on rank " +
              std::to_string(rank) + " (" + how + ")"};
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

Status ShmAllreduce(Comm& c, Caller& caller, const char* src, char* dst,
                    size_t n, size_t es, MPI_Datatype dt, MPI_Op mop) {
  int p = c.size, r = c.rank;
  size_t bytes = n * es;
  auto first = [&](int b) { return n * b / p; };  // block b: [first(b), first(b + 1))
  uint64_t k = ++c.seq;
  Header* me = Head(c, r);
  char* mine = Data(c, r);
  // 1. Once everyone has read this rank's segment from the previous call:
  // the blocks the other ranks reduce go in (its own block it reads from
  // `src` directly).
  Wait(c, caller, AllAtLeast(c, &Header::done, k - 1));
  for (int j = 0; j < p; ++j) {
    if (j == r) continue;
    std::memcpy(mine + first(j) * es, src + first(j) * es,
                (first(j + 1) - first(j)) * es);
  }
  // 2. Every input is in; all ranks must be reducing the same thing.
  if (Status s = Arrive(c, caller, k, bytes, kPathShm); !s.ok()) return s;
  // 3. This rank's block, reduced by this rank only (so every rank gets the
  // same bits), finished, and published where its own input would have been.
  size_t lo = first(r), cnt = first(r + 1) - lo;
  const char* in = src + lo * es;
  char* out = dst + lo * es;
  char* pub = mine + lo * es;
  bool fused = mop == MPI_SUM && !caller.finishes &&
               (dt == MPI_FLOAT || dt == MPI_DOUBLE);
  if (cnt > 0 && fused) {
    if (dt == MPI_FLOAT) {
      ShmSumBlock<float>(c, lo, cnt, reinterpret_cast<const float*>(in),
                         reinterpret_cast<float*>(out),
                         reinterpret_cast<float*>(pub));
    } else {
      ShmSumBlock<double>(c, lo, cnt, reinterpret_cast<const double*>(in),
                          reinterpret_cast<double*>(out),
                          reinterpret_cast<double*>(pub));
    }
  } else if (cnt > 0) {
    // Rank order, as ShmSumBlock; in place, this rank's input is still
    // needed after rank 0's term is in, so the sum is made in scratch.
    auto term = [&](int i) { return i == r ? in : Data(c, i) + lo * es; };
    char* acc = out != in || r == 0 ? out : Scratch(cnt * es);
    if (acc != term(0)) std::memcpy(acc, term(0), cnt * es);
    for (int i = 1; i < p; ++i) {
      NODE_CHECK_MPI(caller, MPI_Reduce_local(term(i), acc,
                                              static_cast<int>(cnt), dt, mop));
    }
    if (acc != out) std::memcpy(out, acc, cnt * es);
    if (caller.finishes) {
      if (Status s = caller.Finish(out, cnt); !s.ok()) return s;
    }
    std::memcpy(pub, out, cnt * es);
  }
  Publish(c, &Header::reduced, k);
  // 4. Every block is published: copy the others' out (in place, over input
  // blocks already copied to this rank's segment in step 1).
  Wait(c, caller, AllAtLeast(c, &Header::reduced, k));
  for (int i = 0; i < p; ++i) {
    if (i == r) continue;
    std::memcpy(dst + first(i) * es, Data(c, i) + first(i) * es,
                (first(i + 1) - first(i)) * es);
  }
  Publish(c, &Header::done, k);
  return {};
}

Status CmaAllreduce(Comm& c, Caller& caller, const Spans& spans,
                    MPI_Datatype dt, MPI_Op mop) {
  int p = c.size, r = c.rank;
  size_t n = spans.size(), es = spans.elem_bytes();
  uint64_t k = ++c.seq;
  Header* me = Head(c, r);
  for (size_t i = 0; i < spans.buffers(); ++i) {
    me->addr[i][0] = reinterpret_cast<uint64_t>(spans.src(i));
    me->addr[i][1] = reinterpret_cast<uint64_t>(spans.dst(i));
  }
  // The same signature means the same buffers, so `spans` describes every
  // rank's layout; only the addresses differ.
  if (Status s = Arrive(c, caller, k, n * es, kPathCma); !s.ok()) return s;
  // Elements [lo, hi) of rank h's inputs (out = 0) or outputs (1), as
  // iovecs; a chunk spans at most kCmaMaxBuffers buffers, within IOV_MAX.
  iovec remote[kCmaMaxBuffers], here[kCmaMaxBuffers];
  auto remote_iov = [&](const Header* h, int out, size_t lo, size_t hi) {
    size_t count = 0;
    spans.Pieces(lo, hi, [&](size_t i, size_t at, size_t cnt, size_t) {
      remote[count++] = {reinterpret_cast<void*>(h->addr[i][out] + at * es),
                         cnt * es};
      return true;
    });
    return count;
  };
  // This rank's block, chunk by chunk, reduced into an accumulator: the
  // chunk's pieces of this rank's outputs when none of them is in place
  // (they are written once, by the first read), else a scratch chunk copied
  // to them at the end (reading another rank's input into an output that is
  // this rank's input would lose it). The accumulator gets the ranks'
  // chunks in rank order, the other ranks' through tmp.
  bool into_outputs = !spans.any_in_place();
  size_t chunk = std::max<size_t>(kCmaChunkBytes / es, 1);
  char* scratch = Scratch(2 * chunk * es);
  char* tmp = scratch + chunk * es;
  int err = 0;
  const char* failed_call = "";
  for (size_t at = n * r / p, hi = n * (r + 1) / p; at < hi && err == 0;
       at += chunk) {
    size_t cnt = std::min(chunk, hi - at), pieces = 1;
    // The accumulator's pieces, and the address of element `index` in it.
    if (into_outputs) {
      pieces = 0;
      spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                     size_t) {
        here[pieces++] = {spans.dst(i) + first * es, count * es};
        return true;
      });
    } else {
      here[0] = {scratch, cnt * es};
    }
    auto acc = [&](size_t index, size_t i, size_t first) {
      return into_outputs ? spans.dst(i) + first * es
                          : scratch + (index - at) * es;
    };
    // Copies between `local` and elements [at, at + cnt) of rank h's buffers.
    auto copy = [&](const Header* h, const iovec* local, size_t nlocal,
                    bool write) {
      failed_call = write ? "process_vm_writev" : "process_vm_readv";
      return CmaCopy(h->pid, local, nlocal, remote,
                     remote_iov(h, write ? 1 : 0, at, at + cnt), cnt * es,
                     write);
    };
    // inout (the accumulator's piece for element `index`) = in op inout.
    auto fold = [&](auto in_of) {
      spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                     size_t index) {
        failed_call = "MPI_Reduce_local";
        err = MPI_Reduce_local(in_of(index, i, first), acc(index, i, first),
                               static_cast<int>(count), dt, mop) == MPI_SUCCESS
                  ? 0
                  : EINVAL;
        return err == 0;
      });
    };
    // The terms in rank order, ((x0 + x1) + x2) + ... (as ShmSumBlock; the
    // first two in either order): the accumulator starts as the first of
    // ranks 0 and 1 that is not this rank, read straight into it.
    iovec tmp_iov{tmp, cnt * es};
    int head = r == 0 ? 1 : 0;
    err = copy(Head(c, head), here, pieces, false);
    for (int j = 0; j < p && err == 0; ++j) {
      if (j == head) continue;
      if (j == r) {
        fold([&](size_t, size_t i, size_t first) {
          return spans.src(i) + first * es;
        });
      } else if ((err = copy(Head(c, j), &tmp_iov, 1, false)) == 0) {
        fold([&](size_t index, size_t, size_t) {
          return tmp + (index - at) * es;
        });
      }
    }
    if (err != 0) break;
    spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                   size_t index) {
      char* a = acc(index, i, first);
      if (caller.finishes) (void)caller.Finish(a, count);
      if (!into_outputs) std::memcpy(spans.dst(i) + first * es, a, count * es);
      return true;
    });
    for (int j = 1; j < p && err == 0; ++j)
      err = copy(Head(c, (r + j) % p), here, pieces, true);
  }
  // Finished with every other rank's buffers (or failed): once all ranks
  // are, every output is complete and no input is read any more.
  me->failed_errno = err;
  me->failed = err != 0 ? static_cast<int64_t>(k) : 0;
  Publish(c, &Header::reduced, k);
  Wait(c, caller, AllAtLeast(c, &Header::reduced, k));
  Publish(c, &Header::done, k);
  for (int i = 0; i < p; ++i) {
    const Header* h = Head(c, i);
    if (h->failed != static_cast<int64_t>(k)) continue;
    std::string how = i == r ? std::string(failed_call) + " failed: "
                             : std::string("its copy failed: ");
    return caller.CmaFailed(
        i, how + std::strerror(static_cast<int>(h->failed_errno)));
  }
  return {};
}

int Allreduce(Comm& c, const void* sendbuf, void* recvbuf, int count,
              MPI_Datatype datatype, MPI_Op op) {
  c.last_path = 0;
  auto mpi = [&] {
    return MPI_Allreduce(sendbuf, recvbuf, count, datatype, op, c.comm);
  };
  if (count <= 0 || c.state < 0) return mpi();
  int64_t shm_max = c.limits.shm_max_bytes, cma_min = c.limits.cma_min_bytes;
  int type_size = 0, commutes = 0;
  MPI_Aint lb = 0, extent = 0;
  MPI_Type_size(datatype, &type_size);
  MPI_Type_get_extent(datatype, &lb, &extent);
  MPI_Op_commutative(op, &commutes);
  if (type_size <= 0 || lb != 0 || extent != type_size || !commutes)
    return mpi();
  size_t es = static_cast<size_t>(type_size);
  size_t n = static_cast<size_t>(count), bytes = n * es;
  bool cma = cma_min > 0 && bytes >= static_cast<size_t>(cma_min);
  bool shm = shm_max > 0 && bytes <= static_cast<size_t>(shm_max);
  if (!cma && !shm) return mpi();
  if (c.state == 0) {  // the same answer on every rank: all set up or none
    int inter = 0;
    MPI_Comm_test_inter(c.comm, &inter);
    if (inter || CommSize(c.comm) < 2) {
      c.state = -1;
      return mpi();
    }
  }
  PlainCaller caller(c);
  auto fail = [&](const Status& s) {
    c.last_error = s.message;
    return caller.mpi_error != MPI_SUCCESS ? caller.mpi_error : MPI_ERR_OTHER;
  };
  bool ready = false;
  if (Status s = Ready(c, caller, shm_max, &ready); !s.ok()) return fail(s);
  if (!ready) return mpi();
  char* dst = static_cast<char*>(recvbuf);
  const char* src = sendbuf == MPI_IN_PLACE ? dst
                                            : static_cast<const char*>(sendbuf);
  Status s;
  if (cma && c.cma_ok) {
    Spans spans(es);
    spans.Add(src, dst, n);
    c.last_path = 2;
    s = CmaAllreduce(c, caller, spans, datatype, op);
    if (!s.ok()) c.cma_ok = false;  // every rank saw the same failure
  } else if (shm && bytes <= c.segment_bytes()) {
    c.last_path = 1;
    s = ShmAllreduce(c, caller, src, dst, n, es, datatype, op);
  } else {
    return mpi();
  }
  return s.ok() ? MPI_SUCCESS : fail(s);
}

}  // namespace mpijax::node_local

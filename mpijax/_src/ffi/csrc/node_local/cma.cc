// The node-local all-reduce by cross-memory attach: each rank publishes the
// addresses of its inputs and outputs in its shared-memory header, then reduces
// its 1/P block: for each cache-sized chunk it reads the other ranks' inputs
// there (process_vm_readv), folds in its own, and writes the result into every
// other rank's outputs (process_vm_writev). One flag wait to start and one to
// finish, no MPI message; each block is reduced by one rank, so every rank gets
// the same bits; in place works alike (a rank reads a chunk of another's buffer
// before it writes that chunk). Per rank that is the memory traffic of a copy:
// every input byte it needs read once, every output byte written once. The ring
// also writes each received block to memory and reads it back, and reads its
// finished block again to send it; Open MPI's single-copy path pays the same
// kernel copy. Measured per jitted call with 2 ranks, ring -> this: 256 KiB 32
// -> 18 us, 4 MiB 507 -> 357 us (donated 501 -> 306), 64 MiB donated 10.7 ->
// 7.3 ms; 4 ranks on 2 cores, 4 MiB 1.80 -> 1.23 ms. Below 64 KiB
// (cma_min_bytes) shared memory is as fast or faster.
#include "node_local/cma.h"

#include <fcntl.h>
#include <sys/uio.h>  // iovec; on Linux process_vm_readv/writev
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "base/common.h"
#include "node_local/flags.h"
#include "node_local/layout.h"

namespace mpijax::node_local {
namespace {

using internal::AllAtLeast;
using internal::Arrive;
using internal::Head;
using internal::Header;
using internal::kPathCma;
using internal::Publish;
using internal::Wait;

// Cache-sized chunks for the cross-memory all-reduce and reduce-scatter:
// fewer, larger kernel copies (each pins its pages anew) cost less while a
// chunk fits L2. 1 MiB against 256 KiB: a jitted 4 MiB call, 2 ranks, 332 ->
// 275 us (medians).
constexpr size_t kCmaChunkBytes = size_t{1} << 20;

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

// The end of call k on this rank (`err` from `failed_call`, or 0): once
// every rank has marked it reduced, none reads another's buffers any more
// and every output is complete; then names a rank whose copy failed.
Status Finished(Comm& c, Caller& caller, uint64_t k, int err,
                const char* failed_call) {
  Header* me = Head(c, c.rank);
  me->failed_errno = err;
  me->failed = err != 0 ? static_cast<int64_t>(k) : 0;
  Publish(c, &Header::reduced, k);
  Wait(c, caller, AllAtLeast(c, &Header::reduced, k));
  Publish(c, &Header::done, k);
  for (int i = 0; i < c.size; ++i) {
    const Header* h = Head(c, i);
    if (h->failed != static_cast<int64_t>(k)) continue;
    std::string how = i == c.rank ? std::string(failed_call) + " failed: "
                                  : std::string("its copy failed: ");
    return caller.CmaFailed(
        i, how + std::strerror(static_cast<int>(h->failed_errno)));
  }
  return {};
}

}  // namespace

namespace internal {

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

}  // namespace internal

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
  // This rank's block, chunk by chunk, reduced in its outputs (the
  // accumulator), the ranks' chunks in rank order: ((x0 + x1) + x2) + ...
  // (as ShmSumBlock; each step's two terms in either order, the same bits).
  // With no buffer in place the accumulator starts as the first of ranks 0
  // and 1 that is not this rank, read straight into it. Otherwise it starts
  // as this rank's own input (already there in place; copied where not),
  // and the ranks before it are summed in scratch and folded in: an output
  // that is this rank's input must not be overwritten before it is read.
  // (A scratch accumulator copied out at the end cost a pass: donated 4 MiB,
  // 2 ranks, 366-436 -> 260-272 us.) No other rank reads or writes this
  // rank's block of its buffers.
  bool from_head = !spans.any_in_place();
  size_t block = n * (r + 1) / p - n * r / p;
  size_t chunk = std::max<size_t>(std::min(kCmaChunkBytes / es, block), 1);
  char* tmp = Scratch((from_head || r < 2 ? 1 : 2) * chunk * es);
  char* sum = tmp + chunk * es;  // ranks 0..r-1, in place and r >= 2
  int err = 0;
  const char* failed_call = "";
  for (size_t at = n * r / p, hi = n * (r + 1) / p; at < hi && err == 0;
       at += chunk) {
    size_t cnt = std::min(chunk, hi - at), pieces = 0;
    spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                   size_t) {
      here[pieces++] = {spans.dst(i) + first * es, count * es};
      return true;
    });
    // Copies between `local` and elements [at, at + cnt) of rank h's buffers.
    auto copy = [&](const Header* h, const iovec* local, size_t nlocal,
                    bool write) {
      failed_call = write ? "process_vm_writev" : "process_vm_readv";
      return CmaCopy(h->pid, local, nlocal, remote,
                     remote_iov(h, write ? 1 : 0, at, at + cnt), cnt * es,
                     write);
    };
    // Rank j's chunk into the contiguous `into`.
    auto read = [&](int j, char* into) {
      iovec one{into, cnt * es};
      return copy(Head(c, j), &one, 1, false);
    };
    // inout op= in, over `count` elements; 0 or EINVAL.
    auto reduce = [&](const char* in, char* inout, size_t count) {
      failed_call = "MPI_Reduce_local";
      return MPI_Reduce_local(in, inout, static_cast<int>(count), dt, mop) ==
                     MPI_SUCCESS
                 ? 0
                 : EINVAL;
    };
    // The accumulator (this rank's outputs) op= the contiguous `in`, or op=
    // this rank's inputs (in == nullptr).
    auto fold = [&](const char* in) {
      spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                     size_t index) {
        const char* from =
            in != nullptr ? in + (index - at) * es : spans.src(i) + first * es;
        err = reduce(from, spans.dst(i) + first * es, count);
        return err == 0;
      });
      return err;
    };
    int head = r == 0 ? 1 : 0, next = 0;  // the next rank to fold in
    if (from_head) {
      err = copy(Head(c, head), here, pieces, false);
      if (err == 0 && r < 2) err = fold(nullptr);
      next = r < 2 ? 2 : 1;
    } else {
      spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                     size_t) {
        if (spans.src(i) != spans.dst(i))
          std::memcpy(spans.dst(i) + first * es, spans.src(i) + first * es,
                      count * es);
        return true;
      });
      if (r < 2) {
        if ((err = read(head, tmp)) == 0) err = fold(tmp);
        next = 2;
      } else {
        // sum = ((x0 + x1) + ...) + x(r-1), then folded into x(r).
        if ((err = read(0, sum)) == 0) {
          for (int j = 1; j < r && err == 0; ++j) {
            if ((err = read(j, tmp)) == 0) err = reduce(tmp, sum, cnt);
          }
        }
        if (err == 0) err = fold(sum);
        next = r + 1;
      }
    }
    for (int j = next; j < p && err == 0; ++j) {
      if (j == r)
        err = fold(nullptr);
      else if ((err = read(j, tmp)) == 0)
        err = fold(tmp);
    }
    if (err != 0) break;
    if (caller.finishes) {
      spans.Pieces(at, at + cnt, [&](size_t i, size_t first, size_t count,
                                     size_t) {
        (void)caller.Finish(spans.dst(i) + first * es, count);
        return true;
      });
    }
    for (int j = 1; j < p && err == 0; ++j)
      err = copy(Head(c, (r + j) % p), here, pieces, true);
  }
  return Finished(c, caller, k, err, failed_call);
}

// The reduce-scatter by cross-memory attach: CmaAllreduce's block step
// without its writes to the other ranks, summed in the same order (so it
// gives the bits of the all-reduce's block); at 2 ranks and 256 KiB it reads
// half the data the all-reduce moves and writes nothing across processes.
Status CmaReduceScatter(Comm& c, Caller& caller, const char* src, char* dst,
                        size_t count, size_t es, MPI_Datatype dt, MPI_Op mop) {
  int p = c.size, r = c.rank;
  uint64_t k = ++c.seq;
  Header* me = Head(c, r);
  me->addr[0][0] = reinterpret_cast<uint64_t>(src);
  me->addr[0][1] = reinterpret_cast<uint64_t>(dst);
  if (Status s = Arrive(c, caller, k, count * p * es, kPathCma); !s.ok())
    return s;
  size_t chunk = std::max<size_t>(kCmaChunkBytes / es, 1);
  char* tmp = p > 2 ? Scratch(std::min(chunk, count) * es) : nullptr;
  int err = 0;
  const char* failed_call = "";
  for (size_t at = 0; at < count && err == 0; at += chunk) {
    size_t cnt = std::min(chunk, count - at), off = (r * count + at) * es;
    char* acc = dst + at * es;
    // Elements [at, at + cnt) of this rank's block of rank h's input.
    auto read = [&](int h, char* into) {
      failed_call = "process_vm_readv";
      const Header* hh = Head(c, h);
      iovec here{into, cnt * es};
      iovec there{reinterpret_cast<void*>(hh->addr[0][0] + off), cnt * es};
      return CmaCopy(hh->pid, &here, 1, &there, 1, cnt * es, false);
    };
    auto fold = [&](const char* in) {
      failed_call = "MPI_Reduce_local";
      return MPI_Reduce_local(in, acc, static_cast<int>(cnt), dt, mop) ==
                     MPI_SUCCESS
                 ? 0
                 : EINVAL;
    };
    // ((x0 + x1) + x2) + ..., as CmaAllreduce.
    int head = r == 0 ? 1 : 0;
    err = read(head, acc);
    for (int j = 0; j < p && err == 0; ++j) {
      if (j == head) continue;
      if (j == r)
        err = fold(src + off);
      else if ((err = read(j, tmp)) == 0)
        err = fold(tmp);
    }
    if (err == 0 && caller.finishes) (void)caller.Finish(acc, cnt);
  }
  return Finished(c, caller, k, err, failed_call);
}

// The all-gather by cross-memory attach: one arrival and one departure
// instead of MPI's P - 1 exchanges, each a handshake with a neighbour that
// may wait for its core on an oversubscribed node. Per rank the traffic of
// the copies alone: every other block read once, written once.
Status CmaAllgather(Comm& c, Caller& caller, const char* src, char* dst,
                    size_t block) {
  int p = c.size, r = c.rank;
  uint64_t k = ++c.seq;
  Header* me = Head(c, r);
  me->addr[0][0] = reinterpret_cast<uint64_t>(src);
  me->addr[0][1] = reinterpret_cast<uint64_t>(dst);
  if (Status s = Arrive(c, caller, k, block * p, kPathCma); !s.ok()) return s;
  char* mine = dst + static_cast<size_t>(r) * block;
  if (mine != src) std::memcpy(mine, src, block);
  int err = 0;
  // From the next rank on, so that the ranks do not all read one at once.
  for (int j = 1; j < p && err == 0 && block > 0; ++j) {
    int h = (r + j) % p;
    const Header* hh = Head(c, h);
    iovec here{dst + static_cast<size_t>(h) * block, block};
    iovec there{reinterpret_cast<void*>(hh->addr[0][0]), block};
    err = CmaCopy(hh->pid, &here, 1, &there, 1, block, false);
  }
  return Finished(c, caller, k, err, "process_vm_readv");
}

}  // namespace mpijax::node_local

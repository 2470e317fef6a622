// The node-local all-reduce through shared memory: each rank maps one POSIX
// shared-memory file holding a slot per rank: a header of flags and a data
// segment. A call copies the blocks the other ranks reduce into its segment,
// reduces its own 1/P block (its input plus the others' segments; one rank
// per block, so every rank gets the same bits), publishes it, and copies the
// other ranks' finished blocks out: three flag waits and no MPI message,
// rendezvous or kernel copy. Measured per jitted call with 2 ranks (MPI ->
// shared memory): 64 KiB 24.6 -> 17.1 us; in place 256 KiB 49.9 -> 43.4 us,
// 1 MiB 81.1 -> 69.0 us, 4 MiB 241 -> 290 us (hence MPIJAX_SHM_MAX_BYTES);
// 4 ranks on 2 cores, 64 KiB 127 -> 64 us. Out of place the ring is as fast
// from 256 KiB at 2 ranks and goes first. A small message skips the blocks:
// every rank copies all of it in and reduces the whole from every segment,
// one flag wait in all (ShmAllreduceWhole).
#include "node_local/shm.h"

#include <algorithm>
#include <cstring>

#include "node_local/flags.h"
#include "node_local/layout.h"
#include "base/spans.h"

namespace mpijax::node_local {
namespace {

using internal::AllAtLeast;
using internal::Arrive;
using internal::Data;
using internal::Head;
using internal::Header;
using internal::kPathShm;
using internal::Publish;
using internal::Wait;

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
  if (pub != nullptr) std::memcpy(pub, out, cnt * sizeof(T));
}

// While every rank reads at most this much (the message times the ranks),
// each reduces the whole message itself: one flag wait per call instead of
// two, the second of which costs a wake-up where ranks share cores. Jitted
// all-reduce, two-phase -> whole: 4 B at 4 ranks on 2 cores 40-42 -> 37-39
// us, 2 ranks x 2 devices 129-131 -> 126-128 us; 64 KiB at 2 ranks 19 -> 23
// us (hence the bound).
constexpr size_t kWholeReadBytes = size_t{32} << 10;

// The whole message reduced by every rank, in rank order as ShmSumBlock (so
// every rank gets the bits of the block-wise reduction).
Status ShmAllreduceWhole(Comm& c, Caller& caller, const char* src, char* dst,
                         size_t n, size_t es, MPI_Datatype dt, MPI_Op mop,
                         uint64_t k) {
  int p = c.size, r = c.rank;
  size_t bytes = n * es;
  // Once everyone has read this rank's segment from the previous call.
  Wait(c, caller, AllAtLeast(c, &Header::done, k - 1));
  std::memcpy(Data(c, r), src, bytes);
  if (Status s = Arrive(c, caller, k, bytes, kPathShm); !s.ok()) return s;
  bool fused = mop == MPI_SUM && (dt == MPI_FLOAT || dt == MPI_DOUBLE);
  if (n > 0 && fused && dt == MPI_FLOAT) {
    ShmSumBlock<float>(c, 0, n, reinterpret_cast<const float*>(src),
                       reinterpret_cast<float*>(dst), nullptr);
  } else if (n > 0 && fused) {
    ShmSumBlock<double>(c, 0, n, reinterpret_cast<const double*>(src),
                        reinterpret_cast<double*>(dst), nullptr);
  } else if (n > 0) {
    // In place, `dst` is this rank's input: its term is read from its
    // segment instead.
    std::memcpy(dst, Data(c, 0), bytes);
    for (int i = 1; i < p; ++i) {
      NODE_CHECK_MPI(caller, MPI_Reduce_local(Data(c, i), dst,
                                              static_cast<int>(n), dt, mop));
    }
  }
  if (n > 0 && caller.finishes) {
    if (Status s = caller.Finish(dst, n); !s.ok()) return s;
  }
  Publish(c, &Header::reduced, k);
  Publish(c, &Header::done, k);
  return {};
}

}  // namespace

Status ShmAllreduce(Comm& c, Caller& caller, const char* src, char* dst,
                    size_t n, size_t es, MPI_Datatype dt, MPI_Op mop) {
  int p = c.size, r = c.rank;
  size_t bytes = n * es;
  auto first = [&](int b) { return n * b / p; };  // block b: [first(b), first(b + 1))
  uint64_t k = ++c.seq;
  if (bytes * static_cast<size_t>(p) <= kWholeReadBytes)
    return ShmAllreduceWhole(c, caller, src, dst, n, es, dt, mop, k);
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

}  // namespace mpijax::node_local

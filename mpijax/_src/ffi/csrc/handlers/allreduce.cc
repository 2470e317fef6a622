#include "handlers/allreduce.h"

#include <algorithm>
#include <string>
#include <thread>

#include "core/inspector.h"
#include "node_local/node_local.h"
#include "core/reduce_ops.h"
#include "handlers/ring.h"
#include "core/settings.h"
#include "core/call_check.h"
#include "core/timeline.h"
#include "core/wait.h"

namespace mpijax::detail {
namespace {

ffi::Error ToFfi(const node_local::Status& s) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(static_cast<ffi::ErrorCode>(s.code), s.message);
}

node_local::Status FromFfi(const ffi::Error& e) {
  if (e.success()) return {};
  return {static_cast<int>(*e.errc()), e.message()};
}

// A handler as the node-local all-reduce's caller: stalls go to the stall
// inspector, failures are worded with the call's description and the
// settings that avoid them.
class HandlerCaller : public node_local::Caller {
 public:
  HandlerCaller(const CallInfo& info, ffi::DataType type, int64_t divisor)
      : info_(info), type_(type), divisor_(divisor) {
    sig = info.sig;
    finishes = divisor != 1;
  }
  node_local::Status Finish(char* p, size_t count) override {
    return FromFfi(DivideInPlace(type_, p, count, divisor_));
  }
  double Timeout() const override {
    return g_settings.timeout_s.load(std::memory_order_relaxed);
  }
  double SpinS() const override {
    return g_settings.wait_spin_s.load(std::memory_order_relaxed);
  }
  void Stalled(double waited_s) override { ReportStall(info_, waited_s); }
  void Blocking(bool inside) override {
    info_.dc->status.blocking_since_ns.store(inside ? NowNs() : 0,
                                             std::memory_order_relaxed);
  }
  node_local::Status MpiFailed(int rc, const char* call) override {
    return FromFfi(MpiError(rc, call, info_));
  }
  node_local::Status Mismatch(int rank, int64_t rank_sig, int64_t rank_bytes,
                              int64_t my_bytes) override {
    if (rank_sig != info_.sig) return FromFfi(MismatchError(info_, info_.sig));
    std::string what = rank_bytes != my_bytes
        ? " reduces " + std::to_string(rank_bytes) + " bytes, this rank " +
              std::to_string(my_bytes)
        : " takes another transport path (MPIJAX_SHM_MAX_BYTES and "
          "MPIJAX_CMA_MIN_BYTES must be the same on every rank)";
    return {node_local::kInternal,
            info_.Describe() + ": rank " + std::to_string(rank) + what};
  }
  node_local::Status CmaFailed(int rank, const std::string& how) override {
    return {node_local::kInternal,
            info_.Describe() + ": the cross-memory all-reduce failed on rank " +
                std::to_string(rank) + " (" + how +
                "); MPIJAX_CMA_MIN_BYTES=0 turns this path off."};
  }

 private:
  const CallInfo& info_;
  ffi::DataType type_;
  int64_t divisor_;
};

// Sets up dc's node-local paths if no call has tried yet (collective: the
// same call on every rank); whether they are mapped.
ffi::ErrorOr<bool> NodeReady(const CallInfo& info) {
  node_local::Comm& node = info.dc->node;
  if (node.state != 0) return node.state == 1;
  HandlerCaller caller(info, info.dtype, 1);
  bool ready = false;
  node_local::Status s = node_local::Ready(
      node, caller, g_settings.shm_max_bytes.load(), &ready);
  if (!s.ok()) return ffi::Unexpected(ToFfi(s));
  // The other local devices' threads may spin in their own all-reduces at
  // the same time: count them when deciding whether to yield.
  int threads = info.comm_size * info.dc->local_devices;
  node.oversubscribed |=
      threads > static_cast<int>(std::thread::hardware_concurrency());
  return ready;
}

// Whether an all-reduce of `bytes` goes through shared memory (setting it up
// at the first call that could). With several local devices each has its
// own segments, on its own communicator.
ffi::ErrorOr<bool> UseShm(const CallInfo& info, size_t bytes) {
  DevComm* dc = info.dc;
  int64_t max_bytes = g_settings.shm_max_bytes.load(std::memory_order_relaxed);
  if (dc == nullptr || info.comm_size < 2 || max_bytes <= 0 || bytes == 0 || bytes > static_cast<size_t>(max_bytes))
    return false;
  auto ready = NodeReady(info);
  if (ready.has_error()) return ready;
  return *ready && bytes <= dc->node.segment_bytes();
}

// Whether an all-reduce of `bytes` in `buffers` buffers runs CmaAllreduce:
// from cma_min_bytes on, up to node_local::kCmaMaxBuffers buffers, with
// all ranks on one node, and cross-memory attach
// allowed between them (setting up the node-local paths at the first call
// that could use them: collective; with several local devices, each on its
// own communicator). Allocation-free, like UseRing.
ffi::ErrorOr<bool> UseCma(const CallInfo& info, size_t bytes, size_t buffers) {
  int64_t min_bytes = g_settings.cma_min_bytes.load(std::memory_order_relaxed);
  if (info.dc == nullptr || info.comm_size < 2 || min_bytes <= 0 ||
      bytes < static_cast<size_t>(min_bytes) ||
      buffers > node_local::kCmaMaxBuffers)
    return false;
  auto ready = NodeReady(info);
  if (ready.has_error()) return ready;
  return *ready && info.dc->node.cma_ok;
}

// The all-reduce of `spans` by cross-memory attach (after UseCma).
ffi::Error CmaAllreduce(const CallInfo& info, const Spans& spans,
                        ffi::DataType type, MPI_Datatype dt, MPI_Op mop,
                        int64_t divisor) {
  // A bad divisor fails here, on every rank, before any rank waits.
  if (divisor != 1) {
    if (auto e = DivideInPlace(type, nullptr, 0, divisor); e.failure())
      return e;
  }
  HandlerCaller caller(info, type, divisor);
  return ToFfi(node_local::CmaAllreduce(info.dc->node, caller, spans, dt, mop));
}

}  // namespace

ffi::ErrorOr<int> AllreducePath(const CallInfo& info, size_t bytes,
                                size_t buffers, bool in_place) {
  auto cma = UseCma(info, bytes, buffers);
  if (cma.has_error()) return ffi::Unexpected(cma.error());
  if (*cma) return kPathCma;
  if (UseRing(info, bytes, in_place)) return kPathRing;
  if (buffers == 1) {
    auto shm = UseShm(info, bytes);
    if (shm.has_error()) return ffi::Unexpected(shm.error());
    if (*shm) return kPathShm;
  }
  return kPathMpi;
}

ffi::Error AllreduceBuffer(const CallInfo& info, MPI_Comm comm,
                           ffi::AnyBuffer x, ffi::AnyBuffer out, int64_t op,
                           int64_t divisor) {
  ffi::DataType type = x.element_type();
  size_t n = x.element_count();
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out.untyped_data());
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(type, op, &dt, &mop); e.failure()) return e;
  size_t es = ffi::ByteWidth(type);
  bool in_place = src == dst;  // the output aliases the (donated) input
  auto path = AllreducePath(info, n * es, 1, in_place);
  if (path.has_error()) return path.error();
  info.path |= *path;
  if (*path == kPathCma || *path == kPathRing) {
    Spans spans(es);
    spans.Add(src, dst, n);
    if (*path == kPathCma)
      return CmaAllreduce(info, spans, type, dt, mop, divisor);
    return RingSegments(info, comm, spans, type, dt, mop, divisor);
  }
  if (*path == kPathShm) {
    HandlerCaller caller(info, type, divisor);
    return ToFfi(node_local::ShmAllreduce(info.dc->node, caller, src, dst, n,
                                          es, dt, mop));
  }
  size_t chunk = ChunkElems(es);
  for (size_t off = 0; off < n; off += chunk) {
    int count = static_cast<int>(std::min(chunk, n - off));
    const void* send = in_place ? MPI_IN_PLACE : src + off * es;
    MPIJAX_COLLECTIVE(
        info, comm, count * es,
        MPI_Allreduce(send, dst + off * es, count, dt, mop, comm),
        MPI_Iallreduce(send, dst + off * es, count, dt, mop, comm, &req_));
    if (divisor != 1) {
      if (auto e = DivideInPlace(type, dst + off * es, count, divisor);
          e.failure())
        return e;
    }
  }
  return ffi::Error::Success();
}

ffi::Error AllreduceBuffers(
    CallInfo& info, MPI_Comm comm,
    const std::vector<std::pair<ffi::AnyBuffer, ffi::AnyBuffer>>& bufs,
    int64_t op) {
  if (bufs.empty()) return ffi::Error::Success();
  ffi::DataType type = bufs.front().first.element_type();
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(type, op, &dt, &mop); e.failure()) return e;
  Spans spans(ffi::ByteWidth(type));
  for (const auto& [x, out] : bufs) {
    spans.Add(static_cast<const char*>(x.untyped_data()),
              static_cast<char*>(out.untyped_data()), x.element_count());
  }
  info.dtype = type;
  info.dims = bufs.front().first.dimensions();
  auto path = AllreducePath(info, spans.size() * spans.elem_bytes(),
                            spans.buffers(), spans.any_in_place());
  if (path.has_error()) return path.error();
  if (*path == kPathCma) {
    info.path |= kPathCma;
    return CmaAllreduce(info, spans, type, dt, mop, 1);
  }
  if (*path == kPathRing) {
    info.path |= kPathRing;
    return RingSegments(info, comm, spans, type, dt, mop, 1);
  }
  // Shared memory takes one buffer at a time, as MPI's all-reduce does: each
  // buffer goes its own way (AllreducePath again, for that buffer alone).
  for (const auto& [x, out] : bufs) {
    info.dims = x.dimensions();
    if (auto e = AllreduceBuffer(info, comm, x, out, op, 1); e.failure())
      return e;
  }
  return ffi::Error::Success();
}

ffi::Error DeviceAllreduce(const CallInfo& info, ffi::AnyBuffer x,
                           ffi::AnyBuffer out, int64_t op) {
  node_local::Comm& group = info.dc->group;
  ffi::DataType type = x.element_type();
  size_t es = ffi::ByteWidth(type), n = x.element_count(), bytes = n * es;
  if (group.state != 1) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      info.Describe() + ": the node-local segments of the "
                      "all-reduce over every device are not set up (the "
                      "program was compiled in another process?)");
  }
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(type, op, &dt, &mop); e.failure()) return e;
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out.untyped_data());
  HandlerCaller caller(info, type, 1);
  int64_t cma_min = g_settings.cma_min_bytes.load(std::memory_order_relaxed);
  size_t shm_max = static_cast<size_t>(std::max<int64_t>(
      g_settings.shm_max_bytes.load(std::memory_order_relaxed), 0));
  // Cross-memory attach from cma_min_bytes, and wherever shared memory does
  // not take the message; shared memory otherwise (Python chose this op
  // only where one of them applies).
  bool cma = group.cma_ok && cma_min > 0 &&
             (bytes >= static_cast<size_t>(cma_min) ||
              bytes > std::min(shm_max, group.segment_bytes()));
  if (cma) {
    Spans spans(es);
    spans.Add(src, dst, n);
    return ToFfi(node_local::CmaAllreduce(group, caller, spans, dt, mop));
  }
  if (bytes > group.segment_bytes()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      info.Describe() + ": " + std::to_string(bytes) +
                      " bytes do not fit the node-local segment (" +
                      std::to_string(group.segment_bytes()) +
                      " bytes) and cross-memory attach is off");
  }
  return ToFfi(node_local::ShmAllreduce(group, caller, src, dst, n, es, dt,
                                        mop));
}

}  // namespace mpijax::detail

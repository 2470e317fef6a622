// mpijax's MPI transport: XLA FFI handlers (CPU) that run MPI collectives on
// XLA's own buffers, plus the nanobind module that registers communicators and
// hands the handlers to jax.ffi.register_ffi_target.
//
// Design (see DESIGN.md, layer 3):
// * Every handler runs on a private communicator: Python registers, per user
//   communicator, one clone per local device index; the handler picks the one
//   of its local device (ffi::DeviceOrdinal), so several local devices calling
//   MPI at once pair up by local index across ranks.
// * Every wait goes through WaitAll(): a nonblocking MPI call polled with
//   MPI_Testall until done or until the configured timeout, which becomes an
//   ffi::Error naming the operation (never an abort, never a silent hang).
// * Messages larger than max_chunk_bytes are sent in pieces so MPI's int
//   counts never overflow.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "half.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace mpijax {
namespace {

// ---------------------------------------------------------------------------
// Settings and registries (written from Python, read by the handlers).

std::atomic<int64_t> g_max_chunk_bytes{int64_t{1} << 30};
std::atomic<double> g_timeout_s{0.0};

std::mutex g_comms_mu;
std::vector<std::vector<MPI_Comm>> g_comms;  // comm id -> one per local device

std::once_flag g_types_once;
MPI_Datatype g_half_type = MPI_DATATYPE_NULL;  // 2 opaque bytes (f16, bf16)
MPI_Op g_f16_ops[4];                           // sum, prod, min, max
MPI_Op g_bf16_ops[4];

enum ReduceOp : int64_t {
  kSum = 0, kProd = 1, kMin = 2, kMax = 3, kAnd = 4, kOr = 5, kXor = 6,
};
const char* kOpNames[] = {"sum", "prod", "min", "max", "and", "or", "xor"};

// ---------------------------------------------------------------------------
// float16 / bfloat16 reductions: widen to float per element, round back.

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int kOp>
void HalfOp(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]), r;
    if constexpr (kOp == kSum) r = x + y;
    else if constexpr (kOp == kProd) r = x * y;
    // NaN propagates like MPI_MIN/MAX on floats in practice (x != x).
    else if constexpr (kOp == kMin) r = (x != x || x < y) ? x : y;
    else r = (x != x || x > y) ? x : y;
    b[i] = FromF(r);
  }
}

void InitTypesOnce() {
  std::call_once(g_types_once, [] {
    MPI_Type_contiguous(2, MPI_BYTE, &g_half_type);
    MPI_Type_commit(&g_half_type);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kSum>, 1, &g_f16_ops[0]);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kProd>, 1, &g_f16_ops[1]);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kMin>, 1, &g_f16_ops[2]);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kMax>, 1, &g_f16_ops[3]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kSum>, 1, &g_bf16_ops[0]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kProd>, 1, &g_bf16_ops[1]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kMin>, 1, &g_bf16_ops[2]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kMax>, 1, &g_bf16_ops[3]);
  });
}

// ---------------------------------------------------------------------------
// Describing a call, for error messages.

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "unsupported";
  }
}

struct CallInfo {
  const char* name;     // e.g. "allreduce"
  ffi::DataType dtype;
  ffi::Span<const int64_t> dims;
  int comm_size;
  int64_t comm_id;
  int64_t device;

  std::string Describe() const {
    std::ostringstream s;
    s << "mpijax.ops." << name << " on " << DtypeName(dtype) << "[";
    for (size_t i = 0; i < dims.size(); ++i) s << (i ? "," : "") << dims[i];
    s << "] (communicator " << comm_id << ", size " << comm_size
      << ", local device " << device << ")";
    return s.str();
  }
};

ffi::Error MpiError(int rc, const char* call, const CallInfo& info) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(call) + " failed in " + info.Describe() +
                        ": " + std::string(text, len));
}

#define MPIJAX_CHECK_MPI(call, info)                          \
  do {                                                        \
    int rc_ = (call);                                         \
    if (rc_ != MPI_SUCCESS) return MpiError(rc_, #call, info); \
  } while (0)

// The one place every operation waits. timeout <= 0 waits forever in
// MPI_Waitall; otherwise polls so a stall becomes an error, not a hang.
// (Issue 8 extends the expiry branch to name the ranks that did not arrive.)
ffi::Error WaitAll(int n, MPI_Request* reqs, const CallInfo& info) {
  double timeout = g_timeout_s.load(std::memory_order_relaxed);
  if (timeout <= 0) {
    MPIJAX_CHECK_MPI(MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE), info);
    return ffi::Error::Success();
  }
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeout));
  for (uint64_t spin = 0;; ++spin) {
    int done = 0;
    MPIJAX_CHECK_MPI(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE), info);
    if (done) return ffi::Error::Success();
    // Reading the clock every poll would cost more than a small message.
    if ((spin & 255) == 255) {
      if (Clock::now() > deadline) {
        std::ostringstream s;
        s << info.Describe() << " timed out: not complete after " << timeout
          << " s (MPIJAX_TIMEOUT). Another rank is probably not calling the "
             "same collective; every rank must run the same collectives in "
             "the same order.";
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, s.str());
      }
      // Oversubscribed ranks (more ranks than cores) need the CPU back.
      if (spin > 4096) std::this_thread::yield();
    }
  }
}

ffi::Error Wait(MPI_Request* req, const CallInfo& info) {
  return WaitAll(1, req, info);
}

ffi::ErrorOr<MPI_Comm> GetComm(int64_t comm_id, int64_t device) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  if (comm_id < 0 || comm_id >= static_cast<int64_t>(g_comms.size())) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: unknown communicator id " + std::to_string(comm_id) +
        " (was the program compiled in another process?)"));
  }
  const auto& per_device = g_comms[comm_id];
  if (per_device.empty()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: communicator " + std::to_string(comm_id) +
        " was freed by mpijax.shutdown(); this compiled program is stale. "
        "Call jax.clear_caches() after re-running mpijax.init()."));
  }
  if (device < 0 || device >= static_cast<int64_t>(per_device.size())) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: local device ordinal " + std::to_string(device) +
        " has no sub-communicator; communicator " + std::to_string(comm_id) +
        " was registered for " + std::to_string(per_device.size()) +
        " local devices. Call mpijax.init() after setting the number of "
        "local devices."));
  }
  return per_device[device];
}

// Element type and reduction op for a (dtype, op) pair. Python checks the
// combination at trace time; this is the last line of defence.
ffi::Error ReductionTypes(ffi::DataType t, int64_t op, MPI_Datatype* dt,
                          MPI_Op* mop) {
  if (op < kSum || op > kXor) {
    return ffi::Error::InvalidArgument("mpijax: unknown reduction op code " +
                                       std::to_string(op));
  }
  bool is_float = false, is_complex = false, is_half = false;
  switch (t) {
    case ffi::DataType::PRED: *dt = MPI_UINT8_T; break;
    case ffi::DataType::S8: *dt = MPI_INT8_T; break;
    case ffi::DataType::S16: *dt = MPI_INT16_T; break;
    case ffi::DataType::S32: *dt = MPI_INT32_T; break;
    case ffi::DataType::S64: *dt = MPI_INT64_T; break;
    case ffi::DataType::U8: *dt = MPI_UINT8_T; break;
    case ffi::DataType::U16: *dt = MPI_UINT16_T; break;
    case ffi::DataType::U32: *dt = MPI_UINT32_T; break;
    case ffi::DataType::U64: *dt = MPI_UINT64_T; break;
    case ffi::DataType::F32: *dt = MPI_FLOAT; is_float = true; break;
    case ffi::DataType::F64: *dt = MPI_DOUBLE; is_float = true; break;
    case ffi::DataType::C64: *dt = MPI_C_FLOAT_COMPLEX; is_complex = true; break;
    case ffi::DataType::C128: *dt = MPI_C_DOUBLE_COMPLEX; is_complex = true; break;
    case ffi::DataType::F16:
    case ffi::DataType::BF16: *dt = g_half_type; is_half = true; break;
    default:
      return ffi::Error::InvalidArgument(
          std::string("mpijax: unsupported dtype for a reduction: ") +
          DtypeName(t));
  }
  bool bad = ((is_float || is_complex || is_half) && op >= kAnd) ||
             (is_complex && (op == kMin || op == kMax)) ||
             (t == ffi::DataType::PRED && (op == kSum || op == kProd));
  if (bad) {
    return ffi::Error::InvalidArgument(std::string("mpijax: op '") +
                                       kOpNames[op] + "' is not defined for " +
                                       DtypeName(t));
  }
  if (is_half) {
    *mop = (t == ffi::DataType::F16 ? g_f16_ops : g_bf16_ops)[op];
    return ffi::Error::Success();
  }
  static const MPI_Op kOps[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX,
                                MPI_BAND, MPI_BOR, MPI_BXOR};
  *mop = kOps[op];
  return ffi::Error::Success();
}

// Elements per message: at most max_chunk_bytes and never above INT_MAX.
size_t ChunkElems(size_t elem_bytes) {
  int64_t max_bytes = std::max<int64_t>(g_max_chunk_bytes.load(), 1);
  size_t n = std::max<size_t>(static_cast<size_t>(max_bytes) / elem_bytes, 1);
  return std::min<size_t>(n, INT_MAX);
}

// A byte block of `len` bytes whose extent is `stride`: lets one collective
// move chunk c of every rank's block without a staging copy.
struct StridedBytes {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  StridedBytes(size_t len, size_t stride) {
    MPI_Datatype block;
    MPI_Type_contiguous(static_cast<int>(len), MPI_BYTE, &block);
    MPI_Type_create_resized(block, 0, static_cast<MPI_Aint>(stride), &type);
    MPI_Type_commit(&type);
    MPI_Type_free(&block);
  }
  ~StridedBytes() { MPI_Type_free(&type); }
};

int CommRank(MPI_Comm c) { int r = 0; MPI_Comm_rank(c, &r); return r; }
int CommSize(MPI_Comm c) { int s = 0; MPI_Comm_size(c, &s); return s; }

#define MPIJAX_GET_COMM(var, comm_id, device)          \
  auto var##_or = GetComm(comm_id, device);            \
  if (var##_or.has_error()) return var##_or.error();   \
  MPI_Comm var = var##_or.value();

// ---------------------------------------------------------------------------
// Handlers.

ffi::Error AllreduceImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                         int64_t op) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allreduce", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop); e.failure())
    return e;
  size_t n = x.element_count(), es = ffi::ByteWidth(x.element_type());
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  bool in_place = src == dst;  // the output aliases the (donated) input
  size_t chunk = ChunkElems(es);
  for (size_t off = 0; off < n; off += chunk) {
    int count = static_cast<int>(std::min(chunk, n - off));
    MPI_Request req;
    MPIJAX_CHECK_MPI(
        MPI_Iallreduce(in_place ? MPI_IN_PLACE : src + off * es,
                       dst + off * es, count, dt, mop, comm, &req),
        info);
    if (auto e = Wait(&req, info); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error AllgatherImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allgather", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  size_t chunk = ChunkElems(1);
  if (nb == 0) return ffi::Error::Success();
  if (nb <= chunk) {
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Iallgather(src, static_cast<int>(nb), MPI_BYTE, dst,
                                    static_cast<int>(nb), MPI_BYTE, comm, &req),
                     info);
    return Wait(&req, info);
  }
  for (size_t off = 0; off < nb; off += chunk) {
    size_t len = std::min(chunk, nb - off);
    StridedBytes recv_type(len, nb);
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Iallgather(src + off, static_cast<int>(len), MPI_BYTE,
                                    dst + off, 1, recv_type.type, comm, &req),
                     info);
    if (auto e = Wait(&req, info); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error ReduceScatterImpl(int64_t device, ffi::AnyBuffer x,
                             ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                             int64_t op) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm), rank = CommRank(comm);
  CallInfo info{"reduce_scatter", x.element_type(), x.dimensions(), size,
                comm_id, device};
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop); e.failure())
    return e;
  size_t es = ffi::ByteWidth(x.element_type());
  size_t n = out->element_count();  // elements per rank
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  size_t chunk = ChunkElems(es);
  if (n == 0) return ffi::Error::Success();
  if (n <= chunk) {
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Ireduce_scatter_block(src, dst, static_cast<int>(n),
                                               dt, mop, comm, &req),
                     info);
    return Wait(&req, info);
  }
  // Huge blocks: one contiguous reduce per (destination, chunk); reductions
  // over strided derived types are not portable for user-defined ops.
  for (int r = 0; r < size; ++r) {
    for (size_t off = 0; off < n; off += chunk) {
      int count = static_cast<int>(std::min(chunk, n - off));
      MPI_Request req;
      MPIJAX_CHECK_MPI(MPI_Ireduce(src + (r * n + off) * es,
                                   rank == r ? dst + off * es : nullptr, count,
                                   dt, mop, r, comm, &req),
                       info);
      if (auto e = Wait(&req, info); e.failure()) return e;
    }
  }
  return ffi::Error::Success();
}

ffi::Error AlltoallImpl(int64_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"alltoall", x.element_type(), x.dimensions(), size, comm_id,
                device};
  size_t nb = x.size_bytes() / std::max(size, 1);  // bytes per block
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  size_t chunk = ChunkElems(1);
  if (nb == 0) return ffi::Error::Success();
  if (nb <= chunk) {
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Ialltoall(src == dst ? MPI_IN_PLACE : src,
                                   static_cast<int>(nb), MPI_BYTE, dst,
                                   static_cast<int>(nb), MPI_BYTE, comm, &req),
                     info);
    return Wait(&req, info);
  }
  if (src == dst) {
    return ffi::Error::InvalidArgument(
        info.Describe() + ": in-place alltoall of blocks larger than "
        "max_chunk_bytes is not supported; do not alias this output.");
  }
  for (size_t off = 0; off < nb; off += chunk) {
    size_t len = std::min(chunk, nb - off);
    StridedBytes block(len, nb);
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Ialltoall(src + off, 1, block.type, dst + off, 1,
                                   block.type, comm, &req),
                     info);
    if (auto e = Wait(&req, info); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error BcastImpl(int64_t device, ffi::AnyBuffer x,
                     ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                     int64_t root) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"bcast", x.element_type(), x.dimensions(), size, comm_id,
                device};
  if (root < 0 || root >= size) {
    return ffi::Error::InvalidArgument(info.Describe() + ": root " +
                                       std::to_string(root) + " out of range");
  }
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  if (CommRank(comm) == root && src != dst) std::memcpy(dst, src, nb);
  size_t chunk = ChunkElems(1);
  for (size_t off = 0; off < nb; off += chunk) {
    int len = static_cast<int>(std::min(chunk, nb - off));
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Ibcast(dst + off, len, MPI_BYTE,
                                static_cast<int>(root), comm, &req),
                     info);
    if (auto e = Wait(&req, info); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// Sum (or op) to root; zeros on the other ranks. The transpose of bcast.
ffi::Error ReduceImpl(int64_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                      int64_t op, int64_t root) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  bool is_root = CommRank(comm) == root;
  CallInfo info{"reduce", x.element_type(), x.dimensions(), size, comm_id,
                device};
  if (root < 0 || root >= size) {
    return ffi::Error::InvalidArgument(info.Describe() + ": root " +
                                       std::to_string(root) + " out of range");
  }
  MPI_Datatype dt;
  MPI_Op mop;
  if (auto e = ReductionTypes(x.element_type(), op, &dt, &mop); e.failure())
    return e;
  size_t n = x.element_count(), es = ffi::ByteWidth(x.element_type());
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  size_t chunk = ChunkElems(es);
  for (size_t off = 0; off < n; off += chunk) {
    int count = static_cast<int>(std::min(chunk, n - off));
    const void* send = (is_root && src == dst) ? MPI_IN_PLACE : src + off * es;
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Ireduce(send, dst + off * es, count, dt, mop,
                                 static_cast<int>(root), comm, &req),
                     info);
    if (auto e = Wait(&req, info); e.failure()) return e;
  }
  if (!is_root) std::memset(dst, 0, n * es);
  return ffi::Error::Success();
}

// Point-to-point by a permutation given as (srcs[i] -> dsts[i]) rank pairs.
// A rank nobody sends to gets zeros (jax.lax.ppermute semantics).
ffi::Error PpermuteImpl(int64_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                        ffi::Span<const int64_t> srcs,
                        ffi::Span<const int64_t> dsts) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm), rank = CommRank(comm);
  CallInfo info{"ppermute", x.element_type(), x.dimensions(), size, comm_id,
                device};
  if (srcs.size() != dsts.size()) {
    return ffi::Error::InvalidArgument(info.Describe() +
                                       ": srcs and dsts differ in length");
  }
  int send_to = -1, recv_from = -1;
  for (size_t i = 0; i < srcs.size(); ++i) {
    if (srcs[i] < 0 || srcs[i] >= size || dsts[i] < 0 || dsts[i] >= size) {
      return ffi::Error::InvalidArgument(info.Describe() +
                                         ": permutation names a rank outside "
                                         "the communicator");
    }
    if (srcs[i] == rank) send_to = static_cast<int>(dsts[i]);
    if (dsts[i] == rank) recv_from = static_cast<int>(srcs[i]);
  }
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  if (send_to == rank && recv_from == rank) {
    if (src != dst) std::memcpy(dst, src, nb);
    return ffi::Error::Success();
  }
  size_t chunk = ChunkElems(1);
  for (size_t off = 0; off < nb; off += chunk) {
    int len = static_cast<int>(std::min(chunk, nb - off));
    MPI_Request reqs[2];
    int nreq = 0;
    if (recv_from >= 0) {
      MPIJAX_CHECK_MPI(MPI_Irecv(dst + off, len, MPI_BYTE, recv_from, 0, comm,
                                 &reqs[nreq++]),
                       info);
    }
    if (send_to >= 0) {
      MPIJAX_CHECK_MPI(MPI_Isend(src + off, len, MPI_BYTE, send_to, 0, comm,
                                 &reqs[nreq++]),
                       info);
    }
    if (auto e = WaitAll(nreq, reqs, info); e.failure()) return e;
  }
  if (recv_from < 0) std::memset(dst, 0, nb);
  return ffi::Error::Success();
}

ffi::Error BarrierImpl(int64_t device, ffi::AnyBuffer /*token_in*/,
                       ffi::Result<ffi::AnyBuffer> /*token_out*/,
                       int64_t comm_id) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"barrier", ffi::DataType::INVALID, {}, CommSize(comm), comm_id,
                device};
  MPI_Request req;
  MPIJAX_CHECK_MPI(MPI_Ibarrier(comm, &req), info);
  return Wait(&req, info);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduce, AllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllgather, AllgatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduceScatter, ReduceScatterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAlltoall, AlltoallImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBcast, BcastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduce, ReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPpermute, PpermuteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int64_t>>("srcs")
                                  .Attr<ffi::Span<const int64_t>>("dsts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier, BarrierImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm"));

// ---------------------------------------------------------------------------
// Python module.

namespace {

// Open MPI's MPI_Comm is a pointer, MPICH's an int; mpi4py's
// MPI._handleof() gives the same bits as a Python int in both cases. (A
// template so the branch not taken is never instantiated.)
template <typename Comm = MPI_Comm>
Comm HandleToComm(uintptr_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);
  } else {
    return static_cast<Comm>(handle);
  }
}

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::string LinkedLibraryVersion() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  return std::string(text, len);
}

}  // namespace

NB_MODULE(_mpijax_ffi, m) {
  m.doc() = "mpijax's MPI transport: XLA FFI handlers and communicator table.";

  m.def("registrations", [] {
    nb::dict d;
    d["mpijax_allreduce"] = Capsule(kAllreduce);
    d["mpijax_allgather"] = Capsule(kAllgather);
    d["mpijax_reduce_scatter"] = Capsule(kReduceScatter);
    d["mpijax_alltoall"] = Capsule(kAlltoall);
    d["mpijax_bcast"] = Capsule(kBcast);
    d["mpijax_reduce"] = Capsule(kReduce);
    d["mpijax_ppermute"] = Capsule(kPpermute);
    d["mpijax_barrier"] = Capsule(kBarrier);
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");

  m.def("setup", [](int64_t max_chunk_bytes, double timeout_s) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      throw nb::value_error("mpijax: MPI is not initialized; import mpi4py.MPI "
                            "(or call mpijax.init()) first.");
    }
    if (max_chunk_bytes <= 0) {
      throw nb::value_error(("max_chunk_bytes must be positive, got " +
                             std::to_string(max_chunk_bytes)).c_str());
    }
    InitTypesOnce();
    g_max_chunk_bytes = max_chunk_bytes;
    g_timeout_s = timeout_s;
  }, nb::arg("max_chunk_bytes"), nb::arg("timeout_s"),
  "Creates the float16/bfloat16 MPI ops and sets chunk size and timeout.");

  m.def("register_comms", [](const std::vector<uintptr_t>& handles) {
    std::vector<MPI_Comm> comms;
    for (uintptr_t h : handles) {
      MPI_Comm c = HandleToComm(h);
      // Errors become ffi::Error (a Python exception), never an abort.
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
      comms.push_back(c);
    }
    std::lock_guard<std::mutex> lock(g_comms_mu);
    g_comms.push_back(std::move(comms));
    return static_cast<int64_t>(g_comms.size() - 1);
  }, nb::arg("handles"),
  "Registers one communicator per local device index (mpi4py handles from "
  "MPI._handleof); returns the id used as the ops' 'comm' attribute.");

  m.def("unregister_comms", [](int64_t comm_id) {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    if (comm_id >= 0 && comm_id < static_cast<int64_t>(g_comms.size())) {
      g_comms[comm_id].clear();  // later calls fail cleanly, never use freed comms
    }
  }, nb::arg("comm_id"),
  "Forgets the communicators of comm_id (before Python frees them).");

  m.def("build_mpi_version", [] {
#if defined(MPIJAX_BUILD_MPI_VERSION)
    return std::string(MPIJAX_BUILD_MPI_VERSION);
#else
    return std::string("unknown");
#endif
  }, "The MPI family and version of the mpi.h this module was compiled with.");

  m.def("linked_library_version", &LinkedLibraryVersion,
        "MPI_Get_library_version of the libmpi this module resolved to.");
}

}  // namespace mpijax

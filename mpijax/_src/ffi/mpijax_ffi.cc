// mpijax's MPI transport: XLA FFI handlers (CPU) that run MPI collectives on
// XLA's own buffers, plus the nanobind module that registers communicators and
// hands the handlers to jax.ffi.register_ffi_target.
//
// Design (see DESIGN.md, layer 3):
// * Every handler runs on a private communicator: Python registers, per user
//   communicator, one clone per local device index; the handler picks the one
//   of its local device (ffi::DeviceOrdinal), so several local devices calling
//   MPI at once pair up by local index across ranks.
// * No wait hangs silently: a blocking MPI call runs under the watchdog
//   thread, and every other wait goes through WaitAll(), polled with
//   MPI_Testall; past MPIJAX_TIMEOUT the stall inspector names the ranks that
//   have not arrived (see ReportStall).
// * Messages larger than max_chunk_bytes are sent in pieces so MPI's int
//   counts never overflow.
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <sys/uio.h>  // iovec; on Linux process_vm_readv/writev (CmaAllreduce)
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
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
// From this size on a collective runs MPI's blocking algorithm under the
// watchdog: Open MPI's tuned blocking collectives are faster than the
// nonblocking (libnbc) ones a polled wait needs at every size (2 ranks, same
// job: 4 B 10.2 vs 11.6 us per jitted call, 4 KiB 9.4 vs 15.3 us).
std::atomic<int64_t> g_blocking_min_bytes{0};
// Without the watchdog a blocking call must first check that every rank has
// arrived (a polled MPI_Ibarrier round trip), which only pays off from here.
constexpr int64_t kUnwatchedBlockingMinBytes = int64_t{64} << 10;
// From this many bytes per rank (a message's size over the communicator's)
// an all-reduce runs mpijax's own ring (RingAllreduce); <= 0: never. In
// place the ring saves no input copy, and MPI's own algorithm (fewer steps)
// is as fast up to a few MiB, hence a second, larger threshold.
std::atomic<int64_t> g_ring_min_bytes{int64_t{128} << 10};
std::atomic<int64_t> g_ring_in_place_min_bytes{int64_t{4} << 20};
// All-reduces of at most this many bytes, on a communicator whose ranks
// share one node (and one local device each), go through node-local shared
// memory (ShmAllreduce) instead of MPI; <= 0: never. Also each rank's
// segment size, fixed when a communicator first uses it.
std::atomic<int64_t> g_shm_max_bytes{int64_t{1} << 20};
// All-reduces of at least this many bytes, on such a communicator, are
// reduced by each rank reading the other ranks' buffers and writing its
// block of the result into theirs with cross-memory attach (CmaAllreduce);
// <= 0: never. They go before the ring and shared memory.
std::atomic<int64_t> g_cma_min_bytes{int64_t{64} << 10};
std::atomic<bool> g_stall_abort{true};   // MPIJAX_STALL_ACTION=abort
std::atomic<bool> g_check_every{false};  // MPIJAX_CHECK=1

using Clock = std::chrono::steady_clock;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

// What one (communicator, local device) is doing, for the stall inspector.
// Written by the handler thread with relaxed atomics (a few stores per call:
// the fast path stays lean), read by the responder thread.
struct Status {
  std::atomic<int64_t> calls{0};     // calls entered so far
  std::atomic<int64_t> site{-1};     // site id of the current / last call
  std::atomic<int64_t> since_ns{0};  // entered (in a call) or left (idle)
  std::atomic<int> phase{0};         // 0 idle, 1 mismatch check, 2 collective
  // Nonzero while in a blocking MPI call the watchdog guards: when it entered.
  std::atomic<int64_t> blocking_since_ns{0};
};

// One local device's private communicators: `comm` carries the collectives,
// `check` only the signature checks, so a check on one rank can never pair
// up with (and corrupt) a real collective on another: a divergence there is
// a stall the inspector reports, never silent garbage.
struct DevComm {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm check = MPI_COMM_NULL;
  int64_t key = -1;  // the communicator's id, agreed by all its ranks
  // Local devices of the communicator: with more than one, their threads
  // call MPI at the same time, and every wait is polled (see WaitAll).
  int local_devices = 1;
  int64_t index = 0;  // its local device index (XLA's ordinal may differ)
  Status status;
  // Node-local shared memory (ShmAllreduce), mapped by the first call that
  // can use it; touched only by this device's handler thread.
  int shm_state = 0;  // 0 not tried yet, 1 mapped, -1 unavailable
  char* shm_base = nullptr;
  size_t shm_stride = 0, shm_map_bytes = 0;  // header + segment; all slots
  int shm_rank = 0;
  bool shm_oversubscribed = false;  // more ranks on the node than cores
  uint64_t shm_seq = 0;  // calls so far: the same on every rank
  // Every rank can read and write every other's memory with cross-memory
  // attach (probed by ShmSetup): CmaAllreduce may run.
  bool cma_ok = false;
  uint64_t p2p_seq = 0;  // ppermute calls so far: the same on every rank
};

struct CommEntry {
  int64_t key = -1;
  // unique_ptr: DevComm holds atomics; entries are never deleted (a freed
  // communicator keeps its memory so the responder never reads freed state).
  std::vector<std::unique_ptr<DevComm>> devs;
  // XLA's device ordinal of each local device index: the device's id, which
  // is the local index in a single-process JAX but a global id (e.g. 2048 on
  // the second process) under jax.distributed.
  std::vector<int64_t> ordinals;
  bool freed = false;
};

std::mutex g_comms_mu;
std::vector<CommEntry> g_comms;  // comm id -> one DevComm per local device

// Call sites: id -> "allreduce(float32[4], sum) at train.py:42", registered
// by Python at lowering time, and which local devices already checked them.
// "Checked" flags belong to a check slot, i.e. to a (signature,
// communicator) pair, not to the site text: whether a call is compared must
// depend only on what every rank agrees on (the sequence of signatures), never
// on per-rank compilation history (e.g. a program cached on one rank under
// another call site).
struct Site {
  std::string text;
  std::atomic<uint64_t>* checked = nullptr;  // bit d: device d compared it
};
std::mutex g_sites_mu;
std::deque<Site> g_sites;
std::deque<std::atomic<uint64_t>> g_check_slots;  // stable addresses

int CommRank(MPI_Comm c) { int r = 0; MPI_Comm_rank(c, &r); return r; }
int CommSize(MPI_Comm c) { int s = 0; MPI_Comm_size(c, &s); return s; }

std::string SiteText(int64_t site) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  if (site < 0 || site >= static_cast<int64_t>(g_sites.size()))
    return "an unknown operation";
  return g_sites[site].text;
}

Site* GetSite(int64_t site) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  if (site < 0 || site >= static_cast<int64_t>(g_sites.size())) return nullptr;
  return &g_sites[site];
}

std::once_flag g_types_once;
MPI_Datatype g_half_type = MPI_DATATYPE_NULL;  // 2 opaque bytes (f16, bf16)
MPI_Op g_f16_ops[4];                           // sum, prod, min, max
MPI_Op g_bf16_ops[4];
// 8- and 16-bit integer sums that wrap around like XLA's: Open MPI's AVX
// kernels (op/avx, on by default on x86) add these with saturating
// instructions (open-mpi/ompi#8045, 'wontfix'): int8 100 + 100 came back 127
// from 64 elements on, where jax.lax gives -56. Signed and unsigned share
// the op: two's-complement addition is the same bits.
MPI_Op g_wrap_sum8 = MPI_OP_NULL, g_wrap_sum16 = MPI_OP_NULL;

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

template <typename U>
void WrapSumOp(void* in, void* inout, int* len, MPI_Datatype*) {
  const U* a = static_cast<const U*>(in);
  U* b = static_cast<U*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<U>(a[i] + b[i]);
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
    MPI_Op_create(&WrapSumOp<uint8_t>, 1, &g_wrap_sum8);
    MPI_Op_create(&WrapSumOp<uint16_t>, 1, &g_wrap_sum16);
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
  DevComm* dc = nullptr;  // set by MPIJAX_ENTER
  int64_t site = -1;
  int64_t sig = 0;

  std::string Describe() const {
    std::ostringstream s;
    s << "mpijax.ops." << name << " on " << DtypeName(dtype) << "[";
    for (size_t i = 0; i < dims.size(); ++i) s << (i ? "," : "") << dims[i];
    s << "] (communicator " << comm_id << ", size " << comm_size
      << ", local device " << device << ")";
    return s.str();
  }
};

// An MPI error inside a handler leaves the communicator, and with requests
// still pending into XLA's buffers the process's memory, in an undefined
// state: returning an error would let XLA free buffers that MPI may still
// write (measured: heap corruption after MPI_ERR_TRUNCATE in the ring, and
// the other rank returning garbage as a result). So the rank reports and
// takes the job down, as a rank that raises does.
ffi::Error MpiError(int rc, const char* call, const CallInfo& info) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(
      stderr,
      "mpijax: rank %d: %s failed in %s: %.*s\n"
      "mpijax: a size or truncation error means the ranks called this collective "
      "with different shapes, dtypes or ops after its first-call check; "
      "MPIJAX_CHECK=1 compares every call and names the ranks. The MPI state is "
      "undefined after an error: aborting the job.\n",
      rank, call, info.Describe().c_str(), len, text);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(call) + " failed in " + info.Describe() +
                        ": " + std::string(text, len));
}

#define MPIJAX_CHECK_MPI(call, info)                          \
  do {                                                        \
    int rc_ = (call);                                         \
    if (rc_ != MPI_SUCCESS) return MpiError(rc_, #call, info); \
  } while (0)

// ---------------------------------------------------------------------------
// Stall inspector. Each process runs one responder thread on a private clone
// of the runtime's communicator; it polls for status queries (MPI_Iprobe,
// then sleeps, so it costs nothing measurable) and answers with what its
// (communicator, device) is doing. A rank whose wait passes the deadline asks
// the other ranks of the op's communicator and prints who has not arrived.

constexpr int kQueryTag = 7001;
constexpr int kReplyTagBase = 7002;  // + (query sequence % 20000)
constexpr double kReplyWaitS = 2.0;

std::mutex g_insp_mu;                  // start / stop
std::atomic<MPI_Comm> g_insp_comm{MPI_COMM_NULL};
std::thread* g_responder = nullptr;    // joined by StopInspector
std::atomic<bool> g_responder_stop{false};
std::thread* g_watchdog = nullptr;     // joined by StopInspector
std::atomic<bool> g_watchdog_running{false};
std::atomic<int64_t> g_query_seq{0};

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s);
  return buf;
}

DevComm* FindDev(int64_t key, int64_t device) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  for (auto& e : g_comms) {
    if (e.key == key && !e.freed && device >= 0 &&
        device < static_cast<int64_t>(e.devs.size()))
      return e.devs[device].get();
  }
  return nullptr;
}

// "<calls> <phase> <human text>" for (key, device), as sent to an asker.
std::string DescribeStatus(int64_t key, int64_t device) {
  DevComm* dc = FindDev(key, device);
  if (dc == nullptr) return "0 0 has not used this communicator yet";
  const Status& st = dc->status;
  int64_t calls = st.calls.load(std::memory_order_relaxed);
  int phase = st.phase.load(std::memory_order_relaxed);
  int64_t site = st.site.load(std::memory_order_relaxed);
  double secs = (NowNs() - st.since_ns.load(std::memory_order_relaxed)) * 1e-9;
  std::ostringstream s;
  s << calls << " " << phase << " ";
  if (calls == 0) {
    s << "idle, no call on this communicator yet";
  } else if (phase == 0) {
    s << "idle since " << Seconds(secs) << " s; last: " << SiteText(site)
      << ", call #" << calls;
  } else {
    s << "in call #" << calls << " since " << Seconds(secs) << " s: "
      << (phase == 1 ? "signature check before " : "") << SiteText(site);
  }
  return s.str();
}

void ResponderLoop(MPI_Comm comm) {
  struct Pending {
    MPI_Request req;
    std::unique_ptr<std::string> text;
  };
  std::vector<Pending> pending;
  while (!g_responder_stop.load(std::memory_order_relaxed)) {
    for (size_t i = 0; i < pending.size();) {
      int done = 0;
      MPI_Test(&pending[i].req, &done, MPI_STATUS_IGNORE);
      if (done) {
        pending[i] = std::move(pending.back());
        pending.pop_back();
      } else {
        ++i;
      }
    }
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, comm, &flag, &st) != MPI_SUCCESS)
      break;
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int64_t q[3];  // key, device, reply tag
    MPI_Recv(q, 3, MPI_INT64_T, st.MPI_SOURCE, kQueryTag, comm,
             MPI_STATUS_IGNORE);
    Pending p{MPI_REQUEST_NULL,
              std::make_unique<std::string>(DescribeStatus(q[0], q[1]))};
    MPI_Isend(p.text->data(), static_cast<int>(p.text->size()), MPI_CHAR,
              st.MPI_SOURCE, static_cast<int>(q[2]), comm, &p.req);
    pending.push_back(std::move(p));
  }
  for (auto& p : pending) {  // an asker that died: drop, leak the text
    MPI_Cancel(&p.req);
    MPI_Request_free(&p.req);
    p.text.release();
  }
}

void StopInspector() {
  std::lock_guard<std::mutex> lock(g_insp_mu);
  g_responder_stop = true;
  g_watchdog_running = false;  // from now on large calls check arrival first
  if (g_watchdog != nullptr) {
    g_watchdog->join();
    delete g_watchdog;
    g_watchdog = nullptr;
  }
  if (g_responder != nullptr) {
    g_responder->join();
    delete g_responder;
    g_responder = nullptr;
  }
  g_insp_comm = MPI_COMM_NULL;
}

// Asks every other rank of the stalled op's communicator for its status,
// prints the report on stderr, then ends the job (MPIJAX_STALL_ACTION=abort)
// or returns so the caller keeps waiting (warn).
void ReportStall(const CallInfo& info, double waited) {
  DevComm* dc = info.dc;
  MPI_Comm insp = g_insp_comm.load();
  int my_insp_rank = insp == MPI_COMM_NULL ? -1 : CommRank(insp);
  const Status& st = dc->status;
  int64_t my_calls = st.calls.load(std::memory_order_relaxed);
  int my_phase = st.phase.load(std::memory_order_relaxed);
  int n = CommSize(dc->comm), me = CommRank(dc->comm);
  std::ostringstream s;
  s << "mpijax: stall: rank " << (insp == MPI_COMM_NULL ? me : my_insp_rank)
    << " waited " << Seconds(waited) << " s in "
    << (my_phase == 1 ? "the signature check before " : "")
    << SiteText(info.site) << " (call #" << my_calls << " on communicator "
    << dc->key;
  if (info.device != 0) s << ", local device " << info.device;
  s << ").";
  if (insp == MPI_COMM_NULL) {
    s << " (The stall inspector is off: mpijax.init() did not start it, so "
         "the other ranks cannot be asked.)";
  } else {
    std::vector<int> ranks(n), world(n);
    for (int i = 0; i < n; ++i) ranks[i] = i;
    MPI_Group g, wg;
    MPI_Comm_group(dc->comm, &g);
    MPI_Comm_group(insp, &wg);
    MPI_Group_translate_ranks(g, n, ranks.data(), wg, world.data());
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    int tag = kReplyTagBase + static_cast<int>(g_query_seq++ % 20000);
    // Queries outlive this call if a peer never receives them: leaked.
    auto* queries = new std::vector<int64_t>(3 * n);
    std::vector<MPI_Request> sends;
    for (int r = 0; r < n; ++r) {
      if (r == me || world[r] == MPI_UNDEFINED) continue;
      int64_t* q = queries->data() + 3 * r;
      q[0] = dc->key; q[1] = info.device; q[2] = tag;
      MPI_Request req;
      MPI_Isend(q, 3, MPI_INT64_T, world[r], kQueryTag, insp, &req);
      sends.push_back(req);
    }
    std::vector<std::string> answer(n);
    std::vector<bool> got(n, false);
    got[me] = true;
    auto until = Clock::now() + std::chrono::milliseconds(
                                    static_cast<int>(kReplyWaitS * 1000));
    int missing = n - 1;
    while (missing > 0 && Clock::now() < until) {
      bool any = false;
      for (int r = 0; r < n; ++r) {
        if (got[r] || world[r] == MPI_UNDEFINED) continue;
        int flag = 0;
        MPI_Status rs;
        MPI_Iprobe(world[r], tag, insp, &flag, &rs);
        if (!flag) continue;
        int len = 0;
        MPI_Get_count(&rs, MPI_CHAR, &len);
        answer[r].resize(len);
        MPI_Recv(answer[r].data(), len, MPI_CHAR, world[r], tag, insp,
                 MPI_STATUS_IGNORE);
        got[r] = true;
        --missing;
        any = true;
      }
      if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    bool all_sent = true;
    for (auto& req : sends) {
      int done = 0;
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (!done) { all_sent = false; MPI_Request_free(&req); }
    }
    if (all_sent) delete queries;
    std::vector<std::string> late, arrived;
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      std::string who = "rank " + std::to_string(world[r]);
      if (!got[r]) {
        late.push_back(who + " (no answer within " + Seconds(kReplyWaitS) +
                       " s: the process died, is exiting, or is stuck "
                       "outside mpijax)");
        continue;
      }
      long long calls = 0;
      int phase = 0, used = 0;
      std::sscanf(answer[r].c_str(), "%lld %d %n", &calls, &phase, &used);
      if (calls == my_calls && phase == my_phase) {
        arrived.push_back(std::to_string(world[r]));
      } else {
        late.push_back(who + " (" + answer[r].substr(used) + ")");
      }
    }
    if (late.empty()) {
      s << " Every rank has arrived; the network may be stuck.";
    } else {
      s << " Not arrived: ";
      for (size_t i = 0; i < late.size(); ++i) s << (i ? ", " : "") << late[i];
      s << ".";
    }
    if (!arrived.empty()) {
      s << " Waiting in the same call: rank" << (arrived.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < arrived.size(); ++i)
        s << (i ? "," : "") << arrived[i];
      s << ".";
    }
  }
  s << " Every rank must call the same collectives in the same order "
       "(MPIJAX_TIMEOUT=" << g_timeout_s.load() << " s; MPIJAX_STALL_ACTION="
    << (g_stall_abort.load() ? "abort" : "warn") << ").\n";
  std::string text = s.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  if (g_stall_abort.load()) {
    // Give the launcher's output forwarding time to pass the report on.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// The watchdog thread guards blocking MPI calls (large messages): a thread
// inside one cannot poll its own deadline, so this thread looks at every
// (communicator, device) status a few times per second and, once a blocking
// call has run past MPIJAX_TIMEOUT, reports the stall like WaitAll does (the
// responder threads of the other ranks answer) and aborts the job, or with
// MPIJAX_STALL_ACTION=warn reports again every timeout. It replaces an
// MPI_Ibarrier round trip before every large call.
void WatchdogLoop() {
  struct Seen {
    int64_t since;    // the blocking call being watched
    int64_t next_ns;  // when to report (again)
  };
  std::vector<std::pair<DevComm*, Seen>> seen;
  while (!g_responder_stop.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    double timeout = g_timeout_s.load(std::memory_order_relaxed);
    if (timeout <= 0) continue;
    int64_t period = static_cast<int64_t>(timeout * 1e9);
    int64_t now = NowNs();
    struct Due {
      DevComm* dc;
      int64_t device;
      int64_t since;
    };
    std::vector<Due> due;
    {
      std::lock_guard<std::mutex> lock(g_comms_mu);
      for (auto& e : g_comms) {
        for (size_t d = 0; d < e.devs.size(); ++d) {
          DevComm* dc = e.devs[d].get();
          int64_t since =
              dc->status.blocking_since_ns.load(std::memory_order_relaxed);
          if (since != 0 && now - since > period)
            due.push_back({dc, static_cast<int64_t>(d), since});
        }
      }
    }
    for (const Due& u : due) {
      auto it = std::find_if(seen.begin(), seen.end(),
                             [&](const auto& p) { return p.first == u.dc; });
      if (it == seen.end()) {
        seen.push_back({u.dc, {0, 0}});
        it = seen.end() - 1;
      }
      if (it->second.since != u.since) it->second = {u.since, u.since + period};
      if (now < it->second.next_ns) continue;
      it->second.next_ns += period;
      CallInfo info{"collective", ffi::DataType::INVALID,
                    ffi::Span<const int64_t>(nullptr, 0), CommSize(u.dc->comm),
                    u.dc->key, u.device};
      info.dc = u.dc;
      info.site = u.dc->status.site.load(std::memory_order_relaxed);
      ReportStall(info, (now - u.since) * 1e-9);
    }
  }
}

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

// The deadline of one polled wait. Check() (called every few polls: reading
// the clock on every poll would cost more than a small message) does nothing
// without a timeout; past MPIJAX_TIMEOUT the stall inspector reports which
// ranks have not arrived, then aborts the job (or, with
// MPIJAX_STALL_ACTION=warn, returns, and the wait reports again one timeout
// later). A wait with no (communicator, device) to inspect fails instead.
class StallClock {
 public:
  explicit StallClock(const CallInfo& info)
      : info_(info),
        timeout_(g_timeout_s.load(std::memory_order_relaxed)),
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

// The one place every MPI request is waited for. Without a timeout it waits
// in MPI_Waitall (polled instead when several local devices wait at once:
// threads blocked in MPI together hand progress to each other through
// condition variables, measured 3-10x slower on 2 cores for a hierarchical
// psum); otherwise it polls under a StallClock. Returning an error on a
// stall is not an option: the pending request still owns XLA's buffers.
ffi::Error WaitAll(int n, MPI_Request* reqs, const CallInfo& info) {
  bool concurrent = info.dc != nullptr && info.dc->local_devices > 1;
  if (g_timeout_s.load(std::memory_order_relaxed) <= 0 && !concurrent) {
    MPIJAX_CHECK_MPI(MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE), info);
    return ffi::Error::Success();
  }
  StallClock clock(info);
  for (uint64_t spin = 0;; ++spin) {
    int done = 0;
    MPIJAX_CHECK_MPI(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE), info);
    if (done) return ffi::Error::Success();
    if ((spin & 255) == 255) {
      if (auto e = clock.Check(); e.failure()) return e;
      // Oversubscribed ranks (more ranks than cores) need the CPU back.
      if (spin > 4096) std::this_thread::yield();
    }
  }
}

ffi::Error Wait(MPI_Request* req, const CallInfo& info) {
  return WaitAll(1, req, info);
}

// Whether a collective of `bytes` runs blocking. Never with several local
// devices: their threads would block in MPI together (see WaitAll).
// Otherwise, without a timeout nothing needs polling; with one, a call of at
// least MPIJAX_BLOCKING_MIN_BYTES (default: every call) runs blocking under
// the watchdog (`*watched`) and smaller ones are polled nonblocking calls.
// When the inspector (and with it the watchdog) is not running, a blocking
// call first waits in a polled MPI_Ibarrier, after which only a rank that
// dies (which the launcher handles) can hold it up; that round trip is only
// worth it from kUnwatchedBlockingMinBytes on.
ffi::Error ChooseBlocking(MPI_Comm comm, size_t bytes, const CallInfo& info,
                          bool* blocking, bool* watched) {
  *watched = false;
  if (info.dc != nullptr && info.dc->local_devices > 1) {
    *blocking = false;
    return ffi::Error::Success();
  }
  if (g_timeout_s.load(std::memory_order_relaxed) <= 0) {
    *blocking = true;
    return ffi::Error::Success();
  }
  int64_t min_bytes = g_blocking_min_bytes.load(std::memory_order_relaxed);
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

// Runs BLOCKING_CALL or NONBLOCKING_CALL (which posts `req_`) and waits.
#define MPIJAX_COLLECTIVE(info, comm, bytes, BLOCKING_CALL, NONBLOCKING_CALL) \
  do {                                                                       \
    bool blocking_ = false, watched_ = false;                                \
    if (auto e_ = ChooseBlocking(comm, bytes, info, &blocking_, &watched_);  \
        e_.failure())                                                        \
      return e_;                                                             \
    if (blocking_) {                                                         \
      BlockingMark mark_(watched_ ? info.dc : nullptr);                      \
      MPIJAX_CHECK_MPI(BLOCKING_CALL, info);                                 \
    } else {                                                                 \
      MPI_Request req_;                                                      \
      MPIJAX_CHECK_MPI(NONBLOCKING_CALL, info);                              \
      if (auto e_ = Wait(&req_, info); e_.failure()) return e_;              \
    }                                                                        \
  } while (0)

ffi::ErrorOr<DevComm*> GetComm(int64_t comm_id, int64_t device) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  if (comm_id < 0 || comm_id >= static_cast<int64_t>(g_comms.size())) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: unknown communicator id " + std::to_string(comm_id) +
        " (was the program compiled in another process?)"));
  }
  const auto& entry = g_comms[comm_id];
  if (entry.freed) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "mpijax: communicator " + std::to_string(comm_id) +
        " was freed by mpijax.shutdown(); this compiled program is stale. "
        "Call jax.clear_caches() after re-running mpijax.init()."));
  }
  int64_t n = static_cast<int64_t>(entry.devs.size());
  if (device >= 0 && device < n && entry.ordinals[device] == device)
    return entry.devs[device].get();  // the usual case: ordinal = local index
  for (int64_t i = 0; i < n; ++i) {
    if (entry.ordinals[i] == device) return entry.devs[i].get();
  }
  return ffi::Unexpected(ffi::Error::InvalidArgument(
      "mpijax: local device ordinal " + std::to_string(device) +
      " has no sub-communicator; communicator " + std::to_string(comm_id) +
      " was registered for " + std::to_string(entry.devs.size()) +
      " local devices. Call mpijax.init() after setting the number of "
      "local devices."));
}

// Marks the (communicator, device) busy for the handler's lifetime.
struct CallScope {
  Status& st;
  CallScope(Status& s, int64_t site) : st(s) {
    st.site.store(site, std::memory_order_relaxed);
    st.since_ns.store(NowNs(), std::memory_order_relaxed);
    st.phase.store(2, std::memory_order_relaxed);
    st.calls.fetch_add(1, std::memory_order_relaxed);
  }
  ~CallScope() {
    st.since_ns.store(NowNs(), std::memory_order_relaxed);
    st.phase.store(0, std::memory_order_relaxed);
  }
};

// Every rank of the communicator gets this error, from the same check.
ffi::Error MismatchError(const CallInfo& info, int64_t sig) {
  DevComm* dc = info.dc;
  int n = CommSize(dc->check);
  std::string text = SiteText(info.site);
  int64_t mine[2] = {sig, static_cast<int64_t>(text.size())};
  std::vector<int64_t> all(2 * n);
  MPI_Request req;
  MPIJAX_CHECK_MPI(MPI_Iallgather(mine, 2, MPI_INT64_T, all.data(), 2,
                                  MPI_INT64_T, dc->check, &req), info);
  if (auto e = Wait(&req, info); e.failure()) return e;
  std::vector<int> counts(n), displs(n);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    counts[r] = static_cast<int>(all[2 * r + 1]);
    displs[r] = total;
    total += counts[r];
  }
  std::string texts(std::max(total, 1), '\0');
  MPIJAX_CHECK_MPI(MPI_Iallgatherv(text.data(), static_cast<int>(text.size()),
                                   MPI_CHAR, texts.data(), counts.data(),
                                   displs.data(), MPI_CHAR, dc->check, &req),
                   info);
  if (auto e = Wait(&req, info); e.failure()) return e;
  // Group ranks by signature, in order of first appearance.
  std::vector<int64_t> sigs;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < n; ++r) {
    auto it = std::find(sigs.begin(), sigs.end(), all[2 * r]);
    if (it == sigs.end()) {
      sigs.push_back(all[2 * r]);
      members.push_back({r});
    } else {
      members[it - sigs.begin()].push_back(r);
    }
  }
  std::ostringstream s;
  s << "mpijax: collective mismatch on communicator " << dc->key
    << " (call #" << dc->status.calls.load(std::memory_order_relaxed)
    << "): ";
  for (size_t g = 0; g < sigs.size(); ++g) {
    const auto& m = members[g];
    int first = m[0];
    if (g) s << (g + 1 == sigs.size() ? " but " : ", ");
    s << (m.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < m.size(); ++i) s << (i ? "," : "") << m[i];
    s << (m.size() > 1 ? " run " : " runs ")
      << texts.substr(displs[first], counts[first]);
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(sigs[g]));
    s << " [signature " << hex << "]";
  }
  s << ". Every rank must call the same collectives in the same order with "
       "the same shapes and dtypes.";
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.str());
}

// Compares this call's signature across the communicator's ranks: on the
// first execution of each call site, or on every call with MPIJAX_CHECK=1.
// Runs on the separate `check` communicator (see DevComm).
ffi::Error CheckSignature(const CallInfo& info, int64_t sig) {
  DevComm* dc = info.dc;
  Site* site = GetSite(info.site);
  uint64_t bit = info.device >= 0 && info.device < 64
                     ? (uint64_t{1} << info.device) : 0;
  bool every = g_check_every.load(std::memory_order_relaxed);
  if (!every && site != nullptr && bit != 0 &&
      (site->checked->load(std::memory_order_relaxed) & bit)) {
    return ffi::Error::Success();
  }
  if (info.comm_size > 1) {
    dc->status.phase.store(1, std::memory_order_relaxed);
    int64_t buf[2] = {sig, -sig};  // sig < 2^63: -sig never overflows
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, 2, MPI_INT64_T, MPI_MAX,
                                    dc->check, &req), info);
    if (auto e = Wait(&req, info); e.failure()) return e;
    dc->status.phase.store(2, std::memory_order_relaxed);
    if (buf[0] != -buf[1]) return MismatchError(info, sig);
  }
  if (site != nullptr && bit != 0) site->checked->fetch_or(bit);
  return ffi::Error::Success();
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
  if (op == kSum && (t == ffi::DataType::S8 || t == ffi::DataType::U8))
    *mop = g_wrap_sum8;
  if (op == kSum && (t == ffi::DataType::S16 || t == ffi::DataType::U16))
    *mop = g_wrap_sum16;
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


// `device` (XLA's ordinal) becomes the local device index from here on.
#define MPIJAX_GET_COMM(var, comm_id, device)          \
  auto var##_or = GetComm(comm_id, device);            \
  if (var##_or.has_error()) return var##_or.error();   \
  DevComm* var##_dc = var##_or.value();                \
  device = var##_dc->index;                            \
  MPI_Comm var = var##_dc->comm;

// After `info` is built: marks the call in the status table and compares
// signatures across ranks when due.
#define MPIJAX_ENTER(info_, var, site_id, signature)                   \
  info_.dc = var##_dc;                                                \
  info_.site = site_id;                                               \
  info_.sig = signature;                                              \
  CallScope scope_(var##_dc->status, site_id);                        \
  if (auto e_ = CheckSignature(info_, signature); e_.failure()) return e_;

// ---------------------------------------------------------------------------
// Handlers.

// Divides `count` elements at `p` by `divisor` in place, as XLA's `x / n`
// does (float16/bfloat16 through float): allreduce(op="mean"). Run right
// after each chunk's MPI call, so a chunk that fits in cache is divided
// there. (Inside a training step XLA's own division is cheaper still: it
// fuses into the optimizer's update, which is why mpijax.train uses it.)
template <typename T>
void DivideAll(T* p, size_t count, T d) {
  // x * (1/d) rounds exactly like x / d when d is a power of two (1/d is then
  // exact), and a multiply is several times cheaper than a divide.
  if (std::ilogb(d) >= 0 && std::scalbn(T(1), std::ilogb(d)) == d) {
    T r = T(1) / d;
    for (size_t i = 0; i < count; ++i) p[i] *= r;
  } else {
    for (size_t i = 0; i < count; ++i) p[i] /= d;
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void DivideHalf(uint16_t* p, size_t count, float d) {
  for (size_t i = 0; i < count; ++i) p[i] = FromF(ToF(p[i]) / d);
}

ffi::Error DivideInPlace(ffi::DataType t, void* p, size_t count,
                         int64_t divisor) {
  switch (t) {
    case ffi::DataType::F32:
      DivideAll(static_cast<float*>(p), count, static_cast<float>(divisor));
      break;
    case ffi::DataType::F64:
      DivideAll(static_cast<double*>(p), count, static_cast<double>(divisor));
      break;
    case ffi::DataType::C64:  // (a + bi) / d, component-wise
      DivideAll(static_cast<float*>(p), 2 * count, static_cast<float>(divisor));
      break;
    case ffi::DataType::C128:
      DivideAll(static_cast<double*>(p), 2 * count,
                static_cast<double>(divisor));
      break;
    case ffi::DataType::F16:
      DivideHalf<F16ToFloat, FloatToF16>(static_cast<uint16_t*>(p), count,
                                         static_cast<float>(divisor));
      break;
    case ffi::DataType::BF16:
      DivideHalf<Bf16ToFloat, FloatToBf16>(static_cast<uint16_t*>(p), count,
                                           static_cast<float>(divisor));
      break;
    default:
      return ffi::Error::InvalidArgument(
          std::string("mpijax: a mean needs a floating dtype, got ") +
          DtypeName(t));
  }
  return ffi::Error::Success();
}

// The in-place ring receives each block into scratch before reducing it; a
// ring over a bigger buffer runs in segments so the scratch stays this small.
// Small enough to stay in cache: the block is written there by the receive
// and read back by the reduction without a trip to memory, which outweighs
// the extra messages of more segments. Measured per donated all-reduce, 8 MiB
// -> 256 KiB of scratch: 2 ranks 16 MiB 3.3 -> 2.7-2.8 ms, 64 MiB 13.4-13.8
// -> 10.7 ms; 4 ranks on 2 cores 64 MiB 39.5 -> 33.5 ms (512 KiB and 1 MiB
// were in between); the fused gradient all-reduce of a 38 MiB model alone
// 8.9 -> 7.5 ms and its training step 36.4-37.4 -> 34.1-34.8 ms.
constexpr size_t kRingScratchBytes = size_t{256} << 10;
constexpr int kRingTag = 1;
// ppermute's messages: tags kPpermuteTagBase + (call count % kPpermuteTags),
// within the 32767 every MPI allows.
constexpr int kPpermuteTagBase = 2;
constexpr int kPpermuteTags = 16384;

// This thread's scratch of at least `bytes` (untouched until used: new[]
// of char does not initialize, so an idle reservation costs no memory).
char* RingScratch(size_t bytes) {
  thread_local std::unique_ptr<char[]> buf;
  thread_local size_t size = 0;
  if (size < bytes) {
    buf.reset(new char[bytes]);
    size = bytes;
  }
  return buf.get();
}

// Buffers of one dtype seen as one vector of `size()` elements, so that one
// ring covers all of them: its blocks may span several buffers, and the
// buckets of a fused gradient all-reduce need neither a packing copy nor a
// ring (2(P-1) steps) each. A buffer whose src is its dst is reduced in place.
class Spans {
 public:
  explicit Spans(size_t elem_bytes) : es_(elem_bytes) {}
  void Add(const char* src, char* dst, size_t n) {
    if (n == 0) return;
    bufs_.push_back({src, dst, n, total_});
    total_ += n;
    in_place_ = in_place_ || src == dst;
  }
  size_t size() const { return total_; }
  size_t elem_bytes() const { return es_; }
  bool any_in_place() const { return in_place_; }
  size_t buffers() const { return bufs_.size(); }
  // Calls f(buffer, at, count, index) for each piece of elements [lo, hi)
  // that lies in one buffer: the buffer's number, the piece's first element
  // in it and in the whole; stops when f returns false.
  template <typename F>
  void Pieces(size_t lo, size_t hi, F f) const {
    auto it = std::upper_bound(
        bufs_.begin(), bufs_.end(), lo,
        [](size_t v, const Buf& b) { return v < b.start; });
    for (--it; lo < hi && it != bufs_.end(); ++it) {
      size_t count = std::min(hi, it->start + it->n) - lo;
      if (!f(static_cast<size_t>(it - bufs_.begin()), lo - it->start, count,
             lo))
        return;
      lo += count;
    }
  }
  // Calls f(src, dst, count, index) for each piece of elements [lo, hi)
  // that lies in one buffer: its addresses there and its first element's
  // index in the whole.
  template <typename F>
  ffi::Error ForEach(size_t lo, size_t hi, F f) const {
    ffi::Error err;
    Pieces(lo, hi, [&](size_t i, size_t at, size_t count, size_t index) {
      const Buf& b = bufs_[i];
      err = f(b.src + at * es_, b.dst + at * es_, static_cast<int>(count),
              index);
      return err.success();
    });
    return err;
  }
  // Buffer i's input and output.
  const char* src(size_t i) const { return bufs_[i].src; }
  char* dst(size_t i) const { return bufs_[i].dst; }

 private:
  struct Buf { const char* src; char* dst; size_t n, start; };
  size_t es_;
  std::vector<Buf> bufs_;
  size_t total_ = 0;
  bool in_place_ = false;
};

// The ring all-reduce of elements [lo, hi) of `spans`: a reduce-scatter in
// P-1 steps, in which rank r passes its partial result for block r-k to its
// right neighbour and folds the block r-k-1 coming from its left into its
// own, then an allgather of the finished blocks in P-1 steps. Each rank
// reduces 1/P of the data and sends 2(P-1)/P of it; each block is reduced
// by one rank only, so all ranks get the same bits. Out of place, blocks
// arrive straight in the output and are reduced there with this rank's
// input: the input is never copied. Measured here with 2 ranks against Open
// MPI's own algorithm: 256 KiB 33 vs 66 us, 4 MiB 325 vs 478 us, 64 MiB 15
// vs 28 ms out of place (in place 64 MiB: 9 vs 18 ms). With a divisor (op
// "mean") each rank divides the block it finished, before the allgather.
// Blocks must hold at most INT_MAX elements and, in place, fit the scratch.
ffi::Error RingAllreduce(const CallInfo& info, MPI_Comm comm,
                         const Spans& spans, size_t lo, size_t hi,
                         ffi::DataType type, MPI_Datatype dt, MPI_Op mop,
                         int64_t divisor) {
  int p = info.comm_size, r = CommRank(comm);
  int right = (r + 1) % p, left = (r + p - 1) % p;
  size_t n = hi - lo, es = spans.elem_bytes();
  // Block b (taken mod p) is elements lo + [n*b/p, n*(b+1)/p).
  auto index = [p](int b) { return static_cast<size_t>((b % p + p) % p); };
  auto first = [&](int b) { return lo + n * index(b) / p; };
  auto last = [&](int b) { return lo + n * (index(b) + 1) / p; };
  char* scratch =
      spans.any_in_place() ? RingScratch((n / p + 1) * es) : nullptr;
  std::vector<MPI_Request> reqs;
  // One step: block `sb` (from the inputs at the first step, else from the
  // outputs) to the right, block `rb` from the left, then reduce it if asked.
  auto step = [&](int sb, int rb, bool from_src, bool reduce) -> ffi::Error {
    reqs.clear();
    // A piece of an in-place buffer is received into scratch (at its offset
    // in the block), any other straight into the output.
    auto recv_to = [&](const char* src, char* dst, size_t off) {
      return reduce && src == dst ? scratch + (off - first(rb)) * es : dst;
    };
    if (auto e = spans.ForEach(first(rb), last(rb),
            [&](const char* src, char* dst, int count, size_t off) {
              reqs.emplace_back();
              MPIJAX_CHECK_MPI(MPI_Irecv(recv_to(src, dst, off), count, dt,
                                         left, kRingTag, comm, &reqs.back()),
                               info);
              return ffi::Error::Success();
            });
        e.failure())
      return e;
    if (auto e = spans.ForEach(first(sb), last(sb),
            [&](const char* src, char* dst, int count, size_t) {
              reqs.emplace_back();
              MPIJAX_CHECK_MPI(MPI_Isend(from_src ? src : dst, count, dt,
                                         right, kRingTag, comm, &reqs.back()),
                               info);
              return ffi::Error::Success();
            });
        e.failure())
      return e;
    if (auto e = WaitAll(static_cast<int>(reqs.size()), reqs.data(), info);
        e.failure())
      return e;
    if (!reduce) return ffi::Error::Success();
    return spans.ForEach(first(rb), last(rb),
        [&](const char* src, char* dst, int count, size_t off) {
          MPIJAX_CHECK_MPI(MPI_Reduce_local(src == dst ? recv_to(src, dst, off)
                                                       : src,
                                            dst, count, dt, mop),
                           info);
          return ffi::Error::Success();
        });
  };
  for (int k = 0; k < p - 1; ++k) {
    if (auto e = step(r - k, r - k - 1, k == 0, true); e.failure()) return e;
  }
  if (divisor != 1) {
    if (auto e = spans.ForEach(first(r + 1), last(r + 1),
            [&](const char*, char* dst, int count, size_t) {
              return DivideInPlace(type, dst, count, divisor);
            });
        e.failure())
      return e;
  }
  for (int k = 0; k < p - 1; ++k) {
    if (auto e = step(r + 1 - k, r - k, false, false); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// Whether an all-reduce of `bytes` runs the ring: when each rank's share is
// at least ring_min_bytes, or ring_in_place_min_bytes if a buffer is reduced
// in place and MPI's call would block. (In place, the ring only beats MPI's
// blocking algorithm from a few MiB; where MPI's call would be polled, with
// several local devices, it beats it from ring_min_bytes: hierarchical psum,
// 4 MiB per device, 1.7-1.9 vs 2.0-2.2 ms.) Allocation-free: it is on every
// all-reduce's path.
bool UseRing(const CallInfo& info, size_t bytes, bool in_place) {
  size_t p = static_cast<size_t>(info.comm_size);
  bool mpi_blocks = info.dc == nullptr || info.dc->local_devices == 1;
  int64_t ring_min = (in_place && mpi_blocks ? g_ring_in_place_min_bytes
                                             : g_ring_min_bytes)
                         .load(std::memory_order_relaxed);
  return p > 1 && ring_min > 0 && bytes / p >= static_cast<size_t>(ring_min);
}

// Runs the ring over all of `spans` (one dtype), in segments that keep every
// block within one MPI count and, in place, within the scratch. Its waits are
// WaitAll's (polled, inspected): several local devices may run rings at
// once, and threads blocked inside MPI at the same time were measured
// several times slower here.
ffi::Error RingSegments(const CallInfo& info, MPI_Comm comm,
                        const Spans& spans, ffi::DataType type,
                        MPI_Datatype dt, MPI_Op mop, int64_t divisor) {
  size_t p = static_cast<size_t>(info.comm_size), es = spans.elem_bytes();
  size_t n = spans.size();
  size_t block = ChunkElems(es);
  if (spans.any_in_place()) {
    block = std::min(block, std::max<size_t>(kRingScratchBytes / es, 1));
  }
  for (size_t lo = 0; lo < n; lo += p * block) {
    if (auto e = RingAllreduce(info, comm, spans, lo,
                               std::min(n, lo + p * block), type, dt, mop,
                               divisor);
        e.failure())
      return e;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Node-local shared memory all-reduce. When every rank of a communicator runs
// on one node, each maps one POSIX shared-memory file holding a slot per
// rank: a header of flags and a data segment. A call copies the blocks the
// other ranks reduce into its segment, reduces its own 1/P block (its input
// plus the others' segments; one rank per block, so every rank gets the same
// bits), publishes it, and copies the other ranks' finished blocks out: three
// flag waits and no MPI message, rendezvous or kernel copy. Measured per
// jitted call with 2 ranks (MPI -> shared memory): 64 KiB 24.6 -> 17.1 us;
// in place 256 KiB 49.9 -> 43.4 us, 1 MiB 81.1 -> 69.0 us, 4 MiB 241 -> 290
// us (hence MPIJAX_SHM_MAX_BYTES); 4 ranks on 2 cores, 64 KiB 127 -> 64 us.
// Out of place the ring is as fast from 256 KiB at 2 ranks and goes first.

// The most buffers one CmaAllreduce takes (their addresses fill the rest of
// the header's page); a fused all-reduce of more runs the ring.
constexpr size_t kCmaMaxBuffers = 224;

struct alignas(64) ShmHeader {
  std::atomic<uint64_t> arrived;  // this call's input is in the segment
  char pad0[56];
  std::atomic<uint64_t> reduced;  // its block of the result is published
  char pad1[56];
  std::atomic<uint64_t> done;     // it has read every other segment
  char pad2[56];
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
constexpr size_t kShmHeaderBytes = 4096;  // a page: segments stay aligned
static_assert(sizeof(ShmHeader) <= kShmHeaderBytes, "header exceeds its page");
constexpr int64_t kPathShm = 1, kPathCma = 2;  // ShmHeader::path
std::atomic<int64_t> g_shm_files{0};      // names this process created

ShmHeader* ShmHead(DevComm* dc, int i) {
  return reinterpret_cast<ShmHeader*>(dc->shm_base + i * dc->shm_stride);
}
char* ShmData(DevComm* dc, int i) {
  return dc->shm_base + i * dc->shm_stride + kShmHeaderBytes;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until ready(), under a StallClock like WaitAll. Yields the CPU once
// a wait is not short, and at once when ranks outnumber cores (the rank
// being waited for may need this core).
template <typename Ready>
ffi::Error ShmWait(const CallInfo& info, Ready ready) {
  if (ready()) return ffi::Error::Success();
  bool oversubscribed = info.dc->shm_oversubscribed;
  StallClock clock(info);
  for (uint64_t spin = 1;; ++spin) {
    CpuRelax();
    if (ready()) return ffi::Error::Success();
    if ((spin & 63) == 0) {
      if (auto e = clock.Check(); e.failure()) return e;
    }
    if (oversubscribed || (spin > 1024 && (spin & 15) == 0))
      std::this_thread::yield();
  }
}

// Copies `nbytes` between the `nlocal` pieces `local` of this process and
// the `nremote` pieces `remote` of process `pid` (cross-memory attach: one
// kernel copy, no staging); 0 or an errno.
int CmaCopy(int64_t pid, const iovec* local, size_t nlocal,
            const iovec* remote, size_t nremote, size_t nbytes, bool write) {
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

// Whether every rank of dc's communicator can read and write every other
// rank's memory with cross-memory attach (collective; after the segments
// are mapped). Each rank publishes its process id, and the address and
// value of its private nonce; every other rank reads the nonce there and,
// only if it found it, writes the same value back. That fails, and
// CmaAllreduce stays off for this communicator, where the kernel refuses
// (ranks of different users; Yama's ptrace_scope 1 without
// prctl(PR_SET_PTRACER), which Open MPI's own CMA support calls, 2 without
// CAP_SYS_PTRACE, or 3; container seccomp profiles that block
// process_vm_readv) or where a
// rank's process id names another process (ranks in different PID
// namespaces, e.g. one container each sharing /dev/shm).
ffi::Error CmaProbe(const CallInfo& info, DevComm* dc) {
  dc->cma_ok = false;
  int p = info.comm_size, r = dc->shm_rank;
  ShmHeader* me = ShmHead(dc, r);
  uint64_t& nonce = CmaNonce();
  me->pid = static_cast<int64_t>(getpid());
  me->probe = reinterpret_cast<uint64_t>(&nonce);
  me->nonce = nonce;
  MPIJAX_CHECK_MPI(MPI_Barrier(dc->comm), info);  // every rank has published
  int ok = 1;
  for (int i = 0; i < p && ok; ++i) {
    if (i == r) continue;
    const ShmHeader* h = ShmHead(dc, i);
    uint64_t word = 0;
    iovec there{reinterpret_cast<void*>(h->probe), sizeof word};
    iovec here{&word, sizeof word};
    ok = CmaCopy(h->pid, &here, 1, &there, 1, sizeof word, false) == 0 &&
         word == h->nonce &&
         CmaCopy(h->pid, &here, 1, &there, 1, sizeof word, true) == 0;
  }
  MPIJAX_CHECK_MPI(
      MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, dc->comm), info);
  dc->cma_ok = ok == 1;
  return ffi::Error::Success();
}

// Maps the shared segments of `dc` (collective over its communicator: the
// first call that can use them, which is the same call on every rank). Any
// failure on any rank -- ranks on several nodes, no /dev/shm, no space --
// leaves every rank on the MPI path.
ffi::Error ShmSetup(const CallInfo& info, DevComm* dc) {
  dc->shm_state = -1;
  MPI_Comm comm = dc->comm;
  BlockingMark mark(dc);  // blocking MPI calls below: the watchdog guards them
  int p = info.comm_size, r = CommRank(comm);
  MPI_Comm node;
  MPIJAX_CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, r,
                                       MPI_INFO_NULL, &node),
                   info);
  int node_size = CommSize(node);
  MPI_Comm_free(&node);
  // Whether `ok` holds on every rank (each rank's answer becomes all's).
  auto everywhere = [&](int* ok) {
    return MPI_Allreduce(MPI_IN_PLACE, ok, 1, MPI_INT, MPI_MIN, comm);
  };
  int one_node = node_size == p;
  MPIJAX_CHECK_MPI(everywhere(&one_node), info);
  if (!one_node) return ffi::Error::Success();
  size_t seg = (static_cast<size_t>(g_shm_max_bytes.load()) + 4095) / 4096 * 4096;
  size_t stride = kShmHeaderBytes + seg, total = stride * p;
  char name[64] = {0};
  int fd = -1;
  if (r == 0) {
    std::snprintf(name, sizeof name, "/mpijax-%d-%lld", static_cast<int>(getpid()),
                  static_cast<long long>(g_shm_files.fetch_add(1)));
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(total)) != 0) {
      close(fd);
      fd = -1;
      shm_unlink(name);
    }
    if (fd < 0) name[0] = 0;
  }
  MPIJAX_CHECK_MPI(MPI_Bcast(name, sizeof name, MPI_CHAR, 0, comm), info);
  if (r != 0 && name[0] != 0) fd = shm_open(name, O_RDWR, 0);
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
  }
  int mapped = base != MAP_FAILED;
  MPIJAX_CHECK_MPI(everywhere(&mapped), info);
  // Every rank has opened it (or given up): the name can go, so nothing is
  // left in /dev/shm however the job ends.
  if (r == 0 && name[0] != 0) shm_unlink(name);
  if (!mapped) {
    if (base != MAP_FAILED) munmap(base, total);
    return ffi::Error::Success();
  }
  dc->shm_base = static_cast<char*>(base);
  dc->shm_stride = stride;
  dc->shm_map_bytes = total;
  dc->shm_rank = r;
  dc->shm_oversubscribed = p > static_cast<int>(std::thread::hardware_concurrency());
  dc->shm_state = 1;
  return CmaProbe(info, dc);
}

// Maps dc's shared segments if no call has tried yet (collective: the same
// call on every rank); whether they are mapped.
ffi::ErrorOr<bool> ShmReady(const CallInfo& info) {
  DevComm* dc = info.dc;
  if (dc->shm_state == 0) {
    if (auto e = ShmSetup(info, dc); e.failure()) return ffi::Unexpected(e);
  }
  return dc->shm_state == 1;
}

// Whether an all-reduce of `bytes` goes through shared memory (mapping it
// at the first call that could). Not with several local devices per rank:
// their reductions already meet in XLA's local collectives first.
ffi::ErrorOr<bool> UseShm(const CallInfo& info, size_t bytes) {
  DevComm* dc = info.dc;
  int64_t max_bytes = g_shm_max_bytes.load(std::memory_order_relaxed);
  if (dc == nullptr || dc->local_devices != 1 || info.comm_size < 2 ||
      max_bytes <= 0 || bytes == 0 || bytes > static_cast<size_t>(max_bytes))
    return false;
  auto ready = ShmReady(info);
  if (ready.has_error()) return ready;
  return *ready && bytes <= dc->shm_stride - kShmHeaderBytes;
}

// A wait condition: `flag` of every rank's header is at least `at_least`.
auto AllAtLeast(DevComm* dc, int p, std::atomic<uint64_t> ShmHeader::*flag,
                uint64_t at_least) {
  return [=] {
    for (int i = 0; i < p; ++i)
      if ((ShmHead(dc, i)->*flag).load(std::memory_order_acquire) < at_least)
        return false;
    return true;
  };
}

// Call k's arrival: publishes what this rank reduces (`bytes` by `path`),
// marks it arrived (after whatever the caller published first), waits for
// every rank, then checks that all of them reduce the same thing the same
// way (the same comparison on every rank, so all of them raise together,
// after marking the call finished so none waits).
ffi::Error ShmArrive(const CallInfo& info, uint64_t k, size_t bytes,
                     int64_t path) {
  DevComm* dc = info.dc;
  ShmHeader* me = ShmHead(dc, dc->shm_rank);
  me->sig = info.sig;
  me->bytes = static_cast<int64_t>(bytes);
  me->path = path;
  me->arrived.store(k, std::memory_order_release);
  if (auto e = ShmWait(
          info, AllAtLeast(dc, info.comm_size, &ShmHeader::arrived, k));
      e.failure())
    return e;
  for (int i = 0; i < info.comm_size; ++i) {
    ShmHeader* h = ShmHead(dc, i);
    if (h->sig == info.sig && h->bytes == me->bytes && h->path == me->path)
      continue;
    me->reduced.store(k, std::memory_order_release);
    me->done.store(k, std::memory_order_release);
    if (h->sig != info.sig) return MismatchError(info, info.sig);
    std::string what = h->bytes != me->bytes
        ? " reduces " + std::to_string(h->bytes) + " bytes, this rank " +
              std::to_string(me->bytes)
        : " takes another transport path (MPIJAX_SHM_MAX_BYTES and "
          "MPIJAX_CMA_MIN_BYTES must be the same on every rank)";
    return ffi::Error(ffi::ErrorCode::kInternal,
                      info.Describe() + ": rank " + std::to_string(i) + what);
  }
  return ffi::Error::Success();
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
void ShmSumBlock(DevComm* dc, int p, int r, size_t lo, size_t cnt,
                 const T* mine, T* out, T* pub) {
  auto term = [&](int i) {
    return i == r ? mine : reinterpret_cast<const T*>(ShmData(dc, i)) + lo;
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
        const T* c = term(j) + at;
        for (size_t i = 0; i < m; ++i) acc[i] += c[i];
      }
      std::memcpy(out + at, acc, m * sizeof(T));
    }
  }
  std::memcpy(pub, out, cnt * sizeof(T));
}

ffi::Error ShmAllreduce(const CallInfo& info, const char* src, char* dst,
                        size_t n, ffi::DataType type, MPI_Datatype dt,
                        MPI_Op mop, int64_t divisor) {
  DevComm* dc = info.dc;
  int p = info.comm_size, r = dc->shm_rank;
  size_t es = ffi::ByteWidth(type), bytes = n * es;
  auto first = [&](int b) { return n * b / p; };  // block b: [first(b), first(b + 1))
  uint64_t k = ++dc->shm_seq;
  ShmHeader* me = ShmHead(dc, r);
  char* mine = ShmData(dc, r);
  // 1. Once everyone has read this rank's segment from the previous call:
  // the blocks the other ranks reduce go in (its own block it reads from
  // `src` directly).
  if (auto e = ShmWait(info, AllAtLeast(dc, p, &ShmHeader::done, k - 1));
      e.failure())
    return e;
  for (int j = 0; j < p; ++j) {
    if (j == r) continue;
    std::memcpy(mine + first(j) * es, src + first(j) * es,
                (first(j + 1) - first(j)) * es);
  }
  // 2. Every input is in; all ranks must be reducing the same thing.
  if (auto e = ShmArrive(info, k, bytes, kPathShm); e.failure()) return e;
  // 3. This rank's block, reduced by this rank only (so every rank gets the
  // same bits), divided, and published where its own input would have been.
  size_t lo = first(r), cnt = first(r + 1) - lo;
  const char* in = src + lo * es;
  char* out = dst + lo * es;
  char* pub = mine + lo * es;
  bool fused = mop == MPI_SUM && divisor == 1 &&
               (type == ffi::DataType::F32 || type == ffi::DataType::F64);
  if (cnt > 0 && fused) {
    if (type == ffi::DataType::F32) {
      ShmSumBlock<float>(dc, p, r, lo, cnt, reinterpret_cast<const float*>(in),
                         reinterpret_cast<float*>(out),
                         reinterpret_cast<float*>(pub));
    } else {
      ShmSumBlock<double>(dc, p, r, lo, cnt,
                          reinterpret_cast<const double*>(in),
                          reinterpret_cast<double*>(out),
                          reinterpret_cast<double*>(pub));
    }
  } else if (cnt > 0) {
    // Rank order, as ShmSumBlock; in place, this rank's input is still
    // needed after rank 0's term is in, so the sum is made in scratch.
    auto term = [&](int i) {
      return i == r ? in : ShmData(dc, i) + lo * es;
    };
    char* acc = out != in || r == 0 ? out : RingScratch(cnt * es);
    if (acc != term(0)) std::memcpy(acc, term(0), cnt * es);
    for (int i = 1; i < p; ++i) {
      MPIJAX_CHECK_MPI(MPI_Reduce_local(term(i), acc, static_cast<int>(cnt),
                                        dt, mop),
                       info);
    }
    if (acc != out) std::memcpy(out, acc, cnt * es);
    if (divisor != 1) {
      if (auto e = DivideInPlace(type, out, cnt, divisor); e.failure())
        return e;
    }
    std::memcpy(pub, out, cnt * es);
  }
  me->reduced.store(k, std::memory_order_release);
  // 4. Every block is published: copy the others' out (in place, over input
  // blocks already copied to this rank's segment in step 1).
  if (auto e = ShmWait(info, AllAtLeast(dc, p, &ShmHeader::reduced, k));
      e.failure())
    return e;
  for (int i = 0; i < p; ++i) {
    if (i == r) continue;
    std::memcpy(dst + first(i) * es, ShmData(dc, i) + first(i) * es,
                (first(i + 1) - first(i)) * es);
  }
  me->done.store(k, std::memory_order_release);
  return ffi::Error::Success();
}

// Whether an all-reduce of `bytes` in `buffers` buffers runs CmaAllreduce:
// from cma_min_bytes on, up to kCmaMaxBuffers buffers, with one local device
// per rank (as UseShm), all ranks on one node, and cross-memory attach
// allowed between them. Allocation-free, like UseRing.
ffi::ErrorOr<bool> UseCma(const CallInfo& info, size_t bytes, size_t buffers) {
  int64_t min_bytes = g_cma_min_bytes.load(std::memory_order_relaxed);
  if (info.dc == nullptr || info.dc->local_devices != 1 ||
      info.comm_size < 2 || min_bytes <= 0 ||
      bytes < static_cast<size_t>(min_bytes) || buffers > kCmaMaxBuffers)
    return false;
  auto ready = ShmReady(info);
  if (ready.has_error()) return ready;
  return *ready && info.dc->cma_ok;
}

// Node-local all-reduce by cross-memory attach. Each rank publishes the
// addresses of its inputs and outputs in its shared-memory header, then
// reduces its 1/P block: for each cache-sized chunk it reads the other
// ranks' inputs there (process_vm_readv), folds in its own, and writes the
// result into every other rank's outputs (process_vm_writev). One flag
// wait to start and one to finish, no MPI message; each block is reduced
// by one rank, so every rank gets the same bits; in place works alike (a
// rank reads a chunk of another's buffer before it writes that chunk). Per
// rank that is the memory traffic of a copy: every input byte it needs
// read once, every output byte written once. The ring also writes each
// received block to memory and reads it back, and reads its finished block
// again to send it; Open MPI's single-copy path pays the same kernel copy.
// Measured per jitted call with 2 ranks, ring -> this: 256 KiB 32 -> 18 us,
// 4 MiB 507 -> 357 us (donated 501 -> 306), 64 MiB donated 10.7 -> 7.3 ms;
// 4 ranks on 2 cores, 4 MiB 1.80 -> 1.23 ms. Below 64 KiB (cma_min_bytes)
// shared memory is as fast or faster.
constexpr size_t kCmaChunkBytes = size_t{256} << 10;

ffi::Error CmaAllreduce(const CallInfo& info, const Spans& spans,
                        ffi::DataType type, MPI_Datatype dt, MPI_Op mop,
                        int64_t divisor) {
  // A bad divisor fails here, on every rank, before any rank waits.
  if (divisor != 1) {
    if (auto e = DivideInPlace(type, nullptr, 0, divisor); e.failure())
      return e;
  }
  DevComm* dc = info.dc;
  int p = info.comm_size, r = dc->shm_rank;
  size_t n = spans.size(), es = spans.elem_bytes();
  uint64_t k = ++dc->shm_seq;
  ShmHeader* me = ShmHead(dc, r);
  for (size_t i = 0; i < spans.buffers(); ++i) {
    me->addr[i][0] = reinterpret_cast<uint64_t>(spans.src(i));
    me->addr[i][1] = reinterpret_cast<uint64_t>(spans.dst(i));
  }
  // The same signature means the same buffers, so `spans` describes every
  // rank's layout; only the addresses differ.
  if (auto e = ShmArrive(info, k, n * es, kPathCma); e.failure()) return e;
  // Elements [lo, hi) of rank h's inputs (out = 0) or outputs (1), as
  // iovecs; a chunk spans at most kCmaMaxBuffers buffers, within IOV_MAX.
  iovec remote[kCmaMaxBuffers], here[kCmaMaxBuffers];
  auto remote_iov = [&](const ShmHeader* h, int out, size_t lo, size_t hi) {
    size_t count = 0;
    spans.Pieces(lo, hi, [&](size_t i, size_t at, size_t c, size_t) {
      remote[count++] = {reinterpret_cast<void*>(h->addr[i][out] + at * es),
                         c * es};
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
  char* scratch = RingScratch(2 * chunk * es);
  char* tmp = scratch + chunk * es;
  int err = 0;
  const char* failed_call = "";
  for (size_t at = n * r / p, hi = n * (r + 1) / p; at < hi && err == 0;
       at += chunk) {
    size_t c = std::min(chunk, hi - at), pieces = 1;
    // The accumulator's pieces, and the address of element `index` in it.
    if (into_outputs) {
      pieces = 0;
      spans.Pieces(at, at + c, [&](size_t i, size_t first, size_t count,
                                   size_t) {
        here[pieces++] = {spans.dst(i) + first * es, count * es};
        return true;
      });
    } else {
      here[0] = {scratch, c * es};
    }
    auto acc = [&](size_t index, size_t i, size_t first) {
      return into_outputs ? spans.dst(i) + first * es
                          : scratch + (index - at) * es;
    };
    // Copies between `local` and elements [at, at + c) of rank h's buffers.
    auto copy = [&](const ShmHeader* h, const iovec* local, size_t nlocal,
                    bool write) {
      failed_call = write ? "process_vm_writev" : "process_vm_readv";
      return CmaCopy(h->pid, local, nlocal, remote,
                     remote_iov(h, write ? 1 : 0, at, at + c), c * es, write);
    };
    // inout (the accumulator's piece for element `index`) = in op inout.
    auto fold = [&](auto in_of) {
      spans.Pieces(at, at + c, [&](size_t i, size_t first, size_t count,
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
    iovec tmp_iov{tmp, c * es};
    int head = r == 0 ? 1 : 0;
    err = copy(ShmHead(dc, head), here, pieces, false);
    for (int j = 0; j < p && err == 0; ++j) {
      if (j == head) continue;
      if (j == r) {
        fold([&](size_t, size_t i, size_t first) {
          return spans.src(i) + first * es;
        });
      } else if ((err = copy(ShmHead(dc, j), &tmp_iov, 1, false)) == 0) {
        fold([&](size_t index, size_t, size_t) {
          return tmp + (index - at) * es;
        });
      }
    }
    if (err != 0) break;
    spans.Pieces(at, at + c, [&](size_t i, size_t first, size_t count,
                                 size_t index) {
      char* a = acc(index, i, first);
      if (divisor != 1) (void)DivideInPlace(type, a, count, divisor);
      if (!into_outputs) std::memcpy(spans.dst(i) + first * es, a, count * es);
      return true;
    });
    for (int j = 1; j < p && err == 0; ++j)
      err = copy(ShmHead(dc, (r + j) % p), here, pieces, true);
  }
  // Finished with every other rank's buffers (or failed): once all ranks
  // are, every output is complete and no input is read any more.
  me->failed_errno = err;
  me->failed = err != 0 ? static_cast<int64_t>(k) : 0;
  me->reduced.store(k, std::memory_order_release);
  if (auto e = ShmWait(info, AllAtLeast(dc, p, &ShmHeader::reduced, k));
      e.failure())
    return e;
  me->done.store(k, std::memory_order_release);
  for (int i = 0; i < p; ++i) {
    const ShmHeader* h = ShmHead(dc, i);
    if (h->failed != static_cast<int64_t>(k)) continue;
    std::string how = i == r ? std::string(failed_call) + " failed: "
                             : std::string("its copy failed: ");
    return ffi::Error(
        ffi::ErrorCode::kInternal,
        info.Describe() + ": the cross-memory all-reduce failed on rank " +
            std::to_string(i) + " (" + how + std::strerror(h->failed_errno) +
            "); MPIJAX_CMA_MIN_BYTES=0 turns this path off.");
  }
  return ffi::Error::Success();
}

// One buffer's all-reduce: by cross-memory attach (UseCma), the ring
// (UseRing), shared memory (UseShm) or MPI's, chunked, each chunk blocking
// or polled by size; with a divisor (op "mean") each chunk is divided right
// after its MPI call.
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
  auto cma = UseCma(info, n * es, 1);
  if (cma.has_error()) return cma.error();
  if (*cma || UseRing(info, n * es, in_place)) {
    Spans spans(es);
    spans.Add(src, dst, n);
    if (*cma) return CmaAllreduce(info, spans, type, dt, mop, divisor);
    return RingSegments(info, comm, spans, type, dt, mop, divisor);
  }
  auto shm = UseShm(info, n * es);
  if (shm.has_error()) return shm.error();
  if (*shm) return ShmAllreduce(info, src, dst, n, type, dt, mop, divisor);
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

ffi::Error AllreduceImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                         int64_t op, int64_t divisor,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allreduce", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  return AllreduceBuffer(info, comm, x, *out, op, divisor);
}

// Several buffers (the buckets of a gradient tree) reduced in one call: those
// of one dtype in one cross-memory all-reduce (UseCma) or one ring (UseRing)
// when either applies, else one after another as `allreduce` would; the last operand and result are the order token. One
// custom call instead of one per bucket: one signature check on the first
// run, no per-bucket thunk, and XLA cannot interleave a bucket's packing
// with another's MPI call. (Posting every bucket as an MPI_Iallreduce and
// awaiting them together was measured slower inside a training step: 90 vs
// 76 ms with 4 ranks on 2 cores, 42 vs 34 ms with 2.)
ffi::Error AllreduceManyImpl(int64_t device, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, int64_t comm_id,
                             int64_t op, int64_t site, int64_t sig) {
  if (args.size() < 2 || rets.size() != args.size()) {
    return ffi::Error::InvalidArgument(
        "mpijax: allreduce_many needs buffers plus an order token, with one "
        "result per operand; got " + std::to_string(args.size()) +
        " operands and " + std::to_string(rets.size()) + " results");
  }
  auto first = args.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return first.error();
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allreduce", first->element_type(), first->dimensions(),
                CommSize(comm), comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  MPI_Datatype dt;
  MPI_Op mop;
  // Buffers of one dtype share one ring (UseRing); the dtypes go in order
  // of first appearance, the same on every rank.
  std::vector<ffi::DataType> types;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (std::find(types.begin(), types.end(), x->element_type()) == types.end())
      types.push_back(x->element_type());
  }
  for (ffi::DataType type : types) {
    if (auto e = ReductionTypes(type, op, &dt, &mop); e.failure()) return e;
    Spans spans(ffi::ByteWidth(type));
    std::vector<std::pair<ffi::AnyBuffer, ffi::AnyBuffer>> bufs;
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      auto x = args.get<ffi::AnyBuffer>(i);
      auto out = rets.get<ffi::AnyBuffer>(i);
      if (out.has_error()) return out.error();
      if (x->element_type() != type) continue;
      spans.Add(static_cast<const char*>(x->untyped_data()),
                static_cast<char*>((*out)->untyped_data()), x->element_count());
      bufs.emplace_back(*x, **out);
    }
    info.dtype = type;
    info.dims = bufs.front().first.dimensions();
    auto cma =
        UseCma(info, spans.size() * spans.elem_bytes(), spans.buffers());
    if (cma.has_error()) return cma.error();
    if (*cma) {
      if (auto e = CmaAllreduce(info, spans, type, dt, mop, 1); e.failure())
        return e;
      continue;
    }
    if (UseRing(info, spans.size() * spans.elem_bytes(),
                spans.any_in_place())) {
      if (auto e = RingSegments(info, comm, spans, type, dt, mop, 1);
          e.failure())
        return e;
      continue;
    }
    for (size_t i = 0; i < bufs.size(); ++i) {
      info.dims = bufs[i].first.dimensions();
      if (auto e = AllreduceBuffer(info, comm, bufs[i].first, bufs[i].second,
                                   op, 1);
          e.failure())
        return e;
    }
  }
  return ffi::Error::Success();
}

ffi::Error AllgatherImpl(int64_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"allgather", x.element_type(), x.dimensions(), CommSize(comm),
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
  size_t nb = x.size_bytes();
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  size_t chunk = ChunkElems(1);
  if (nb == 0) return ffi::Error::Success();
  if (nb <= chunk) {
    int len = static_cast<int>(nb);
    MPIJAX_COLLECTIVE(
        info, comm, nb * CommSize(comm),
        MPI_Allgather(src, len, MPI_BYTE, dst, len, MPI_BYTE, comm),
        MPI_Iallgather(src, len, MPI_BYTE, dst, len, MPI_BYTE, comm, &req_));
    return ffi::Error::Success();
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
                             int64_t op,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm), rank = CommRank(comm);
  CallInfo info{"reduce_scatter", x.element_type(), x.dimensions(), size,
                comm_id, device};
  MPIJAX_ENTER(info, comm, site, sig);
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
    int count = static_cast<int>(n);
    MPIJAX_COLLECTIVE(
        info, comm, x.size_bytes(),
        MPI_Reduce_scatter_block(src, dst, count, dt, mop, comm),
        MPI_Ireduce_scatter_block(src, dst, count, dt, mop, comm, &req_));
    return ffi::Error::Success();
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
    int64_t comm_id,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"alltoall", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  size_t nb = x.size_bytes() / std::max(size, 1);  // bytes per block
  char* src = static_cast<char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  size_t chunk = ChunkElems(1);
  if (nb == 0) return ffi::Error::Success();
  if (nb <= chunk) {
    const void* send = src == dst ? MPI_IN_PLACE : src;
    int len = static_cast<int>(nb);
    MPIJAX_COLLECTIVE(
        info, comm, x.size_bytes(),
        MPI_Alltoall(send, len, MPI_BYTE, dst, len, MPI_BYTE, comm),
        MPI_Ialltoall(send, len, MPI_BYTE, dst, len, MPI_BYTE, comm, &req_));
    return ffi::Error::Success();
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
                     int64_t root,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  CallInfo info{"bcast", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
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
    int r = static_cast<int>(root);
    MPIJAX_COLLECTIVE(info, comm, len,
                      MPI_Bcast(dst + off, len, MPI_BYTE, r, comm),
                      MPI_Ibcast(dst + off, len, MPI_BYTE, r, comm, &req_));
  }
  return ffi::Error::Success();
}

// Sum (or op) to root; zeros on the other ranks. The transpose of bcast.
ffi::Error ReduceImpl(int64_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer /*token_in*/,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> /*token_out*/,
    int64_t comm_id,
                      int64_t op, int64_t root,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm);
  bool is_root = CommRank(comm) == root;
  CallInfo info{"reduce", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
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
                        ffi::Span<const int64_t> dsts,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  int size = CommSize(comm), rank = CommRank(comm);
  CallInfo info{"ppermute", x.element_type(), x.dimensions(), size, comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
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
  // Each exchange has its own tag (every rank counts its ppermute calls on
  // this communicator), so a message nobody received -- ranks whose sendrecv
  // arguments do not match up -- can never be taken by a later exchange.
  int tag = kPpermuteTagBase + static_cast<int>(comm_dc->p2p_seq++ % kPpermuteTags);
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
      MPIJAX_CHECK_MPI(MPI_Irecv(dst + off, len, MPI_BYTE, recv_from, tag, comm,
                                 &reqs[nreq++]),
                       info);
    }
    if (send_to >= 0) {
      MPIJAX_CHECK_MPI(MPI_Isend(src + off, len, MPI_BYTE, send_to, tag, comm,
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
                       int64_t comm_id,
    int64_t site, int64_t sig) {
  MPIJAX_GET_COMM(comm, comm_id, device);
  CallInfo info{"barrier", ffi::DataType::INVALID, {}, CommSize(comm), comm_id,
                device};
  MPIJAX_ENTER(info, comm, site, sig);
  MPI_Request req;
  MPIJAX_CHECK_MPI(MPI_Ibarrier(comm, &req), info);
  return Wait(&req, info);
}

// Orders the next mpijax call of a block after a control-flow op (or an
// isolated region) that contains mpijax calls: it reads one of that op's
// results, so XLA runs it (and what consumes its token) only once the op has
// finished. It makes no MPI call and touches no data.
ffi::Error JoinImpl(ffi::AnyBuffer /*token_in*/, ffi::AnyBuffer /*after*/,
                    ffi::Result<ffi::AnyBuffer> /*token_out*/) {
  return ffi::Error::Success();
}

// Orders an XLA collective (one over this rank's local devices) after the
// mpijax calls before it: the collective reads this call's results, which
// are its operands passed through, aliased (XLA hands over one buffer, or
// copies first where the operand lives on). The last operand is the order
// token; nothing is read or written, unless XLA did not alias a result.
ffi::Error GateImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != rets.size() + 1) {
    return ffi::Error::InvalidArgument(
        "mpijax_gate: expected one result per operand before the order token, "
        "got " + std::to_string(args.size()) + " operands and " +
        std::to_string(rets.size()) + " results");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    if (in->untyped_data() != (*out)->untyped_data() && in->size_bytes() > 0) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

// The binding every one-buffer operation starts with, in its handler's
// argument order: the device, the input and the order token in, the result and
// the order token out, the communicator id. Each handler adds its own
// attributes, then "site" and "sig".
auto OneBufferOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()  // order token in
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()  // order token out
      .Attr<int64_t>("comm");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoin, JoinImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Arg<ffi::AnyBuffer>()  // a result of the op to wait for
                                  .Ret<ffi::AnyBuffer>());  // order token out
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGate, GateImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()  // operands, order token
                                  .RemainingRets());  // the operands, aliased
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduce, AllreduceImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("divisor")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduceMany, AllreduceManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()  // buffers, order token
                                  .RemainingRets()  // results, order token
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllgather, AllgatherImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduceScatter, ReduceScatterImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAlltoall, AlltoallImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBcast, BcastImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduce, ReduceImpl,
                              OneBufferOp()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPpermute, PpermuteImpl,
                              OneBufferOp()
                                  .Attr<ffi::Span<const int64_t>>("srcs")
                                  .Attr<ffi::Span<const int64_t>>("dsts")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier, BarrierImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // order token in
                                  .Ret<ffi::AnyBuffer>()  // order token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("sig"));

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
    d["mpijax_allreduce_many"] = Capsule(kAllreduceMany);
    d["mpijax_allgather"] = Capsule(kAllgather);
    d["mpijax_reduce_scatter"] = Capsule(kReduceScatter);
    d["mpijax_alltoall"] = Capsule(kAlltoall);
    d["mpijax_bcast"] = Capsule(kBcast);
    d["mpijax_reduce"] = Capsule(kReduce);
    d["mpijax_ppermute"] = Capsule(kPpermute);
    d["mpijax_barrier"] = Capsule(kBarrier);
    d["mpijax_join"] = Capsule(kJoin);
    d["mpijax_gate"] = Capsule(kGate);
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");

  m.def("setup", [](int64_t max_chunk_bytes, double timeout_s,
                    bool stall_abort, bool check_every,
                    int64_t blocking_min_bytes, int64_t ring_min_bytes,
                    int64_t ring_in_place_min_bytes, int64_t shm_max_bytes,
                    int64_t cma_min_bytes) {
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
    g_stall_abort = stall_abort;
    g_check_every = check_every;
    g_blocking_min_bytes = blocking_min_bytes;
    g_ring_min_bytes = ring_min_bytes;
    g_ring_in_place_min_bytes = ring_in_place_min_bytes;
    g_shm_max_bytes = std::min<int64_t>(shm_max_bytes, int64_t{1} << 30);
    g_cma_min_bytes = cma_min_bytes;
  }, nb::arg("max_chunk_bytes"), nb::arg("timeout_s"),
  nb::arg("stall_abort") = true, nb::arg("check_every") = false,
  nb::arg("blocking_min_bytes") = int64_t{0},
  nb::arg("ring_min_bytes") = int64_t{128} << 10,
  nb::arg("ring_in_place_min_bytes") = int64_t{4} << 20,
  nb::arg("shm_max_bytes") = int64_t{1} << 20,
  nb::arg("cma_min_bytes") = int64_t{64} << 10,
  "Creates the float16/bfloat16 MPI ops; sets chunk size, timeout, stall "
  "action, whether every call's signature is checked, the sizes from "
  "which collectives block and all-reduces run the ring, up to which "
  "all-reduces go through node-local shared memory, and from which they "
  "run by cross-memory attach.");

  m.def("register_comms", [](const std::vector<uintptr_t>& handles,
                             const std::vector<uintptr_t>& check_handles,
                             int64_t key, const std::vector<int64_t>& ordinals) {
    if (handles.size() != check_handles.size() ||
        ordinals.size() != handles.size()) {
      throw nb::value_error("register_comms: one check communicator and one "
                            "device ordinal per communicator are needed");
    }
    CommEntry entry;
    entry.key = key;
    entry.ordinals = ordinals;
    for (size_t i = 0; i < handles.size(); ++i) {
      auto dev = std::make_unique<DevComm>();
      dev->comm = HandleToComm(handles[i]);
      dev->check = HandleToComm(check_handles[i]);
      dev->key = key;
      dev->local_devices = static_cast<int>(handles.size());
      dev->index = static_cast<int64_t>(i);
      // Errors become ffi::Error (a Python exception), never an abort.
      MPI_Comm_set_errhandler(dev->comm, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(dev->check, MPI_ERRORS_RETURN);
      entry.devs.push_back(std::move(dev));
    }
    std::lock_guard<std::mutex> lock(g_comms_mu);
    g_comms.push_back(std::move(entry));
    return static_cast<int64_t>(g_comms.size() - 1);
  }, nb::arg("handles"), nb::arg("check_handles"), nb::arg("key"),
  nb::arg("ordinals"),
  "Registers one communicator (and one signature-check communicator) per "
  "local device index (mpi4py handles from MPI._handleof); `key` is the id "
  "all ranks of the communicator agreed on; `ordinals` are XLA's device "
  "ordinals (jax device ids) of the local devices in index order. Returns the id used as the ops' 'comm' attribute.");

  m.def("node_paths", [](int64_t comm_id) {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    std::vector<int> out;
    if (comm_id >= 0 && comm_id < static_cast<int64_t>(g_comms.size())) {
      for (auto& dev : g_comms[comm_id].devs)
        out.push_back(dev->shm_state == 1 ? 1 + dev->cma_ok : dev->shm_state);
    }
    return out;
  }, nb::arg("comm_id"),
  "The node-local all-reduce paths of comm_id, per local device: 0 not set up "
  "yet (no all-reduce has needed them), -1 unavailable (ranks on several "
  "nodes, or no shared memory), 1 shared memory, 2 shared memory and "
  "cross-memory attach. For diagnostics and tests; read between calls.");

  m.def("unregister_comms", [](int64_t comm_id) {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    if (comm_id >= 0 && comm_id < static_cast<int64_t>(g_comms.size())) {
      // Later calls fail cleanly, never use freed comms; the DevComms stay
      // allocated so the responder thread never reads freed memory.
      g_comms[comm_id].freed = true;
      for (auto& dev : g_comms[comm_id].devs) {
        if (dev->shm_base != nullptr) munmap(dev->shm_base, dev->shm_map_bytes);
        dev->shm_base = nullptr;
        dev->shm_state = -1;
      }
    }
  }, nb::arg("comm_id"),
  "Forgets the communicators of comm_id (before Python frees them).");

  m.def("register_site", [](const std::string& text, int64_t slot) {
    if (slot < 0) throw nb::value_error("register_site: slot must be >= 0");
    std::lock_guard<std::mutex> lock(g_sites_mu);
    while (static_cast<int64_t>(g_check_slots.size()) <= slot)
      g_check_slots.emplace_back(0);
    g_sites.emplace_back();
    g_sites.back().text = text;
    g_sites.back().checked = &g_check_slots[slot];
    return static_cast<int64_t>(g_sites.size() - 1);
  }, nb::arg("text"), nb::arg("slot"),
  "Registers a call site's description (e.g. 'allreduce(float32[4], sum) at "
  "train.py:42') and its check slot (one per (signature, communicator)); "
  "returns its id, the ops' 'site' attribute.");

  m.def("start_inspector", [](uintptr_t handle) {
    std::lock_guard<std::mutex> lock(g_insp_mu);
    if (g_responder != nullptr) return false;
    int level = 0;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE) return false;
    MPI_Comm comm = HandleToComm(handle);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    g_insp_comm = comm;
    g_responder_stop = false;
    g_responder = new std::thread(ResponderLoop, comm);
    g_watchdog = new std::thread(WatchdogLoop);
    g_watchdog_running = true;
    return true;
  }, nb::arg("handle"),
  "Starts the stall inspector's responder and watchdog threads on a private "
  "communicator spanning the job (needs MPI_THREAD_MULTIPLE); False if not "
  "started.");

  m.def("stop_inspector", [] {
    nb::gil_scoped_release release;
    StopInspector();
  }, "Stops and joins the responder thread (before its communicator is freed).");

  m.def("status", [](int64_t key, int64_t device) {
    return DescribeStatus(key, device);
  }, nb::arg("key"), nb::arg("device"),
  "This process's status line for (communicator key, device), as the stall "
  "inspector sends it: '<calls> <phase> <text>'.");

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

// The extension's side of mpijax's XLA MPI bridge: the table of real MPI
// calls (bridge_table.h) that mpijax.init() hands to libmpijax_bridge.so,
// which jaxlib's MPItrampoline loaded for XLA's CPU collectives.
//
// XLA reaches these from its own threads: communicator creation from
// whichever thread first runs a collective of a clique, the operations from
// its thread pool. MPI runs at MPI_THREAD_MULTIPLE (mpijax.init() refuses to
// attach the bridge otherwise). XLA splits the job's communicator for each
// clique (a set of devices) at its first collective; every rank makes the
// same splits in the same order, because XLA runs the collectives of one
// program in program order and programs with collectives in launch order.
// What a split cannot do is wait for ranks that never come (a program over
// some processes' devices only, or ranks running different programs): it
// waits at most MPIJAX_TIMEOUT and then stops the job with a message.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "bridge_table.h"
#include "node_local.h"
#include "settings.h"

namespace mpijax {
namespace bridge {
namespace {

static_assert(sizeof(MPI_Request) <= sizeof(uint64_t),
              "an MPI_Request must fit the bridge's 8-byte request slot");

struct Comm {
  MPI_Comm comm;
  // mpijax's node-local all-reduce (shared memory, cross-memory attach) for
  // XLA's all-reduces on this communicator: set up by the first one that
  // could use it, MPI_Allreduce where none applies.
  std::unique_ptr<node_local::Comm> node;
  std::mutex node_mu;  // node_local::Comm is used by one thread at a time
};

MpijaxBridgeTable g_table;
Comm g_world{MPI_COMM_NULL};
std::mutex g_split_mu;  // one split at a time per process, in call order
double g_split_timeout_s = 0.0;
char g_library_version[MPI_MAX_LIBRARY_VERSION_STRING + 64];

MPI_Datatype Type(int code) {
  switch (code) {
    case MJB_BYTE: return MPI_BYTE;
    case MJB_INT8: return MPI_INT8_T;
    case MJB_UINT8: return MPI_UINT8_T;
    case MJB_INT16: return MPI_INT16_T;
    case MJB_UINT16: return MPI_UINT16_T;
    case MJB_INT32: return MPI_INT32_T;
    case MJB_UINT32: return MPI_UINT32_T;
    case MJB_INT64: return MPI_INT64_T;
    case MJB_UINT64: return MPI_UINT64_T;
    case MJB_FLOAT: return MPI_FLOAT;
    case MJB_DOUBLE: return MPI_DOUBLE;
    case MJB_C_FLOAT_COMPLEX: return MPI_C_FLOAT_COMPLEX;
    case MJB_C_DOUBLE_COMPLEX: return MPI_C_DOUBLE_COMPLEX;
    case MJB_CHAR: return MPI_CHAR;
    case MJB_INT: return MPI_INT;
    case MJB_LONG: return MPI_LONG;
    case MJB_UNSIGNED: return MPI_UNSIGNED;
    case MJB_UNSIGNED_LONG: return MPI_UNSIGNED_LONG;
    default: return MPI_DATATYPE_NULL;
  }
}

MPI_Op Op(int code) {
  switch (code) {
    case MJB_SUM: return MPI_SUM;
    case MJB_PROD: return MPI_PROD;
    case MJB_MIN: return MPI_MIN;
    case MJB_MAX: return MPI_MAX;
    case MJB_LAND: return MPI_LAND;
    case MJB_LOR: return MPI_LOR;
    case MJB_BAND: return MPI_BAND;
    case MJB_BOR: return MPI_BOR;
    default: return MPI_OP_NULL;
  }
}

MPI_Comm Of(void* comm) { return static_cast<Comm*>(comm)->comm; }

const void* Send(const void* send) { return send ? send : MPI_IN_PLACE; }

MPI_Request ToRequest(uint64_t bits) {
  MPI_Request r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

uint64_t FromRequest(MPI_Request r) {
  uint64_t bits = 0;
  std::memcpy(&bits, &r, sizeof r);
  return bits;
}

void Status3(const MPI_Status& s, int* s3) {
  if (!s3) return;
  s3[0] = s.MPI_SOURCE;
  s3[1] = s.MPI_TAG;
  s3[2] = s.MPI_ERROR;
}

// Waits (polled) until every rank of `comm` has arrived, at most the
// configured timeout; past it, stops the job with what went wrong.
int ArriveOrAbort(MPI_Comm comm, int color) {
  if (g_split_timeout_s <= 0) return MPI_SUCCESS;
  MPI_Request req;
  int rc = MPI_Ibarrier(comm, &req);
  if (rc != MPI_SUCCESS) return rc;
  auto start = std::chrono::steady_clock::now();
  int spins = 0;
  for (;;) {
    int done = 0;
    rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    double waited = std::chrono::duration<double>(
        std::chrono::steady_clock::now() - start).count();
    if (waited > g_split_timeout_s) {
      std::fprintf(stderr,
          "mpijax: rank %d of %d waited %.0f s for the other ranks to create "
          "a communicator for XLA's MPI collectives (MPI_Comm_split of all "
          "ranks, for the devices from %d on). XLA makes it at the first "
          "collective of each device group, on every process: every rank must "
          "run the same jitted programs in the same order, and a jitted "
          "program over the devices of some processes only cannot use XLA's "
          "MPI collectives (set MPIJAX_XLA_COLLECTIVES=gloo). Raise the wait "
          "with MPIJAX_TIMEOUT. Stopping the job.\n",
          g_table.world_rank, g_table.world_size, waited, color);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
}

int CommSplit(void* comm, int color, int key, void** out, int* rank, int* size) {
  std::lock_guard<std::mutex> lock(g_split_mu);
  *out = nullptr;
  MPI_Comm base = Of(comm);
  int rc = ArriveOrAbort(base, color);
  if (rc != MPI_SUCCESS) return rc;
  MPI_Comm made = MPI_COMM_NULL;
  rc = MPI_Comm_split(base, color < 0 ? MPI_UNDEFINED : color, key, &made);
  if (rc != MPI_SUCCESS || made == MPI_COMM_NULL) return rc;
  MPI_Comm_rank(made, rank);
  MPI_Comm_size(made, size);
  *out = new Comm{made};
  return MPI_SUCCESS;
}

int CommFree(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  int finalized = 0;
  MPI_Finalized(&finalized);
  int rc = MPI_SUCCESS;
  c->node.reset();  // unmaps its segments before the communicator goes
  if (!finalized) rc = MPI_Comm_free(&c->comm);
  delete c;
  return rc;
}

// Below this, XLA's all-reduces go to MPI_Allreduce: through the bridge the
// node-local path cost about 90 us more per call than MPI at 4-64 KiB, and
// from 256 KiB it is the faster one (2 ranks, 4 MiB: 0.73 vs 2.2 ms).
constexpr int64_t kNodeLocalMinBytes = int64_t{256} << 10;

int Allreduce(const void* send, void* recv, int count, int type, int op, void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  int type_bytes = 0;
  MPI_Type_size(Type(type), &type_bytes);
  if (int64_t{count} * type_bytes < kNodeLocalMinBytes) {
    return MPI_Allreduce(Send(send), recv, count, Type(type), Op(op), c->comm);
  }
  std::lock_guard<std::mutex> lock(c->node_mu);
  if (!c->node) {
    // mpijax's settings, the same on every rank.
    const auto& s = detail::g_settings;
    node_local::Limits limits;
    limits.shm_max_bytes = s.shm_max_bytes.load();
    limits.cma_min_bytes = s.cma_min_bytes.load();
    limits.timeout_s = s.timeout_s.load();
    limits.wait_spin_s = s.wait_spin_s.load();
    c->node = std::make_unique<node_local::Comm>(c->comm, limits);
  }
  return node_local::Allreduce(*c->node, Send(send), recv, count, Type(type), Op(op));
}

int Allgather(const void* send, int send_count, int send_type, void* recv,
              int recv_count, int recv_type, void* comm) {
  return MPI_Allgather(Send(send), send_count, send ? Type(send_type) : MPI_DATATYPE_NULL,
                       recv, recv_count, Type(recv_type), Of(comm));
}

int ReduceScatter(const void* send, void* recv, const int* recv_counts, int type,
                  int op, void* comm) {
  return MPI_Reduce_scatter(Send(send), recv, recv_counts, Type(type), Op(op), Of(comm));
}

int Isend(const void* buf, int count, int type, int dest, int tag, void* comm,
          uint64_t* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Isend(buf, count, Type(type), dest, tag, Of(comm), &r);
  *request = FromRequest(r);
  return rc;
}

int Irecv(void* buf, int count, int type, int source, int tag, void* comm,
          uint64_t* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Irecv(buf, count, Type(type), source, tag, Of(comm), &r);
  *request = FromRequest(r);
  return rc;
}

int Wait(uint64_t* request, int* status3) {
  MPI_Request r = ToRequest(*request);
  MPI_Status s;
  int rc = MPI_Wait(&r, &s);
  *request = FromRequest(r);
  Status3(s, status3);
  return rc;
}

int Sendrecv(const void* send, int send_count, int send_type, int dest, int send_tag,
             void* recv, int recv_count, int recv_type, int source, int recv_tag,
             void* comm, int* status3) {
  MPI_Status s;
  int rc = MPI_Sendrecv(send, send_count, Type(send_type), dest, send_tag, recv,
                        recv_count, Type(recv_type), source, recv_tag, Of(comm), &s);
  Status3(s, status3);
  return rc;
}

int Barrier(void* comm) { return MPI_Barrier(Of(comm)); }

// Callers' buffers hold at least 256 bytes (MPI ABI 2.9's smallest
// MPI_MAX_ERROR_STRING is larger); the real MPI's may be longer.
int ErrorString(int code, char* buf, int* len) {
  char text[MPI_MAX_ERROR_STRING + 1] = {0};
  int n = 0;
  int rc = MPI_Error_string(code, text, &n);
  if (rc != MPI_SUCCESS) std::snprintf(text, sizeof text, "MPI error %d", code);
  std::snprintf(buf, 256, "%s", text);
  *len = static_cast<int>(std::strlen(buf));
  return MPI_SUCCESS;
}

int Finalized(int* flag) { return MPI_Finalized(flag); }

void Abort(void* comm, int code) { MPI_Abort(comm ? Of(comm) : MPI_COMM_WORLD, code); }

}  // namespace
}  // namespace bridge
}  // namespace mpijax

// Called once, collectively, by mpijax.init() on every rank (the main thread):
// duplicates the job's communicator (*comm_handle, an mpi4py handle's address)
// for XLA and returns the table for mpijax_bridge_attach(), or NULL with the
// reason in `error`.
extern "C" __attribute__((visibility("default"))) const MpijaxBridgeTable*
mpijax_bridge_make_table(const void* comm_handle, double split_timeout_s,
                         char* error, int error_len) {
  using namespace mpijax::bridge;
  auto fail = [&](const std::string& why) -> const MpijaxBridgeTable* {
    std::snprintf(error, error_len, "%s", why.c_str());
    return nullptr;
  };
  if (g_table.version) return &g_table;  // made once per process
  int level = 0;
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE)
    return fail("MPI runs below MPI_THREAD_MULTIPLE; XLA calls MPI from its own threads");
  MPI_Comm base = *static_cast<const MPI_Comm*>(comm_handle);
  MPI_Comm dup = MPI_COMM_NULL;
  if (MPI_Comm_dup(base, &dup) != MPI_SUCCESS)
    return fail("MPI_Comm_dup of the job's communicator failed");
  // XLA turns an error code into an exception naming the call; the job's
  // abort-on-exception hook then stops every rank.
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  MPI_Comm_set_name(dup, "mpijax-xla");
  g_world.comm = dup;
  g_split_timeout_s = split_timeout_s;
  int n = 0;
  MPI_Get_library_version(g_library_version, &n);
  MpijaxBridgeTable& t = g_table;
  t.size = sizeof(MpijaxBridgeTable);
  t.world = &g_world;
  MPI_Comm_rank(dup, &t.world_rank);
  MPI_Comm_size(dup, &t.world_size);
  t.thread_level = 3;
  t.library_version = g_library_version;
  t.comm_split = CommSplit;
  t.comm_free = CommFree;
  t.allreduce = Allreduce;
  t.allgather = Allgather;
  t.reduce_scatter = ReduceScatter;
  t.isend = Isend;
  t.irecv = Irecv;
  t.wait = Wait;
  t.sendrecv = Sendrecv;
  t.barrier = Barrier;
  t.error_string = ErrorString;
  t.finalized = Finalized;
  t.abort = Abort;
  t.version = MPIJAX_BRIDGE_TABLE_VERSION;  // last: marks the table complete
  return &t;
}

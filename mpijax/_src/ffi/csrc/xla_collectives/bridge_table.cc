// The extension's side of mpijax's XLA MPI bridge: the table of real MPI
// calls (bridge_table.h) that mpijax.init() hands to libmpijax_bridge.so,
// which jaxlib's MPItrampoline loaded for XLA's CPU collectives.
//
// XLA reaches these from its own threads: communicator creation from
// whichever thread first runs a collective of a clique, the operations from
// the thread that runs the program. MPI runs at MPI_THREAD_MULTIPLE
// (mpijax.init() refuses to attach the bridge otherwise). Every
// communicator XLA splits becomes one of mpijax's (communicator.h), and every
// operation on it runs under mpijax's guards (collectives.h).
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "bridge/bridge_table.h"
#include "xla_collectives/communicator.h"
#include "xla_collectives/members.h"
#include "xla_collectives/collectives.h"

namespace mpijax {
namespace bridge {
namespace {

static_assert(sizeof(void*) <= sizeof(uint64_t),
              "a request pointer must fit the bridge's 8-byte request slot");

MpijaxBridgeTable g_table;
// The job's communicator for XLA (a private duplicate): XLA only splits it.
// Its address is the table's `world` handle.
MPI_Comm g_world = MPI_COMM_NULL;
double g_split_timeout_s = 0.0;
char g_library_version[MPI_MAX_LIBRARY_VERSION_STRING + 64];

bool IsWorld(void* comm) { return comm == &g_world; }
XlaComm& Of(void* comm) { return *static_cast<XlaComm*>(comm); }

int CommSplit(void* comm, int color, int key, void** out, int* rank, int* size) {
  if (MembersEnabled() && IsWorld(comm)) {
    // Several devices per process: a member mpijax prepared (members.h).
    XlaComm* m = color < 0 ? nullptr : TakeMember(color, key);
    *out = m;
    if (m != nullptr) {
      *rank = m->rank;
      *size = m->size;
    }
    return MPI_SUCCESS;
  }
  MPI_Comm base = IsWorld(comm) ? g_world : Of(comm).comm;
  XlaComm* made = nullptr;
  int rc = Split(base, g_table.world_rank, g_table.world_size,
                 g_split_timeout_s, color, key, &made);
  *out = made;
  if (made != nullptr) {
    *rank = made->rank;
    *size = made->size;
  }
  return rc;
}

int CommFree(void* comm) {
  if (IsWorld(comm)) return MPI_SUCCESS;
  XlaComm& c = Of(comm);
  if (c.clique != nullptr || !c.failed.empty()) return FreeMember(&c);
  return Free(&c);
}

int AllreduceCall(const void* send, void* recv, int count, int type, int op,
                  void* comm) {
  return Allreduce(Of(comm), send, recv, count, type, op);
}

int AllgatherCall(const void* send, int send_count, int send_type, void* recv,
                  int recv_count, int recv_type, void* comm) {
  return Allgather(Of(comm), send, send_count, send_type, recv, recv_count,
                   recv_type);
}

int ReduceScatterCall(const void* send, void* recv, const int* recv_counts,
                      int type, int op, void* comm) {
  return ReduceScatter(Of(comm), send, recv, recv_counts, type, op);
}

int IsendCall(const void* buf, int count, int type, int dest, int tag,
              void* comm, uint64_t* request) {
  return Isend(Of(comm), buf, count, type, dest, tag, request);
}

int IrecvCall(void* buf, int count, int type, int source, int tag, void* comm,
              uint64_t* request) {
  return Irecv(Of(comm), buf, count, type, source, tag, request);
}

int SendrecvCall(const void* send, int send_count, int send_type, int dest,
                 int send_tag, void* recv, int recv_count, int recv_type,
                 int source, int recv_tag, void* comm, int* status3) {
  return Sendrecv(Of(comm), send, send_count, send_type, dest, send_tag, recv,
                  recv_count, recv_type, source, recv_tag, status3);
}

int BarrierCall(void* comm) {
  return MPI_Barrier(IsWorld(comm) ? g_world : Of(comm).comm);
}

// Callers' buffers hold at least 256 bytes (MPI ABI 2.9's smallest
// MPI_MAX_ERROR_STRING is larger); the real MPI's may be longer.
int ErrorString(int code, char* buf, int* len) {
  std::string text;
  if (code == kErrXla) {
    text = ErrorText();
  } else {
    char mpi[MPI_MAX_ERROR_STRING + 1] = {0};
    int n = 0;
    if (MPI_Error_string(code, mpi, &n) == MPI_SUCCESS)
      text.assign(mpi, n);
    else
      text = "MPI error " + std::to_string(code);
  }
  std::snprintf(buf, 256, "%s", text.c_str());
  *len = static_cast<int>(std::strlen(buf));
  return MPI_SUCCESS;
}

int Finalized(int* flag) { return MPI_Finalized(flag); }

void Abort(void* comm, int code) {
  MPI_Abort(comm == nullptr || IsWorld(comm) ? MPI_COMM_WORLD : Of(comm).comm,
            code);
}

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
  // MPI's errors come back as codes: the operations word them (operation.cc).
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  MPI_Comm_set_name(dup, "mpijax-xla");
  g_world = dup;
  g_split_timeout_s = split_timeout_s;
  SetMembersWorld(dup, split_timeout_s);
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
  t.allreduce = AllreduceCall;
  t.allgather = AllgatherCall;
  t.reduce_scatter = ReduceScatterCall;
  t.isend = IsendCall;
  t.irecv = IrecvCall;
  t.wait = Wait;
  t.sendrecv = SendrecvCall;
  t.barrier = BarrierCall;
  t.error_string = ErrorString;
  t.finalized = Finalized;
  t.abort = Abort;
  t.version = MPIJAX_BRIDGE_TABLE_VERSION;  // last: marks the table complete
  return &t;
}

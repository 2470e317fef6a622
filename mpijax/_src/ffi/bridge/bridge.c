/* libmpijax_bridge.so: the MPI library jaxlib's MPItrampoline loads for XLA's
 * CPU collectives (jax_cpu_collectives_implementation='mpi'), forwarding to
 * the MPI that mpi4py and mpijax use.
 *
 * MPItrampoline (inside jaxlib) dlopens the library named by MPITRAMPOLINE_LIB
 * when jaxlib loads, checks mpiabi_version_*, and resolves every MPIABI_*
 * name of MPI ABI 2.9 (constants are read by value right then, functions kept
 * as pointers). At that moment no MPI library is loaded yet, so this library
 * links none: it exports the constants XLA uses in an encoding of its own
 * (small tags for predefined handles) and forwards each call, at call time,
 * through the table mpijax.init() attaches (bridge_table.h). Names XLA never
 * calls are generated stubs (bridge_stubs.c) that fail loudly.
 *
 * MPI's life belongs to mpi4py: MPI_Init_thread finds it initialized and
 * reports its thread level, MPI_Finalize is a no-op (mpi4py finalizes at
 * exit), and communicators XLA frees after that are only forgotten.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bridge_table.h"

#define EXPORT __attribute__((visibility("default")))

/* --- types of MPI ABI 2.9 (handles are pointer-sized) ---------------------- */

typedef void *MPIABI_Comm;
typedef void *MPIABI_Datatype;
typedef void *MPIABI_Op;
typedef void *MPIABI_Request;
typedef struct {
  int MPI_SOURCE;
  int MPI_TAG;
  int MPI_ERROR;
  int mpi_reserved[5];
} MPIABI_Status;

/* --- versions read by MPItrampoline ---------------------------------------- */

EXPORT const int mpiabi_version_major = 2;
EXPORT const int mpiabi_version_minor = 9;
EXPORT const int mpiabi_version_patch = 0;
/* This library's own version (MPItrampoline only prints it). */
EXPORT const int mpiwrapper_version_major = 0;
EXPORT const int mpiwrapper_version_minor = 1;
EXPORT const int mpiwrapper_version_patch = 0;

/* MPItrampoline calls this before resolving names; no Fortran here. */
EXPORT void mpiwrapper_export_fortran_constants_(void) {}

/* --- constants XLA uses, in this library's encoding ------------------------
 * Predefined handles are tags below one page (never a heap address);
 * communicators XLA creates are pointers to struct bcomm. */

#define TAG_COMM_WORLD 0x101
#define TAG_COMM_SELF 0x102
#define TAG_TYPE_BASE 0x200
#define TAG_OP_BASE 0x300

#define TYPE_TAG(code) ((uintptr_t)(TAG_TYPE_BASE + (code)))
#define OP_TAG(code) ((uintptr_t)(TAG_OP_BASE + (code)))

EXPORT const uintptr_t MPIABI_COMM_WORLD = TAG_COMM_WORLD;
EXPORT const uintptr_t MPIABI_COMM_SELF = TAG_COMM_SELF;
EXPORT const uintptr_t MPIABI_COMM_NULL = 0;
EXPORT const uintptr_t MPIABI_DATATYPE_NULL = 0;
EXPORT const uintptr_t MPIABI_OP_NULL = 0;
EXPORT const uintptr_t MPIABI_REQUEST_NULL = 0;

EXPORT const uintptr_t MPIABI_BYTE = TYPE_TAG(MJB_BYTE);
EXPORT const uintptr_t MPIABI_INT8_T = TYPE_TAG(MJB_INT8);
EXPORT const uintptr_t MPIABI_UINT8_T = TYPE_TAG(MJB_UINT8);
EXPORT const uintptr_t MPIABI_INT16_T = TYPE_TAG(MJB_INT16);
EXPORT const uintptr_t MPIABI_UINT16_T = TYPE_TAG(MJB_UINT16);
EXPORT const uintptr_t MPIABI_INT32_T = TYPE_TAG(MJB_INT32);
EXPORT const uintptr_t MPIABI_UINT32_T = TYPE_TAG(MJB_UINT32);
EXPORT const uintptr_t MPIABI_INT64_T = TYPE_TAG(MJB_INT64);
EXPORT const uintptr_t MPIABI_UINT64_T = TYPE_TAG(MJB_UINT64);
EXPORT const uintptr_t MPIABI_FLOAT = TYPE_TAG(MJB_FLOAT);
EXPORT const uintptr_t MPIABI_DOUBLE = TYPE_TAG(MJB_DOUBLE);
EXPORT const uintptr_t MPIABI_C_COMPLEX = TYPE_TAG(MJB_C_FLOAT_COMPLEX);
EXPORT const uintptr_t MPIABI_C_FLOAT_COMPLEX = TYPE_TAG(MJB_C_FLOAT_COMPLEX);
EXPORT const uintptr_t MPIABI_C_DOUBLE_COMPLEX = TYPE_TAG(MJB_C_DOUBLE_COMPLEX);
EXPORT const uintptr_t MPIABI_CHAR = TYPE_TAG(MJB_CHAR);
EXPORT const uintptr_t MPIABI_INT = TYPE_TAG(MJB_INT);
EXPORT const uintptr_t MPIABI_LONG = TYPE_TAG(MJB_LONG);
EXPORT const uintptr_t MPIABI_UNSIGNED = TYPE_TAG(MJB_UNSIGNED);
EXPORT const uintptr_t MPIABI_UNSIGNED_LONG = TYPE_TAG(MJB_UNSIGNED_LONG);

EXPORT const uintptr_t MPIABI_SUM = OP_TAG(MJB_SUM);
EXPORT const uintptr_t MPIABI_PROD = OP_TAG(MJB_PROD);
EXPORT const uintptr_t MPIABI_MIN = OP_TAG(MJB_MIN);
EXPORT const uintptr_t MPIABI_MAX = OP_TAG(MJB_MAX);
EXPORT const uintptr_t MPIABI_LAND = OP_TAG(MJB_LAND);
EXPORT const uintptr_t MPIABI_LOR = OP_TAG(MJB_LOR);
EXPORT const uintptr_t MPIABI_BAND = OP_TAG(MJB_BAND);
EXPORT const uintptr_t MPIABI_BOR = OP_TAG(MJB_BOR);

EXPORT MPIABI_Status *const MPIABI_STATUS_IGNORE = NULL;
EXPORT MPIABI_Status *const MPIABI_STATUSES_IGNORE = NULL;
EXPORT void *const MPIABI_IN_PLACE = (void *)1;
EXPORT void *const MPIABI_BOTTOM = NULL;

EXPORT const int MPIABI_SUCCESS = 0;
EXPORT const int MPIABI_THREAD_SINGLE = 0;
EXPORT const int MPIABI_THREAD_FUNNELED = 1;
EXPORT const int MPIABI_THREAD_SERIALIZED = 2;
EXPORT const int MPIABI_THREAD_MULTIPLE = 3;
EXPORT const int MPIABI_UNDEFINED = -32766;
EXPORT const int MPIABI_ANY_SOURCE = -1;
EXPORT const int MPIABI_ANY_TAG = -1;
EXPORT const int MPIABI_PROC_NULL = -2;
EXPORT const int MPIABI_MAX_ERROR_STRING = 256;
EXPORT const int MPIABI_MAX_LIBRARY_VERSION_STRING = 8192;

/* Error codes of the bridge itself (the real MPI's codes are small). */
enum {
  ERR_COMM = 0x6d6a0001,
  ERR_TYPE,
  ERR_OP,
  ERR_REQUEST,
  ERR_UNSUPPORTED,
  ERR_TABLE,
};

/* --- the attached table ----------------------------------------------------- */

static _Atomic(const MpijaxBridgeTable *) g_table;

/* Calls counted per kind, for mpijax's checks and tests (relaxed counters). */
enum {
  STAT_INIT,
  STAT_SPLIT,
  STAT_FREE,
  STAT_ALLREDUCE,
  STAT_ALLGATHER,
  STAT_REDUCE_SCATTER,
  STAT_SENDRECV,
  STAT_ISEND,
  STAT_IRECV,
  STAT_WAIT,
  STAT_FINALIZE,
  STAT_COUNT
};
static _Atomic uint64_t g_stats[STAT_COUNT];

static void count(int which) {
  atomic_fetch_add_explicit(&g_stats[which], 1, memory_order_relaxed);
}

/* Used by the generated stubs and by calls made before mpijax.init(). */
__attribute__((noreturn, visibility("hidden"))) void mpijax_bridge_fatal(
    const char *what) {
  fprintf(stderr, "mpijax: %s\n", what);
  fflush(stderr);
  abort();
}

__attribute__((noreturn, visibility("hidden"))) void mpijax_bridge_unimplemented(
    const char *mpi_name) {
  char text[512];
  snprintf(text, sizeof text,
           "%s was called through mpijax's MPI bridge for XLA "
           "(MPITRAMPOLINE_LIB), which implements only the MPI calls XLA's "
           "CPU collectives make. Use JAX's gloo collectives for this program "
           "(MPIJAX_XLA_COLLECTIVES=gloo) and report the call.",
           mpi_name);
  mpijax_bridge_fatal(text);
}

static const MpijaxBridgeTable *table_or_die(const char *mpi_name) {
  const MpijaxBridgeTable *t =
      atomic_load_explicit(&g_table, memory_order_acquire);
  if (t) return t;
  char text[640];
  snprintf(text, sizeof text,
           "XLA called %s through mpijax's MPI bridge (MPITRAMPOLINE_LIB), but "
           "mpijax.init() has not attached the bridge to MPI. XLA's MPI "
           "collectives (jax_cpu_collectives_implementation='mpi') need "
           "mpijax.init() to run before JAX starts its backend: call "
           "mpijax.init() first in the program, or use gloo "
           "(MPIJAX_XLA_COLLECTIVES=gloo).",
           mpi_name);
  mpijax_bridge_fatal(text);
}

/* Returns 0, or 1 if the table's version or size differs from this library's. */
EXPORT int mpijax_bridge_attach(const MpijaxBridgeTable *t) {
  if (!t || t->version != MPIJAX_BRIDGE_TABLE_VERSION ||
      t->size != (int)sizeof(MpijaxBridgeTable))
    return 1;
  const MpijaxBridgeTable *expected = NULL;
  /* The first table stays: XLA may hold communicators split from its world. */
  atomic_compare_exchange_strong(&g_table, &expected, t);
  return 0;
}

EXPORT int mpijax_bridge_attached(void) {
  return atomic_load_explicit(&g_table, memory_order_acquire) != NULL;
}

EXPORT int mpijax_bridge_table_version(void) {
  return MPIJAX_BRIDGE_TABLE_VERSION;
}

/* Copies up to n call counters (see STAT_*) into out; returns how many exist. */
EXPORT int mpijax_bridge_stats(uint64_t *out, int n) {
  for (int i = 0; i < n && i < STAT_COUNT; ++i)
    out[i] = atomic_load_explicit(&g_stats[i], memory_order_relaxed);
  return STAT_COUNT;
}

/* --- handle translation ------------------------------------------------------ */

#define BCOMM_MAGIC 0x6d706a786272636dULL /* "mpjxbrcm" */

struct bcomm {
  uint64_t magic;
  void *ext; /* the extension's communicator */
  int rank;
  int size;
};

/* The extension's communicator for `c`, with its rank and size; NULL if `c`
 * is no communicator of ours. */
static void *ext_comm(const MpijaxBridgeTable *t, MPIABI_Comm c, int *rank,
                      int *size) {
  uintptr_t v = (uintptr_t)c;
  if (v == TAG_COMM_WORLD) {
    if (rank) *rank = t->world_rank;
    if (size) *size = t->world_size;
    return t->world;
  }
  if (v < 4096) return NULL; /* COMM_NULL, COMM_SELF, or junk */
  struct bcomm *b = (struct bcomm *)c;
  if (b->magic != BCOMM_MAGIC) return NULL;
  if (rank) *rank = b->rank;
  if (size) *size = b->size;
  return b->ext;
}

static int type_code(MPIABI_Datatype d) {
  uintptr_t v = (uintptr_t)d;
  if (v > TAG_TYPE_BASE && v < TAG_TYPE_BASE + MJB_TYPE_END)
    return (int)(v - TAG_TYPE_BASE);
  return -1;
}

static int op_code(MPIABI_Op o) {
  uintptr_t v = (uintptr_t)o;
  if (v > TAG_OP_BASE && v < TAG_OP_BASE + MJB_OP_END)
    return (int)(v - TAG_OP_BASE);
  return -1;
}

static void fill_status(MPIABI_Status *status, const int *s3) {
  if (status == MPIABI_STATUS_IGNORE) return;
  memset(status, 0, sizeof *status);
  status->MPI_SOURCE = s3[0];
  status->MPI_TAG = s3[1];
  status->MPI_ERROR = s3[2];
}

/* --- environment ----------------------------------------------------------------- */

/* MPI is mpi4py's, initialized by mpijax.init() before XLA's backend starts. */
EXPORT int MPIABI_Init_thread(int *argc, char ***argv, int required,
                              int *provided) {
  (void)argc;
  (void)argv;
  (void)required;
  const MpijaxBridgeTable *t = table_or_die("MPI_Init_thread");
  count(STAT_INIT);
  if (provided) *provided = t->thread_level;
  return 0;
}

EXPORT int MPIABI_Init(int *argc, char ***argv) {
  int provided;
  return MPIABI_Init_thread(argc, argv, 0, &provided);
}

EXPORT int MPIABI_Initialized(int *flag) {
  *flag = mpijax_bridge_attached();
  return 0;
}

EXPORT int MPIABI_Finalized(int *flag) {
  const MpijaxBridgeTable *t =
      atomic_load_explicit(&g_table, memory_order_acquire);
  *flag = 0;
  return t ? t->finalized(flag) : 0;
}

/* XLA registers this at exit; mpi4py finalizes MPI later, itself. */
EXPORT int MPIABI_Finalize(void) {
  count(STAT_FINALIZE);
  return 0;
}

EXPORT int MPIABI_Query_thread(int *provided) {
  *provided = table_or_die("MPI_Query_thread")->thread_level;
  return 0;
}

/* XLA creates a communicator from whichever thread first runs a collective,
 * and refuses unless this says "main thread". The extension only attaches
 * the bridge when MPI runs at MPI_THREAD_MULTIPLE, where any thread may. */
EXPORT int MPIABI_Is_thread_main(int *flag) {
  *flag = table_or_die("MPI_Is_thread_main")->thread_level >= 3;
  return 0;
}

EXPORT int MPIABI_Get_version(int *version, int *subversion) {
  *version = 3;
  *subversion = 1;
  return 0;
}

EXPORT int MPIABI_Get_library_version(char *version, int *resultlen) {
  const MpijaxBridgeTable *t =
      atomic_load_explicit(&g_table, memory_order_acquire);
  int n = snprintf(version, 8192, "mpijax MPI bridge for XLA over: %s",
                   t && t->library_version ? t->library_version
                                           : "(not attached yet)");
  *resultlen = n < 8191 ? n : 8191;
  return 0;
}

EXPORT int MPIABI_Error_string(int code, char *text, int *resultlen) {
  const char *own = NULL;
  switch (code) {
    case ERR_COMM: own = "mpijax bridge: not a communicator of the bridge"; break;
    case ERR_TYPE: own = "mpijax bridge: datatype not supported"; break;
    case ERR_OP: own = "mpijax bridge: reduction op not supported"; break;
    case ERR_REQUEST: own = "mpijax bridge: invalid request"; break;
    case ERR_UNSUPPORTED: own = "mpijax bridge: operation not supported"; break;
    case ERR_TABLE: own = "mpijax bridge: not attached"; break;
    default: break;
  }
  const MpijaxBridgeTable *t =
      atomic_load_explicit(&g_table, memory_order_acquire);
  if (!own && t) return t->error_string(code, text, resultlen);
  int n = snprintf(text, 256, "%s", own ? own : "unknown MPI error");
  *resultlen = n < 255 ? n : 255;
  return 0;
}

EXPORT int MPIABI_Abort(MPIABI_Comm comm, int code) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Abort");
  void *c = ext_comm(t, comm, NULL, NULL);
  t->abort(c ? c : t->world, code);
  abort();
}

/* --- communicators --------------------------------------------------------------- */

EXPORT int MPIABI_Comm_rank(MPIABI_Comm comm, int *rank) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Comm_rank");
  return ext_comm(t, comm, rank, NULL) ? 0 : ERR_COMM;
}

EXPORT int MPIABI_Comm_size(MPIABI_Comm comm, int *size) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Comm_size");
  return ext_comm(t, comm, NULL, size) ? 0 : ERR_COMM;
}

EXPORT int MPIABI_Comm_split(MPIABI_Comm comm, int color, int key,
                             MPIABI_Comm *newcomm) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Comm_split");
  void *c = ext_comm(t, comm, NULL, NULL);
  if (!c) return ERR_COMM;
  count(STAT_SPLIT);
  void *out = NULL;
  int rank = 0, size = 0;
  int rc = t->comm_split(c, color == MPIABI_UNDEFINED ? -1 : color, key, &out,
                         &rank, &size);
  if (rc != 0) return rc;
  if (!out) {
    *newcomm = (MPIABI_Comm)MPIABI_COMM_NULL;
    return 0;
  }
  struct bcomm *b = (struct bcomm *)malloc(sizeof *b);
  if (!b) {
    t->comm_free(out);
    return ERR_UNSUPPORTED;
  }
  b->magic = BCOMM_MAGIC;
  b->ext = out;
  b->rank = rank;
  b->size = size;
  *newcomm = b;
  return 0;
}

/* XLA frees its communicators when its clique cache goes, possibly after
 * mpi4py has finalized MPI at exit; the extension then only forgets them. */
EXPORT int MPIABI_Comm_free(MPIABI_Comm *comm) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Comm_free");
  uintptr_t v = (uintptr_t)*comm;
  if (v == TAG_COMM_WORLD || v == TAG_COMM_SELF) return ERR_COMM;
  if (!ext_comm(t, *comm, NULL, NULL)) return ERR_COMM;
  count(STAT_FREE);
  struct bcomm *b = (struct bcomm *)*comm;
  int rc = t->comm_free(b->ext);
  b->magic = 0;
  free(b);
  *comm = (MPIABI_Comm)MPIABI_COMM_NULL;
  return rc;
}

/* --- collectives and point-to-point ---------------------------------------------- */

#define COMM_OR_FAIL(t, comm, c)            \
  void *c = ext_comm((t), (comm), NULL, NULL); \
  if (!c) return ERR_COMM

EXPORT int MPIABI_Allreduce(const void *send, void *recv, int count_,
                            MPIABI_Datatype type, MPIABI_Op op,
                            MPIABI_Comm comm) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Allreduce");
  COMM_OR_FAIL(t, comm, c);
  int ty = type_code(type), o = op_code(op);
  if (ty < 0) return ERR_TYPE;
  if (o < 0) return ERR_OP;
  count(STAT_ALLREDUCE);
  /* NULL: in place (XLA may alias its input and output buffers). */
  if (send == MPIABI_IN_PLACE || send == recv) send = NULL;
  return t->allreduce(send, recv, count_, ty, o, c);
}

EXPORT int MPIABI_Allgather(const void *send, int send_count,
                            MPIABI_Datatype send_type, void *recv,
                            int recv_count, MPIABI_Datatype recv_type,
                            MPIABI_Comm comm) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Allgather");
  COMM_OR_FAIL(t, comm, c);
  int st = type_code(send_type), rt = type_code(recv_type);
  if (rt < 0 || (send != MPIABI_IN_PLACE && st < 0)) return ERR_TYPE;
  count(STAT_ALLGATHER);
  if (send == MPIABI_IN_PLACE) send = NULL;
  return t->allgather(send, send_count, st, recv, recv_count, rt, c);
}

EXPORT int MPIABI_Reduce_scatter(const void *send, void *recv,
                                 const int *recv_counts, MPIABI_Datatype type,
                                 MPIABI_Op op, MPIABI_Comm comm) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Reduce_scatter");
  COMM_OR_FAIL(t, comm, c);
  int ty = type_code(type), o = op_code(op);
  if (ty < 0) return ERR_TYPE;
  if (o < 0) return ERR_OP;
  count(STAT_REDUCE_SCATTER);
  if (send == MPIABI_IN_PLACE) send = NULL;
  return t->reduce_scatter(send, recv, recv_counts, ty, o, c);
}

EXPORT int MPIABI_Isend(const void *buf, int count_, MPIABI_Datatype type,
                        int dest, int tag, MPIABI_Comm comm,
                        MPIABI_Request *request) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Isend");
  COMM_OR_FAIL(t, comm, c);
  int ty = type_code(type);
  if (ty < 0) return ERR_TYPE;
  if (dest == MPIABI_PROC_NULL || dest < 0) return ERR_UNSUPPORTED;
  count(STAT_ISEND);
  uint64_t bits = 0;
  int rc = t->isend(buf, count_, ty, dest, tag, c, &bits);
  *request = (MPIABI_Request)(uintptr_t)bits;
  return rc;
}

EXPORT int MPIABI_Irecv(void *buf, int count_, MPIABI_Datatype type,
                        int source, int tag, MPIABI_Comm comm,
                        MPIABI_Request *request) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Irecv");
  COMM_OR_FAIL(t, comm, c);
  int ty = type_code(type);
  if (ty < 0) return ERR_TYPE;
  if (source < 0 || tag < 0) return ERR_UNSUPPORTED; /* no wildcards */
  count(STAT_IRECV);
  uint64_t bits = 0;
  int rc = t->irecv(buf, count_, ty, source, tag, c, &bits);
  *request = (MPIABI_Request)(uintptr_t)bits;
  return rc;
}

EXPORT int MPIABI_Wait(MPIABI_Request *request, MPIABI_Status *status) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Wait");
  if ((uintptr_t)*request == MPIABI_REQUEST_NULL) {
    static const int empty[3] = {-2, -1, 0}; /* MPI's empty status */
    fill_status(status, empty);
    return 0;
  }
  count(STAT_WAIT);
  uint64_t bits = (uint64_t)(uintptr_t)*request;
  int s3[3] = {0, 0, 0};
  int rc = t->wait(&bits, s3);
  *request = (MPIABI_Request)MPIABI_REQUEST_NULL;
  fill_status(status, s3);
  return rc;
}

EXPORT int MPIABI_Sendrecv(const void *send, int send_count,
                           MPIABI_Datatype send_type, int dest, int send_tag,
                           void *recv, int recv_count,
                           MPIABI_Datatype recv_type, int source, int recv_tag,
                           MPIABI_Comm comm, MPIABI_Status *status) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Sendrecv");
  COMM_OR_FAIL(t, comm, c);
  int st = type_code(send_type), rt = type_code(recv_type);
  if (st < 0 || rt < 0) return ERR_TYPE;
  if (dest < 0 || source < 0 || recv_tag < 0) return ERR_UNSUPPORTED;
  count(STAT_SENDRECV);
  int s3[3] = {0, 0, 0};
  int rc = t->sendrecv(send, send_count, st, dest, send_tag, recv, recv_count,
                       rt, source, recv_tag, c, s3);
  fill_status(status, s3);
  return rc;
}

EXPORT int MPIABI_Barrier(MPIABI_Comm comm) {
  const MpijaxBridgeTable *t = table_or_die("MPI_Barrier");
  COMM_OR_FAIL(t, comm, c);
  return t->barrier(c);
}

/* --- MPIX extensions MPItrampoline also resolves: no device memory here --- */

EXPORT int MPIXABI_Query_cuda_support(void) { return 0; }
EXPORT int MPIXABI_Query_hip_support(void) { return 0; }
EXPORT int MPIXABI_Query_ze_support(void) { return 0; }

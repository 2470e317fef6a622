/* The contract between mpijax's XLA MPI bridge (libmpijax_bridge.so, which
 * knows no MPI) and mpijax's extension (linked to the MPI that mpi4py loaded).
 *
 * XLA's CPU collectives reach MPI through MPItrampoline, built into jaxlib,
 * which loads the bridge by MPITRAMPOLINE_LIB when jaxlib loads, long before
 * any MPI library is. So the bridge links nothing: mpijax.init() hands it
 * this table, filled by the extension, and every MPI call XLA makes is
 * forwarded through it. Plain C types only: handles are opaque pointers
 * owned by the extension, datatypes and reduction ops small codes, and
 * requests the raw bits of the real MPI_Request (at most 8 bytes). Return
 * values are the real MPI's error codes (0 = success).
 */
#ifndef MPIJAX_BRIDGE_TABLE_H_
#define MPIJAX_BRIDGE_TABLE_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever the layout below changes; the bridge refuses a table of
 * another version. */
#define MPIJAX_BRIDGE_TABLE_VERSION 1

enum MpijaxBridgeType {
  MJB_BYTE = 1,
  MJB_INT8,
  MJB_UINT8,
  MJB_INT16,
  MJB_UINT16,
  MJB_INT32,
  MJB_UINT32,
  MJB_INT64,
  MJB_UINT64,
  MJB_FLOAT,
  MJB_DOUBLE,
  MJB_C_FLOAT_COMPLEX,
  MJB_C_DOUBLE_COMPLEX,
  MJB_CHAR,
  MJB_INT,
  MJB_LONG,
  MJB_UNSIGNED,
  MJB_UNSIGNED_LONG,
  MJB_TYPE_END
};

enum MpijaxBridgeOp {
  MJB_SUM = 1,
  MJB_PROD,
  MJB_MIN,
  MJB_MAX,
  MJB_LAND,
  MJB_LOR,
  MJB_BAND,
  MJB_BOR,
  MJB_OP_END
};

typedef struct MpijaxBridgeTable {
  int version;   /* MPIJAX_BRIDGE_TABLE_VERSION */
  int size;      /* sizeof(MpijaxBridgeTable) */
  void *world;   /* the job's communicator: a private duplicate */
  int world_rank;
  int world_size;
  int thread_level; /* 0 single, 1 funneled, 2 serialized, 3 multiple */
  const char *library_version; /* MPI_Get_library_version of the real MPI */

  /* color < 0: MPI_UNDEFINED (*out = NULL). Collective over `comm`; may be
   * called from any thread (the extension serializes and bounds it). */
  int (*comm_split)(void *comm, int color, int key, void **out, int *rank,
                    int *size);
  int (*comm_free)(void *comm);
  int (*allreduce)(const void *send, void *recv, int count, int type, int op,
                   void *comm);
  int (*allgather)(const void *send, int send_count, int send_type, void *recv,
                   int recv_count, int recv_type, void *comm);
  int (*reduce_scatter)(const void *send, void *recv, const int *recv_counts,
                        int type, int op, void *comm);
  int (*isend)(const void *buf, int count, int type, int dest, int tag,
               void *comm, uint64_t *request);
  int (*irecv)(void *buf, int count, int type, int source, int tag, void *comm,
               uint64_t *request);
  /* status3: {source, tag, error} or NULL. */
  int (*wait)(uint64_t *request, int *status3);
  int (*sendrecv)(const void *send, int send_count, int send_type, int dest,
                  int send_tag, void *recv, int recv_count, int recv_type,
                  int source, int recv_tag, void *comm, int *status3);
  int (*barrier)(void *comm);
  int (*error_string)(int code, char *buf, int *len);
  int (*finalized)(int *flag);
  void (*abort)(void *comm, int code);
} MpijaxBridgeTable;

#ifdef __cplusplus
}
#endif

#endif /* MPIJAX_BRIDGE_TABLE_H_ */

// node_local::Allreduce: chooses a node-local path by size (or
// MPI_Allreduce), with the Caller's defaults and the Comm's Limits.
#include "node_local/standalone.h"

#include <cstddef>
#include <cstdint>

#include "base/common.h"
#include "node_local/caller.h"
#include "node_local/cma.h"
#include "node_local/shm.h"
#include "base/spans.h"

namespace mpijax::node_local {
namespace {

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

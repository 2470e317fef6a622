// Element types and reductions: XLA dtypes -> MPI datatypes and ops
// (including the float16/bfloat16 and wrapping 8/16-bit sums MPI lacks), and
// the division of a mean.
#ifndef MPIJAX_FFI_REDUCE_OPS_H_
#define MPIJAX_FFI_REDUCE_OPS_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

namespace ffi = ::xla::ffi;

// The op codes of the handlers' "op" attribute (mpijax/_src/ops).
enum ReduceOp : int64_t {
  kSum = 0, kProd = 1, kMin = 2, kMax = 3, kAnd = 4, kOr = 5, kXor = 6,
};

// "float32" etc., for messages.
const char* DtypeName(ffi::DataType t);

// Creates the MPI datatype and ops for float16/bfloat16 and the wrapping
// integer sums (once; MPI must be initialized).
void InitTypesOnce();

// Element type and reduction op for a (dtype, op) pair. Python checks the
// combination at trace time; this is the last line of defence.
ffi::Error ReductionTypes(ffi::DataType t, int64_t op, MPI_Datatype* dt,
                          MPI_Op* mop);

// Divides `count` elements at `p` by `divisor` in place, as XLA's `x / n`
// does (float16/bfloat16 through float): allreduce(op="mean"). Fails for a
// dtype that is not floating (also with count 0: a check before any wait).
ffi::Error DivideInPlace(ffi::DataType t, void* p, size_t count,
                         int64_t divisor);

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_REDUCE_OPS_H_

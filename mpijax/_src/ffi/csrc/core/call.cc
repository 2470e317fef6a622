#include "core/call.h"

#include <cstdio>
#include <sstream>
#include <string>

#include "core/reduce_ops.h"

namespace mpijax::detail {

std::string CallInfo::Describe() const {
  std::ostringstream s;
  s << "mpijax.ops." << name << " on " << DtypeName(dtype) << "[";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? "," : "") << dims[i];
  s << "] (communicator " << comm_id << ", size " << comm_size
    << ", local device " << device << ")";
  return s.str();
}

ffi::Error CheckRoot(const CallInfo& info, int64_t root) {
  if (root < 0 || root >= info.comm_size) {
    return ffi::Error::InvalidArgument(info.Describe() + ": root " +
                                       std::to_string(root) + " out of range");
  }
  return ffi::Error::Success();
}

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

}  // namespace mpijax::detail

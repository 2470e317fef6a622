// The Caller's defaults: reports on stderr, errors worded for a plain MPI
// caller.
#include "node_local/caller.h"

#include <mpi.h>

#include <cstdio>
#include <string>

namespace mpijax::node_local {

Status Caller::Finish(char*, size_t) { return {}; }

void Caller::Stalled(double waited_s) {
  std::fprintf(stderr,
               "mpijax: node-local all-reduce: waited %.1f s for the other "
               "ranks\n",
               waited_s);
  std::fflush(stderr);
}

Status Caller::MpiFailed(int rc, const char* call) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return {kInternal, std::string("node-local all-reduce: ") + call +
                         " failed: " + std::string(text, len)};
}

Status Caller::Mismatch(int rank, int64_t rank_sig, int64_t rank_bytes,
                        int64_t my_bytes) {
  std::string what =
      rank_sig != sig ? " reduces something else than this rank"
      : rank_bytes != my_bytes
          ? " reduces " + std::to_string(rank_bytes) + " bytes, this rank " +
                std::to_string(my_bytes)
          : std::string(" takes another node-local path (the limits must be "
                        "the same on every rank)");
  return {kInternal, "node-local all-reduce: rank " + std::to_string(rank) +
                         what};
}

Status Caller::CmaFailed(int rank, const std::string& how) {
  return {kInternal,
          "node-local all-reduce: the cross-memory all-reduce failed on rank " +
              std::to_string(rank) + " (" + how + ")"};
}

}  // namespace mpijax::node_local

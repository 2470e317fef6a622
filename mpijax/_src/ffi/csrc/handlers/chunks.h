// Messages in pieces: a handler's buffer goes in chunks of at most
// max_chunk_bytes (and never more than INT_MAX elements), one MPI call each.
// The handler states its MPI calls; these say how the buffer is cut.
#ifndef MPIJAX_FFI_CHUNKS_H_
#define MPIJAX_FFI_CHUNKS_H_

#include <mpi.h>

#include <algorithm>
#include <cstddef>

#include "core/call.h"
#include "core/settings.h"
#include "core/wait.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax::detail {

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
  StridedBytes(const StridedBytes&) = delete;
  StridedBytes& operator=(const StridedBytes&) = delete;
};

// Calls `piece(off, count)` (returning ffi::Error) for each chunk of `n`
// elements of `elem_bytes` each, in order; stops at the first error.
template <typename Piece>
ffi::Error ForEachChunk(size_t n, size_t elem_bytes, Piece&& piece) {
  size_t chunk = ChunkElems(elem_bytes);
  for (size_t off = 0; off < n; off += chunk) {
    int count = static_cast<int>(std::min(chunk, n - off));
    if (auto e = piece(off, count); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// A collective that moves one block of `nb` bytes per rank (allgather,
// alltoall, gather, scatter). A block that fits one message goes in one call,
// `whole(len)` (MPIJAX_COLLECTIVE: every rank has the same `nb`, so all choose
// the same call). A larger one goes chunk by chunk: `piece(off, len, block,
// req)` posts chunk [off, off + len) of every rank's block (`block` is that
// chunk as a datatype whose extent is the whole block) into `req`, which is
// then waited for.
template <typename Whole, typename Piece>
ffi::Error BlockCollective(const CallInfo& info, size_t nb, Whole&& whole,
                           Piece&& piece) {
  size_t chunk = ChunkElems(1);
  if (nb == 0) return ffi::Error::Success();
  if (nb <= chunk) return whole(static_cast<int>(nb));
  for (size_t off = 0; off < nb; off += chunk) {
    size_t len = std::min(chunk, nb - off);
    StridedBytes block(len, nb);
    MPI_Request req;
    if (auto e = piece(off, len, block, req); e.failure()) return e;
    if (auto e = Wait(&req, info); e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_CHUNKS_H_

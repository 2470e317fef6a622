"""Type stub for mpijax's C++ MPI transport (mpijax/_src/ffi/mpijax_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target."""

def setup(max_chunk_bytes: int, timeout_s: float) -> None:
  """Creates the float16/bfloat16 MPI ops and sets chunk size and timeout."""

def register_comms(handles: list[int]) -> int:
  """Registers one communicator per local device index; returns its id."""

def unregister_comms(comm_id: int) -> None:
  """Forgets the communicators of ``comm_id`` (before they are freed)."""

def build_mpi_version() -> str:
  """MPI family and version of the mpi.h this module was compiled with."""

def linked_library_version() -> str:
  """MPI_Get_library_version of the libmpi this module resolved to."""

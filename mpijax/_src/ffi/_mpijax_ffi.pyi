"""Type stub for mpijax's C++ MPI transport (mpijax/_src/ffi/mpijax_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target."""

def setup(max_chunk_bytes: int, timeout_s: float, stall_abort: bool = True,
          check_every: bool = False, blocking_min_bytes: int = 0,
          ring_min_bytes: int = 131072,
          ring_in_place_min_bytes: int = 4194304,
          shm_max_bytes: int = 1048576) -> None:
  """Creates the float16/bfloat16 MPI ops; sets chunk size, timeout, stall
  action, whether every call's signature is compared across ranks, the sizes
  from which collectives block and all-reduces run the ring, and up to which
  all-reduces go through node-local shared memory."""

def register_comms(handles: list[int], check_handles: list[int], key: int,
                   ordinals: list[int]) -> int:
  """Registers one communicator (and one signature-check communicator) per
  local device index; ``key`` is the id all its ranks agreed on; ``ordinals``
  are XLA's device ordinals (jax device ids) of the local devices in index
  order. Returns the id used as the ops' ``comm``
  attribute."""

def register_site(text: str, slot: int) -> int:
  """Registers a call site's description and check slot (one per (signature,
  communicator)); returns its id (``site`` attribute)."""

def start_inspector(handle: int) -> bool:
  """Starts the stall inspector's responder thread on a private communicator."""

def stop_inspector() -> None:
  """Stops and joins the responder thread."""

def status(key: int, device: int) -> str:
  """'<calls> <phase> <text>' for (communicator key, device), as sent to askers."""

def unregister_comms(comm_id: int) -> None:
  """Forgets the communicators of ``comm_id`` (before they are freed)."""

def build_mpi_version() -> str:
  """MPI family and version of the mpi.h this module was compiled with."""

def linked_library_version() -> str:
  """MPI_Get_library_version of the libmpi this module resolved to."""

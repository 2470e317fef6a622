"""Type stub for mpijax's C++ MPI transport (mpijax/_src/ffi/csrc/module.cc).

tests/unit/test_ffi_stub.py checks that every function here has the
module's parameters (names, kinds, defaults), and the other way round.
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target."""

def setup(*, max_chunk_bytes: int, timeout_s: float, stall_abort: bool,
          check_every: bool, blocking_min_bytes: int, ring_min_bytes: int,
          ring_in_place_min_bytes: int, shm_max_bytes: int,
          cma_min_bytes: int, wait_spin_s: float,
          oversubscribed: bool) -> None:
  """Creates the float16/bfloat16 MPI ops; sets chunk size, timeout, stall
  action, whether every call's signature is compared across ranks, the sizes
  from which collectives block and all-reduces run the ring, up to which
  all-reduces go through node-local shared memory, from which they run by
  cross-memory attach, how long a wait spins, and whether the node has more
  ranks than cores (waits then yield the core after every poll)."""

def register_comms(handles: Sequence[int], check_handles: Sequence[int],
                   key: int, ordinals: Sequence[int]) -> int:
  """Registers one communicator (and one signature-check communicator) per
  local device index; ``key`` is the id all its ranks agreed on; ``ordinals``
  are XLA's device ordinals (jax device ids) of the local devices in index
  order. Returns the id used as the ops' ``comm`` attribute."""

def node_paths(comm_id: int) -> list[int]:
  """The node-local all-reduce paths of ``comm_id``, per local device: 0 not
  set up yet, -1 unavailable, 1 shared memory, 2 shared memory and
  cross-memory attach."""

def setup_device_group(comm_id: int, handle: int, segment_bytes: int) -> list[int]:
  """Sets up (once) the node-local all-reduce over every local device of
  every rank of ``comm_id``; collective over ``handle`` (a private
  communicator of the same ranks). Returns [state (1 ready, -1
  unavailable), segment bytes, 1 if cross-memory attach works]."""

def node_allreduce(handle: int, send: np.ndarray, recv: np.ndarray, *,
                   op: str = "sum", shm_max_bytes: int = 1048576,
                   cma_min_bytes: int = 65536, repeat: int = 1) -> list[int]:
  """Runs the node-local all-reduce's C++ API on the mpi4py communicator
  ``handle`` ``repeat`` times; each call's path (0 MPI_Allreduce, 1 shared
  memory, 2 cross-memory attach). Collective; for tests."""

def unregister_comms(comm_id: int) -> None:
  """Forgets the communicators of ``comm_id`` (before they are freed)."""

def register_site(text: str, slot: int) -> int:
  """Registers a call site's description and check slot (one per (signature,
  communicator)); returns its id (``site`` attribute)."""

def xla_label(kind: str, dtype: str, elements: int, op: str, label: str) -> None:
  """Names one of XLA's collectives of a compiled program (HLO opcode, dtype or
  'bytes', result elements, reduction op or '') in the bridge's reports."""

def xla_program(text: str, collectives: list[tuple[str, str, int, str]]) -> None:
  """A compiled program (its name and argument shapes) and its collectives as
  (kind, dtype, elements, op): its first operation on each of XLA's
  communicators carries its fingerprint in the ranks' check."""

def xla_enable_members(local_devices: int) -> None:
  """Answers XLA's communicator requests with the members xla_prepare_clique
  made (several devices per process)."""

def xla_prepare_clique(devices: list[int], world: list[int], local: list[int]) -> int:
  """Prepares the communicator XLA will make for a clique (global device ids
  in rank order, each member's job rank and local device index); collective
  over the clique's ranks. Its id, or -1 where this rank has no member."""

def xla_expect(ids: list[int]) -> None:
  """Names the prepared cliques XLA is about to create."""

def site_texts() -> list[str]:
  """Every registered call site's description, indexed by its id."""

def start_inspector(handle: int) -> bool:
  """Starts the stall inspector's responder and watchdog threads on a private
  communicator; False if not started."""

def stop_inspector() -> None:
  """Stops and joins the responder thread."""

def set_python_place(fn: Callable[[], str] | None) -> None:
  """Sets the function that says where the Python main thread is (the stall
  inspector's answers); None removes it."""

def status(key: int, device: int) -> str:
  """'<calls> <phase> <activity> <text>' for (communicator key, device), as sent to askers."""

def set_activity(kind: int, text: str) -> None:
  """What this process does that ranks waiting for it should know of: 1
  compiling a program, 2 waiting for another rank's compile, 0 neither."""

def timeline_start(capacity: int) -> None:
  """Turns the collective timeline on: every handler call records one event
  in a ring of at least ``capacity`` events (allocated once)."""

def timeline_stop() -> None:
  """Turns the collective timeline off."""

def timeline_drain() -> tuple[list[tuple[Any, ...]], int]:
  """The events recorded since the last drain, oldest first, as tuples (name,
  dtype, shape or None, bytes, path bits, site, communicator key, local
  device, communicator size, sequence number or -1, enter ns, exit ns), and
  how many were lost."""

def arrivals_record(on: bool) -> None:
  """Turns the straggler report's arrival stamps on or off."""

def arrivals_drain() -> bytes:
  """The arrivals stamped since the last drain (at most 4096 per communicator
  and device, the most recent), as native int64 rows of (communicator key,
  leader, local device, 1 if the device's calls are collectives of their own,
  communicator size, collective number, enter ns)."""

def now_ns() -> int:
  """The handlers' clock (steady_clock) in nanoseconds."""

def build_mpi_version() -> str:
  """MPI family and version of the mpi.h this module was compiled with."""

def linked_library_version() -> str:
  """MPI_Get_library_version of the libmpi this module resolved to."""

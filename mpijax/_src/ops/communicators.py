"""The communicator registry of mpijax's primitives.

Every op runs on private clones of the user's communicator (default: the
runtime's), one clone per local device index, so user mpi4py traffic can
never interleave with ours and several local devices can call MPI at once.
Clones are made once per user communicator, at its first use, and freed at
``mpijax.shutdown()``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np

from mpijax._src import ffi as _ffi
from mpijax._src import mpi_util
from mpijax._src.ffi.settings import push_settings
from mpijax._src.guards import inspector
from mpijax._src.runtime import state as runtime


@dataclasses.dataclass(frozen=True)
class CommInfo:
  """A registered user communicator: id in the C++ table, size and rank."""
  id: int
  size: int
  rank: int


@dataclasses.dataclass
class _Entry:
  info: CommInfo
  user_comm: Any          # kept alive so its handle is not reused
  clones: list[Any]       # one per local device index


_registry_lock = threading.RLock()
_registry: dict[int, _Entry] = {}
_hook_installed = False
_next_key = 0  # smallest communicator key not used by this process


def _local_device_ids() -> list[int]:
  """The local devices' ids in local index order: XLA's device ordinals.

  That is the local index in a single-process JAX, but a global id under
  jax.distributed (2048, 2049, ... on the second process).
  """
  if runtime.is_initialized():
    return [d.id for d in runtime.get().local_devices]
  return [d.id for d in jax.local_devices()]


def _free_all() -> None:
  """Shutdown hook: forget and free every clone (compiled programs go stale)."""
  global _hook_installed
  ext = _ffi.load()
  with _registry_lock:
    for entry in _registry.values():
      ext.unregister_comms(entry.info.id)
      for c in entry.clones:
        c.Free()
    _registry.clear()
    _hook_installed = False
  _fast.clear()
  _groups.clear()


def _register(comm: Any) -> CommInfo:
  global _hook_installed, _next_key
  MPI = mpi_util.import_mpi()  # MPI is up (a comm exists); registers the exit cleanup
  ext = _ffi.load()
  push_settings()  # before the inspector starts: its watchdog reads the timeout
  inspector.ensure_started()  # local: the responder's communicator exists since init()
  key = MPI._handleof(comm)
  with _registry_lock:
    entry = _registry.get(key)
    if entry is None:
      # Collective over `comm`: ranks register communicators in program order
      # (first use), so clone ids line up across ranks.
      ordinals = _local_device_ids()
      n = len(ordinals)
      clones = [comm.Clone() for _ in range(n)]
      for i, c in enumerate(clones):
        c.Set_name(f"mpijax-ops-{len(_registry)}-dev{i}")
      # Signature checks run on their own clones (see DevComm in the C++), and
      # all ranks of `comm` agree on a key that names it in stall reports.
      checks = [comm.Clone() for _ in range(n)]
      buf = np.array([_next_key], np.int64)  # a buffer, not a pickled object
      comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
      key = int(buf[0])
      _next_key = key + 1
      cid = ext.register_comms([MPI._handleof(c) for c in clones],
                               [MPI._handleof(c) for c in checks], key, ordinals)
      entry = _Entry(CommInfo(cid, comm.Get_size(), comm.Get_rank()), comm,
                     clones + checks)
      _registry[key] = entry
      if not _hook_installed:
        runtime.register_shutdown_hook(_free_all)
        _hook_installed = True
    return entry.info


# id(python comm object) -> (object, info): mpi4py communicators are not
# hashable, and this lookup runs on every trace / eager call.
_fast: dict[int, tuple[Any, CommInfo]] = {}


def resolve_comm(comm: Any, op_name: str) -> CommInfo:
  """CommInfo for ``comm`` (default: the runtime's communicator)."""
  if comm is None:
    comm = runtime.get(op_name).comm
  elif not runtime.is_initialized():
    runtime.get(op_name)  # the same clear "call mpijax.init()" error
  hit = _fast.get(id(comm))
  if hit is not None and hit[0] is comm:
    return hit[1]
  info = _register(comm)
  _fast[id(comm)] = (comm, info)
  return info


# comm id -> (ready, segment bytes, cross-memory attach ok), per registered comm.
_groups: dict[int, tuple[bool, int, bool]] = {}


def device_group(comm: Any) -> tuple[bool, int, bool]:
  """The node-local all-reduce over every local device of every rank of ``comm``.

  Set up at the first call for ``comm`` (collective over it, on a private
  clone: the device threads may be running earlier programs on the others).
  Returns (ready, segment bytes, cross-memory attach works); every rank gets
  the same answer.
  """
  info = resolve_comm(comm, "mpijax.lax.psum")
  with _registry_lock:
    got = _groups.get(info.id)
    if got is not None:
      return got
    from mpijax._src import config
    MPI = mpi_util.import_mpi()
    clone = comm.Clone()
    clone.Set_name(f"mpijax-ops-{info.id}-devices")
    state, segment, cma = _ffi.load().setup_device_group(
        info.id, MPI._handleof(clone), max(int(config.get("shm_max_bytes")), 4096))
    for entry in _registry.values():
      if entry.info.id == info.id:
        entry.clones.append(clone)  # freed at shutdown, after the segments
    got = _groups[info.id] = (state == 1, int(segment), bool(cma))
    return got


def info_of(comm_id: int) -> CommInfo:
  """The CommInfo of a registered communicator, by its id in the C++ table."""
  with _registry_lock:
    return next(e.info for e in _registry.values() if e.info.id == comm_id)

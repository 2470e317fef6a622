"""The stall inspector's Python side: start and stop the responder thread.

The C++ transport (``mpijax_ffi.cc``) keeps, per communicator and local
device, what the last mpijax call was and whether it is still inside it. A
responder thread answers other ranks' status queries on a private clone of
the runtime's communicator; a collective that waits longer than
``MPIJAX_TIMEOUT`` asks every other rank of its communicator and prints who
has not arrived and what each last did, then aborts the job (or, with
``MPIJAX_STALL_ACTION=warn``, keeps waiting).

:func:`start` is called by ``mpijax.init()``; :func:`stop` by
``mpijax.shutdown()`` and at interpreter exit, before MPI is finalized, so the
thread never polls a finalized MPI.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

_lock = threading.Lock()
_comm: Any = None
_atexit_registered = False


def start(comm: Any) -> bool:
  """Starts the responder on a clone of ``comm`` (collective over ``comm``).

  Returns:
    True if the responder runs (it needs MPI_THREAD_MULTIPLE).
  """
  global _comm, _atexit_registered
  from mpi4py import MPI

  from mpijax._src import ffi as _ffi
  from mpijax._src.ops import _base
  with _lock:
    if _comm is not None:
      return True
    ext = _ffi.load()
    _base.push_settings()
    clone = comm.Clone()  # collective: every rank clones, even if it cannot start
    clone.Set_name("mpijax-inspector")
    if not ext.start_inspector(MPI._handleof(clone)):
      clone.Free()
      return False
    _comm = clone
    if not _atexit_registered:
      # atexit runs last-registered first: this runs before mpi4py's finalize.
      atexit.register(_stop_at_exit)
      _atexit_registered = True
    return True


def stop() -> None:
  """Stops and joins the responder thread, then frees its communicator."""
  global _comm
  with _lock:
    if _comm is None:
      return
    from mpijax._src import ffi as _ffi
    from mpijax._src import mpi_util
    _ffi.load().stop_inspector()
    if not mpi_util.import_mpi().Is_finalized():
      _comm.Free()
    _comm = None


def _stop_at_exit() -> None:
  global _comm
  with _lock:
    if _comm is None:
      return
    from mpijax._src import ffi as _ffi
    # Not freeing the communicator: MPI_Finalize does, and Comm_free is
    # collective in spirit; joining the thread is what matters here.
    _ffi.load().stop_inspector()
    _comm = None

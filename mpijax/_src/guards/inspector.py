"""The stall inspector's Python side: start and stop the responder thread.

The C++ transport (``ffi/csrc/``) keeps, per communicator and local
device, what the last mpijax call was and whether it is still inside it. A
responder thread answers other ranks' status queries on a private clone of
the runtime's communicator; a collective that waits longer than
``MPIJAX_TIMEOUT`` asks every other rank of its communicator and prints who
has not arrived and what each last did, then aborts the job (or, with
``MPIJAX_STALL_ACTION=warn``, keeps waiting).

:func:`prepare` is called by ``mpijax.init()``, which hands it the
communicator to clone and the function that drains in-flight work at exit;
:func:`ensure_started` by the first communicator registration of the
transport, after it pushed the transport settings; :func:`stop` by
``mpijax.shutdown()`` and at interpreter exit, before MPI is finalized, so the
thread never polls a finalized MPI.
"""

from __future__ import annotations

import atexit
import linecache
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from mpijax._src import ffi as _ffi
from mpijax._src import mpi_util

_lock = threading.Lock()
_comm: Any = None  # the responder's private communicator, cloned by init()
_drain: Callable[[], None] | None = None  # waits for in-flight work (given by init())
_started = False
_atexit_registered = False


def prepare(comm: Any, *, drain: Callable[[], None]) -> None:
  """Clones ``comm`` for the responder (collective: called by ``mpijax.init()``).

  The thread itself starts with the first mpijax collective (:func:`ensure_started`),
  so the runtime works without the C++ transport (e.g. under another MPI than
  the one the extension was built for) until a collective needs it.

  Args:
    comm: the runtime's communicator.
    drain: waits for the computations still in flight; called at exit
      before the responder stops, so a stall there is still reported.
  """
  global _comm, _drain
  with _lock:
    _drain = drain
    if _comm is None:
      _comm = comm.Clone()
      _comm.Set_name("mpijax-inspector")


# Frames in these directories are not the user's program.
_LIBRARY_DIRS = tuple(
  os.path.dirname(os.path.abspath(p)) + os.sep
  for p in (os.__file__, threading.__file__, os.path.dirname(__file__))
)


def python_place() -> str:
  """Where the Python main thread is: its innermost frame in the user's code,
  e.g. ``stall.py:19 in <module>: time.sleep(600)`` ('' if unknown).

  The stall inspector adds it to a rank's answer, so a report says what a
  rank outside any collective is doing.
  """
  frame = sys._current_frames().get(threading.main_thread().ident)
  seen = 0
  while frame is not None and seen < 200:
    name = frame.f_code.co_filename
    lib = (
      name.startswith(_LIBRARY_DIRS)
      or name.startswith("<")
      or (os.sep + "jax" + os.sep) in name
      or (os.sep + "jaxlib" + os.sep) in name
      or (os.sep + "numpy" + os.sep) in name
    )
    if not lib:
      line = linecache.getline(name, frame.f_lineno).strip()
      where = f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
      return f"{where}: {line[:80]}" if line else where
    frame = frame.f_back
    seen += 1
  return ""


def ensure_started() -> bool:
  """Starts the responder thread once (local; at the first registered communicator).

  The caller has pushed the transport settings: the watchdog reads the timeout.

  Returns:
    True if the responder runs (it needs MPI_THREAD_MULTIPLE and init()).
  """
  global _started, _atexit_registered
  with _lock:
    if _started or _comm is None:
      return _started
    MPI = mpi_util.import_mpi()
    ext = _ffi.load()
    if not ext.start_inspector(MPI._handleof(_comm)):
      return False
    ext.set_python_place(python_place)
    _started = True
    if not _atexit_registered:
      # atexit runs last-registered first: this runs before mpi4py's finalize.
      atexit.register(_stop_at_exit)
      _atexit_registered = True
    return True


def stop() -> None:
  """Stops and joins the responder thread, then frees its communicator."""
  global _comm, _started
  with _lock:
    if _comm is None:
      return
    if _started:
      _ffi.load().stop_inspector()
      _ffi.load().set_python_place(None)
      _started = False
    if not mpi_util.import_mpi().Is_finalized():
      _comm.Free()
    _comm = None


def _stop_at_exit() -> None:
  global _started
  # Work still in flight may stall: drain it while the responder can report.
  if _drain is not None:
    _drain()
  with _lock:
    if not _started:
      return
    # Not freeing the communicator: MPI_Finalize does; joining the thread is
    # what matters here.
    _ffi.load().stop_inspector()
    _ffi.load().set_python_place(None)
    _started = False

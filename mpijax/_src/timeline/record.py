"""Recording the collective timeline on every rank, and merging it on rank 0.

``start`` turns the C++ event ring on and measures each rank's clock against
rank 0's (collective); ``span`` records Python-side spans (training steps);
``finish`` drains the ring, measures the clocks again, sends every rank's
events to rank 0, which merges them (merge.py) and writes one JSON file
atomically. ``finish`` runs at exit (before MPI is finalized) and at
``mpijax.shutdown()``; every wait in it is bounded, so a rank that died
costs the others a delay, never a hang.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from mpijax._src import ffi as _ffi
from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src.timeline import merge

# Events kept per rank: the ring keeps the most recent ones (about 100 bytes each).
CAPACITY = 1 << 17
MAX_SPANS = 1 << 16
PINGS = 16  # ping-pong rounds per rank and measurement; the shortest round trip wins
FINISH_TIMEOUT_S = 60.0  # how long rank 0 waits for the ranks' events at the end
PEER_TIMEOUT_S = 15.0  # how long rank 0 waits for one rank's clock reading
_TAG_PING, _TAG_DATA = 1, 2


class _Recorder:

  def __init__(self, path: str, comm: Any, devices: int) -> None:
    self.path = path
    self.comm = comm  # a private duplicate: no message here can meet another's
    self.devices = devices
    self.spans: collections.deque = collections.deque(maxlen=MAX_SPANS)
    self.sync: merge.ClockSync | None = None
    self.hostnames: tuple[str, ...] = ()
    self.done = False


_rec: _Recorder | None = None


def active() -> bool:
  """Whether the timeline is recording on this rank."""
  return _rec is not None and not _rec.done


def now_ns() -> int:
  """The clock of the C++ events (steady_clock)."""
  return _ffi.load().now_ns()


def add_span(name: str, start_ns: int, end_ns: int, *, category: str = "span",
             **args: Any) -> None:
  """Records a Python-side span (times from :func:`now_ns`) on this rank's row.

  ``category`` "step" marks a training step (what ``render --step`` counts);
  "compile" JAX's and mpijax's compilation.
  """
  rec = _rec
  if rec is not None and not rec.done:
    rec.spans.append((name, int(start_ns), int(end_ns), {"category": category, **args}))


# JAX reports how long tracing, lowering and compiling a function took
# (jax.monitoring, at the end of each): spans on the rank's Python row.
_JAX_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "jax trace",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax lower",
               "/jax/core/compile/backend_compile_duration": "jax compile"}
_jax_listener_installed = False


def _on_jax_event(event: str, duration: float, **kwargs: Any) -> None:
  name = _JAX_EVENTS.get(event)
  if name is not None and active():
    end = now_ns()
    fun = kwargs.get("fun_name")
    add_span(f"{name}: {fun}" if fun else name, end - int(duration * 1e9), end,
             category="compile")


def _install_jax_listener() -> None:
  global _jax_listener_installed
  if not _jax_listener_installed:
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(_on_jax_event)
    _jax_listener_installed = True


@contextlib.contextmanager
def span(name: str, *, step: bool = False, **args: Any) -> Iterator[None]:
  """Records the enclosed code as a span on this rank's Python row (nothing when off).

  Args:
    name: the span's name in the trace.
    step: the span is one training step: ``python -m mpijax.timeline render
      --step N`` draws the N-th of them (as it does DataParallel's steps).
    **args: shown with the span (JSON values).

  Yields:
    None: the ``with`` block is the span.

  Examples:
    >>> with mpijax.timeline.span("data loading"):  # doctest: +SKIP
    ...   batch = next(batches)
  """
  if not active():
    yield
    return
  start = now_ns()
  try:
    yield
  finally:
    add_span(name, start, now_ns(), category="step" if step else "span", **args)


# --- bounded point-to-point ----------------------------------------------------

def _wait(req: Any, deadline: float, spin_s: float = 0.002) -> bool:
  """Polls ``req`` until it completes (True) or ``deadline`` passes (False).

  Spins for ``spin_s`` first: a sleep between tests would lengthen the
  ping-pong round trips, and with them the clock offsets' error.
  """
  spin_until = time.monotonic() + spin_s
  while not req.Test():
    now = time.monotonic()
    if now > deadline:
      return False
    if now > spin_until:
      time.sleep(0.0005)
  return True


def _writable(path: str) -> str:
  """Why ``path`` cannot be written, or ''."""
  directory = os.path.dirname(path) or "."
  while not os.path.exists(directory):
    directory = os.path.dirname(directory)
  if os.path.isdir(path):
    return f"{path} is a directory"
  if not os.access(directory, os.W_OK | os.X_OK):
    return f"{directory} is not writable"
  return ""


def _clock_sync(comm: Any, deadline: float,
                alive: set[int] | None = None) -> dict[int, tuple[int, int]]:
  """Collective ping-pong with rank 0; on rank 0: rank -> (offset, round trip).

  Other ranks get {}; a rank that does not answer by ``deadline`` is left out.
  """
  import numpy as np
  lib = _ffi.load()
  rank, size = comm.Get_rank(), comm.Get_size()
  buf = np.zeros(1, np.int64)
  if rank != 0:
    for _ in range(PINGS):
      if not _wait(comm.Irecv(buf, source=0, tag=_TAG_PING), deadline):
        return {}
      buf[0] = lib.now_ns()
      if not _wait(comm.Isend(buf, dest=0, tag=_TAG_PING), deadline):
        return {}
    return {}
  out = {0: (0, 0)}
  for peer in range(1, size):
    if alive is not None and peer not in alive:
      continue
    # Each peer gets its own bound: one that died does not use up the others' time.
    peer_deadline = min(deadline, time.monotonic() + PEER_TIMEOUT_S)
    samples = []
    for _ in range(PINGS):
      t_send = lib.now_ns()
      if not (_wait(comm.Isend(buf, dest=peer, tag=_TAG_PING), peer_deadline)
              and _wait(comm.Irecv(buf, source=peer, tag=_TAG_PING), peer_deadline)):
        break
      samples.append((t_send, int(buf[0]), lib.now_ns()))
    if len(samples) == PINGS:
      out[peer] = merge.offset_from_pingpong(samples)
  return out


def _share_sync(comm: Any, measured: dict[int, tuple[int, int]], hostnames: tuple[str, ...],
                deadline: float) -> tuple[int, int] | None:
  """Sends each rank its (offset, round trip); this rank's, or None if it got none."""
  import numpy as np
  rank = comm.Get_rank()
  buf = np.zeros(2, np.int64)
  if rank == 0:
    for peer, (offset, rtt) in measured.items():
      if peer == 0:
        continue
      # One node shares one monotonic clock: an offset within the round trip is zero.
      if hostnames[peer] == hostnames[0] and abs(offset) <= rtt:
        offset = 0
      buf[:] = (offset, rtt)
      _wait(comm.Isend(buf, dest=peer, tag=_TAG_PING), deadline)
    return (0, 0)
  if _wait(comm.Irecv(buf, source=0, tag=_TAG_PING), deadline):
    return int(buf[0]), int(buf[1])
  return None


# --- start / finish --------------------------------------------------------------

def start(path: str, comm: Any, *, hostnames: tuple[str, ...], devices: int,
          drain: Callable[[], None] | None = None) -> None:
  """Turns the timeline on (collective over ``comm``); ``finish`` writes ``path``."""
  global _rec
  if _rec is not None and not _rec.done:
    raise RuntimeError(f"the mpijax timeline is already recording to {_rec.path!r}")
  if not path:
    raise ValueError("the timeline needs a file path, e.g. MPIJAX_TIMELINE=trace.json")
  path = os.path.abspath(os.path.expanduser(str(path)))
  if drain is not None:
    drain()  # earlier dispatched calls would enter the ring as this one turns on
  # Rank 0 writes the file: it checks the path, and every rank raises alike.
  problem = mpi_util.bcast_str(comm, _writable(path) if comm.Get_rank() == 0 else None)
  if problem:
    raise ValueError(f"the timeline file {path!r} cannot be written on rank 0 ({problem}); "
                     "set MPIJAX_TIMELINE / init(timeline=...) to a writable path")
  dup = comm.Dup()
  dup.Set_name("mpijax timeline")
  rec = _Recorder(path, dup, devices)
  rec.hostnames = hostnames
  deadline = time.monotonic() + FINISH_TIMEOUT_S
  t_local = _ffi.load().now_ns()
  mine = _share_sync(dup, _clock_sync(dup, deadline), hostnames, deadline)
  if mine is not None:
    rec.sync = merge.ClockSync(t1=t_local, offset1=mine[0])
  _install_jax_listener()
  _ffi.load().timeline_start(CAPACITY)
  _rec = rec
  if dup.Get_rank() == 0:
    log.notice(f"timeline on: every rank's mpijax calls go to {path} at "
               "mpijax.timeline.finish(), mpijax.shutdown() or exit, whichever comes first")


def _site_texts() -> dict[int, str]:
  return dict(enumerate(_ffi.load().site_texts()))


def finish(drain: Callable[[], None] | None = None) -> str | None:
  """Stops recording and writes the merged file on rank 0 (collective, bounded).

  Returns the file written (rank 0) or None.
  """
  global _rec
  rec = _rec
  if rec is None or rec.done:
    return None
  MPI = mpi_util.import_mpi()
  if MPI.Is_finalized():
    rec.done = True
    return None
  if drain is not None:
    drain()
  lib = _ffi.load()
  lib.timeline_stop()
  rec.done = True
  calls, lost = lib.timeline_drain()
  comm = rec.comm
  rank, size = comm.Get_rank(), comm.Get_size()
  deadline = time.monotonic() + FINISH_TIMEOUT_S
  t_local = lib.now_ns()
  mine = _share_sync(comm, _clock_sync(comm, deadline), rec.hostnames, deadline)
  if rec.sync is not None and mine is not None:
    rec.sync.t2, rec.sync.offset2 = t_local, mine[0]
  data = merge.RankData(rank=rank, host=socket.gethostname(), devices=rec.devices,
                        calls=calls, spans=list(rec.spans), sites=_site_texts(), lost=lost,
                        sync=rec.sync)
  written = None
  try:
    if rank != 0:
      payload = json.dumps(data.to_json()).encode()
      import numpy as np
      req = comm.Isend(np.frombuffer(payload, np.uint8), dest=0, tag=_TAG_DATA)
      if not _wait(req, deadline):
        log.warning("timeline: rank 0 did not take this rank's events in time; "
                    "they are not in the file")
    else:
      written = _gather_and_write(rec, comm, data, size, deadline)
  finally:
    _rec = None
    try:
      comm.Free()
    except Exception:  # a communicator with a send still pending; exit reclaims it
      pass
  return written


def _gather_and_write(rec: _Recorder, comm: Any, mine: merge.RankData, size: int,
                      deadline: float) -> str:
  import numpy as np
  MPI = mpi_util.import_mpi()
  ranks = [mine]
  pending = set(range(1, size))
  status = MPI.Status()
  while pending and time.monotonic() < deadline:
    got = False
    for peer in sorted(pending):
      if comm.Iprobe(source=peer, tag=_TAG_DATA, status=status):
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        comm.Recv(buf, source=peer, tag=_TAG_DATA)
        ranks.append(merge.RankData.from_json(json.loads(buf.tobytes())))
        pending.discard(peer)
        got = True
    if not got:
      time.sleep(0.001)
  if pending:
    log.warning(f"timeline: no events from ranks {sorted(pending)} within "
                f"{FINISH_TIMEOUT_S:.0f} s; the file has the other ranks")
  lost = {r.rank: r.lost for r in ranks if r.lost}
  if lost:
    log.warning(f"timeline: the event buffer overflowed ({lost} events lost per rank); "
                "the file has each rank's most recent events")
  trace = merge.chrome_trace(ranks, job_ranks=size, missing=sorted(pending))
  directory = os.path.dirname(rec.path) or "."
  os.makedirs(directory, exist_ok=True)
  tmp = f"{rec.path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(trace, f)
  os.replace(tmp, rec.path)
  log.notice(f"timeline written to {rec.path} ({len(trace['traceEvents'])} events, "
             f"{len(ranks)} ranks)")
  return rec.path

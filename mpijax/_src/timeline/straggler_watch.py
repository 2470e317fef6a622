"""The straggler report on every rank: arrival stamps, a background exchange, the report lines.

:func:`start` (``mpijax.init()``, collective) turns the extension's arrival
stamps on (``csrc/core/arrivals.h``: each collective call writes when it entered)
and starts one thread per rank on a private communicator. Every
``MPIJAX_STRAGGLER_INTERVAL`` seconds each rank's thread drains its stamps,
with the times ``mpijax.train`` called its steps (:func:`note_step`), and
sends them to rank 0 without waiting. Rank 0's thread sleeps a short grace
period meanwhile, then takes what came, measures the clock of every other
host against its own (a ping-pong with the host's first rank, which waits
for it after sending), pairs the collectives (``straggler.py``) and logs a
line when one rank is a straggler; what came late is paired in the next
period. :func:`finish` (at exit, after the dispatched work has finished and
before MPI is finalized; at ``mpijax.shutdown()``) stops the thread, sends
the last stamps from the main thread, and rank 0 logs the job's line. No
collective runs on the user's communicators and every wait is bounded: a
rank that died costs rank 0 ``FINISH_TIMEOUT_S`` at the end, and the line
names it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from mpijax._src import ffi as _ffi
from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src.timeline import merge
from mpijax._src.timeline import record
from mpijax._src.timeline import straggler

PINGS = 16  # ping-pong rounds per host and exchange; the shortest round trip wins
GRACE_S = 1.0  # how long rank 0 lets a period's stamps come (at most a quarter period)
PING_TIMEOUT_S = 1.0  # how long one host's ping-pong may take
FINISH_TIMEOUT_S = 30.0  # how long rank 0 waits for the other ranks' last stamps
MAX_STEPS = 4096  # training steps' call times a rank keeps between two sends
FINAL = -1  # the period number of the stamps sent at the end
_TAG_DATA, _TAG_PING, _TAG_PONG = 1, 2, 3
_HEADER = 3  # period, stamp rows, steps


class _Watch:
  """One rank's side of the report (rank 0's also pairs and reports)."""

  def __init__(self, comm: Any, hostnames: tuple[str, ...], interval: float) -> None:
    self.comm = comm
    self.rank, self.size = comm.Get_rank(), comm.Get_size()
    self.hostnames = hostnames
    self.interval = interval
    self.grace = min(GRACE_S, interval / 4)
    # Each host's first rank answers rank 0's pings; ranks on rank 0's host share its clock.
    self.leaders: dict[str, int] = {}
    for r, host in enumerate(hostnames):
      self.leaders.setdefault(host, r)
    self.remote_leaders = {r for host, r in self.leaders.items() if host != hostnames[0]}
    self.lock = threading.Lock()
    self.steps: collections.deque = collections.deque(maxlen=MAX_STEPS)  # (step, call ns)
    self.step_count = 0
    self.stop = threading.Event()
    self.thread: threading.Thread | None = None
    self.sends: list[tuple[Any, Any]] = []  # (request, buffer) not yet complete
    self.done = False
    # Rank 0's.
    self.offsets: dict[str, int] = {hostnames[0]: 0}
    self.collectives = straggler.Pairing()
    self.step_calls = straggler.StepPairing(self.size)
    self.job = straggler.Tally()
    self.got: dict[int, list[Any]] = {}  # payloads taken, not yet paired
    self.finished = {0}  # the ranks whose last stamps came

  # --- every rank --------------------------------------------------------------

  def note_step(self) -> None:
    ns = _ffi.load().now_ns()
    with self.lock:
      self.steps.append((self.step_count, ns))
      self.step_count += 1

  def payload(self, period: int) -> Any:
    """This rank's stamps and step calls since the last payload, as one int64 array."""
    import numpy as np

    rows = np.frombuffer(_ffi.load().arrivals_drain(), np.int64)
    with self.lock:
      steps = np.array(self.steps, np.int64).reshape(-1)
      self.steps.clear()
    head = [period, rows.size // len(straggler.COLUMNS), steps.size // 2]
    return np.concatenate([np.array(head, np.int64), rows, steps])

  def send(self, period: int) -> None:
    """Sends this rank's stamps to rank 0 (nonblocking; at most two periods' outstanding)."""
    self.sends = [(req, buf) for req, buf in self.sends if not req.Test()]
    if len(self.sends) >= 2 and period != FINAL:
      self.payload(period)  # rank 0 takes nothing: these stamps are dropped
      return
    buf = self.payload(period)
    self.sends.append((self.comm.Isend(buf, dest=0, tag=_TAG_DATA), buf))

  def serve_pings(self, period: int, deadline: float) -> None:
    """Answers rank 0's ping-pong of ``period`` (this host's clock against rank 0's)."""
    import numpy as np

    lib = _ffi.load()
    ping = np.zeros(2, np.int64)
    answered = 0
    while answered < PINGS:
      req = self.comm.Irecv(ping, source=0, tag=_TAG_PING)
      if not _wait(req, deadline, None if period == FINAL else self.stop):
        _cancel(req)
        return
      if int(ping[0]) != period:
        continue  # an earlier exchange's ping that rank 0 gave up on
      pong = np.array([period, ping[1], lib.now_ns()], np.int64)
      if not _wait(self.comm.Isend(pong, dest=0, tag=_TAG_PONG), deadline):
        return
      answered += 1

  # --- rank 0 ------------------------------------------------------------------

  def ping(self, peer: int, period: int) -> None:
    """Measures ``peer``'s host clock against this one's (``peer`` waits in serve_pings)."""
    import numpy as np

    lib = _ffi.load()
    deadline = time.monotonic() + PING_TIMEOUT_S
    pong = np.zeros(3, np.int64)
    samples = []
    for i in range(PINGS):
      t_send = lib.now_ns()
      if not _wait(
        self.comm.Isend(np.array([period, i], np.int64), dest=peer, tag=_TAG_PING), deadline
      ):
        return
      while True:
        req = self.comm.Irecv(pong, source=peer, tag=_TAG_PONG)
        if not _wait(req, deadline):
          _cancel(req)
          return
        if (int(pong[0]), int(pong[1])) == (period, i):
          break  # else an answer to an exchange given up on
      samples.append((t_send, int(pong[2]), lib.now_ns()))
    self.offsets[self.hostnames[peer]] = merge.offset_from_pingpong(samples)[0]

  def take(self) -> set[int]:
    """Rank 0: receives every payload that has come; the ranks whose last came."""
    import numpy as np

    MPI = mpi_util.import_mpi()
    status = MPI.Status()
    final = set()
    while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_DATA, status=status):
      peer = status.Get_source()
      buf = np.empty(status.Get_count(MPI.INT64_T), np.int64)
      self.comm.Recv(buf, source=peer, tag=_TAG_DATA)
      self.got.setdefault(peer, []).append(buf)
      if peer in self.remote_leaders:
        self.ping(peer, int(buf[0]))
      if int(buf[0]) == FINAL:
        final.add(peer)
    self.finished |= final
    return final

  def tally(self) -> straggler.Tally:
    """Rank 0: this period's collectives and steps, from the payloads taken."""
    width = len(straggler.COLUMNS)
    got, self.got = self.got, {}
    for r, bufs in got.items():
      offset = self.offsets.get(self.hostnames[r])
      if offset is None:
        continue  # its host's clock was not measured: not comparable
      for buf in bufs:
        n_rows = int(buf[1])
        self.collectives.add(r, buf[_HEADER : _HEADER + n_rows * width], offset)
        self.step_calls.add(r, buf[_HEADER + n_rows * width :], offset)
    window = straggler.Tally()
    window.add_batch(self.collectives.complete())
    window.add_steps(*self.step_calls.complete())
    return window

  def report(self, v: straggler.Verdict, window: str, *, always: bool) -> None:
    if v.rank is None and not always:
      return
    text = straggler.line(v, self.hostnames, window=window)
    if v.rank is not None:
      log.warning(text)
    else:
      log.notice(text)
    if record.active():
      now = record.now_ns()
      record.add_span(
        f"straggler: rank {v.rank}" if v.rank is not None else "stragglers: none",
        now,
        now,
        category="straggler",
        report=text,
      )

  # --- the periods ---------------------------------------------------------------

  def run(self) -> None:
    start = time.monotonic()
    k = 0
    while True:
      k += 1
      if self.stop.wait(max(0.0, start + k * self.interval - time.monotonic())):
        return
      try:
        self.period(k)
      except Exception as e:  # the report must never take the job down
        log.warning(
          f"straggler report: the periodic exchange failed ({type(e).__name__}: {e}); "
          "the report at the end of the job still comes"
        )
        return

  def period(self, k: int) -> None:
    if self.rank != 0:
      self.send(k)
      if self.rank in self.remote_leaders:
        self.serve_pings(k, time.monotonic() + 2 * self.grace + PING_TIMEOUT_S)
      return
    # One sleep while the others' stamps come (no polling: this thread must
    # not take rank 0's time), then what came; the rest waits for the next period.
    self.got.setdefault(0, []).append(self.payload(k))
    if self.stop.wait(self.grace):
      return  # the end of the job: finish() pairs what was taken
    self.take()
    window = self.tally()
    self.job.merge(window)
    self.report(straggler.verdict(window), f"in the last {self.interval:g} s", always=False)

  def finish(self) -> None:
    """The end of the job: the last stamps to rank 0 (main thread), rank 0's job line."""
    if self.rank != 0:
      self.send(FINAL)
      deadline = time.monotonic() + FINISH_TIMEOUT_S
      if self.rank in self.remote_leaders:
        self.serve_pings(FINAL, deadline)
      for req, _ in self.sends:
        if not _wait(req, deadline):
          log.warning(
            "straggler report: rank 0 did not take this rank's last arrival stamps "
            f"within {FINISH_TIMEOUT_S:.0f} s; the job's report goes without them"
          )
          break
      return
    self.got.setdefault(0, []).append(self.payload(FINAL))
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    while len(self.finished) < self.size and time.monotonic() < deadline:
      if not self.take():
        time.sleep(0.002)
    window = self.tally()
    self.job.merge(window)
    if not self.job.collectives:
      return
    missing = sorted(set(range(self.size)) - self.finished)
    self.report(
      straggler.verdict(self.job),
      "over the job"
      + (
        f" (no last stamps from ranks {missing} within {FINISH_TIMEOUT_S:.0f} s)" if missing else ""
      ),
      always=True,
    )


def _wait(req: Any, deadline: float, stop: threading.Event | None = None) -> bool:
  """Polls ``req`` until it completes (True), ``deadline`` passes or ``stop`` is set (False).

  Spins for 2 ms first: a sleep between tests would lengthen the ping-pong's
  round trips, and with them the clock offsets' error.
  """
  spin_until = time.monotonic() + 0.002
  while not req.Test():
    now = time.monotonic()
    if now > deadline or (stop is not None and stop.is_set()):
      return False
    if now > spin_until:
      time.sleep(0.0005)
  return True


def _cancel(req: Any) -> None:
  """Cancels a receive that nothing answered (it then completes at once)."""
  try:
    req.Cancel()
    req.Wait()
  except Exception:  # already complete, or MPI is going away
    pass


_watch: _Watch | None = None


def active() -> bool:
  """Whether the straggler report runs on this rank."""
  return _watch is not None and not _watch.done


def start(comm: Any, *, hostnames: tuple[str, ...], interval: float) -> None:
  """Turns the straggler report on (collective over ``comm``: it is duplicated).

  Args:
    comm: the runtime's communicator.
    hostnames: every rank's host, in rank order.
    interval: seconds between the periodic exchanges; 0: only the report at the end.
  """
  global _watch
  if _watch is not None and not _watch.done:
    return
  dup = comm.Dup()
  dup.Set_name("mpijax stragglers")
  watch = _Watch(dup, tuple(hostnames), float(interval))
  _ffi.load().arrivals_record(True)
  _watch = watch
  MPI = mpi_util.import_mpi()
  # The thread makes MPI calls beside the main thread's: MPI_THREAD_MULTIPLE only.
  if interval > 0 and MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
    watch.thread = threading.Thread(target=watch.run, name="mpijax stragglers", daemon=True)
    watch.thread.start()


def note_step() -> None:
  """Notes that this rank calls an ``mpijax.train`` step now (the input/compute split)."""
  watch = _watch
  if watch is not None and not watch.done:
    watch.note_step()


def finish(drain: Callable[[], None] | None = None) -> None:
  """Stops the report; rank 0 logs the job's line (collective, bounded; at exit and shutdown).

  Args:
    drain: waits for the dispatched work first, so its collectives are in the line
      (at exit the runtime's own hook has done so).
  """
  global _watch
  watch = _watch
  if watch is None or watch.done:
    return
  if drain is not None:
    drain()
  watch.done = True
  watch.stop.set()
  if watch.thread is not None:
    watch.thread.join(timeout=2 * watch.grace + PING_TIMEOUT_S + 5.0)
  MPI = mpi_util.import_mpi()
  if MPI.Is_finalized():
    _watch = None
    return
  try:
    _ffi.load().arrivals_record(False)
    watch.finish()
  except Exception as e:  # the report must never take the job down
    log.warning(f"straggler report: the exchange at the end failed ({type(e).__name__}: {e})")
  finally:
    _watch = None
    try:
      watch.comm.Free()
    except Exception:  # a send still pending; exit reclaims it
      pass

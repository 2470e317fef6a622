"""Ranks that never reach ``init()``: named after ``MPIJAX_TIMEOUT``, with where they are.

``init()`` begins with MPI_Init, which waits for every rank of the job (Open
MPI, MPICH), then gathers every rank's host name: a rank that has not called
``init()`` holds the others there. :func:`waiting` starts a watch as
``init()`` begins. If ``init()`` is still in that first stretch after
``MPIJAX_TIMEOUT``, the rank says so on stderr and, with
``MPIJAX_STALL_ACTION=abort``, ends the job (exit status 1); with ``warn`` it
says so again every timeout. MPI_Init runs without Python's GIL
(``mpi_util.import_mpi``), so the watch runs while it waits.

Under ``mpijax-run`` a rank also talks to mpijax-run's arrival board
(``launch/arrivals.py``; where it listens: ``MPIJAX_ARRIVALS``). From ``import
mpijax`` on, a thread of the rank keeps a connection to it, says when the
rank enters ``init()`` and when it got through, and answers the board's
question where the rank's main thread is (its Python stack). A watch that
fires asks the board, which names the ranks that have not entered
``init()`` and says where each one is; every waiting rank prints the same
report (the stacks, once: the lowest waiting rank). The messages are JSON
lines; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import CodeType

from mpijax._src import cluster
from mpijax._src import config

CONNECT_S = 2.0  # per address the board advertises
ASK_S = 6.0  # the board gathers stacks for up to 2 s
GRACE_S = 1.0  # after a fatal report, before the exit: the other ranks print theirs
MAX_LINE = 1 << 16
STACK_FRAMES = 12

# The detectors that read no launcher's variables ("mpi" would initialize MPI).
_NOT_A_LAUNCHER = ("mpi", "single")


def _place_in_job() -> tuple[int, int] | None:
  """(rank, size) from the launcher's variables; None outside a launched job."""
  try:
    for cls in cluster.registered():
      if cls.name not in _NOT_A_LAUNCHER and cls.is_env_present():
        info = cluster.detect(cls.name)
        if info.rank is not None and info.size is not None:
          return info.rank, info.size
        return None
  except ValueError:
    return None
  return None


def parse_address(spec: str) -> tuple[str, list[str], int]:
  """``token@host[,host...]:port`` -> (token, hosts, port).

  Raises:
    ValueError: ``spec`` is not of that form.
  """
  token, at, rest = spec.partition("@")
  hosts, colon, port = rest.rpartition(":")
  if not (at and colon and token and hosts and port.isdigit() and 0 < int(port) < 65536):
    raise ValueError(f"expected token@host[,host...]:port, got {spec!r}")
  return token, [h for h in hosts.split(",") if h], int(port)


# --- where the main thread is ---------------------------------------------------------

# The frames of the interpreter's and mpijax's own start-up (runpy, python -m
# mpijax) are left out of a rank's stack.
_WRAPPER_FILES = (
  os.sep + "runpy.py",
  os.path.join("mpijax", "__main__.py"),
  os.path.join("mpijax", "_src", "guards", "failure.py"),
  os.path.join("mpijax", "_src", "run", "rank.py"),
)


def main_stack(limit: int = STACK_FRAMES) -> list[str]:
  """The Python stack of this process's main thread, innermost frame last, as
  ``File "x.py", line 3, in f`` lines each followed by its source line."""
  frame = sys._current_frames().get(threading.main_thread().ident)
  if frame is None:
    return []
  entries = [
    e
    for e in traceback.extract_stack(frame)
    if not e.filename.startswith("<frozen") and not e.filename.endswith(_WRAPPER_FILES)
  ]
  lines = []
  for e in entries[-limit:]:
    lines.append(f'File "{e.filename}", line {e.lineno}, in {e.name}')
    if e.line:
      lines.append(f"  {e.line.strip()[:160]}")
  return lines


def importing() -> bool:
  """Whether the main thread is inside an ``import`` (it is busy, not stuck)."""
  frame = sys._current_frames().get(threading.main_thread().ident)
  while frame is not None:
    if frame.f_code.co_filename.startswith("<frozen importlib"):
      return True
    frame = frame.f_back
  return False


def _place() -> str:
  from mpijax._src.guards import inspector

  return inspector.python_place()


# --- the connection to mpijax-run's board ----------------------------------------------


class Board:
  """This rank's connection to mpijax-run's arrival board (a thread of its own).

  Args:
    spec: ``MPIJAX_ARRIVALS``: ``token@host[,host...]:port``.
    rank: this rank (the launcher's variables).
    size: the job's rank count.
  """

  def __init__(self, spec: str, rank: int, size: int):
    self.token, self.hosts, self.port = parse_address(spec)
    self.rank, self.size = rank, size
    self.started = time.monotonic()
    self._lock = threading.Lock()
    self._sock: socket.socket | None = None
    self._pending: list[bytes] = []
    self._state = "connecting"  # connecting | up | down
    # Called with each report the board sends (None once the board is gone).
    self.on_report: Callable[[dict | None], None] | None = None
    self._thread = threading.Thread(target=self._run, name="mpijax-arrival", daemon=True)
    self._thread.start()

  def _hello(self) -> bytes:
    return _line(
      {
        "hello": self.token,
        "rank": self.rank,
        "size": self.size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "attempt": _attempt(),
      }
    )

  def _connect(self) -> socket.socket | None:
    for host in self.hosts:
      try:
        s = socket.create_connection((host, self.port), timeout=CONNECT_S)
      except OSError:
        continue
      try:
        s.sendall(self._hello())
        reply = _read_line(s, CONNECT_S)
        if reply is not None and json.loads(reply).get("ok"):
          s.settimeout(None)
          return s
      except (OSError, ValueError):
        pass
      s.close()
    return None

  def _run(self) -> None:
    s = self._connect()
    with self._lock:
      if s is None or self._state == "down":
        self._state = "down"
        if s is not None:
          s.close()
        return
      self._sock, self._state = s, "up"
      try:
        for data in self._pending:
          s.sendall(data)
      except OSError:
        pass
      self._pending.clear()
    buf = b""
    while True:
      try:
        chunk = s.recv(MAX_LINE)
      except OSError:
        chunk = b""
      if not chunk:
        break
      buf += chunk
      while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        try:
          self._handle(json.loads(line))
        except (ValueError, AttributeError, TypeError):
          pass
      if len(buf) > MAX_LINE:
        break
    with self._lock:
      self._state = "down"
      self._sock = None
    try:
      s.close()
    except OSError:
      pass

  def _handle(self, msg: dict) -> None:
    if "stack" in msg:
      self.send(
        {"stack": msg["stack"], "place": _place(), "lines": main_stack(), "importing": importing()}
      )
    elif "report" in msg and self.on_report is not None:
      self.on_report(msg)

  def send(self, msg: dict) -> None:
    """Sends ``msg`` now, or once connected."""
    data = _line(msg)
    with self._lock:
      if self._state == "connecting":
        self._pending.append(data)
      elif self._sock is not None:
        try:
          self._sock.sendall(data)
        except OSError:
          pass

  def up(self) -> bool:
    """Whether the board can (still) be asked."""
    return self._state != "down"

  def connect_wait(self) -> float:
    """Seconds the connection may still take to come up."""
    return len(self.hosts) * CONNECT_S if self._state == "connecting" else 0.0

  def close(self) -> None:
    """Ends the connection (the rank got through ``init()``'s first collective)."""
    with self._lock:
      sock, self._sock = self._sock, None
      self._state = "down"
    if sock is not None:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


def _line(msg: dict) -> bytes:
  return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def _read_line(s: socket.socket, timeout: float) -> bytes | None:
  s.settimeout(timeout)
  buf = b""
  while b"\n" not in buf and len(buf) < MAX_LINE:
    chunk = s.recv(4096)
    if not chunk:
      return None
    buf += chunk
  return buf.split(b"\n", 1)[0]


def _attempt() -> int:
  try:
    return int(config.get("restart_attempt"))
  except ValueError:
    return 0


_board: Board | None = None


def hello() -> None:
  """At ``import mpijax`` in a rank of an mpijax-run job: connects to the
  board (in the background) and says this rank has started."""
  global _board
  if _board is not None:
    return
  try:
    spec = config.get("arrivals")
  except ValueError:
    return
  where = _place_in_job() if spec else None
  if where is None or where[1] <= 1:
    return
  try:
    _board = Board(spec, *where)
  except ValueError:
    return


def _forget_in_child() -> None:
  global _board
  _board = None  # a forked child is no rank: the connection is its parent's


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_in_child)


# --- the watch ---------------------------------------------------------------------------


class Watch:
  """Watches one ``init()`` until :meth:`arrived`: reports a wait past the timeout.

  Args:
    rank: this rank.
    size: the job's rank count.
    timeout: ``MPIJAX_TIMEOUT`` in seconds.
    action: ``MPIJAX_STALL_ACTION``, ``abort`` or ``warn``.
    code: the code object of the function being watched (``init``): once no
      frame of the watched thread runs it, it has returned or raised, and the
      watch ends.
    board: the connection to mpijax-run's board, or None.
  """

  def __init__(
    self, rank: int, size: int, timeout: float, action: str, code: CodeType, board: Board | None
  ):
    self.rank, self.size, self.timeout, self.action = rank, size, timeout, action
    self.code = code
    self.board = board
    self.thread_id = threading.get_ident()
    self.started = time.monotonic()
    self._done = threading.Event()
    self._reported = threading.Event()
    self._lock = threading.Lock()
    if board is not None:
      board.on_report = self._deliver
      board.send({"init": 1, "timeout": timeout, "action": action})
    self._thread = threading.Thread(target=self._run, name="mpijax-init-watch", daemon=True)
    self._thread.start()

  def arrived(self) -> None:
    """Every rank got through ``init()``'s first collective: the watch ends."""
    self._done.set()
    if self.board is not None:
      self.board.send({"arrived": 1})
      self.board.on_report = None
      self.board.close()

  def _in_watched_call(self) -> bool:
    frame = sys._current_frames().get(self.thread_id)
    while frame is not None:
      if frame.f_code is self.code:
        return True
      frame = frame.f_back
    return False

  def _in_mpi_init(self) -> bool:
    frame = sys._current_frames().get(self.thread_id)
    while frame is not None:
      if frame.f_code.co_name in ("_init_without_gil", "import_mpi"):
        return True
      frame = frame.f_back
    return False

  def _run(self) -> None:
    while not self._done.wait(self.timeout):
      if not self._in_watched_call():
        return
      self._reported.clear()
      board = self.board
      if board is not None and board.up():
        # The board answers every waiting rank at once, through _deliver.
        board.send({"ask": 1})
        self._reported.wait(ASK_S + board.connect_wait())
      if self._done.is_set():
        return
      if not self._reported.is_set():
        self._deliver(None)

  def _deliver(self, reply: dict | None) -> None:
    """Prints a report (``reply``: the board's; None: without a board) and
    ends the job if it says so."""
    with self._lock:
      if self._done.is_set() or not self._in_watched_call():
        return
      lines, fatal = self.report(reply)
      _write(lines)
      self._reported.set()
      if fatal:
        # The other waiting ranks got the same report at the same moment: let them say it.
        time.sleep(GRACE_S)
        os._exit(1)

  def report(self, reply: dict | None) -> tuple[list[str], bool]:
    """The lines to print for board reply ``reply`` (None: no board), and
    whether the job ends."""
    ending = self.action == "abort"
    settings = f"MPIJAX_TIMEOUT={self.timeout:g} s; MPIJAX_STALL_ACTION={self.action}"
    if reply is not None:
      lines = [str(reply.get("line", ""))]
      lines += ["  " + str(s) for s in reply.get("stacks") or []]
      return lines, ending and bool(reply.get("stuck"))
    waited = time.monotonic() - self.started
    where = (
      "in MPI_Init, which waits for every rank of the job"
      if self._in_mpi_init()
      else "in its first collective over every rank"
    )
    then = "Ending the job." if ending else "Still waiting."
    return [
      f"mpijax: init: rank {self.rank} waited {waited:.1f} s in mpijax.init() for the other "
      f"ranks of the job ({where}): a rank that has not called mpijax.init() holds it up. "
      "mpijax-run names such ranks and says where each one is; here they are not known "
      f"({settings}). {then}"
    ], ending


def _write(lines: list[str]) -> None:
  text = "".join(line + "\n" for line in lines)
  try:
    sys.stderr.write(text)
    sys.stderr.flush()
  except (OSError, ValueError):
    os.write(2, text.encode(errors="replace"))


def waiting(size: int | None) -> Watch | None:
  """Starts watching the calling function (``init()``) on this thread, in a
  job the launcher says has ``size`` ranks; None where nothing is watched
  (one rank, the timeout off, a place in the job the launcher does not say)."""
  try:
    timeout = float(config.get("timeout"))
    action = str(config.get("stall_action"))
  except ValueError:
    return None  # init() reports the malformed value
  where = _place_in_job()
  if timeout <= 0 or where is None or where[1] <= 1 or (size is not None and size != where[1]):
    return None
  return Watch(where[0], where[1], timeout, action, sys._getframe(1).f_code, _board)

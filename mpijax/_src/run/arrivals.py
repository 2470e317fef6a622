"""The arrival board: which ranks started, entered ``init()`` and got through it.

``mpijax-run`` listens on a TCP port for the whole job (one thread, one
``selectors`` loop) and gives every rank its address and a random key in
``MPIJAX_ARRIVALS`` (in the launcher's environment, never on a command
line). Each rank's thread (``mpijax/_src/guards/arrival.py``) connects at ``import
mpijax``, says which rank it is, when it enters ``init()`` and when it got
through its first collective, and answers the question where its main
thread is. A rank whose ``init()`` has waited ``MPIJAX_TIMEOUT`` asks the
board: it names the ranks that have not entered ``init()`` (never heard of,
or started and elsewhere: their Python stacks, asked for at once and
awaited at most 2 s), and every rank that asks within the same round gets
the same report. Messages are JSON lines; a connection that does not begin
with the key is closed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Sequence

from mpijax._src.guards import arrival
from mpijax._src.mpi_util import rank_ranges
from mpijax._src.run.hosts import hosts_of

ENV = "MPIJAX_ARRIVALS"
STACK_WAIT_S = 2.0
DESCRIBED = 8  # ranks described one by one in a report; the rest counted
STACKS = 4  # ranks whose stacks a report shows


@dataclasses.dataclass
class _Rank:
  host: str
  pid: int
  seen: float  # when it said hello (monotonic)
  conn: socket.socket | None = None
  init: float | None = None
  arrived: bool = False
  gone: bool = False  # its connection ended before it got through init()
  place: str = ""
  importing: bool = False  # its main thread was inside an import when it last answered
  stack: list[str] = dataclasses.field(default_factory=list)
  answered: float = 0.0  # when it last answered a stack question
  timeout: float = 0.0  # its MPIJAX_TIMEOUT and MPIJAX_STALL_ACTION, said on entering init()
  action: str = "abort"


@dataclasses.dataclass
class _Round:
  """One report: stack questions out, answers awaited until ``deadline``."""

  started: float
  deadline: float
  report: dict | None = None
  done: float = 0.0
  told: set[int] = dataclasses.field(default_factory=set)  # ranks sent this report
  audience: list[int] = dataclasses.field(default_factory=list)  # waiting when it was made


class Board:
  """The arrival board of one mpijax-run job; see the module docstring.

  Args:
    bind: the address to listen on (``127.0.0.1`` for a job on this machine
      alone, ``0.0.0.0`` when ranks run on other hosts).
    advertise: the addresses the ranks try, in order.
  """

  def __init__(self, bind: str, advertise: Sequence[str]):
    self.token = secrets.token_hex(16)
    self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._listener.bind((bind, 0))
    self._listener.listen(128)
    self._listener.setblocking(False)
    self.port = self._listener.getsockname()[1]
    self.advertise = list(dict.fromkeys(advertise))
    self._sel = selectors.DefaultSelector()
    self._sel.register(self._listener, selectors.EVENT_READ, None)
    self._lock = threading.Lock()
    self._bufs: dict[socket.socket, bytes] = {}
    self._who: dict[socket.socket, int | None] = {}
    self._attempt = 0
    self._size = 0
    self._ranks: dict[int, _Rank] = {}
    self._round: _Round | None = None
    self._stop = False
    self._wake_r, self._wake_w = socket.socketpair()
    self._wake_r.setblocking(False)
    self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
    self._thread = threading.Thread(target=self._loop, name="mpijax-run-arrivals", daemon=True)
    self._thread.start()

  @property
  def value(self) -> str:
    """``MPIJAX_ARRIVALS`` for the ranks: ``key@host[,host...]:port``."""
    return f"{self.token}@{','.join(self.advertise)}:{self.port}"

  def begin(self, attempt: int, ranks: int) -> None:
    """A new attempt of ``ranks`` ranks: what the last one said is forgotten."""
    with self._lock:
      self._attempt, self._size = attempt, ranks
      for r in self._ranks.values():
        if r.conn is not None:
          self._drop(r.conn)
      self._ranks.clear()
      self._round = None

  def close(self) -> None:
    self._stop = True
    self._wake()
    self._thread.join(5)
    for key in list(self._sel.get_map().values()):
      try:
        key.fileobj.close()
      except OSError:
        pass
    self._sel.close()
    self._wake_w.close()

  def _wake(self) -> None:
    try:
      self._wake_w.send(b"x")
    except OSError:
      pass

  # --- the loop ------------------------------------------------------------------------

  def _loop(self) -> None:
    while not self._stop:
      timeout = 0.5
      with self._lock:
        rnd = self._round
        if rnd is not None and rnd.report is None:
          timeout = max(0.0, min(timeout, rnd.deadline - time.monotonic()))
      for key, _ in self._sel.select(timeout):
        if key.data == "wake":
          try:
            key.fileobj.recv(4096)
          except OSError:
            pass
        elif key.fileobj is self._listener:
          self._accept()
        else:
          self._read(key.fileobj)
      with self._lock:
        self._finish_round()

  def _accept(self) -> None:
    try:
      conn, _ = self._listener.accept()
    except OSError:
      return
    conn.setblocking(False)
    self._bufs[conn] = b""
    self._who[conn] = None
    self._sel.register(conn, selectors.EVENT_READ, "rank")

  def _read(self, conn: socket.socket) -> None:
    try:
      chunk = conn.recv(arrival.MAX_LINE)
    except BlockingIOError:
      return
    except OSError:
      chunk = b""
    with self._lock:
      if not chunk:
        self._drop(conn)
        return
      buf = self._bufs.get(conn, b"") + chunk
      while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        try:
          msg = json.loads(line)
          if not isinstance(msg, dict):
            raise ValueError(line)
          self._handle(conn, msg)
        except (ValueError, TypeError, KeyError):
          self._drop(conn)
          return
      if len(buf) > arrival.MAX_LINE:
        self._drop(conn)
        return
      if conn in self._bufs:
        self._bufs[conn] = buf

  def _drop(self, conn: socket.socket) -> None:
    rank = self._who.pop(conn, None)
    self._bufs.pop(conn, None)
    try:
      self._sel.unregister(conn)
    except (KeyError, ValueError):
      pass
    try:
      conn.close()
    except OSError:
      pass
    r = self._ranks.get(rank) if rank is not None else None
    if r is not None and r.conn is conn:
      r.conn = None
      r.gone = not r.arrived

  def _send(self, conn: socket.socket, msg: dict) -> None:
    try:
      conn.setblocking(True)
      conn.settimeout(1.0)
      conn.sendall(arrival._line(msg))
    except OSError:
      self._drop(conn)
      return
    finally:
      try:
        conn.setblocking(False)
      except OSError:
        pass

  def _handle(self, conn: socket.socket, msg: dict) -> None:
    rank = self._who.get(conn)
    now = time.monotonic()
    if rank is None:
      # The first line must carry the key, this attempt's number and a rank.
      if not secrets.compare_digest(str(msg.get("hello", "")), self.token):
        raise ValueError("bad key")
      rank = int(msg["rank"])
      if int(msg.get("attempt", 0)) != self._attempt or not 0 <= rank < max(self._size, 1):
        raise ValueError("another attempt")
      if self._size == 0:
        self._size = int(msg.get("size", 0))
      old = self._ranks.get(rank)
      if old is not None and old.conn is not None:
        self._drop(old.conn)
      self._ranks[rank] = _Rank(str(msg.get("host", "?")), int(msg.get("pid", 0)), now, conn)
      self._who[conn] = rank
      self._send(conn, {"ok": 1})
      return
    r = self._ranks[rank]
    if "init" in msg:
      r.init = now
      r.timeout = float(msg.get("timeout", 0))
      r.action = str(msg.get("action", "abort"))
    elif "arrived" in msg:
      r.arrived = True
    elif "stack" in msg:
      r.place = str(msg.get("place", ""))[:300]
      r.importing = bool(msg.get("importing"))
      r.stack = [str(line)[:300] for line in (msg.get("lines") or [])][-2 * arrival.STACK_FRAMES :]
      r.answered = now
    elif "ask" in msg:
      self._ask(conn, rank, now)

  # --- reports -------------------------------------------------------------------------

  def _ask(self, conn: socket.socket, rank: int, now: float) -> None:
    """A rank's watch fired: a new round, unless this one is recent enough
    (then the rank gets its report if it has not yet)."""
    rnd = self._round
    timeout = self._ranks[rank].timeout or 1.0
    if rnd is not None and (rnd.report is None or now - rnd.done < max(2.0, timeout / 2)):
      return  # _finish_round tells every waiting rank, this one too
    self._round = _Round(now, now + STACK_WAIT_S)
    for r in self._missing_ranks():
      got = self._ranks.get(r)
      if got is not None and got.conn is not None:
        self._send(got.conn, {"stack": r})

  def _missing_ranks(self) -> list[int]:
    return [
      r
      for r in range(self._size)
      if r not in self._ranks or (self._ranks[r].init is None and not self._ranks[r].arrived)
    ]

  def _finish_round(self) -> None:
    rnd = self._round
    if rnd is None:
      return
    now = time.monotonic()
    if rnd.report is None:
      missing = self._missing_ranks()
      answered = all(
        r not in self._ranks
        or self._ranks[r].conn is None
        or self._ranks[r].answered >= rnd.started
        for r in missing
      )
      if not answered and now < rnd.deadline:
        return
      rnd.report = self.report(now, rnd.started)
      rnd.done = now
      rnd.audience = self._waiting()
    # Every rank that was waiting says the same, at the same moment; the stacks once.
    for rank in rnd.audience:
      conn = self._ranks[rank].conn if rank in self._ranks else None
      if rank in rnd.told or conn is None or self._ranks[rank].arrived:
        continue
      rnd.told.add(rank)
      reply = dict(rnd.report, report=1)
      if rank != rnd.audience[0]:
        reply["stacks"] = []
      self._send(conn, reply)

  def _waiting(self) -> list[int]:
    return sorted(
      r for r, x in self._ranks.items() if x.init is not None and not x.arrived and not x.gone
    )

  def report(self, now: float, asked: float) -> dict:
    """The report on the ranks that have not entered ``init()`` (``now``: the
    monotonic time; ``asked``: when this round's stack questions went out).

    ``stuck`` says whether the stall action applies: a rank never heard of,
    gone, or answering from elsewhere in its program is stuck; one still
    importing modules, or too busy to answer (code that holds the GIL, such
    as MPI_Init under ``from mpi4py import MPI``), is on its way, as a rank
    that compiles is in a collective's stall report.
    """
    waiting = self._waiting()
    entered = [x.init for x in self._ranks.values() if x.init is not None]
    waited = now - min(entered) if entered else 0.0
    first = next((self._ranks[r] for r in waiting), None)
    timeout = first.timeout if first is not None else 0.0
    action = first.action if first is not None else "abort"
    settings = f"MPIJAX_TIMEOUT={timeout:g} s; MPIJAX_STALL_ACTION={action}"
    missing = self._missing_ranks()
    who = _ranks_text(waiting)
    if not missing:
      return {
        "line": f"mpijax: init: every rank has called mpijax.init(); {who} waited {waited:.1f} s "
        "in its first stretch (MPI_Init and the gathering of host names), which MPI is "
        f"slow to finish. Still waiting ({settings}).",
        "stacks": [],
        "missing": [],
        "stuck": False,
      }
    states = {r: self._state(r, asked) for r in missing}
    stuck = any(state in ("unknown", "gone", "elsewhere") for state in states.values())
    verb = "has" if len(missing) == 1 else "have"
    parts = [self._describe(r, states[r], now) for r in missing[:DESCRIBED]]
    if len(missing) > DESCRIBED:
      parts.append(f"and {len(missing) - DESCRIBED} more")
    if stuck:
      then = "Ending the job." if action == "abort" else "Still waiting."
    else:
      then = (
        "Still waiting: a rank that imports modules, or is busy, arrives when it is done "
        "(whatever MPIJAX_STALL_ACTION says)."
      )
    line = (
      f"mpijax: init: {who} waited {waited:.1f} s in mpijax.init() for "
      f"{_ranks_text(missing)}, which {verb} not called it. Not arrived: {'; '.join(parts)}. "
      "Every rank must call mpijax.init(): the others wait for it in MPI_Init, which waits "
      f"for every rank of the job ({settings}). {then}"
    )
    stacks: list[str] = []
    shown = 0
    for r in missing:
      x = self._ranks.get(r)
      if x is None or not x.stack or states[r] not in ("elsewhere", "importing"):
        continue
      stacks.append(f"rank {r} ({x.host}, pid {x.pid}), Python main thread:")
      stacks += ["  " + s for s in x.stack]
      shown += 1
      if shown >= STACKS:
        break
    return {"line": line, "stacks": stacks, "missing": missing, "stuck": stuck}

  def _state(self, r: int, asked: float) -> str:
    x = self._ranks.get(r)
    if x is None:
      return "unknown"
    if x.gone:
      return "gone"
    if x.answered < asked:
      return "busy"
    return "importing" if x.importing else "elsewhere"

  def _describe(self, r: int, state: str, now: float) -> str:
    x = self._ranks.get(r)
    if x is None:
      return (
        f"rank {r} (no word from it since the job started: it has not imported mpijax, "
        "or cannot reach mpijax-run)"
      )
    who = f"rank {r} ({x.host}, pid {x.pid}"
    if state == "gone":
      return f"{who}: left before calling mpijax.init(): it exited, or runs another program)"
    started = f"started {now - x.seen:.1f} s ago"
    if state == "busy":
      return f"{who}: {started}; no answer within {STACK_WAIT_S:g} s: busy in code that holds Python's GIL)"
    place = f"; Python: {x.place}" if x.place else ""
    doing = "; still importing modules" if state == "importing" else ""
    return f"{who}: {started}{doing}{place})"


def _ranks_text(ranks: list[int]) -> str:
  if not ranks:
    return "no rank"
  return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


# --- where the board listens ----------------------------------------------------------


def _addresses_towards(hosts: Sequence[str]) -> list[str]:
  """This host's address on the interface that routes to each of ``hosts``."""
  out = []
  for host in hosts:
    try:
      peer = socket.gethostbyname(host)
      with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP connect sends nothing; it only picks a route
        addr = s.getsockname()[0]
    except OSError:
      continue
    if not addr.startswith("127."):
      out.append(addr)
  return out


def start(opts, env: dict[str, str], slurm: bool) -> Board | None:
  """The board of a job run with ``opts``; None where it cannot listen.

  A job on this machine alone listens on loopback; with ``--hosts``,
  ``--hostfile`` or inside a Slurm allocation on every interface, and the
  ranks try this host's address towards each of the job's hosts, then its
  name's.
  """
  hosts = [h for h, _ in (hosts_of(opts) or [])]
  nodes: list[str] = []
  if slurm:
    from mpijax._src.cluster.hostlist import expand_hostlist

    try:
      nodes = list(expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")))
    except ValueError:
      nodes = []
  remote = [h for h in hosts + nodes if h not in ("localhost", "127.0.0.1")]
  if not remote:
    bind, advertise = "127.0.0.1", ["127.0.0.1"]
  else:
    here = socket.gethostname()
    advertise = ["127.0.0.1"] + _addresses_towards(remote)
    try:
      advertise += [a for a in socket.gethostbyname_ex(here)[2] if not a.startswith("127.")]
    except OSError:
      pass
    advertise.append(here)
    bind = "0.0.0.0"
  try:
    return Board(bind, advertise)
  except OSError:
    return None


def environ_with(board: Board | None) -> None:
  """Puts the board's address into this process's environment (the launcher
  inherits it and passes it on), or takes it out."""
  if board is None:
    os.environ.pop(ENV, None)
  else:
    os.environ[ENV] = board.value

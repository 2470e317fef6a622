"""The launcher's output, as ``mpijax-run`` passes it on: per-rank logs and exit reasons.

``mpirun``/``srun`` tag every line a rank writes with its rank (Open MPI
``[1,3]<stdout>: ``, Hydra ``[3] ``, srun ``3: ``). ``mpijax-run`` reads the
launcher's stdout and stderr through pipes and

* shows each rank's lines on its own stdout and stderr with one prefix, the
  rank as PyTorch's distributed jobs name it (``[rank3]: ``), whichever
  launcher ran the job (the ranks know, ``MPIJAX_RUN``, and leave their own
  rank tags out);
* writes each rank's lines, tag removed, to ``DIR/rank_<r>.log``
  (``--log-dir DIR``), on the console too with ``--tee``, and the
  launcher's own lines to ``DIR/mpijax-run.log`` and the console; the logs
  are appended to, with a header line per attempt, and sit on the machine
  where ``mpijax-run`` runs, whichever host a rank ran on;
* keeps the launcher's messages and mpijax's failure reports (an uncaught
  exception, a stall, an MPI error) to say, in one line, why an attempt
  ended: which rank, on which node, killed by which signal or exiting with
  which status;
* shows one block per failure on the console (:class:`ConsoleFilter`): the
  first rank's report of an uncaught exception, not its echo from every
  other rank, nor Open MPI's and JAX's messages about the abort that
  follows (the logs keep everything).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO

from mpijax._src import mpi_util

# One regular expression per tag style; group "rank" is the rank.
_TAGS = {
  "openmpi": re.compile(rb"^\[\d+,(?P<rank>\d+)\]<(?:stdout|stderr|stddiag)>: ?"),
  "mpich": re.compile(rb"^\[(?P<rank>\d+)\] ?"),
  "srun": re.compile(rb"^ *(?P<rank>\d+): "),
}

_KEEP_LINES = 400  # launcher lines kept for the exit reason
_READ_BYTES = 1 << 16


def rank_prefix(rank: int) -> bytes:
  """The prefix of rank ``rank``'s lines on mpijax-run's console: ``[rank3]: ``."""
  return b"[rank%d]: " % rank


def split_tag(kind: str, line: bytes) -> tuple[int | None, bytes]:
  """(rank, text without the tag) of one output line; rank None for the launcher's own lines."""
  m = _TAGS[kind].match(line)
  if m is None:
    return None, line
  return int(m.group("rank")), line[m.end() :]


_HYDRA_TAG = re.compile(rb"\[(\d+)\] ")


class HydraDemux:
  """Sorts Hydra's output into per-rank lines.

  Hydra's ``-prepend-rank`` tags every chunk it reads from a rank, not every
  line: a line written in pieces (unbuffered output) carries the tag again
  where each piece began, and pieces of different ranks can share one output
  line. Each rank's text is kept until its own newline. A ``[N] `` with N not
  a rank of the job is text.
  """

  def __init__(self):
    self.ranks = 0
    self._pending: dict[int, bytes] = {}

  def feed(self, line: bytes) -> list[tuple[int | None, bytes]]:
    """(rank, complete line) pairs; (None, line) for a line of Hydra's own."""
    if _TAGS["mpich"].match(line) is None:
      return [(None, line)]
    parts = _HYDRA_TAG.split(line)
    chunks: list[list] = []
    for i in range(1, len(parts), 2):
      rank = int(parts[i])
      if rank < self.ranks or not chunks:
        chunks.append([rank, parts[i + 1]])
      else:
        chunks[-1][1] += b"[" + parts[i] + b"] " + parts[i + 1]
    out: list[tuple[int | None, bytes]] = []
    for rank, text in chunks:
      buf = self._pending.pop(rank, b"") + text
      *complete, rest = buf.split(b"\n")
      out += [(rank, c + b"\n") for c in complete]
      if rest:
        self._pending[rank] = rest
    return out

  def flush(self) -> list[tuple[int | None, bytes]]:
    """What is left without a newline (at the end of an attempt)."""
    out = [(rank, text + b"\n") for rank, text in self._pending.items()]
    self._pending.clear()
    return out


# --- why an attempt ended -------------------------------------------------------

# mpijax's own reports, as the ranks print them (failure.py, the C++ transport).
# The first line of failure.py's report: the exception, the rank, its message.
_UNCAUGHT = re.compile(
  r"mpijax: uncaught (\S+?)(?: in thread '[^']*')? on rank (\d+)/\d+"
  r"(?:, aborting the job \(exit code \d+\))?(?:: (.*))?"
)
_TRACE_LINE = re.compile(r"^\[rank (\d+)/\d+\] (\S.*)$")
_STALL = re.compile(r"mpijax: stall: (rank \d+.*)")
_MPI_ERROR = re.compile(r"mpijax: rank (\d+): (\S+ failed in .*)")
_MISMATCH = re.compile(r"(mpijax: collective mismatch.*)")
_INIT = re.compile(r"mpijax: init: (.*)")

# Open MPI's "process rank R with PID P on node H <what happened>".
_OMPI_RANK = r"process rank (\d+) with PID \d+ on node (\S+) "


def _says(template: str) -> Callable[[re.Match], str]:
  """A reason that is `template` with the match's groups as {1}, {2}, ..."""
  return lambda m: template.format(m[0], *m.groups())


# The launchers' messages (whitespace-normalized, since they wrap lines), each
# with the reason it gives.
_LAUNCHER_REASONS = [
  (re.compile(pattern), reason)
  for pattern, reason in [
    # Open MPI 4 and 5
    (
      _OMPI_RANK + r"exited on signal (\d+) \(([^)]*)\)",
      _says("rank {1} on node {2} was killed by signal {3} ({4})"),
    ),
    (r"Process name: \[[^\]]*?,(\d+)\] Exit code: (\d+)", _says("rank {1} exited with status {2}")),
    (_OMPI_RANK + r"calling \"abort\"", _says("rank {1} on node {2} called MPI_Abort")),
    (
      r"MPI_ABORT was invoked on rank (\d+) in communicator \S+ with errorcode (\d+)",
      _says("rank {1} called MPI_Abort (error code {2})"),
    ),
    (_OMPI_RANK + r"exiting improperly", _says("rank {1} on node {2} exited without MPI_Finalize")),
    (
      r"A daemon failed to report back.*?Remote host: (\S+)",
      _says("the launcher lost its daemon on host {1} (or could not start it)"),
    ),
    (
      r"lost communication with a remote daemon.*?Remote daemon: \S+ on node (\S+)",
      _says("the launcher lost communication with its daemon on host {1}"),
    ),
    (
      r"(?:ORTE|PRTE) (?:was|is) unable to reliably start one or more daemons",
      _says("the launcher could not start its daemons on every host"),
    ),
    # Slurm
    (
      r"srun: error: (\S+): tasks? ([\d,\-]+): (Exited with exit code \d+|"
      r"[A-Z][a-z]+(?: [a-z]+)*)",
      lambda m: f"task {m[2]} on node {m[1]}: {m[3].lower()}",
    ),
    # MPICH / Hydra (older versions name the rank, 4.x and 5.x only the PID)
    (
      r"(?:RANK (\d+) )?PID \d+ RUNNING AT (\S+)[=\s]*(KILLED BY SIGNAL: \d+(?: \([^)]*\))?"
      r"|EXIT STATUS: \d+|EXIT CODE: \d+)(?:.*?EXIT STRING: (.*?\(signal \d+\)))?",
      lambda m: (
        f"{'rank ' + m[1] if m[1] else 'a rank'} on node {m[2]}: {m[3].lower()}"
        + (f" ({m[4].lower()})" if m[4] else "")
      ),
    ),
  ]
]

# Messages that mean the job failed even when the launcher's exit status is 0
# (Open MPI 5's prterun exits 0 when a remote daemon and its ranks are killed).
_FATAL = re.compile(
  r"A daemon failed to report back|lost communication with a remote daemon|"
  r"unable to reliably start one or more daemons|exited on signal \d+"
)


def describe_status(status: int) -> str:
  """``exit status 3`` / ``exit status 137 (signal 9, SIGKILL)``."""
  if status > 128:
    import signal

    try:
      name = signal.Signals(status - 128).name
      return f"exit status {status} (signal {status - 128}, {name})"
    except ValueError:
      pass
  return f"exit status {status}"


@dataclasses.dataclass
class Reasons:
  """What the launcher and the ranks said while an attempt ran."""

  launcher_lines: collections.deque = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=_KEEP_LINES)
  )
  mpijax: list[str] = dataclasses.field(default_factory=list)
  last_trace: dict[int, str] = dataclasses.field(default_factory=dict)
  _uncaught: list[tuple[int, str]] = dataclasses.field(default_factory=list)
  _reporting: set[int] = dataclasses.field(default_factory=set)  # ranks in their report

  def rank_line(self, text: str, rank: int | None = None) -> None:
    """Notes one line of rank ``rank``'s (None: the rank only its text names)."""
    m = _TRACE_LINE.match(text)
    if m:
      self.last_trace[int(m[1])] = m[2]
    elif rank in self._reporting and text.strip():
      self.last_trace[rank] = text  # the report's lines, without a rank tag of their own
    m = _UNCAUGHT.search(text)
    if m:
      self._uncaught.append((int(m[2]), f"{m[1]}: {m[3]}" if m[3] else m[1]))
      self._reporting.add(int(m[2]))
      return
    for pattern, fmt in ((_STALL, "stall: {}"), (_MISMATCH, "{}"), (_INIT, "init: {}")):
      m = pattern.search(text)
      if m and len(self.mpijax) < 8:
        self.mpijax.append(fmt.format(_shorten(m[1])))
        return
    m = _MPI_ERROR.search(text)
    if m and len(self.mpijax) < 8:
      self.mpijax.append(f"rank {m[1]}: {_shorten(m[2])}")

  def launcher_line(self, text: str) -> None:
    self.launcher_lines.append(text)

  def _launcher_text(self) -> str:
    return " ".join(" ".join(self.launcher_lines).split())

  def launcher_failed(self) -> bool:
    """The launcher reported a lost daemon or a killed rank (whatever its exit status)."""
    return _FATAL.search(self._launcher_text()) is not None

  def summary(self, status: int) -> str:
    """One line: why the attempt ended."""
    parts: list[str] = []
    text = self._launcher_text()
    for pattern, fmt in _LAUNCHER_REASONS:
      m = pattern.search(text)
      if m:
        parts.append(fmt(m))
        break
    for rank, exc in self._uncaught[:1]:
      # The report's own first line names the exception and its message; a
      # report without one falls back to the last line of the traceback.
      def detail_of(r: int, e: str) -> str:
        return e if ": " in e else self.last_trace.get(r, e)

      detail = detail_of(rank, exc)
      alike = sorted({r for r, e in self._uncaught if detail_of(r, e) == detail})
      also = f" (ranks {mpi_util.rank_ranges(alike)} alike)" if len(alike) > 1 else ""
      parts.append(f"rank {rank}: uncaught {_shorten(detail)}{also}")
    parts += self.mpijax[:1]
    parts.append(describe_status(status))
    return "; ".join(parts)


# --- one block per failure on the console --------------------------------------

_DASHES = re.compile(r"^\s*-{20,}\s*$")
# (With the rank's own tag under plain mpirun, without it under mpijax-run.)
_HEADER = re.compile(r"^(\[rank \d+/\d+\] )?mpijax: uncaught \S+.* on rank \d+/\d+")
# The launchers' messages about an abort or a rank's non-zero exit, which the
# summary line mpijax-run prints after every failed attempt says better.
_ABORT_BOXES = re.compile(
  r"MPI_ABORT was invoked on rank|has exited due to process rank \d+ with PID \d+ on node \S+ "
  r"calling \"abort\"|detected that one or more processes exited with non-zero status"
)
# What JAX's distributed runtime and XLA print on ranks that are being torn down
# (absl log lines, the coordination service giving up, check-failure stacks).
_TEARDOWN = re.compile(
  r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] |JAX distributed service|"
  r"[Cc]oordination[ _]?[Ss]ervice|GRPC error|grpc_status|^\s*@\s+0x[0-9a-f]+|"
  r"\*\*\* Check failure stack trace|"
  r"^\s*$"
)


class ConsoleFilter:
  """Which lines of an attempt reach the console, so that a failure reads as one block.

  Once a rank reported an uncaught exception (:mod:`mpijax._src.guards.failure`'s
  block: the rank, the exception and its message, then the traceback), the
  same report from other ranks, Open MPI's boxes about the abort, and what
  JAX prints while the other ranks are torn down are left out; another
  rank's different report shows as its first line; a box or line that says
  something else is shown. Every line still goes to the logs.
  """

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self.failing = False
    self._shown: set[str] = set()  # error reports shown, rank numbers taken out
    # Ranks inside a report that repeats one shown: True where each line of the
    # report has the rank's own tag, False where none has (every later line
    # of the rank is the report's: the rank aborts after it).
    self._quiet: dict[int, bool] = {}
    self._reporting: set[int] = set()  # ranks whose report is shown
    self._held: dict[int, bytes] = {}  # a rank's dashed line: the start of a box?
    self._in_box: set[int] = set()  # ranks inside Open MPI's MPI_ABORT box
    self._box: list[bytes] | None = None  # the launcher's box being read

  def rank_line(self, rank: int, text: str, raw: bytes) -> list[bytes]:
    """The lines to show for a rank's line ``text`` (``raw``: as the launcher wrote it)."""
    out: list[bytes] = []
    held = self._held.pop(rank, None)
    if rank in self._in_box:
      if _DASHES.match(text):
        self._in_box.discard(rank)
      return out
    if held is not None:
      if text.startswith("MPI_ABORT was invoked"):
        self._in_box.add(rank)
        self.failing = True
        return out
      out.append(held)
    if _DASHES.match(text):
      self._held[rank] = raw
      return out
    m = _HEADER.match(text)
    if m:
      self.failing = True
      key = re.sub(r"rank \d+/\d+", "rank", text)
      if key in self._shown or self._shown:
        # The same report again: nothing; another one (often the teardown's
        # consequence): its first line. Their tracebacks are in the logs.
        self._quiet[rank] = m.group(1) is not None
        if key not in self._shown:
          self._shown.add(key)
          out.append(raw)
        return out
      self._shown.add(key)
      self._quiet.pop(rank, None)
      self._reporting.add(rank)
    elif rank in self._quiet:
      if not self._quiet[rank] or text.startswith(f"[rank {rank}/"):
        return out
      del self._quiet[rank]
    # The shown report's own lines stay, whatever they say (a blank one excepted).
    if (
      self.failing
      and not text.startswith("[rank ")
      and _TEARDOWN.search(text)
      and (rank not in self._reporting or not text.strip())
    ):
      return out
    out.append(raw)
    return out

  def launcher_line(self, text: str, raw: bytes) -> list[bytes]:
    """The lines to show for one of the launcher's own lines."""
    if self._box is None:
      if _DASHES.match(text):
        self._box = [raw]
        return []
      return [raw]
    self._box.append(raw)
    if not _DASHES.match(text):
      return []
    box, self._box = self._box, None
    said = " ".join(b.decode(errors="replace") for b in box)
    return [] if _ABORT_BOXES.search(" ".join(said.split())) else box

  def flush(self) -> list[bytes]:
    """What is still held back at the end of the output."""
    out = list(self._held.values()) + (self._box or [])
    self._held.clear()
    self._box = None
    return out


def _shorten(text: str, limit: int = 240) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the relay ------------------------------------------------------------------


class Relay:
  """Copies the launcher's output to the console and the per-rank logs, and notes failures.

  Args:
    kind: the tag style, "openmpi", "mpich" or "srun".
    log_dir: directory for ``rank_<r>.log``, ``mpijax-run.log`` and
      ``attempts.jsonl``; None to only pass the output on.
    tee: with ``log_dir``, also show the ranks' lines on the console.
    stdout: the console's output stream (bytes; default ``sys.stdout``'s).
    stderr: the console's error stream (bytes; default ``sys.stderr``'s).
  """

  def __init__(
    self,
    kind: str,
    log_dir: str | None = None,
    tee: bool = False,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
  ):
    self.kind = kind
    self.log_dir = log_dir
    self.tee = tee
    self.stdout = stdout if stdout is not None else sys.stdout.buffer
    self.stderr = stderr if stderr is not None else sys.stderr.buffer
    self.reasons = Reasons()
    self._filters: dict[int, ConsoleFilter] = {}  # one per console stream
    self._ranks = 0
    self._files: dict[int, IO[bytes]] = {}
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self._own_log: IO[bytes] | None = None
    if log_dir is not None:
      os.makedirs(log_dir, exist_ok=True)
      self._own_log = open(os.path.join(log_dir, "mpijax-run.log"), "ab")

  # -- attempts --

  def begin(self, attempt: int, ranks: int, detail: str = "") -> None:
    """Starts an attempt: fresh reasons, and a header line in every rank's log."""
    self.reasons = Reasons()
    self._filters.clear()
    self._ranks = ranks
    if self.log_dir is None:
      return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    header = f"===== mpijax-run attempt {attempt}: {ranks} ranks, {stamp}{detail} =====\n".encode()
    with self._lock:
      for r in range(ranks):
        f = self._file(r)
        f.write(header)
        f.flush()
      self._write_own(header)

  def record(self, entry: dict) -> None:
    """Appends one attempt's outcome to ``attempts.jsonl`` (when logging)."""
    if self.log_dir is None:
      return
    with open(os.path.join(self.log_dir, "attempts.jsonl"), "a") as f:
      f.write(json.dumps(entry, sort_keys=True) + "\n")

  def note(self, text: str) -> None:
    """mpijax-run's own message: to stderr, and to ``mpijax-run.log``."""
    data = (text.rstrip("\n") + "\n").encode()
    with self._lock:
      try:
        self.stderr.write(data)
        self.stderr.flush()
      except (OSError, ValueError):
        pass
      self._write_own(data)

  def log(self, text: str) -> None:
    """A line for ``mpijax-run.log`` only (with --log-dir)."""
    with self._lock:
      self._write_own((text.rstrip("\n") + "\n").encode())

  # -- the pipes --

  def attach(self, stdout_pipe: IO[bytes] | None, stderr_pipe: IO[bytes] | None) -> None:
    """Starts one reader thread per pipe of the launcher process."""
    self._threads = []
    for pipe, console in ((stdout_pipe, self.stdout), (stderr_pipe, self.stderr)):
      if pipe is None:
        continue
      t = threading.Thread(
        target=self._pump, args=(pipe, console, HydraDemux()), daemon=True, name="mpijax-run-relay"
      )
      t.start()
      self._threads.append(t)

  def join(self, timeout: float = 5.0) -> None:
    """Waits until both pipes reached end of file (the launcher and its children are gone)."""
    end = time.monotonic() + timeout
    for t in self._threads:
      t.join(max(0.0, end - time.monotonic()))

  def close(self) -> None:
    with self._lock:
      for f in self._files.values():
        f.close()
      self._files.clear()
      if self._own_log is not None:
        self._own_log.close()
        self._own_log = None

  def _pump(self, pipe: IO[bytes], console: IO[bytes], hydra: HydraDemux) -> None:
    hydra.ranks = self._ranks
    fd = pipe.fileno()
    rest = b""
    while True:
      try:
        chunk = os.read(fd, _READ_BYTES)
      except OSError:
        chunk = b""
      if not chunk:
        if rest:
          self._lines([rest + b"\n"], console, hydra)
        self._lines([], console, hydra, final=True)
        break
      data = rest + chunk
      cut = data.rfind(b"\n") + 1
      rest = data[cut:]
      if cut:
        self._lines(data[:cut].splitlines(keepends=True), console, hydra)
    try:
      pipe.close()
    except OSError:
      pass

  def _lines(
    self,
    lines: Iterable[bytes],
    console: IO[bytes],
    hydra: HydraDemux | None = None,
    final: bool = False,
  ) -> None:
    show = bytearray()
    with self._lock:
      console_filter = self._filters.setdefault(id(console), ConsoleFilter())
      for line in lines:
        line = line.replace(b"\0", b"")  # Open MPI ends its abort message with a NUL
        if self.kind == "mpich" and hydra is not None:
          pieces = hydra.feed(line)
        else:
          pieces = [split_tag(self.kind, line)]
        if pieces and pieces[0][0] is None:  # the launcher's own line
          text = line.decode(errors="replace").rstrip("\r\n")
          self.reasons.launcher_line(text)
          show += b"".join(console_filter.launcher_line(text, line))
          self._write_own(line)
          continue
        if self.log_dir is None or self.tee:
          show += self._shown_lines(console_filter, pieces)
        self._rank_lines(pieces)
      if final and hydra is not None:
        rest = hydra.flush()
        if self.log_dir is None or self.tee:
          show += self._shown_lines(console_filter, rest)
        self._rank_lines(rest)
      if final:
        show += b"".join(console_filter.flush())
      for f in self._files.values():
        f.flush()
      if self._own_log is not None:
        self._own_log.flush()
      if show:
        try:
          console.write(bytes(show))
          console.flush()
        except (OSError, ValueError):
          pass

  @staticmethod
  def _shown_lines(
    console_filter: ConsoleFilter, pieces: Iterable[tuple[int | None, bytes]]
  ) -> bytes:
    """What the console shows of ranks' lines: each with one prefix, ``[rank3]: ``.

    A line a progress bar redrew in place (``\\r``) shows its last state: on
    a terminal its earlier ones would overwrite the prefix.
    """
    out = bytearray()
    for r, t in pieces:
      body = t.rstrip(b"\r\n")
      if b"\r" in body:
        t = body.rsplit(b"\r", 1)[1] + b"\n"
      tagged = rank_prefix(r) + t
      out += b"".join(
        console_filter.rank_line(r, t.decode(errors="replace").rstrip("\r\n"), tagged)
      )
    return bytes(out)

  def _rank_lines(self, pieces: Iterable[tuple[int | None, bytes]]) -> None:
    for rank, text in pieces:
      self.reasons.rank_line(text.decode(errors="replace").rstrip("\r\n"), rank)
      if self.log_dir is not None:
        self._file(rank).write(text)

  def _file(self, rank: int) -> IO[bytes]:
    f = self._files.get(rank)
    if f is None:
      f = open(os.path.join(self.log_dir, f"rank_{rank}.log"), "ab")
      self._files[rank] = f
    return f

  def _write_own(self, data: bytes) -> None:
    if self._own_log is not None:
      self._own_log.write(data)
      self._own_log.flush()

"""Running the launcher: in its own session, under a child subreaper, with signals.

mpijax-run marks itself a child subreaper, so ranks orphaned by a dying
launcher are reparented to it and can still be killed: Ctrl-C, SIGTERM and
``--timeout`` leave no process behind. SIGUSR1/SIGUSR2 are passed on to every
rank (Slurm's ``--signal`` before the time limit).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time

from mpijax._src.launch import joblog
from mpijax._src.launch import session_dirs
from mpijax._src.launch.common import PROG
from mpijax._src.launch.common import TIMEOUT_EXIT_CODE
from mpijax._src.launch.common import LaunchError


def become_subreaper() -> bool:
  """Orphaned descendants get reparented to us, so we can still find and kill them."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
  except (OSError, AttributeError):
    return False


def _children_table() -> dict[int, list[int]]:
  table: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    # The command name may contain spaces and parentheses; fields after the last ')' are fixed.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) >= 2:
      table.setdefault(int(fields[1]), []).append(int(entry))
  return table


def descendants(pid: int) -> list[int]:
  """All live descendants of ``pid`` (from /proc; empty where /proc is missing)."""
  if not os.path.isdir("/proc"):
    return []
  table = _children_table()
  out, stack = [], [pid]
  while stack:
    for child in table.get(stack.pop(), []):
      out.append(child)
      stack.append(child)
  return out


def _signal_all(proc: subprocess.Popen, sig: int) -> None:
  pids = descendants(os.getpid())
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
  for pid in pids:
    try:
      os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
      pass


def _reap_all() -> None:
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return


def _stop(proc: subprocess.Popen, sig: int, grace: float) -> None:
  """Forwards ``sig`` to the launcher, then SIGKILLs everything left after ``grace`` s."""
  try:
    proc.send_signal(sig)
  except ProcessLookupError:
    pass
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline:
    if proc.poll() is not None and not descendants(os.getpid()):
      return
    time.sleep(0.05)
  _signal_all(proc, signal.SIGKILL)
  proc.wait()
  # Orphans reparented to us (subreaper) die too; wait for them so none lingers as a zombie.
  end = time.monotonic() + 5
  while descendants(os.getpid()) and time.monotonic() < end:
    _signal_all(proc, signal.SIGKILL)
    _reap_all()
    time.sleep(0.05)
  _reap_all()


class Signals:
  """While active: SIGINT/SIGTERM/SIGHUP are recorded (they stop the job), SIGUSR1/SIGUSR2 are
  queued to be forwarded to the launcher (which passes them on to every rank)."""

  STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  FORWARD = (signal.SIGUSR1, signal.SIGUSR2)

  def __init__(self):
    self.stop: list[int] = []
    self.pending: list[int] = []
    self.forwarded: list[int] = []
    self._previous: dict[int, object] = {}

  def __enter__(self) -> Signals:
    for s in self.STOP:
      self._previous[s] = signal.signal(s, lambda signum, _f: self.stop.append(signum))
    for s in self.FORWARD:
      self._previous[s] = signal.signal(s, lambda signum, _f: self.pending.append(signum))
    return self

  def __exit__(self, *exc) -> None:
    for s, h in self._previous.items():
      signal.signal(s, h)

  def forward(self, proc: subprocess.Popen) -> None:
    while self.pending:
      sig = self.pending.pop(0)
      print(
        f"{PROG}: got {signal.Signals(sig).name}; passing it on to every rank",
        file=sys.stderr,
        flush=True,
      )
      try:
        proc.send_signal(sig)
      except ProcessLookupError:
        pass
      self.forwarded.append(sig)


@dataclasses.dataclass
class Outcome:
  """How one launch ended."""

  status: int
  interrupted: int | None = None  # the stopping signal mpijax-run received
  timed_out: bool = False


def run_launcher(
  cmd: list[str],
  signals: Signals,
  deadline: float | None,
  grace: float,
  relay: joblog.Relay | None,
  timeout: float | None,
) -> Outcome:
  """Runs ``cmd`` in its own session until it ends, a stopping signal arrives or ``deadline``."""
  pipe = subprocess.PIPE if relay is not None else None
  try:
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=pipe, stderr=pipe)
  except OSError as e:
    raise LaunchError(f"cannot start {cmd[0]!r}: {e}") from None
  # Its session directory, if it is killed, is then known to be this namespace's.
  session_dirs.record(proc.pid)
  if relay is not None:
    relay.attach(proc.stdout, proc.stderr)
  outcome = None
  while outcome is None:
    signals.forward(proc)
    if signals.stop:
      sig = signals.stop[0]
      print(
        f"{PROG}: got {signal.Signals(sig).name}; stopping all ranks", file=sys.stderr, flush=True
      )
      _stop(proc, sig, grace)
      outcome = Outcome(128 + sig, interrupted=sig)
      break
    if deadline is not None and time.monotonic() > deadline:
      print(f"{PROG}: job exceeded --timeout {timeout:g} s; killed", file=sys.stderr, flush=True)
      _stop(proc, signal.SIGTERM, grace)
      outcome = Outcome(TIMEOUT_EXIT_CODE, timed_out=True)
      break
    try:
      code = proc.wait(timeout=0.1)
    except subprocess.TimeoutExpired:
      continue
    # The launcher is gone; anything it left behind (an orphaned rank) goes too.
    if descendants(os.getpid()):
      _stop(proc, signal.SIGTERM, min(grace, 2.0))
    _reap_all()
    outcome = Outcome(code if code >= 0 else 128 - code)
  if relay is not None:
    relay.join()
  return outcome

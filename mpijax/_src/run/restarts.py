"""The attempts of a job: how each ended, restarts with back-off, and the
preflight that finds the hosts a restart must drop (``--min-ranks``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Sequence

from mpijax._src.run import arrivals
from mpijax._src.run import joblog
from mpijax._src.run import session_dirs
from mpijax._src.run.commands import build_command
from mpijax._src.run.commands import output_kind
from mpijax._src.run.common import DOCTOR_FAILED
from mpijax._src.run.common import GRACE_SECONDS
from mpijax._src.run.common import MAX_BACKOFF_SECONDS
from mpijax._src.run.common import PREEMPTED_EXIT_CODE
from mpijax._src.run.common import PREFLIGHT_SECONDS
from mpijax._src.run.common import PROG
from mpijax._src.run.common import RESTART_ENV
from mpijax._src.run.common import Options
from mpijax._src.run.common import Plan
from mpijax._src.run.hosts import host_list
from mpijax._src.run.hosts import hosts_of
from mpijax._src.run.process_group import Outcome
from mpijax._src.run.process_group import Signals
from mpijax._src.run.process_group import become_subreaper
from mpijax._src.run.process_group import run_launcher
from mpijax._src.run.shm import JobFiles
from mpijax._src.run.situation import Situation
from mpijax._src.run.situation import choose_launcher


@dataclasses.dataclass
class Attempt:
  """One launch of the job and how it ended."""

  attempt: int
  ranks: int | None
  hosts: list[str] | None
  started: float  # time.time()
  seconds: float
  status: int
  verdict: str  # "ok", "failed", "preempted", "interrupted", "timeout"
  reason: str

  def line(self) -> str:
    hosts = f" on {','.join(self.hosts)}" if self.hosts else ""
    ranks = f"{self.ranks} ranks" if self.ranks is not None else "ranks"
    return (
      f"attempt {self.attempt}: {ranks}{hosts}, {self.seconds:.1f} s, {self.verdict}: {self.reason}"
    )


def verdict(outcome: Outcome, reasons: joblog.Reasons) -> tuple[str, int]:
  """("ok" | "failed" | "preempted" | "interrupted" | "timeout", exit status) of one launch.

  Exit status 75 (EX_TEMPFAIL) is a preempted program that saved its state
  and asks to be requeued; 130 is a rank stopped by Ctrl-C. Open MPI's
  launcher can exit 0 after losing a host's daemon and ranks: its message
  decides then.
  """
  if outcome.interrupted is not None:
    return "interrupted", outcome.status
  if outcome.timed_out:
    return "timeout", outcome.status
  if outcome.status == 0:
    return ("failed", 1) if reasons.launcher_failed() else ("ok", 0)
  if outcome.status == PREEMPTED_EXIT_CODE:
    return "preempted", outcome.status
  if outcome.status == 128 + signal.SIGINT:
    return "interrupted", outcome.status
  return "failed", outcome.status


def backoff_seconds(restart: int, base: float) -> float:
  """Seconds before restart number ``restart`` (1, 2, ...): ``base``, doubling, at most 60."""
  return min(MAX_BACKOFF_SECONDS, base * 2 ** (restart - 1))


def preflight(
  opts: Options,
  sit: Situation,
  hosts: Sequence[tuple[str, int]],
  timeout: float = PREFLIGHT_SECONDS,
) -> dict[str, str | None]:
  """Starts one trivial process on every host at once (through the same launcher and flags).

  Returns:
    host -> None if it started, else what went wrong.
  """
  probe_opts = dataclasses.replace(
    opts, program=["true"], wrap=False, rank_wrapper=[], hostfile=None, hosts=None
  )
  procs = {}
  for host, _ in hosts:
    cmd = build_command(probe_opts, sit, Plan(np=1, hosts=((host, 1),)))
    try:
      procs[host] = subprocess.Popen(
        cmd,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
      )
    except OSError as e:
      procs[host] = e
  end = time.monotonic() + timeout
  result: dict[str, str | None] = {}
  for host, proc in procs.items():
    if isinstance(proc, OSError):
      result[host] = str(proc)
      continue
    try:
      out, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      proc.stdout.close()  # a straggler outside the group may hold the pipe open
      proc.wait()
      result[host] = f"no process started within {timeout:g} s"
      continue
    text = out.decode(errors="replace")
    reasons = joblog.Reasons()
    for line in text.splitlines():
      reasons.launcher_line(line)
    if proc.returncode == 0 and not reasons.launcher_failed():
      result[host] = None
    else:
      result[host] = reasons.summary(proc.returncode) + _outside_boxes(text)
  return result


def _outside_boxes(text: str, limit: int = 300) -> str:
  """The lines of launcher output outside its ``-----`` message boxes (e.g. ssh's own error)."""
  lines, inside = [], False
  for line in text.splitlines():
    if line.strip().startswith("-----"):
      inside = not inside
      continue
    if not inside and line.strip():
      lines.append(line.strip())
  extra = " ".join(lines)
  return f"; {extra[:limit]}" if extra else ""


def supervise(opts: Options, sit: Situation, grace: float = GRACE_SECONDS) -> int:
  """Runs the job, restarting it after a failure up to ``opts.max_restarts`` times.

  Every attempt's exit reason is printed (and kept in ``attempts.jsonl`` with
  --log-dir). A clean exit, Ctrl-C/SIGTERM, --timeout and exit status 75
  (preempted) end the job. With --min-ranks, hosts on which a process cannot
  be started are dropped before a restart, and the job goes on with fewer
  ranks while at least --min-ranks remain.

  Returns:
    The exit status of the last attempt.
  """
  become_subreaper()
  relay = joblog.Relay(output_kind(opts, sit), opts.log_dir, opts.tee)
  hosts = hosts_of(opts)
  job_files = JobFiles()
  # Where the ranks say they started and entered init() (a rank that never does is named).
  board = arrivals.start(opts, sit.env, choose_launcher(opts, sit.env) == "srun")
  arrivals.environ_with(board)
  plan = Plan(np=opts.np, job_files=job_files.path, arrivals=board is not None)
  deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
  attempts: list[Attempt] = []
  status = 0
  try:
    with Signals() as signals:
      while True:
        cmd = build_command(opts, sit, plan)
        detail = f" on {host_list(plan.hosts)}" if plan.hosts is not None else ""
        ranks = plan.np or int(sit.env.get("SLURM_NTASKS", "0") or 0)
        relay.begin(plan.attempt, ranks, detail)
        if board is not None:
          board.begin(plan.attempt, ranks)
        _removed_sessions(relay, session_dirs.remove_stale())
        started, t0 = time.time(), time.monotonic()
        outcome = run_launcher(cmd, signals, deadline, grace, relay, opts.timeout)
        _removed(relay, job_files.clean())
        _removed_sessions(relay, session_dirs.remove_stale())
        kind, status = verdict(outcome, relay.reasons)
        reason = "completed" if kind == "ok" else relay.reasons.summary(outcome.status)
        attempt = Attempt(
          plan.attempt,
          plan.np,
          [h for h, _ in plan.hosts]
          if plan.hosts is not None
          else ([h for h, _ in hosts] if hosts else None),
          started,
          time.monotonic() - t0,
          status,
          kind,
          reason,
        )
        attempts.append(attempt)
        relay.record(dataclasses.asdict(attempt))
        if kind == "ok":
          break
        more = plan.attempt < opts.max_restarts
        if kind != "failed" or signals.forwarded or not more:
          if not (opts.doctor and status == DOCTOR_FAILED):  # its report says it all
            relay.note(f"{PROG}: {attempt.line()}")
          if kind == "failed" and signals.forwarded:
            relay.note(
              f"{PROG}: not restarting: the job was sent "
              f"{signal.Signals(signals.forwarded[0]).name}"
            )
          elif kind == "failed" and opts.max_restarts:
            relay.note(
              f"{PROG}: giving up after {plan.attempt} restart(s) (--max-restarts "
              f"{opts.max_restarts})"
            )
          break
        restart = plan.attempt + 1
        wait = backoff_seconds(restart, opts.restart_backoff)
        relay.note(f"{PROG}: {attempt.line()}")
        plan, problem = _next_plan(opts, sit, plan, hosts, relay)
        if problem:
          relay.note(f"{PROG}: not restarting: {problem}")
          break
        if deadline is not None and time.monotonic() + wait > deadline:
          relay.note(f"{PROG}: not restarting: --timeout {opts.timeout:g} s would pass first")
          break
        relay.note(
          f"{PROG}: restart {restart} of {opts.max_restarts} in {wait:g} s "
          f"({RESTART_ENV}={restart})"
        )
        if not _sleep(wait, signals):
          if signals.stop:
            status = 128 + signals.stop[0]
            relay.note(f"{PROG}: got {signal.Signals(signals.stop[0]).name}; not restarting")
          else:
            # The scheduler's warning with nothing running: the last checkpoint is all
            # there is to save, so ask to be requeued from it.
            status = PREEMPTED_EXIT_CODE
            relay.note(
              f"{PROG}: got {signal.Signals(signals.pending[0]).name} before the "
              f"restart; not restarting, exit {PREEMPTED_EXIT_CODE} (preempted)"
            )
          break
  finally:
    if board is not None:
      board.close()
    arrivals.environ_with(None)
    _removed(relay, job_files.close())
    if len(attempts) > 1:
      relay.note(
        f"{PROG}: {len(attempts)} attempts:\n" + "\n".join("  " + a.line() for a in attempts)
      )
    relay.close()
  return status


def _removed(relay: joblog.Relay, paths: list[str]) -> None:
  if paths:
    relay.log(f"{PROG}: removed what the job left in /dev/shm: {' '.join(paths)}")


def _removed_sessions(relay: joblog.Relay, paths: list[str]) -> None:
  if paths:
    relay.log(f"{PROG}: removed session directories of killed launchers: {' '.join(paths)}")


def _next_plan(
  opts: Options,
  sit: Situation,
  plan: Plan,
  hosts: list[tuple[str, int]] | None,
  relay: joblog.Relay,
) -> tuple[Plan, str | None]:
  """The plan of the next attempt; with --min-ranks, hosts that cannot start a process are dropped."""
  nxt = dataclasses.replace(plan, attempt=plan.attempt + 1)
  if opts.min_ranks is None or hosts is None:
    return nxt, None
  current = list(plan.hosts) if plan.hosts is not None else hosts
  checked = preflight(opts, sit, current)
  bad = [h for h, err in checked.items() if err]
  if not bad:
    return nxt, None
  for h in bad:
    relay.note(f"{PROG}: dropping host {h}: it cannot start a process ({checked[h]})")
  left = tuple((h, s) for h, s in current if h not in bad)
  slots = sum(s for _, s in left)
  n = min(plan.np or slots, slots)
  if n < opts.min_ranks:
    return nxt, (
      f"{slots} slot(s) left on {host_list(left) or 'no host'}, fewer than "
      f"--min-ranks {opts.min_ranks}"
    )
  relay.note(f"{PROG}: going on with {n} ranks on {host_list(left)}")
  return dataclasses.replace(nxt, np=n, hosts=left), None


def _sleep(seconds: float, signals: Signals) -> bool:
  """Sleeps; False as soon as a stopping or a to-be-forwarded signal arrives."""
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    if signals.stop or signals.pending:
      return False
    time.sleep(min(0.05, max(0.0, end - time.monotonic())))
  return not (signals.stop or signals.pending)

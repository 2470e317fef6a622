"""How the test suite starts MPI jobs: always bounded by a timeout."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def mpirun_command(
  n: int, devices_per_process: int = 1, wrap: bool = True, timeout: float | None = None
) -> list[str]:
  """The command prefix that starts ``n`` ranks with ``mpijax-run``."""
  return (
    [
      sys.executable,
      "-m",
      "mpijax.launch",
      "-n",
      str(n),
      "--devices-per-process",
      str(devices_per_process),
    ]
    + ([] if wrap else ["--no-wrap"])
    + ([] if timeout is None else ["--timeout", str(int(timeout))])
    + ["--"]
  )


def run_mpi(
  n: int,
  argv: list[str],
  *,
  devices_per_process: int = 1,
  timeout: float = 300,
  env: dict[str, str] | None = None,
  cwd: Path | None = None,
  wrap: bool = True,
) -> tuple[subprocess.CompletedProcess, float]:
  """Runs ``argv`` on ``n`` ranks; returns the result and the wall time.

  ``wrap=False`` runs a Python program without the ``python -m mpijax`` wrapper.

  The job gets its own process group so a timeout kills every rank.
  """
  full_env = dict(os.environ)
  full_env.update(env or {})
  full_env["MPIJAX_DEVICES_PER_PROCESS"] = str(devices_per_process)
  # mpijax-run's own --timeout stops every rank (they run in other sessions than
  # ours); our timeout below is only the backstop.
  cmd = mpirun_command(n, devices_per_process, wrap, timeout) + argv
  return _bounded(cmd, full_env, cwd or REPO, timeout + 30)


def run_shell(
  command: str, cwd: Path, *, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float]:
  """Runs a documented command line as written (``bash -c``) in ``cwd``; the result and wall time.

  ``mpijax-run`` and ``python`` are this interpreter's (its ``bin`` first on
  PATH, as in an activated virtualenv). Bounded by ``timeout``; nothing may
  be left in /dev/shm (see :func:`run_mpi`).
  """
  full_env = dict(os.environ)
  full_env.update(env or {})
  full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env.get("PATH", "")
  result, seconds = _bounded(["bash", "-c", command], full_env, cwd, timeout)
  return subprocess.CompletedProcess(command, result.returncode, result.stdout, ""), seconds


def _bounded(
  cmd: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> tuple[subprocess.CompletedProcess, float]:
  """Runs ``cmd`` in its own session, killed after ``timeout``; output and stderr together."""
  shm_before = _shm_files()
  start = time.monotonic()
  proc = subprocess.Popen(
    cmd,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=str(cwd),
    start_new_session=True,
  )
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 15)  # mpijax-run forwards SIGTERM and kills every rank after 5 s
    try:
      out, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      out, _ = proc.communicate()
    out += f"\n[tests] killed after the {timeout}s timeout\n"
    proc.returncode = -9
  seconds = time.monotonic() - start
  # mpijax unlinks its shared-memory files as soon as every rank has mapped
  # them: however a job ends, none may be left behind.
  left = _shm_files() - shm_before
  assert not left, f"shared-memory files left behind: {sorted(left)}\n{tail(out)}"
  return subprocess.CompletedProcess(cmd, proc.returncode, out, ""), seconds


# How a job that was stopped for running too long ends: mpijax-run's --timeout
# (like timeout(1)), or run_mpi's own backstop kill.
TIMED_OUT = (124, -9)


def assert_failed_without_hanging(returncode: int, out: str) -> None:
  """The job ended non-zero by itself: a timeout (a hang) fails the test too."""
  assert returncode != 0, f"the job succeeded, expected a failure:\n{tail(out)}"
  assert returncode not in TIMED_OUT and "job exceeded --timeout" not in out, (
    f"the job hung until its timeout (exit {returncode}), expected a failure:\n{tail(out)}"
  )


def _shm_files() -> set[str]:
  return set(glob.glob("/dev/shm/mpijax-*"))


def tail(text: str, lines: int = 80) -> str:
  return "\n".join(text.splitlines()[-lines:])


# Lines for the session's terminal summary: the counts of the pytest runs inside
# MPI jobs (tests/test_multirank.py), which the outer run does not collect.
INNER_RUNS = pytest.StashKey[list]()


def inner_counts(out: str) -> dict[int, str]:
  """Each rank's pytest summary ("310 passed, 2 skipped") from a job's rank-tagged output."""
  from mpijax._src.run.joblog import split_tag

  found = {}
  for line in out.splitlines():
    for kind in ("openmpi", "mpich", "srun"):
      rank, text = split_tag(kind, line.encode())
      if rank is not None:
        break
    m = _SUMMARY.match(text.decode(errors="replace"))
    if rank is not None and m:
      found[rank] = m.group(1)
  return found


_SUMMARY = re.compile(r"^=* ?((?:\d+ \w+(?:, )?)+) in [\d.]+s")


def inner_summary(what: str, out: str) -> str:
  """One line of ``what``'s count: one figure when every rank says the same."""
  counts = inner_counts(out)
  if not counts:
    return f"{what}: no pytest summary in the job's output"
  if len(set(counts.values())) == 1:
    ranks = "1 rank" if len(counts) == 1 else f"on each of {len(counts)} ranks"
    return f"{what}: {next(iter(counts.values()))} ({ranks})"
  return f"{what}: " + "; ".join(f"rank {r} {c}" for r, c in sorted(counts.items()))


# Long or redundant runs kept out of CI (25 minutes at most); MPIJAX_TEST_SLOW=1 runs them.
SLOW = [
  pytest.mark.slow,
  pytest.mark.skipif(
    os.environ.get("MPIJAX_TEST_SLOW") != "1",
    reason="long or covered by a faster test: set MPIJAX_TEST_SLOW=1",
  ),
]

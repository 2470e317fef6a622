"""One rank's uncaught exception ends the whole job quickly, naming the rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from mpijax._src.run import session_dirs
from tests._launch import REPO
from tests._launch import assert_failed_without_hanging
from tests._launch import run_mpi
from tests._launch import tail


def _no_leftovers(script: str) -> list[str]:
  """Processes still running this checkout's script (by its full path: another
  checkout on the same machine may run the same test)."""
  path = str(REPO / "tests" / "scripts" / script)
  out = subprocess.run(["pgrep", "-af", path], capture_output=True, text=True).stdout
  return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize(
  "script,wrapped",
  [
    ("fail_rank2.py", False),  # only the hook that mpijax.init() installs
    ("fail_rank2_noinit.py", True),  # mpijax-run's python -m mpijax wrapper
  ],
)
def test_rank_2_raises_and_the_job_aborts(script, wrapped):
  path = str(REPO / "tests" / "scripts" / script)
  result, seconds = run_mpi(4, [sys.executable, path], timeout=120, wrap=wrapped)
  out = result.stdout
  assert_failed_without_hanging(result.returncode, out)
  assert seconds < 90, f"took {seconds:.0f}s"
  assert "rank 2/4" in out and "deliberate failure on rank 2" in out, tail(out)
  assert "passed the barrier" not in out, tail(out)
  assert not _no_leftovers(script), _no_leftovers(script)


def test_exit_with_collectives_in_flight():
  path = str(REPO / "tests" / "scripts" / "exit_inflight.py")
  result, seconds = run_mpi(4, [sys.executable, path], timeout=120)
  assert result.returncode == 0, tail(result.stdout)
  assert result.stdout.count("dispatched") == 4, tail(result.stdout)
  assert not _no_leftovers("exit_inflight.py")


def test_uneven_local_device_counts_are_refused_on_every_rank():
  path = str(REPO / "tests" / "scripts" / "uneven_devices.py")
  result, seconds = run_mpi(4, [sys.executable, path], timeout=120)
  out = result.stdout
  assert_failed_without_hanging(result.returncode, out)
  assert "were not caught" not in out, tail(out)
  # Every rank that reached the check names the odd rank and the fix.
  assert "rank 1 has 2" in out and "MPIJAX_DEVICES_PER_PROCESS" in out, tail(out)
  assert not _no_leftovers("uneven_devices.py")


def _run_split(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
  """``mpijax-run ARGV`` with stdout and stderr apart (what a terminal shows on each)."""
  cmd = [sys.executable, "-m", "mpijax.launch", "--timeout", str(timeout), *argv]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, cwd=str(REPO))


@pytest.mark.parametrize(
  "script,first",
  [
    # Every rank raises it: one block, from whichever rank came first.
    (
      "save_twice.py",
      r"\[rank(\d)\]: mpijax: uncaught OSError on rank \1/4, aborting the job "
      r"\(exit code 1\): mpijax\.save\('.*/ckpt'\) failed on rank 0: "
      r"FileExistsError: '.*/ckpt' exists; pass overwrite=True",
    ),
    # One rank raises, the others are torn down waiting for it.
    (
      "fail_rank2.py",
      r"\[rank2\]: mpijax: uncaught ValueError on rank 2/4, aborting the job "
      r"\(exit code 1\): deliberate failure on rank 2$",
    ),
  ],
)
def test_a_one_line_error_is_one_block_of_at_most_15_lines(script, first):
  result = _run_split(["-n", "4", "--", sys.executable, str(REPO / "tests" / "scripts" / script)])
  err = result.stderr.splitlines()
  assert_failed_without_hanging(result.returncode, result.stdout + result.stderr)
  # The rank, the exception and its message first; Open MPI's and JAX's noise is gone.
  assert re.match(first, err[0]), result.stderr
  assert len(err) <= 15, result.stderr
  assert err[-1].startswith("mpijax-run: attempt 0: 4 ranks"), result.stderr
  assert "MPI_ABORT" not in result.stderr and "prterun" not in result.stderr, result.stderr
  assert not result.stdout.strip(), result.stdout
  if script == "save_twice.py":
    assert "(ranks 0-3 alike)" in err[-1], err[-1]


def test_a_job_whose_launcher_was_killed_leaves_no_shared_memory_file():
  # mpirun's launcher removes Open MPI's segment files and its session directory
  # at the job's end; killed, it cannot: mpijax-run removes them (each rank noted
  # its files; the session directory is named after the launcher's process id).
  cmd = [
    sys.executable,
    "-m",
    "mpijax.launch",
    "--timeout",
    "120",
    "-n",
    "2",
    "--",
    sys.executable,
    str(REPO / "tests" / "scripts" / "segments_then_wait.py"),
  ]
  proc = subprocess.Popen(
    cmd,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=str(REPO),
    start_new_session=True,
  )
  try:
    segments = None
    for line in proc.stdout:
      if "segments " in line:
        segments = json.loads(line.split("segments ", 1)[1])
        break
    assert segments and all(os.path.exists(p) for p in segments), segments
    launchers = [p for p in _children(proc.pid) if _name(p) in ("prterun", "mpirun", "mpiexec")]
    assert len(launchers) == 1, [(p, _name(p)) for p in _children(proc.pid)]
    os.kill(launchers[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode != 0, out
  assert not [p for p in segments if os.path.exists(p)], (segments, out)
  session = os.path.join(session_dirs.tmp_base(), f"ompi.{launchers[0]}")
  assert not os.path.exists(session), (session, out)


def _children(pid: int) -> list[int]:
  out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
  return [int(p) for p in out.split()]


def _name(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/comm") as f:
      return f.read().strip()
  except OSError:
    return ""

"""One rank's uncaught exception ends the whole job quickly, naming the rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("script,wrapped", [
    ("fail_rank2.py", False),        # only the hook that mpijax.init() installs
    ("fail_rank2_noinit.py", True),  # mpijax-run's python -m mpijax wrapper
])
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

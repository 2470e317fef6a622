"""Runs the ``tests/mpi`` suite inside real MPI jobs (bounded by timeouts)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests._launch import run_mpi, tail

# (ranks, CPU devices per rank, environment). 4 ranks on 2 cores is slow: keep
# tests/mpi lean. Every multi-rank config runs with JAX's distributed runtime
# (the default: XLA's own collectives over MPI with one device per rank, gloo
# with two); one runs without it, as mpijax alone.
CONFIGS = [
    pytest.param(4, 1, {}, id="4ranks-x-1dev"),
    pytest.param(2, 2, {}, id="2ranks-x-2dev"),
    # Not a power of two: uneven ring segments, no exact division in the mean.
    pytest.param(3, 1, {}, id="3ranks-x-1dev"),
    pytest.param(1, 1, {}, id="1rank"),
    pytest.param(2, 1, {"MPIJAX_JAX_DISTRIBUTED": "0"}, id="2ranks-without-jax-distributed"),
]


@pytest.mark.parametrize("ranks,devices,env", CONFIGS)
def test_mpi_suite(ranks, devices, env):
  # As users of MPI Python projects run their suites: pytest-mpi's --with-mpi on every rank.
  argv = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-x", "-p", "no:cacheprovider", "--color=no",
          # fd 2 uncaptured: a stall report printed by the C++ side reaches the log.
          "--capture=sys",
          "-W", "ignore::DeprecationWarning", "tests/mpi"]
  select = os.environ.get("MPIJAX_TEST_SELECT")  # e.g. "-k allreduce" for local work
  if select:
    argv += select.split()
  result, seconds = run_mpi(ranks, argv, devices_per_process=devices, timeout=900,
                            env={"MPIJAX_TIMEOUT": "120", **env})
  print(tail(result.stdout, 400))
  assert result.returncode == 0, (
      f"tests/mpi failed under {ranks} ranks x {devices} devices {env} "
      f"(exit {result.returncode}, {seconds:.0f}s):\n{tail(result.stdout)}")
  # Every rank must have run tests, not skipped them all.
  summaries = re.findall(r"(\d+) passed", result.stdout)
  assert len(summaries) >= ranks and min(int(n) for n in summaries) > 0, tail(result.stdout)
  assert "need --with-mpi" not in result.stdout, tail(result.stdout)

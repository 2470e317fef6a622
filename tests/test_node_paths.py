"""The node-local all-reduce by cross-memory attach, and its fallback.

Each test starts a small bounded 2-rank job running tests/scripts/cma_paths.py,
which checks its all-reduces against NumPy and prints the paths it took.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest

from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import tail

SCRIPTS = REPO / "tests" / "scripts"


def _paths(out: str) -> dict[int, str]:
  return {int(r): p for r, p in re.findall(r"rank (\d) paths (\[[-\d, ]*\])", out)}


def test_ranks_on_one_node_reduce_by_cross_memory_attach():
  result, _ = run_mpi(2, [sys.executable, str(SCRIPTS / "cma_paths.py")], timeout=120)
  assert result.returncode == 0, tail(result.stdout)
  assert _paths(result.stdout) == {0: "[2]", 1: "[2]"}, tail(result.stdout)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a PID namespace per rank needs root and util-linux's unshare")
def test_a_rank_in_another_pid_namespace_turns_cross_memory_attach_off():
  # Rank 1's process id means another process (or none) to rank 0: the probe
  # must find that out, on both ranks, and the all-reduces run through shared
  # memory and the ring instead -- with the right results.
  result, _ = run_mpi(2, ["sh", str(SCRIPTS / "pid_namespace_rank1.sh"), sys.executable,
                          str(SCRIPTS / "cma_paths.py")], timeout=120, wrap=False)
  assert result.returncode == 0, tail(result.stdout)
  assert _paths(result.stdout) == {0: "[1]", 1: "[1]"}, tail(result.stdout)


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_cpp_api_reduces_on_a_plain_communicator(ranks):
  # node_local::Allreduce, as a library outside mpijax's handlers calls it:
  # every path is taken where it should be, and every result is right.
  result, _ = run_mpi(ranks, [sys.executable, str(SCRIPTS / "node_allreduce_api.py")],
                      timeout=180)
  assert result.returncode == 0, tail(result.stdout)
  want = "[1, 1, 1, 2, 2, 2, 2, 2, 2, 1, 1, 1, 0, 0, 0, 1, 2]"
  assert _paths(result.stdout) == {r: want for r in range(ranks)}, tail(result.stdout)

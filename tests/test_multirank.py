"""Runs the ``tests/mpi`` suite inside real MPI jobs (bounded by timeouts)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests._launch import INNER_RUNS
from tests._launch import inner_summary
from tests._launch import run_mpi
from tests._launch import tail

# (ranks, CPU devices per rank, environment, test files). 4 ranks on 2 cores
# is slow: 4 x 1 runs the rank-level files (maps, point-to-point and rooted
# ops, checks, JAX's own arrays); the files about several devices per rank,
# the guides, the docs' recipes and training run at 2 x 2 (the training
# files' 4-rank jobs are tests/test_train_jobs.py, tests/test_restart.py and
# the docs' examples); 3 x 1 runs mpijax's ops, the ring's uneven case, and
# the timeline. Every multi-rank config runs with JAX's distributed runtime
# (the default: XLA's own collectives over MPI, each (rank, local device) a
# member of XLA's communicators) except one, mpijax alone.
ALL = ["tests/mpi"]
# At 2 x 2: what several devices per rank change (mapping, device paths,
# global arrays and JAX's own arrays, the guides, checks, training).
DEVICES = [
  "tests/mpi/test_collectives.py",
  "tests/mpi/test_ops_multidevice.py",
  "tests/mpi/test_device_allreduce.py",
  "tests/mpi/test_global_array.py",
  "tests/mpi/test_jax_arrays.py",
  "tests/mpi/test_guide_sharded.py",
  "tests/mpi/test_guide_multiprocess.py",
  "tests/mpi/test_docs_global_arrays.py",
  "tests/mpi/test_readme.py",
  "tests/mpi/test_runtime.py",
  "tests/mpi/test_checks.py",
  "tests/mpi/test_train.py",
  "tests/mpi/test_train_state.py",
  "tests/mpi/test_train_overlap.py",
  "tests/mpi/test_timeline.py",
  "tests/mpi/test_stragglers.py",
]
# At 4 x 1, all but these: their 2 x 2 run covers them, and mpijax's own
# rank-level ops (test_ops.py) run at 3 x 1, the uneven case, on more ranks
# than cores as at 4 x 1.
NOT_AT_4 = [
  "tests/mpi/test_ops.py",
  "tests/mpi/test_ops_multidevice.py",
  "tests/mpi/test_device_allreduce.py",
  "tests/mpi/test_guide_sharded.py",
  "tests/mpi/test_guide_multiprocess.py",
  "tests/mpi/test_docs_global_arrays.py",
  "tests/mpi/test_readme.py",
  "tests/mpi/test_train.py",
  "tests/mpi/test_train_state.py",
  "tests/mpi/test_train_overlap.py",
]
CONFIGS = [
  pytest.param(4, 1, {}, ALL + [f"--ignore={f}" for f in NOT_AT_4], id="4ranks-x-1dev"),
  pytest.param(2, 2, {}, DEVICES, id="2ranks-x-2dev"),
  # Not a power of two: uneven ring segments, no exact division in the mean.
  pytest.param(
    3, 1, {}, ["tests/mpi/test_ops.py", "tests/mpi/test_timeline.py"], id="3ranks-x-1dev"
  ),
  pytest.param(
    1,
    1,
    {},
    ["tests/mpi/test_runtime.py", "tests/mpi/test_collectives.py", "tests/mpi/test_timeline.py"],
    id="1rank",
  ),
  pytest.param(
    2,
    1,
    {"MPIJAX_JAX_DISTRIBUTED": "0"},
    ["tests/mpi/test_runtime.py", "tests/mpi/test_jax_mixed.py", "tests/mpi/test_readme.py"],
    id="2ranks-without-jax-distributed",
  ),
]


@pytest.mark.parametrize("ranks,devices,env,files", CONFIGS)
def test_mpi_suite(ranks, devices, env, files, pytestconfig):
  # As users of MPI Python projects run their suites: pytest-mpi's --with-mpi on every rank.
  argv = [
    sys.executable,
    "-m",
    "pytest",
    "--with-mpi",
    "-q",
    "-x",
    "-p",
    "no:cacheprovider",
    "--color=no",
    # fd 2 uncaptured: a stall report printed by the C++ side reaches the log.
    "--capture=sys",
    "-W",
    "ignore::DeprecationWarning",
    *files,
  ]
  select = os.environ.get("MPIJAX_TEST_SELECT")  # e.g. "-k allreduce" for local work
  if select:
    argv += select.split()
  result, seconds = run_mpi(
    ranks, argv, devices_per_process=devices, timeout=900, env={"MPIJAX_TIMEOUT": "120", **env}
  )
  print(tail(result.stdout, 400))
  what = (
    f"tests/mpi at {ranks}x{devices}"
    + (f" ({len(files)} files)" if files[0] != ALL[0] else "")
    + "".join(f", {k}={v}" for k, v in env.items())
  )
  pytestconfig.stash.setdefault(INNER_RUNS, []).append(
    inner_summary(what, result.stdout) + f", {seconds:.0f} s"
  )
  assert result.returncode == 0, (
    f"tests/mpi failed under {ranks} ranks x {devices} devices {env} "
    f"(exit {result.returncode}, {seconds:.0f}s):\n{tail(result.stdout)}"
  )
  # Every rank must have run tests, not skipped them all.
  summaries = re.findall(r"(\d+) passed", result.stdout)
  assert len(summaries) >= ranks and min(int(n) for n in summaries) > 0, tail(result.stdout)
  assert "need --with-mpi" not in result.stdout, tail(result.stdout)

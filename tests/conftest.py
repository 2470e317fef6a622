"""Test layout.

* ``tests/unit``: plain pytest, no MPI.
* ``tests/mpi``: MPI tests (pytest-mpi's ``mpi`` marker, set by
  ``tests/mpi/conftest.py``), run with ``--with-mpi`` on every rank of an
  MPI job, e.g. ``mpirun -n 4 python -m pytest --with-mpi tests/mpi``.
  ``tests/test_multirank.py`` starts them that way under ``mpijax-run`` with
  4 ranks x 1 device, 2 ranks x 2 devices, 3 ranks and 1 rank, each bounded
  by a timeout, and the session's summary gives each job's own count. A run
  without ``--with-mpi`` (``python -m pytest tests``) does not collect them,
  unless named (then pytest-mpi skips them, saying why).
* ``tests/system``: real Slurm and multi-host (network namespace) runs; need root.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests._launch import INNER_RUNS
from tests._launch import run_shell

# The README's main job, as printed there.
MAIN_JOB = "mpijax-run -n 4 -- python -m mpijax.examples.digits"

_MPI_SUITE = Path(__file__).resolve().parent / "mpi"


def pytest_ignore_collect(collection_path, config):
  """Outside an MPI job tests/mpi only counts skips: it runs inside test_multirank's jobs."""
  if config.getoption("with_mpi", default=False) or collection_path.resolve() != _MPI_SUITE:
    return None
  named = [Path(a.split("::")[0]).resolve() for a in config.args]
  return True if not any(p == _MPI_SUITE or _MPI_SUITE in p.parents for p in named) else None


def pytest_terminal_summary(terminalreporter, config):
  runs = config.stash.get(INNER_RUNS, [])
  if runs:
    terminalreporter.section("tests/mpi inside the MPI jobs (each job's own count)")
    for line in runs:
      terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def digits_4_ranks(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
  """The README's main job, run once per session as written (MAIN_JOB, in a directory of
  its own): the digits example on 4 ranks, its default 12 epochs, uninterrupted; (its
  output directory runs/digits, the finished job).

  tests/test_main_job.py checks it and resumes it; tests/test_restart.py compares a
  job killed and restarted at 4 ranks with it; tests/test_docs.py goes on from it.
  """
  cwd = tmp_path_factory.mktemp("digits-4-ranks")
  result, _ = run_shell(MAIN_JOB, cwd, timeout=300)
  return cwd / "runs" / "digits", result

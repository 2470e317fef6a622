"""Test layout.

* ``tests/unit``: plain pytest, no MPI.
* ``tests/mpi``: runs *inside* an MPI job; ``tests/test_multirank.py`` starts
  it under ``mpijax-run`` with 4 ranks x 1 device, 2 ranks x 2 devices and 1
  rank, each bounded by a timeout.
* ``tests/system``: real Slurm and multi-host (network namespace) runs; need root.
"""

from __future__ import annotations

import os
from pathlib import Path

INSIDE_MPI = os.environ.get("MPIJAX_TEST_INSIDE_MPI") == "1"
_HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path, config):
  path = Path(collection_path).resolve()
  in_mpi_dir = _HERE / "mpi" in (path, *path.parents)
  if INSIDE_MPI:
    # Inside the MPI job only the MPI suite runs.
    return None if (in_mpi_dir or path == _HERE or path == _HERE / "mpi") else True
  return True if in_mpi_dir else None

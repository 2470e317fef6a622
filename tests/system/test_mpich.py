"""The runtime under MPICH's Hydra `mpiexec` (the `mpich` wheel), in its own venv.

The main environment uses the Open MPI wheel; MPICH's wheel installs its own
`mpicc`/`mpiexec` over the same names, so this test builds a separate virtual
environment with `mpich`, `mpi4py` and `jax` and runs mpijax from the source
tree there. Needs the package registry (pip); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests._launch import REPO, tail

pytestmark = pytest.mark.mpich

VENV = Path(os.environ.get("MPIJAX_TEST_MPICH_VENV", Path(tempfile.gettempdir()) / "mpijax-venv-mpich"))


def _venv() -> Path:
  py = VENV / "bin" / "python"
  if not (VENV / "bin" / "mpiexec").exists():
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "mpich", "mpi4py", "jax", "numpy"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
      pytest.skip(f"could not install mpich/mpi4py/jax into a venv: {tail(r.stderr, 10)}")
  return py


def test_init_under_mpich_mpiexec(tmp_path):
  py = _venv()
  # Each rank writes its own file: Hydra merges the ranks' stdout without tags.
  code = ("import mpijax, os, sys; rt = mpijax.init(); t = rt.topology; "
          "open(os.path.join(sys.argv[1], f'rank{t.rank}'), 'w').write(' '.join(map(str, ["
          "t.rank, t.size, t.local_rank, t.local_size, t.node_count, t.launcher, "
          "t.coordinator_address])))")
  env = dict(os.environ, PYTHONPATH=str(REPO))
  for var in list(env):  # our own mpirun's variables must not leak into Hydra's job
    if var.startswith(("OMPI_", "PMIX_", "PRTE_")):
      del env[var]
  r = subprocess.run(["timeout", "120", str(VENV / "bin" / "mpiexec"), "-n", "4", str(py), "-c", code,
                      str(tmp_path)], capture_output=True, text=True, env=env, cwd=str(REPO),
                     timeout=180)
  assert r.returncode == 0, tail(r.stdout + r.stderr)
  rows = [(tmp_path / f"rank{i}").read_text().split() for i in range(4)]
  for i, row in enumerate(rows):
    assert row[0] == str(i) and row[1] == "4" and row[3] == "4" and row[4] == "1", row
    assert row[5] == "mpich", row
  assert sorted(int(row[2]) for row in rows) == [0, 1, 2, 3]
  assert len({row[6] for row in rows}) == 1  # one coordinator, the same everywhere

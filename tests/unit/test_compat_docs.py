"""docs/mpi4jax.md lists every deviation of mpi4jax's suite and every function, and
its shim, installed with mpijax, runs a program written for mpi4jax unchanged."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "compat"))

from mpi4jax_deviations import DEVIATIONS  # noqa: E402
from mpi4jax_deviations import deviation  # noqa: E402

DOC = (REPO / "docs" / "mpi4jax.md").read_text()


def _public_names() -> list[str]:
  tree = ast.parse((REPO / "mpijax" / "compat" / "mpi4jax.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
      getattr(t, "id", "") == "__all__" for t in node.targets
    ):
      return list(ast.literal_eval(node.value))
  raise AssertionError("mpijax/compat/mpi4jax.py has no __all__")


def test_every_deviation_is_documented():
  missing = [key for key in DEVIATIONS if f"`{key}`" not in DOC and f"`{key}` (" not in DOC]
  assert not missing, f"docs/mpi4jax.md does not list: {missing}"


def test_every_function_is_in_the_table():
  missing = [name for name in _public_names() if f"`{name}(" not in DOC]
  assert not missing, f"docs/mpi4jax.md's table lacks: {missing}"


def test_deviation_matching():
  assert deviation("tests/test_validation.py::test_enforce_types")
  assert deviation("tests/test_jax_compat.py::test_versiontuple[0.1.61]")
  assert deviation("tests/collective_ops/test_sendrecv.py::test_sendrecv_jacfwd")
  assert deviation("tests/collective_ops/test_sendrecv.py::test_sendrecv_jacrev") is None
  assert deviation("tests/collective_ops/test_common.py::test_deadlock_on_exit") is None


PROGRAM = """
import jax.numpy as jnp
from mpi4py import MPI
import mpi4jax  # unchanged: mpijax's shim comes first on PYTHONPATH
print(mpi4jax.__name__, float(mpi4jax.allreduce(jnp.float32(2), op=MPI.SUM)))
"""


def test_the_installed_shim_runs_an_mpi4jax_program_unchanged(tmp_path):
  found = subprocess.run(
    [sys.executable, "-m", "mpijax.compat.shim"],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=tmp_path,
  )
  assert found.returncode == 0 and found.stderr == "", found.stderr
  shim = pathlib.Path(found.stdout.strip())
  # In the package (a wheel has it), not in the repository's tests.
  assert shim.parts[-3:] == ("mpijax", "compat", "shim") and (shim / "mpi4jax.py").is_file()
  (tmp_path / "prog.py").write_text(PROGRAM)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
  out = subprocess.run(
    [sys.executable, "prog.py"],
    capture_output=True,
    text=True,
    timeout=180,
    cwd=tmp_path,
    env={**env, "PYTHONPATH": str(shim), "MPIJAX_LAUNCHER": "single"},
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout == "mpijax.compat.mpi4jax 2.0\n", out.stdout + out.stderr

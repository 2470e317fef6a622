"""docs/mpi4jax.md lists every deviation of mpi4jax's suite and every function."""

from __future__ import annotations

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "compat"))

from mpi4jax_deviations import DEVIATIONS  # noqa: E402
from mpi4jax_deviations import deviation  # noqa: E402

DOC = (REPO / "docs" / "mpi4jax.md").read_text()


def _public_names() -> list[str]:
  tree = ast.parse((REPO / "mpijax" / "compat" / "mpi4jax.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                             for t in node.targets):
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

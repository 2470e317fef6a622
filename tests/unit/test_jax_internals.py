"""Every JAX internal mpijax uses is imported in ``mpijax/_src/jax_compat.py``, each
with a comment saying why, and nowhere else: a JAX upgrade touches one file."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpijax"
COMPAT = PACKAGE / "_src" / "jax_compat.py"


def _is_internal(name: str | None) -> bool:
  return name is not None and (name == "jax._src" or name.startswith("jax._src."))


def internal_uses(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, what) of every way ``path`` reaches into ``jax._src``."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom):
      if _is_internal(node.module):
        found.append((node.lineno, f"from {node.module} import ..."))
      elif node.module == "jax" and any(a.name == "_src" for a in node.names):
        found.append((node.lineno, "from jax import _src"))
    elif isinstance(node, ast.Import):
      found += [(node.lineno, f"import {a.name}") for a in node.names if _is_internal(a.name)]
    elif isinstance(node, ast.Attribute) and node.attr == "_src":
      if isinstance(node.value, ast.Name) and node.value.id == "jax":
        found.append((node.lineno, "jax._src"))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if _is_internal(node.value):  # importlib.import_module("jax._src...")
        found.append((node.lineno, repr(node.value)))
  return found


def test_no_module_but_jax_compat_reaches_into_jax_internals():
  offenders = [
    f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
    for path in sorted(PACKAGE.rglob("*.py"))
    if path != COMPAT
    for line, what in internal_uses(path)
  ]
  assert not offenders, (
    "import JAX internals in mpijax/_src/jax_compat.py (with a comment line saying why) "
    "and take them from there:\n" + "\n".join(offenders)
  )


def test_jax_compat_says_why_it_imports_each_internal():
  lines = COMPAT.read_text().splitlines()
  tree = ast.parse(COMPAT.read_text())
  imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and _is_internal(n.module)]
  assert imports, "jax_compat.py imports no JAX internal at module level"
  unexplained = [
    lines[n.lineno - 1]
    for n in imports
    if n.lineno < 2 or not lines[n.lineno - 2].lstrip().startswith("# ")
  ]
  assert not unexplained, "a comment line above each says why:\n" + "\n".join(unexplained)
  # At module level only, so that the list of internals is this file's import block.
  nested = [
    n.lineno
    for n in ast.walk(tree)
    if isinstance(n, ast.ImportFrom) and _is_internal(n.module) and n not in imports
  ]
  assert not nested, f"jax_compat.py imports JAX internals inside functions at lines {nested}"


def test_the_check_finds_each_kind_of_use(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text(
    "import jax._src.core\nfrom jax._src import pjit\nfrom jax import _src\n"
    "import jax\nx = jax._src.xla_bridge\nimportlib.import_module('jax._src.mesh')\n"
    "from jax.extend import core\n"
  )
  assert [line for line, _ in internal_uses(probe)] == [1, 2, 3, 5, 6]

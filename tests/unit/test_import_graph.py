"""The modules of mpijax/ import each other without a cycle, and downwards only.

Every import in a file counts, also one inside a function: a function-local
import that breaks a cycle at run time still ties the two modules together.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpijax"


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = path
  return mods


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
  """The mpijax modules whose code ``name`` uses: each module a name is taken from."""
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
      # `from p import m` uses module p.m; `from p import name` uses p itself.
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in mods:
        target = target.rpartition(".")[0]
      if target.startswith("mpijax") and target != name:
        found.add(target)
  return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(m: str) -> list[str] | None:
    state[m] = 1
    path.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        return path[path.index(n):] + [n]
      if n not in state and (found := visit(n)):
        return found
    state[m] = 2
    path.pop()
    return None

  for m in sorted(graph):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_the_checker_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_mpijax_has_no_import_cycle():
  mods = _modules()
  assert "mpijax._src.runtime" in mods, sorted(mods)
  graph = {name: _imports(name, path, mods) for name, path in mods.items()}
  cycle = _cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_private_modules_import_only_private_modules():
  mods = _modules()
  public = {m for m in mods if not m.startswith("mpijax._src")}
  upward = {name: sorted(_imports(name, path, mods) & public)
            for name, path in mods.items() if name.startswith("mpijax._src.")}
  assert not any(upward.values()), {k: v for k, v in upward.items() if v}

"""The modules of mpijax/ import each other without a cycle, and downwards only:
each has a layer of docs/architecture.md, and imports its own layer and those below.

Every import in a file counts, also one inside a function: a function-local
import that breaks a cycle at run time still ties the two modules together.
"""

from __future__ import annotations

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "mpijax"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# docs/architecture.md's table of layers, from the ground up, as data. A module
# imports modules of its own layer and of the layers below. Paths are under
# mpijax/; one ending in "/" is a directory. A new module goes into a row here
# and in the table (test_the_table_in_the_docs_is_this_one).
LAYERS: dict[str, list[str]] = {
  "base": [
    "_src/config.py",
    "_src/config_table.py",
    "_src/log.py",
    "_src/jax_compat.py",
    "_src/mpi_util.py",
    "_src/fileio.py",
    "_src/heap.py",
    "_src/tree_codec.py",
  ],
  "environment": ["_src/cluster/"],
  "extension": ["_src/ffi/"],
  "runtime": ["_src/guards/", "_src/timeline/", "_src/xla/", "_src/runtime/"],
  "transport": ["_src/ops/"],
  "collectives": ["_src/collectives/"],
  "sharding": ["_src/sharding/"],
  "training": ["_src/train/"],
  "mpi4jax's API": ["_src/compat/"],
  "entry points": ["_src/run/", "_src/doctor/"],
  "public API": [
    "__init__.py",
    "lax.py",
    "ops.py",
    "train.py",
    "timeline.py",
    "compat/",
    "launch.py",
    "__main__.py",
  ],
  "examples": ["examples/"],
}
# The private package's empty marker: it holds and imports nothing.
UNPLACED = {"mpijax._src"}
# At most this many modules directly in _src/ (the base layer): the rest live in
# one folder per layer (or per part of one).
FLAT_AT_MOST = 10
# Files that load mpijax modules by path, not by import: scripts that must not run
# mpijax/__init__.py (the bridge's build check, the interpreter-start hook). Their
# loads count as imports here; a new one must be listed (test_every_load_by_path_is_known).
LOADS_BY_PATH: dict[str, list[str]] = {
  "_src/ffi/bridge/check_bridge.py": ["_src/ffi/bridge_env.py"],
  "_src/ffi/bridge/_mpijax_startup.py": ["_src/config.py", "_src/ffi/bridge_env.py"],
}


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = path
  return mods


def _module_name(rel: str) -> str:
  """``_src/config.py`` -> ``mpijax._src.config``."""
  parts = ["mpijax", *pathlib.PurePosixPath(rel).with_suffix("").parts]
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
  """The mpijax modules whose code ``name`` uses: each module a name is taken from,
  and each it loads by path (LOADS_BY_PATH)."""
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  rel = path.relative_to(PACKAGE).as_posix()
  found = {_module_name(p) for p in LOADS_BY_PATH.get(rel, [])}
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
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
        return path[path.index(n) :] + [n]
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
  assert "mpijax._src.runtime.state" in mods, sorted(mods)
  graph = {name: _imports(name, path, mods) for name, path in mods.items()}
  cycle = _cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_private_modules_import_only_private_modules():
  mods = _modules()
  public = {m for m in mods if not m.startswith("mpijax._src")}
  upward = {
    name: sorted(_imports(name, path, mods) & public)
    for name, path in mods.items()
    if name.startswith("mpijax._src.")
  }
  assert not any(upward.values()), {k: v for k, v in upward.items() if v}


# --- layers ---------------------------------------------------------------------------


def _layer_of(path: pathlib.Path) -> list[int]:
  """The index of every layer whose paths cover ``path`` (one, if the table is right)."""
  rel = path.relative_to(PACKAGE).as_posix()
  return [
    i
    for i, paths in enumerate(LAYERS.values())
    if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in paths)
  ]


def _upward(graph: dict[str, set[str]], layer: dict[str, int]) -> list[str]:
  """Every import of ``graph`` from a module to one of a higher layer."""
  names = list(LAYERS)
  return [
    f"{m} ({names[layer[m]]}) imports {t} ({names[layer[t]]})"
    for m in sorted(graph)
    for t in sorted(graph[m])
    if layer[t] > layer[m]
  ]


def test_the_checker_finds_an_import_up_the_layers():
  layer = {"low": 0, "mid": 1, "high": 2}
  assert _upward({"low": set(), "mid": {"low"}, "high": {"mid", "low"}}, layer) == []
  assert _upward({"low": {"high"}, "mid": {"mid"}, "high": set()}, layer) == [
    "low (base) imports high (extension)"
  ]


def test_every_module_has_exactly_one_layer():
  mods = _modules()
  wrong = {
    name: [list(LAYERS)[i] for i in _layer_of(path)]
    for name, path in sorted(mods.items())
    if name not in UNPLACED and len(_layer_of(path)) != 1
  }
  assert not wrong, (
    "each module needs exactly one layer: add it to a row of docs/architecture.md's "
    f"table and of LAYERS here (module: layers now) {wrong}"
  )
  for paths in LAYERS.values():
    for p in paths:
      assert (PACKAGE / p).exists(), f"LAYERS names mpijax/{p}, which does not exist"


def test_imports_go_down_the_layers():
  mods = _modules()
  # A module without exactly one layer fails test_every_module_has_exactly_one_layer.
  layer = {name: found[0] for name, path in mods.items() if len(found := _layer_of(path)) == 1}
  graph = {name: _imports(name, mods[name], mods) & set(layer) for name in layer}
  upward = _upward(graph, layer)
  assert not upward, (
    "an import against the layer order of docs/architecture.md; move the "
    "code to the layer it needs, or pass it in from above:\n" + "\n".join(upward)
  )


def _table_in_docs() -> dict[str, list[str]]:
  """The layer table of docs/architecture.md: layer name -> the paths of its "where" cell."""
  rows = re.findall(r"^\| (\d+)\. ([^|]+?) \| ([^|]+?) \| .* \|$", ARCHITECTURE.read_text(), re.M)
  assert [int(n) for n, _, _ in rows] == list(range(len(rows))), rows
  return {name: re.findall(r"`([^`]+)`", where) for _, name, where in rows}


def test_the_table_in_the_docs_is_this_one():
  table = _table_in_docs()
  assert list(table) == list(LAYERS), "the docs' layers, in order, are this test's"
  for name, paths in LAYERS.items():
    assert table[name] == paths, f"layer {name!r}: docs/architecture.md has {table[name]}"


def test_every_load_by_path_is_known():
  # A module loaded from a file path is an import no parser of imports sees.
  loaders = sorted(
    path.relative_to(PACKAGE).as_posix()
    for path in PACKAGE.rglob("*.py")
    if "spec_from_file_location" in path.read_text()
  )
  assert loaders == sorted(LOADS_BY_PATH), (
    "load mpijax modules by import, or list the file and what it loads in LOADS_BY_PATH"
  )
  mods = _modules()
  for loader, loaded in LOADS_BY_PATH.items():
    text = (PACKAGE / loader).read_text()
    for rel in loaded:
      assert _module_name(rel) in mods, f"{loader} loads mpijax/{rel}, which does not exist"
      # The loader names the file (by its name, joined to a directory it computes).
      assert pathlib.PurePosixPath(rel).stem in text, f"{loader} does not load mpijax/{rel}"


def test_src_keeps_only_the_base_layer_flat():
  flat = sorted(p.name for p in (PACKAGE / "_src").glob("*.py") if p.name != "__init__.py")
  assert len(flat) <= FLAT_AT_MOST, f"{len(flat)} modules directly in mpijax/_src: {flat}"
  assert [f"_src/{name}" for name in flat] == sorted(LAYERS["base"]), (
    "a module directly in mpijax/_src belongs to the base layer; others go in their layer's folder"
  )

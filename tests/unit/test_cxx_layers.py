"""The C++ folders of mpijax/_src/ffi/ include each other downwards only.

Each folder has a layer (CMakeLists.txt's list, docs/architecture.md's layer 2
row); a file includes headers of its own folder and of the folders below. The
standalone bridge library (bridge/) includes nothing of the extension's; the
extension may include the bridge's ABI header.
"""

from __future__ import annotations

import pathlib
import re

import pytest

FFI = pathlib.Path(__file__).resolve().parents[2] / "mpijax" / "_src" / "ffi"

# From the ground up. Include names are relative to csrc/ (the extension's
# folders), or to ffi/ for the bridge's ABI header ("bridge/bridge_table.h").
LAYERS: list[str] = [
  "bridge",
  "csrc/base",
  "csrc/node_local",
  "csrc/core",
  "csrc/handlers",
  "csrc/xla_collectives",
  "csrc",  # module.cc, the nanobind module
]
# Folders of one layer step that must not include each other either.
SIBLINGS = {("csrc/handlers", "csrc/xla_collectives")}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _folder_of(path: pathlib.Path) -> str:
  return path.parent.relative_to(FFI).as_posix()


def _target(src: pathlib.Path, name: str) -> pathlib.Path | None:
  """The file `#include "name"` in src names, or None outside mpijax."""
  for root in (src.parent, FFI / "csrc", FFI):
    if (root / name).is_file():
      return root / name
  return None


def _edges(files: list[pathlib.Path]) -> list[tuple[str, str, str]]:
  """(including file, its folder, the included file's folder) per include."""
  out = []
  for f in files:
    for name in INCLUDE.findall(f.read_text()):
      target = _target(f, name)
      if target is not None:
        out.append((f.relative_to(FFI).as_posix(), _folder_of(f), _folder_of(target)))
  return out


def _sources() -> list[pathlib.Path]:
  return sorted(p for p in FFI.rglob("*") if p.suffix in (".c", ".cc", ".h") and p.is_file())


def _violations(edges: list[tuple[str, str, str]]) -> list[str]:
  bad = []
  for f, src, dst in edges:
    if src == dst:
      continue
    if src not in LAYERS or dst not in LAYERS:
      bad.append(f"{f}: folder {src if src not in LAYERS else dst} is not in LAYERS")
    elif LAYERS.index(dst) > LAYERS.index(src) or (src, dst) in SIBLINGS or (dst, src) in SIBLINGS:
      bad.append(f"{f} ({src}) includes a header of {dst}")
  return bad


def test_every_folder_has_a_layer():
  folders = {_folder_of(p) for p in _sources()}
  assert folders == set(LAYERS), f"folders {sorted(folders ^ set(LAYERS))}: add them to LAYERS"


def test_includes_go_downwards_only():
  edges = _edges(_sources())
  assert len(edges) > 100, "the scan found almost no includes: is the pattern right?"
  assert _violations(edges) == []


def test_the_bridge_includes_nothing_of_the_extension():
  bridge = [p for p in _sources() if _folder_of(p) == "bridge"]
  assert bridge, "no bridge sources found"
  for f, _, dst in _edges(bridge):
    assert dst == "bridge", f"{f} includes a header of {dst}"


@pytest.mark.parametrize(
  "edge",
  [
    ("csrc/core/registry.h", "csrc/core", "csrc/xla_collectives"),
    ("csrc/xla_collectives/p2p.cc", "csrc/xla_collectives", "csrc/handlers"),
    ("bridge/bridge.c", "bridge", "csrc/core"),
    ("csrc/base/idle.h", "csrc/base", "csrc/node_local"),
  ],
)
def test_an_upward_include_is_reported(edge):
  assert _violations([edge]) != []

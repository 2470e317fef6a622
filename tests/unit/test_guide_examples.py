"""Every guide example tests/guides.py holds is Python, and a tests/mpi test runs it."""

from __future__ import annotations

import ast
import pathlib

from tests import guides

TESTS = pathlib.Path(__file__).resolve().parents[1]
RUNNERS = sorted((TESTS / "mpi").glob("test_guide_*.py"))


def _blocks() -> dict[str, str]:
  """The guide code of tests/guides.py: its upper-case string constants."""
  return {
    name: value for name, value in vars(guides).items() if name.isupper() and isinstance(value, str)
  }


def test_the_guides_hold_their_examples():
  assert {"ARR", "LAYER_SHARD_MAP", "MULTI_PROCESS_PMAP", "PMAP_PMAX"} <= set(_blocks())


def test_every_example_is_python():
  for name, block in _blocks().items():
    source = guides.doctest_source(block) if ">>> " in block else block
    ast.parse(source, name)  # a SyntaxError names the block


def test_every_example_is_run_by_a_test_under_mpi():
  used = set()
  for path in RUNNERS:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "guides"
      ):
        used.add(node.attr)
      elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        used.add(node.value)
  left_out = sorted(set(_blocks()) - used)
  assert RUNNERS and not left_out, f"guide examples no test in tests/mpi runs: {left_out}"

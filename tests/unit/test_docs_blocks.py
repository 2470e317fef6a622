"""Every code block of README.md and docs/ is run by tests/test_docs.py, or says why not.

No MPI job here: the markers (tests/docs.py) are well formed, a twin holds its
block line for line, and the comment checker reads values the way the docs
write them.
"""

from __future__ import annotations

import ast

import pytest

from tests import docs

BLOCKS = docs.blocks()


def test_the_docs_have_blocks_and_every_marker_is_known():
  assert len(BLOCKS) > 40
  kinds = {b.id: b.kind for b in BLOCKS}  # raises on an unknown marker
  assert set(kinds.values()) == {"run", "skip", "partial", "twin", "output"}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("", "text")], ids=lambda b: b.id)
def test_a_block_without_code_says_what_it_is(block):
  # Output samples and diagrams are not code: each is compared with a run or says why not.
  assert block.kind in ("skip", "output"), (
    f"{block.id}: mark it output or not run (with the reason)"
  )


@pytest.mark.parametrize(
  "block", [b for b in BLOCKS if b.lang not in ("", "text")], ids=lambda b: b.id
)
def test_code_blocks_are_python_or_shell(block):
  assert block.lang in ("python", "bash"), f"{block.id}: ```{block.lang}"
  if block.kind == "skip":
    assert block.marker.split(":", 1)[1].strip(), f"{block.id}: say why it is not run"
  if block.lang == "python" and block.kind in ("run", "twin"):
    ast.parse(block.text)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "partial"], ids=lambda b: b.id)
def test_commands_left_out_exist_and_say_why(block):
  cmds = [c for c, _ in docs.commands(block)]
  for prefix in block.not_run():
    assert any(c.startswith(prefix) for c in cmds), f"{block.id}: no command starts with {prefix!r}"
  assert all(f"`{p}` (" in block.marker for p in block.not_run()), block.marker
  assert any(run for _, run in docs.commands(block)), f"{block.id}: nothing left to run"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "twin"], ids=lambda b: b.id)
def test_a_twin_holds_its_block_line_for_line(block):
  assert (docs.REPO / block.twin).is_file(), block.twin
  assert not docs.missing_from_twin(block), (
    f"{block.id}: {block.twin} lacks these lines of the block (in this order): "
    f"{docs.missing_from_twin(block)}"
  )


def test_output_blocks_follow_a_config():
  for b in BLOCKS:
    if b.kind == "output":
      assert b.configs[0] in docs.CONFIGS, b.id


@pytest.mark.parametrize(
  "printed,comment,ok",
  [
    ("496\n", "496 on every rank", True),
    ("[10. 10.]\n", "[10. 10.] on every rank", True),
    ("[10.]\n", "[10. 10.] on every rank", False),
    ("[ 0  2  4  6  8 10 12 14 16 18 20 22 24 26 28 30]\n", "[ 0  2  4 ... 30] on rank 0", True),
    ("[[2. 3. 1. 4.]\n [2. 3. 1. 4.]]\n", "[[2. 3. 1. 4.] [2. 3. 1. 4.]]", True),
    (
      "[0.02138914 0.89311206 0.5989201  0.97742516]\n",
      "[0.02138914 0.89311206 0.5989201  0.97742516]: the guide's values",
      True,
    ),
    (
      "[0.02138914 0.89311206 0.5989201  0.97742517]\n",
      "[0.02138914 0.89311206 0.5989201  0.97742516]: the guide's values",
      False,
    ),
    ("Array(496, dtype=int32)\n", "Array(496)", False),
  ],
)
def test_a_printed_value_is_what_the_comment_starts_with(printed, comment, ok):
  assert docs.comment_matches(printed, comment) is ok


def test_a_comment_speaks_of_configurations_and_ranks():
  alts = docs.alternatives("[2.] on 2 ranks x 1 device; [4. 4.] on 2 ranks x 2 devices: the sum")
  assert [docs.applies(a, 2, 1, 0) for a in alts] == [True, False]
  assert [docs.applies(a, 2, 2, 1) for a in alts] == [False, True]
  alts = docs.alternatives("[0 1] on rank 0; [2 3] on rank 1")
  assert [docs.applies(a, 2, 2, 1) for a in alts] == [False, True]
  assert docs.applies("[2. 2.] on 2 ranks: ...", 2, 2, 0) and not docs.applies(
    "x on 4 ranks", 2, 1, 0
  )
  assert docs.applies("[4.] on each rank of 4 x 1", 4, 1, 3)


def test_print_comments_are_read_beside_the_statement_and_below_it():
  source = "x = 1  # not a print\nprint(x)  # 1 on every rank\nprint(\n  x)\n# 1: below\ny = 2\n"
  assert docs.print_comments(source) == {1: "1 on every rank", 2: "1: below"}


def test_the_documented_init_signature_is_inits():
  import inspect
  import re
  from pathlib import Path

  from mpijax._src.runtime import state as runtime

  text = (Path(__file__).resolve().parents[2] / "docs" / "collectives.md").read_text()
  documented = re.search(r"^\| `init\((.*?)\)` \|", text, re.M).group(1)
  params = [f"{p.name}={p.default!r}" for p in inspect.signature(runtime.init).parameters.values()]
  assert documented == "*, " + ", ".join(params), documented

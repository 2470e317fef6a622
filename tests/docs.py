"""The code blocks of README.md and docs/*.md, and what the tests do with each.

Every fenced block is run by the tests (tests/test_docs.py) unless an HTML
comment on the line right before its fence says otherwise:

``<!-- docs-test: not run: REASON -->``
    the whole block is not run (a cluster-only command, an output sample).
``<!-- docs-test: not run: `PREFIX` (REASON); `PREFIX2` (REASON) -->``
    in a shell block, the commands that start with PREFIX are not run.
``<!-- docs-test: at 2x2 (REASON) -->``
    a Python block runs only in that configuration (ranks x devices per
    rank); by default at 2 ranks x 1 device and at 2 x 2.
``<!-- docs-test: twin PATH [at 2x1] -->``
    a block with placeholders (``loss_fn``, ``...``): PATH, a complete
    program, holds the block's lines in order (``...`` lines left out,
    trailing comments may differ) and is run in its place (a ``.py``) or by
    the system tests (a Slurm template).
``<!-- docs-test: output at 2x2 -->``
    what rank 0 prints in that configuration: its lines must appear, in
    order, in rank 0's output of the Python blocks.

Python blocks run as programs, statement by statement, twice in the same
directory, the second time in a new MPI job; a ``print(...)`` with a comment
beside it must print the value the comment starts with (:func:`comment_matches`). Shell blocks run line by line
(``bash -c``), twice, all in one directory as a reader of the docs would.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"2x1": (2, 1), "2x2": (2, 2)}

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- docs-test: (.*?) -->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced block of a markdown file."""

  path: str  # relative to the repository, e.g. "docs/training.md"
  line: int  # the opening fence's line, 1-based
  lang: str
  text: str
  marker: str | None

  @property
  def id(self) -> str:
    return f"{self.path}:{self.line}"

  @property
  def kind(self) -> str:
    """ "run", "skip", "partial" (some shell commands not run), "twin" or "output"."""
    m = self.marker
    if m is None or m.startswith("at "):
      return "run"
    if m.startswith("not run: `"):
      return "partial"
    if m.startswith("not run:"):
      return "skip"
    if m.startswith("twin "):
      return "twin"
    if m.startswith("output at "):
      return "output"
    raise ValueError(f"{self.id}: unknown docs-test marker {m!r}")

  @property
  def configs(self) -> list[str]:
    """The configurations a Python block (or a twin) runs in."""
    m = re.search(r"\bat (\d+x\d+)\b", self.marker or "")
    return [m[1]] if m else list(CONFIGS)

  @property
  def twin(self) -> str:
    return self.marker.split()[1]

  def not_run(self) -> list[str]:
    """The command prefixes a partial shell block leaves out."""
    return re.findall(r"`([^`]+)`", self.marker or "")


def doc_files() -> list[Path]:
  return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def blocks() -> list[Block]:
  """Every fenced block of README.md and docs/*.md, in reading order."""
  found = []
  for path in doc_files():
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
      m = _FENCE.match(lines[i])
      if m is None:
        i += 1
        continue
      start = i
      i += 1
      body = []
      while i < len(lines) and lines[i].rstrip() != "```":
        body.append(lines[i])
        i += 1
      marker = _MARKER.match(lines[start - 1]) if start else None
      found.append(
        Block(
          str(path.relative_to(REPO)),
          start + 1,
          m[1],
          "\n".join(body) + "\n",
          marker[1] if marker else None,
        )
      )
      i += 1
  return found


# --- shell blocks ----------------------------------------------------------------------


def commands(block: Block) -> list[tuple[str, bool]]:
  """(command, run?) for each command of a shell block (continuation lines joined, trailing
  comments dropped)."""
  out, pending = [], ""
  for raw in block.text.splitlines():
    line = pending + raw
    if line.rstrip().endswith("\\"):
      pending = line.rstrip()[:-1] + " "
      continue
    pending = ""
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    skip = block.kind == "skip" or any(line.startswith(p) for p in block.not_run())
    out.append((_code(line), not skip))
  return out


# --- twins ------------------------------------------------------------------------------


def _code(line: str) -> str:
  """A line without its trailing comment (two spaces, then #)."""
  return re.sub(r"\s{2,}#\s.*$", "", line.rstrip())


def missing_from_twin(block: Block) -> list[str]:
  """The block's lines that its twin lacks, in order (empty: the twin holds the block)."""
  twin = (REPO / block.twin).read_text(encoding="utf-8").splitlines()
  k, missing = 0, []
  for line in block.text.splitlines():
    if not line.strip() or _code(line).strip() == "...":
      continue
    for j in range(k, len(twin)):
      if twin[j].rstrip() == line.rstrip() or _code(twin[j]) == _code(line):
        k = j + 1
        break
    else:
      missing.append(line)
  return missing


# --- printed values and the comments beside them ----------------------------------------


def print_comments(source: str) -> dict[int, str]:
  """Statement index -> the comment beside it, for each top-level ``print(...)`` with one.

  The comment is the one on the statement's last line and the comment lines
  right below it.
  """
  comments: dict[int, str] = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string.lstrip("#").strip()
  lines = source.splitlines()
  out = {}
  for k, node in enumerate(ast.parse(source).body):
    if not (
      isinstance(node, ast.Expr)
      and isinstance(node.value, ast.Call)
      and isinstance(node.value.func, ast.Name)
      and node.value.func.id == "print"
    ):
      continue
    end = node.end_lineno
    parts = [comments[end]] if end in comments else []
    n = end + 1
    while n <= len(lines) and lines[n - 1].lstrip().startswith("#") and n in comments:
      parts.append(comments[n])
      n += 1
    if parts:
      out[k] = " ".join(parts)
  return out


def normalize(text: str) -> str:
  """Whitespace collapsed, and no padding inside brackets (NumPy aligns its columns)."""
  text = " ".join(text.split())
  return re.sub(r"([\[(]) ", r"\1", re.sub(r" ([\])])", r"\1", text))


_QUALIFIERS = [
  (
    re.compile(r"\bon (\d+) ranks? x (\d+) devices?\b|\bon (?:each rank of )?(\d+) x (\d+)\b"),
    "config",
  ),
  (re.compile(r"\b(?:on|with) (\d+) ranks?\b(?! x)"), "ranks"),
  (re.compile(r"\bon rank (\d+)\b"), "rank"),
]


def applies(alternative: str, ranks: int, devices: int, rank: int) -> bool:
  """Whether a comment's alternative speaks of this configuration and rank."""
  for pattern, what in _QUALIFIERS:
    for m in pattern.finditer(alternative):
      nums = [int(g) for g in m.groups() if g is not None]
      if what == "config" and tuple(nums) != (ranks, devices):
        return False
      if what == "ranks" and nums[0] != ranks:
        return False
      if what == "rank" and nums[0] != rank:
        return False
  return True


def _pattern(value: str) -> re.Pattern:
  parts = re.split(r"\.\.\.|…", normalize(value))
  return re.compile(r"\s?.*?\s?".join(re.escape(p) for p in parts), re.S)


def comment_matches(printed: str, alternative: str) -> bool:
  """True if ``printed`` is the value ``alternative`` starts with.

  The value runs up to a word boundary; the rest is prose (where the value
  holds, what it means). ``...`` in the value stands for anything.
  """
  got = normalize(printed)
  alt = normalize(alternative)
  cuts = [i for i, c in enumerate(alt) if c in " :,;"] + [len(alt)]
  return any(_pattern(alt[:i].rstrip(":,;")).fullmatch(got) for i in cuts)


def alternatives(comment: str) -> list[str]:
  return [a.strip() for a in comment.split(";") if a.strip()]

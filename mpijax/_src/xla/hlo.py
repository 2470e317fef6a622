"""The collective instructions of an HLO module's text: the one parser.

Every program JAX compiles for devices of several processes is read once
(``compile_hook.Program.hlo``); its collectives then serve the labels in
mpijax's reports, the communicators XLA will ask for, the gloo guard and the
check that every rank runs the same program.
"""

from __future__ import annotations

import dataclasses
import functools
import re

# The HLO opcodes that reach XLA's CPU collectives (and their async starts).
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# HLO's element types, as the bridge names them (MPI moves PRED as uint8), and their sizes.
DTYPES = {
  "pred": ("uint8", 1),
  "s8": ("int8", 1),
  "s16": ("int16", 2),
  "s32": ("int32", 4),
  "s64": ("int64", 8),
  "u8": ("uint8", 1),
  "u16": ("uint16", 2),
  "u32": ("uint32", 4),
  "u64": ("uint64", 8),
  "f16": ("float16", 2),
  "bf16": ("bfloat16", 2),
  "f32": ("float32", 4),
  "f64": ("float64", 8),
  "c64": ("complex64", 8),
  "c128": ("complex128", 16),
}
# A reduction computation's root, as MPI's op (XLA maps `or` to max, `and` to min).
OPS = {
  "add": "sum",
  "multiply": "product",
  "maximum": "max",
  "or": "max",
  "minimum": "min",
  "and": "min",
}

_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>.*?) "
  r"(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^\s*%([\w.\-]+) \(.*\) -> .* \{\s*$")
_ROOT = re.compile(r"^\s*ROOT %[\w.\-]+ = \S+ (\w+)\(")


def attribute(rest: str, name: str) -> str | None:
  """The text of attribute ``name=...`` in an instruction's argument text, or None."""
  m = re.search(r"(?:^|[\s,])" + re.escape(name) + r"=", rest)
  if not m:
    return None
  i, depth, out = m.end(), 0, []
  while i < len(rest):
    ch = rest[i]
    if ch in "{[(":
      depth += 1
    elif ch in "}])":
      if depth == 0:
        break
      depth -= 1
    elif ch == "," and depth == 0:
      # mesh['a'=2], device_ids=(...) {'a'}: the mesh's own attribute.
      if not rest.startswith(" device_ids=", i + 1):
        break
    out.append(ch)
    i += 1
  return "".join(out).strip()


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of an HLO module."""

  name: str  # the instruction's name, without its %
  kind: str  # one of KINDS
  shape: str  # its result's shape text, e.g. "f32[4]{0}" or a tuple
  op: str  # the reduction as MPI's op ("sum", ...), "" where none or unknown
  label: str  # its metadata's op_name (jit(f)/psum), else "<module> %<name>"
  rest: str  # the text after the opcode's "(": operands and attributes

  def attribute(self, name: str) -> str | None:
    """The text of one of its attributes (``replica_groups``, ``channel_id``...), or None."""
    return attribute(self.rest, name)

  @property
  def arrays(self) -> list[tuple[str, int]]:
    """(HLO element type, elements) of each array of its shape, a tuple's in order."""
    out = []
    for dtype, dims in _ARRAY.findall(self.shape):
      if dtype in DTYPES:
        n = 1
        for d in dims.split(","):
          n *= int(d) if d else 1
        out.append((dtype, n))
    return out

  def calls(self) -> list[tuple[str, str, int, str, str]]:
    """(kind, dtype or "bytes", elements or bytes, op, label) of each MPI call the
    bridge sees for it: one per array, or one of bytes for all-to-all and
    collective-permute."""
    arrays = self.arrays
    if self.kind in ("all-to-all", "collective-permute"):
      return [(self.kind, "bytes", sum(DTYPES[d][1] * n for d, n in arrays), "", self.label)]
    return [(self.kind, DTYPES[d][0], n, self.op, self.label) for d, n in arrays]


@dataclasses.dataclass(frozen=True)
class Module:
  """An HLO module's name, text and collective instructions (in text order)."""

  name: str
  text: str

  @functools.cached_property
  def collectives(self) -> list[Collective]:
    return parse(self.name, self.text)

  def calls(self) -> list[tuple[str, str, int, str, str]]:
    """Every collective's :meth:`Collective.calls`, in order."""
    return [call for c in self.collectives for call in c.calls()]


def parse(module: str, hlo_text: str) -> list[Collective]:
  """The collective instructions of module ``module``'s HLO text, in text order."""
  lines = hlo_text.splitlines()
  roots: dict[str, str] = {}  # computation -> its root's opcode (a reduction's op)
  current = None
  for line in lines:
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      continue
    m = _ROOT.match(line)
    if m and current is not None:
      roots[current] = m.group(1)
  found = []
  for line in lines:
    m = _INSTR.match(line)
    if not m:
      continue
    kind, rest = m.group("kind"), m.group("rest")
    op = ""
    if kind in ("all-reduce", "reduce-scatter"):
      to_apply = attribute(rest, "to_apply")
      op = OPS.get(roots.get(to_apply.lstrip("%"), ""), "") if to_apply else ""
    op_name = _OP_NAME.search(rest)
    label = op_name.group(1) if op_name else f"{module} %{m.group('name')}"
    found.append(Collective(m.group("name"), kind, m.group("shape"), op, label, rest))
  return found

"""Names for XLA's collectives in mpijax's reports: which jitted program each is in.

The bridge sees XLA's collectives as MPI calls (an MPI_Allreduce of 1,024
floats), not as HLO instructions. When XLA's collectives run over MPI,
:func:`install` makes :func:`label` a reader of the compile hook: each program
compiled (or loaded) for devices of several processes is scanned, once, for
its collective instructions, and
each is handed to the extension with its kind, dtype, size and reduction
and a label from its metadata, e.g. ``jit(train_step)/psum``. Stall reports,
mismatch errors and the timeline then say "XLA all-reduce float32[1024]
(sum) in jit(train_step)/psum" (every candidate, when several programs hold
an operation of that shape).
"""

from __future__ import annotations

import logging
import re

from mpijax._src import compile_hook
from mpijax._src import ffi as _ffi
from mpijax._src import program_check

# HLO's element types, as the bridge names them (MPI moves PRED as uint8).
_DTYPES = {
  "pred": "uint8",
  "s8": "int8",
  "s16": "int16",
  "s32": "int32",
  "s64": "int64",
  "u8": "uint8",
  "u16": "uint16",
  "u32": "uint32",
  "u64": "uint64",
  "f16": "float16",
  "bf16": "bfloat16",
  "f32": "float32",
  "f64": "float64",
  "c64": "complex64",
  "c128": "complex128",
}
_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
# A reduction computation's root, as MPI's op (XLA maps `or` to max, `and` to min).
_OPS = {
  "add": "sum",
  "multiply": "product",
  "maximum": "max",
  "or": "max",
  "minimum": "min",
  "and": "min",
}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?) "
  r"(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_TO_APPLY = re.compile(r"to_apply=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^\s*%([\w.\-]+) \(.*\) -> .* \{\s*$")
_ROOT = re.compile(r"^\s*ROOT %[\w.\-]+ = \S+ (\w+)\(")

# The program init() runs to have XLA create the communicators (xla_cliques).
WARM_UP = "mpijax_prepare_communicators"


def _arrays(shape: str) -> list[tuple[str, int]]:
  """(dtype, elements) of each array in an HLO shape (a tuple's in order)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _BYTES:
      n = 1
      for d in dims.split(","):
        n *= int(d) if d else 1
      out.append((dtype, n))
  return out


def collectives(hlo_text: str, module: str) -> list[tuple[str, str, int, str, str]]:
  """(kind, dtype or 'bytes', elements or bytes, op, label) of each collective
  the bridge will see for an HLO module's text (one per MPI call)."""
  roots: dict[str, str] = {}
  current = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      continue
    m = _ROOT.match(line)
    if m and current is not None:
      roots[current] = m.group(1)
  found = []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    kind, rest = m.group("kind"), m.group("rest")
    op_name = _OP_NAME.search(rest)
    label = op_name.group(1) if op_name else f"{module} %{m.group('name')}"
    arrays = _arrays(m.group("shape"))
    if kind in ("all-to-all", "collective-permute"):
      total = sum(_BYTES[d] * n for d, n in arrays)
      found.append((kind, "bytes", total, "", label))
      continue
    op = ""
    if kind in ("all-reduce", "reduce-scatter"):
      to_apply = _TO_APPLY.search(rest)
      op = _OPS.get(roots.get(to_apply.group(1), ""), "") if to_apply else ""
    for dtype, n in arrays:
      found.append((kind, _DTYPES[dtype], n, op, label))
  return found


def label(program: compile_hook.Program) -> None:
  """Hands the extension the collectives of a program over the devices of
  several processes (a compile hook reader; best effort)."""
  if not program.spans_processes:
    return
  try:
    ext = _ffi.load()
    for name, text in program.modules:
      if WARM_UP in name:  # mpijax's own, not a program of the user's
        continue
      found = collectives(text, name)
      if found:
        program_check.note(name, text, found)
      for kind, dtype, n, op, label in found:
        ext.xla_label(kind, dtype, n, op, label)
  except Exception as e:  # labels are names in messages, never a reason to fail
    logging.getLogger("mpijax").debug("naming XLA's collectives failed: %r", e)


def install() -> None:
  """Labels every program JAX compiles for the devices of several processes."""
  compile_hook.add_reader(label)
  program_check.arm()


GLOO_REDUCE_SCATTER = (
  "{program} has a reduce-scatter, and XLA's collectives run over gloo with "
  "{devices} devices per rank: jaxlib 0.10's gloo reduce-scatter between the "
  "devices of one process can return wrong values for chunks of a few MiB "
  "(https://github.com/jax-ml/jax/issues/40830). Unset MPIJAX_XLA_COLLECTIVES=gloo: "
  "over MPI (the default) it is right."
)


class _GlooGuard:
  """Warns, once (rank 0), at the first program with a reduce-scatter when
  XLA's collectives run over gloo with several devices per rank, where
  jaxlib's can be wrong; the warning never stops the job."""

  def __init__(self, local_devices: int) -> None:
    self.local_devices = local_devices
    self.warned = False

  def __call__(self, program: compile_hook.Program) -> None:
    if self.warned:
      return
    from mpijax._src import log

    try:
      for name, text in program.modules:
        if any(c[0] == "reduce-scatter" for c in collectives(text, name)):
          self.warned = True
          if log.rank_and_size()[0] == 0:  # every rank compiles the same programs
            log.warning(GLOO_REDUCE_SCATTER.format(program=name, devices=self.local_devices))
          return
    except Exception as e:  # a warning's source, never a reason to fail
      logging.getLogger("mpijax").debug("reading a program's collectives failed: %r", e)


_gloo_guard: _GlooGuard | None = None


def guard_gloo_reduce_scatter(local_devices: int) -> None:
  """Installs the gloo reduce-scatter warning (once)."""
  global _gloo_guard
  if _gloo_guard is None:
    _gloo_guard = _GlooGuard(local_devices)
    compile_hook.add_reader(_gloo_guard)

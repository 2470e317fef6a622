"""mpi4py ``MPI.Op`` objects as mpijax reduction ops.

``mpijax.ops`` names its reductions with strings ("sum", "max", "and", ...);
programs written for mpi4py or mpi4jax pass ``MPI.SUM``, ``MPI.MAX``,
``MPI.LAND``. Every op-taking function resolves its ``op`` here first.

MPI's logical ops (``MPI.LAND``, ``MPI.LOR``, ``MPI.LXOR``) treat any
nonzero value as true and give 1 or 0 in the input's type. On bool they are
mpijax's "and", "or", "xor"; on integers the reduction runs on ``x != 0``
and the result is cast back, as MPI defines them (on a communicator of one
rank MPI combines nothing and returns ``x`` itself, and so does mpijax).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from mpijax._src.ops import dtypes

# mpi4py's name -> (mpijax's op, logical).
_MPI_OPS = {
    "SUM": ("sum", False), "PROD": ("prod", False),
    "MIN": ("min", False), "MAX": ("max", False),
    "BAND": ("and", False), "BOR": ("or", False), "BXOR": ("xor", False),
    "LAND": ("and", True), "LOR": ("or", True), "LXOR": ("xor", True),
}
_UNSUPPORTED = ("MAXLOC", "MINLOC", "REPLACE", "NO_OP")


class ResolvedOp(NamedTuple):
  """An op as mpijax runs it."""
  name: str       # mpijax's name ("sum", ...)
  logical: bool   # reduce ``x != 0`` as bool, cast the result back to x's dtype
  shown: str      # how the user wrote it, for messages ("MPI.LAND", "'sum'")


def _mpi_name(op: Any) -> str | None:
  """"SUM" for mpi4py's MPI.SUM, ...; None if ``op`` is not a predefined MPI.Op."""
  MPI = _mpi_module(op)
  if MPI is None:
    return None
  for name in (*_MPI_OPS, *_UNSUPPORTED):
    predefined = getattr(MPI, name, None)
    if predefined is not None and op == predefined:
      return name
  return None


def _mpi_module(op: Any):
  """mpi4py.MPI if ``op`` is an mpi4py MPI.Op (without importing mpi4py otherwise)."""
  if type(op).__module__ != "mpi4py.MPI":
    return None
  from mpi4py import MPI  # already imported: ``op`` is one of its objects
  return MPI if isinstance(op, MPI.Op) else None


def resolve(op: Any, dtype: Any, op_name: str, size: int = 2) -> ResolvedOp:
  """mpijax's reduction for ``op`` (a string or an mpi4py ``MPI.Op``) on ``dtype``.

  ``size``: the communicator's; with one rank a logical op is its bitwise
  twin, which returns ``x`` unchanged, as MPI does.

  Raises a ValueError naming the op for an MPI.Op mpijax does not run
  (MPI.MAXLOC, MPI.MINLOC, MPI.REPLACE, MPI.NO_OP, user-defined ops) and a
  TypeError for a logical op on a dtype MPI does not define it for.
  """
  if isinstance(op, str):
    return ResolvedOp(op, False, repr(op))
  name = _mpi_name(op)
  if name is None or name in _UNSUPPORTED:
    shown = f"MPI.{name}" if name else repr(op)
    what = "" if name else (" (not one of mpi4py's predefined reduction ops; "
                            "user-defined MPI.Op.Create ops do not run inside XLA)")
    if _mpi_module(op) is None and name is None:
      what = f" of type {type(op).__name__}"
    raise ValueError(
        f"{op_name} got op={shown}{what}, which mpijax does not support. Supported: "
        + ", ".join(f"MPI.{n}" for n in _MPI_OPS)
        + ", or mpijax's names 'sum', 'prod', 'min', 'max', 'and', 'or', 'xor'"
        + (" (MAXLOC/MINLOC: reduce the values with MPI.MAX/MPI.MIN, then the "
           "indices where they occur)" if name in ("MAXLOC", "MINLOC") else "") + ".")
  mpijax_name, logical = _MPI_OPS[name]
  dt = jnp.dtype(dtype)
  if logical and dt == jnp.bool_:
    logical = False  # bool's and/or/xor are already logical
  if logical and not jnp.issubdtype(dt, jnp.integer):
    raise TypeError(
        f"{op_name} got op=MPI.{name} for dtype {dt.name}; MPI's logical ops are "
        "defined for integers and bool. Compare first, e.g. x != 0, or use "
        "MPI.MAX / MPI.MIN on floats.")
  return ResolvedOp(mpijax_name, logical and size > 1, f"MPI.{name}")


def as_logical(x):
  """``x`` as MPI's logical ops see it: bool, nonzero is true."""
  return x != 0


def run_reduction(op_name: str, op: Any, x: Any, size: int,
                  run: Callable[[Any, str], Any]) -> Any:
  """``run(x, name)`` with mpijax's reduction ``name`` for ``op``, as MPI defines it.

  Resolves ``op`` (see `resolve`) and checks it for ``x``'s dtype; a logical
  op runs on ``x != 0`` and its result is cast back to ``x``'s dtype.

  Args:
    op_name: the calling function, for messages.
    op: a string or an mpi4py ``MPI.Op``.
    x: the input array.
    size: the communicator's size.
    run: binds the primitive, given the array and the checked op name; it may
      check its other arguments first.
  """
  resolved = resolve(op, x.dtype, op_name, size)
  if resolved.logical:
    return run_reduction(op_name, resolved.name, as_logical(x), size, run).astype(x.dtype)
  return run(x, dtypes.check_reduce_op(op_name, resolved.name, x.dtype))

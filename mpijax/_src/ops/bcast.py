"""bcast: every rank gets root's ``x``; and reduce, its transpose.

``reduce(x, root)`` sums to ``root`` and gives zeros elsewhere, which is the
transpose of ``bcast`` (and bcast is the transpose of reduce-sum).
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive
from mpijax._src.ops import reduce_ops

bcast_p = primitive.make_primitive("mpijax_bcast")
reduce_p = primitive.make_primitive("mpijax_reduce")


def _check_root(op_name: str, root: int, size: int) -> int:
  try:
    index = operator.index(root)  # a Python or NumPy integer, not a traced value
  except TypeError:
    index = None
  if index is None or isinstance(root, (bool, np.bool_)) or not 0 <= index < size:
    raise ValueError(f"{op_name} got root={root!r}; expected a static integer rank "
                     f"in [0, {size}) (a Python int, known at trace time).")
  return int(index)


def bcast(x, root: int, *, comm: Any = None) -> jax.Array:
  """Broadcasts ``x`` from rank ``root`` to every rank of ``comm``.

  Args:
    x: array of a supported dtype; same shape and dtype on every rank (only
      root's values are used).
    root: the sending rank (a Python int).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    Root's ``x`` on every rank.

  Raises:
    ValueError: ``root`` is not a static integer rank of the communicator.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> params = mpijax.ops.bcast(params_leaf, root=0)  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.bcast", x)
  dtypes.check_dtype("mpijax.ops.bcast", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.bcast")
  _check_root("mpijax.ops.bcast", root, info.size)
  return bcast_p.bind(x, comm_id=info.id, root=root)


def reduce(x, op: str = "sum", root: int = 0, *, comm: Any = None) -> jax.Array:
  """Reduces ``x`` over ranks onto ``root``; the other ranks get zeros.

  Args:
    x: array of a supported dtype; same shape on every rank.
    op: reduction ("sum", "prod", "min", "max", "and", "or", "xor"), or an
      mpi4py ``MPI.Op`` (see :func:`mpijax.ops.allreduce`).
    root: the receiving rank (a Python int).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    The reduction on ``root``, zeros of ``x``'s shape elsewhere.

  Raises:
    ValueError: ``root`` is not a static integer rank of the communicator,
      ``op`` is not an op name mpijax knows, or an ``MPI.Op`` it does not
      run (``MAXLOC``, ``MINLOC``, ``REPLACE``, user-defined).
    TypeError: ``x``'s dtype is not supported, or ``op`` is not defined for
      it (e.g. ``"xor"`` on floats).

  Examples:
    >>> total = mpijax.ops.reduce(x, "sum", root=0)  # zeros on ranks != 0  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.reduce", x)
  info = communicators.resolve_comm(comm, "mpijax.ops.reduce")

  def run(x, op):
    _check_root("mpijax.ops.reduce", root, info.size)
    return reduce_p.bind(x, comm_id=info.id, op=op, root=root)

  return reduce_ops.run_reduction("mpijax.ops.reduce", op, x, info.size, run)


def _same(x, **params):
  return x


def _bcast_attrs(*, comm_id, root):
  return dict(comm=primitive.i64(comm_id), root=primitive.i64(root))


def _reduce_attrs(*, comm_id, op, root):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]),
              root=primitive.i64(root))


def _elementwise_batcher(prim):
  def rule(args, dims, **params):
    return prim.bind(args[0], **params), dims[0]
  return rule


def _bcast_transpose(ct, x, *, comm_id, root):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  return (reduce_p.bind(ct, comm_id=comm_id, op="sum", root=root),)


def _reduce_transpose_sum(ct, *, comm_id, op, root):
  # Only root's cotangent matters (the others' outputs are constant zeros).
  return bcast_p.bind(ct, comm_id=comm_id, root=root)


bcast_p.def_abstract_eval(_same)
lowering.register_ffi_lowering(bcast_p, "mpijax_bcast", _bcast_attrs, in_place_capable=True)
batching.primitive_batchers[bcast_p] = _elementwise_batcher(bcast_p)
ad.deflinear2(bcast_p, _bcast_transpose)

reduce_p.def_abstract_eval(_same)
lowering.register_ffi_lowering(reduce_p, "mpijax_reduce", _reduce_attrs)
batching.primitive_batchers[reduce_p] = _elementwise_batcher(reduce_p)
primitive.def_sum_linear_ad(reduce_p, "mpijax.ops.reduce", _reduce_transpose_sum)

"""reduce_scatter: rank r gets the reduction over ranks of ``x[r]``.

Transpose (op="sum"): allgather, and vice versa: both transposes are
registered here, where both primitives exist.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive
from mpijax._src.ops import reduce_ops
from mpijax._src.ops.allgather import allgather_p

reduce_scatter_p = primitive.make_primitive("mpijax_reduce_scatter")


def reduce_scatter(x, op: str = "sum", *, comm: Any = None) -> jax.Array:
  """Reduces ``x`` over ranks and scatters the result along axis 0.

  Args:
    x: array with ``x.shape[0] == comm size``; same shape on every rank.
    op: reduction ("sum", "prod", "min", "max", "and", "or", "xor"), or an
      mpi4py ``MPI.Op`` (see :func:`mpijax.ops.allreduce`).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    On rank r, the reduction over all ranks of ``x[r]`` (shape ``x.shape[1:]``).

  Raises:
    ValueError: ``x.shape[0]`` is not the communicator's size, ``op`` is
      not an op name mpijax knows, or an ``MPI.Op`` it does not run
      (``MAXLOC``, ``MINLOC``, ``REPLACE``, user-defined).
    TypeError: ``x``'s dtype is not supported, or ``op`` is not defined for
      it (e.g. ``"xor"`` on floats).

  Examples:
    >>> mine = mpijax.ops.reduce_scatter(jnp.ones((size, 3)))  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.reduce_scatter", x)
  info = communicators.resolve_comm(comm, "mpijax.ops.reduce_scatter")

  def run(x, op):
    if x.ndim == 0 or x.shape[0] != info.size:
      raise ValueError(
          f"mpijax.ops.reduce_scatter needs x.shape[0] == communicator size "
          f"{info.size}, got shape {x.shape}; reshape to ({info.size}, ...).")
    return reduce_scatter_p.bind(x, comm_id=info.id, op=op, size=info.size)

  return reduce_ops.run_reduction("mpijax.ops.reduce_scatter", op, x, info.size, run)


def _abstract_eval(x, *, comm_id, op, size):
  return x.update(shape=x.shape[1:])


def _attrs(*, comm_id, op, size):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]))


def _batch(args, dims, *, comm_id, op, size):
  (x,), (d,) = args, dims
  out = reduce_scatter_p.bind(primitive.moveaxis(x, d, 1), comm_id=comm_id, op=op,
                              size=size)
  return out, 0


def _transpose_sum(ct, *, comm_id, op, size):
  return allgather_p.bind(ct, comm_id=comm_id, size=size)


def _allgather_transpose(ct, x, *, comm_id, size):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  return (reduce_scatter_p.bind(ct, comm_id=comm_id, op="sum", size=size),)


reduce_scatter_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(reduce_scatter_p, "mpijax_reduce_scatter", _attrs)
batching.primitive_batchers[reduce_scatter_p] = _batch
primitive.def_sum_linear_ad(reduce_scatter_p, "mpijax.ops.reduce_scatter", _transpose_sum)
ad.deflinear2(allgather_p, _allgather_transpose)

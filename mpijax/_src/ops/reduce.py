"""reduce: root gets the reduction of ``x`` over the ranks; the others get zeros.

``reduce(x, root)`` summing to ``root`` is the transpose of ``bcast`` from
``root``, and bcast is reduce-sum's: both transposes are registered here.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import peers
from mpijax._src.ops import primitive
from mpijax._src.ops import reduce_ops
from mpijax._src.ops.bcast import bcast_p

reduce_p = primitive.make_primitive("mpijax_reduce")


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
    peers.check_root("mpijax.ops.reduce", root, info.size)
    return reduce_p.bind(x, comm_id=info.id, op=op, root=root)

  return reduce_ops.run_reduction("mpijax.ops.reduce", op, x, info.size, run)


def _same(x, **params):
  return x


def _reduce_attrs(*, comm_id, op, root):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]),
              root=primitive.i64(root))


def _batch(args, dims, **params):
  return reduce_p.bind(args[0], **params), dims[0]


def _bcast_transpose(ct, x, *, comm_id, root):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  return (reduce_p.bind(ct, comm_id=comm_id, op="sum", root=root),)


def _reduce_transpose_sum(ct, *, comm_id, op, root):
  # Only root's cotangent matters (the others' outputs are constant zeros).
  return bcast_p.bind(ct, comm_id=comm_id, root=root)


reduce_p.def_abstract_eval(_same)
lowering.register_ffi_lowering(reduce_p, "mpijax_reduce", _reduce_attrs)
batching.primitive_batchers[reduce_p] = _batch
primitive.def_sum_linear_ad(reduce_p, "mpijax.ops.reduce", _reduce_transpose_sum)
ad.deflinear2(bcast_p, _bcast_transpose)

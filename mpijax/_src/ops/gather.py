"""gather: root gets the stack of every rank's ``x``; the others get nothing.

Root's result has shape ``(size, *x.shape)``; every other rank's has shape
``(0, *x.shape)`` (no memory). Transpose: scatter from root, and vice versa;
both transposes are registered in scatter.py, which imports this module.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import peers
from mpijax._src.ops import primitive

gather_p = primitive.make_primitive("mpijax_gather")


def gather(x, root: int, *, comm: Any = None) -> jax.Array:
  """Gathers ``x`` from every rank of ``comm`` onto rank ``root``.

  Args:
    x: array of a supported dtype; same shape and dtype on every rank.
    root: the receiving rank (a Python int).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    On ``root``, shape ``(size, *x.shape)``: entry r is rank r's ``x``. On
    the other ranks an empty array of shape ``(0, *x.shape)``.

  Raises:
    ValueError: ``root`` is not a static integer rank of the communicator.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> rows = mpijax.ops.gather(jnp.ones(3), root=0)  # (size, 3) on rank 0  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.gather", x)
  dtypes.check_dtype("mpijax.ops.gather", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.gather")
  root = peers.check_root("mpijax.ops.gather", root, info.size)
  return gather_p.bind(x, comm_id=info.id, root=root, size=info.size)


def _abstract_eval(x, *, comm_id, root, size):
  rows = size if communicators.info_of(comm_id).rank == root else 0
  return x.update(shape=(rows, *x.shape))


def _attrs(*, comm_id, root, size):
  return dict(comm=primitive.i64(comm_id), root=primitive.i64(root))


def _batch(args, dims, *, comm_id, root, size):
  (x,), (d,) = args, dims
  out = gather_p.bind(primitive.moveaxis(x, d, 0), comm_id=comm_id, root=root, size=size)
  return out, 1  # (size or 0, batch, ...)


gather_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(gather_p, "mpijax_gather", _attrs)
batching.primitive_batchers[gather_p] = _batch

"""allgather: every rank gets the stack of every rank's ``x``.

Transpose: reduce_scatter (sum), and vice versa.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching

from mpijax._src.ops import _base

allgather_p = _base.make_primitive("mpijax_allgather")


def allgather(x, *, comm: Any = None) -> jax.Array:
  """Gathers ``x`` from all ranks of ``comm``.

  Args:
    x: array of a supported dtype; same shape on every rank.
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    Shape ``(size, *x.shape)``; entry ``r`` is rank r's ``x``.

  Examples:
    >>> rows = mpijax.ops.allgather(jnp.ones(3))  # (size, 3)  # doctest: +SKIP
  """
  x = _base.as_array("mpijax.ops.allgather", x)
  _base.check_dtype("mpijax.ops.allgather", x.dtype)
  info = _base.resolve_comm(comm, "mpijax.ops.allgather")
  return allgather_p.bind(x, comm_id=info.id, size=info.size)


def _abstract_eval(x, *, comm_id, size):
  return x.update(shape=(size, *x.shape))


def _attrs(*, comm_id, size):
  return dict(comm=_base.i64(comm_id))


def _batch(args, dims, *, comm_id, size):
  (x,), (d,) = args, dims
  out = allgather_p.bind(_base.moveaxis(x, d, 0), comm_id=comm_id, size=size)
  return out, 1  # (size, batch, ...)


def _transpose(ct, x, *, comm_id, size):
  from mpijax._src.ops.reduce_scatter import reduce_scatter_p
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  return (reduce_scatter_p.bind(ct, comm_id=comm_id, op="sum", size=size),)


allgather_p.def_abstract_eval(_abstract_eval)
_base.register_ffi_lowering(allgather_p, "mpijax_allgather", _attrs)
batching.primitive_batchers[allgather_p] = _batch
ad.deflinear2(allgather_p, _transpose)

"""allgather: every rank gets the stack of every rank's ``x``.

Transpose: reduce_scatter (sum), and vice versa; the two transposes are
registered in :mod:`.reduce_scatter`, which builds on this module.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive

allgather_p = primitive.make_primitive("mpijax_allgather")


def allgather(x, *, comm: Any = None) -> jax.Array:
  """Gathers ``x`` from all ranks of ``comm``.

  Args:
    x: array of a supported dtype; same shape on every rank.
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    Shape ``(size, *x.shape)``; entry ``r`` is rank r's ``x``.

  Raises:
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.
    RuntimeError: ``mpijax.init()`` has not run.

  Examples:
    >>> rows = mpijax.ops.allgather(jnp.ones(3))  # (size, 3)  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.allgather", x)
  dtypes.check_dtype("mpijax.ops.allgather", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.allgather")
  return allgather_p.bind(x, comm_id=info.id, size=info.size)


def _abstract_eval(x, *, comm_id, size):
  return x.update(shape=(size, *x.shape))


def _attrs(*, comm_id, size):
  return dict(comm=primitive.i64(comm_id))


def _batch(args, dims, *, comm_id, size):
  (x,), (d,) = args, dims
  out = allgather_p.bind(primitive.moveaxis(x, d, 0), comm_id=comm_id, size=size)
  return out, 1  # (size, batch, ...)


allgather_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(allgather_p, "mpijax_allgather", _attrs)
batching.primitive_batchers[allgather_p] = _batch

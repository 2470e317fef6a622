"""alltoall: block ``x[j]`` of rank r lands in ``out[r]`` of rank j.

It is its own transpose.
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

alltoall_p = primitive.make_primitive("mpijax_alltoall")


def alltoall(x, *, comm: Any = None) -> jax.Array:
  """Exchanges blocks: rank r sends ``x[j]`` to rank j, receives into ``out[j]``.

  Args:
    x: array with ``x.shape[0] == comm size``; same shape on every rank.
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    Same shape as ``x``; on rank r, ``out[j]`` is rank j's ``x[r]``.

  Raises:
    ValueError: ``x.shape[0]`` is not the communicator's size.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> y = mpijax.ops.alltoall(jnp.ones((size, 2)))  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.alltoall", x)
  dtypes.check_dtype("mpijax.ops.alltoall", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.alltoall")
  if x.ndim == 0 or x.shape[0] != info.size:
    raise ValueError(
        f"mpijax.ops.alltoall needs x.shape[0] == communicator size "
        f"{info.size}, got shape {x.shape}; reshape to ({info.size}, ...).")
  return alltoall_p.bind(x, comm_id=info.id)


def _abstract_eval(x, *, comm_id):
  return x


def _attrs(*, comm_id):
  return dict(comm=primitive.i64(comm_id))


def _batch(args, dims, *, comm_id):
  (x,), (d,) = args, dims
  return alltoall_p.bind(primitive.moveaxis(x, d, 1), comm_id=comm_id), 1


def _transpose(ct, x, *, comm_id):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  return (alltoall_p.bind(ct, comm_id=comm_id),)


alltoall_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(alltoall_p, "mpijax_alltoall", _attrs)
batching.primitive_batchers[alltoall_p] = _batch
ad.deflinear2(alltoall_p, _transpose)

"""device_allreduce: one reduction over every local device of every rank.

The node-local path of a collective over a mesh axis that spans every device
of every rank; its sum is linear, its transpose the sum of the cotangents.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src import config
from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive

device_allreduce_p = primitive.make_primitive("mpijax_device_allreduce")


def device_allreduce(x, op: str, *, comm: Any) -> jax.Array | None:
  """Reduces ``x`` over every local device of every rank of ``comm`` in one call.

  For a collective over a mesh axis that spans all of them (inside
  ``mpijax.shard_map`` / ``mpijax.pmap``: each device calls it with its own
  ``x``). With all ranks on one node every (rank, device) takes part in the
  node-local all-reduce: cross-memory attach from ``MPIJAX_CMA_MIN_BYTES``
  (or beyond ``MPIJAX_SHM_MAX_BYTES``), shared memory below; no local XLA
  collective, no MPI message. Returns None where that path does not apply
  (ranks on several nodes, no shared memory, a message too big for the
  segments without cross-memory attach): the caller then takes another.

  Args:
    x: this device's array (a supported dtype, the same shape everywhere).
    op: "sum", "max" or "min".
    comm: the communicator over the ranks (mpi4py).
  """
  info = communicators.resolve_comm(comm, "mpijax.lax.psum")
  nbytes = x.size * x.dtype.itemsize
  if nbytes == 0 or info.size < 2:
    return None
  ready, segment, cma = communicators.device_group(comm)
  shm = nbytes <= min(segment, config.get("shm_max_bytes"))
  if not ready or not (shm or (cma and config.get("cma_min_bytes") > 0)):
    return None
  dtypes.check_reduce_op("mpijax.lax.psum", op, x.dtype)
  return device_allreduce_p.bind(x, comm_id=info.id, op=op)


def _dev_attrs(*, comm_id, op):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]))


def _dev_batch(args, dims, **params):
  (x,), (d,) = args, dims
  return device_allreduce_p.bind(x, **params), d


def _dev_jvp(primals, tangents, *, comm_id, op):
  (x,), (t,) = primals, tangents
  out = device_allreduce_p.bind(x, comm_id=comm_id, op=op)
  if type(t) is ad.Zero or not jnp.issubdtype(x.dtype, jnp.inexact):
    return out, primitive.zero_tangent(out)
  if op != "sum":  # pmax/pmin differentiate through their own rule
    raise TypeError(f"mpijax device all-reduce op={op!r} is not differentiable.")
  return out, device_allreduce_p.bind(t, comm_id=comm_id, op="sum")


def _dev_transpose(ct, x, *, comm_id, op):
  # As psum's under an unchecked shard_map: the sum of the cotangents.
  if op != "sum":
    raise TypeError(f"mpijax device all-reduce op={op!r} is not linear.")
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  return (device_allreduce_p.bind(ct, comm_id=comm_id, op="sum"),)


device_allreduce_p.def_abstract_eval(lambda x, **_: x)
lowering.register_ffi_lowering(device_allreduce_p, "mpijax_device_allreduce", _dev_attrs)
batching.primitive_batchers[device_allreduce_p] = _dev_batch
ad.primitive_jvps[device_allreduce_p] = _dev_jvp
ad.primitive_transposes[device_allreduce_p] = _dev_transpose

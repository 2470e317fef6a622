"""allreduce: every rank gets the reduction of ``x`` over the communicator.

Autodiff convention: like ``jax.lax.psum`` under ``shard_map`` with
``check_vma=False`` (a "non-replicated cotangent"), the sum is linear and its
transpose is again an allreduce-sum of the cotangent. So for a per-rank loss
``l_r(allreduce(x))`` the gradient on rank r is the sum over ranks of the
cotangents, i.e. the gradient of ``sum_r l_r``.
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
from mpijax._src.ops import reduce_ops
from mpijax._src.ops.allgather import allgather_p

allreduce_p = primitive.make_primitive("mpijax_allreduce")


def allreduce(x, op: str = "sum", *, comm: Any = None) -> jax.Array:
  """Reduces ``x`` elementwise over all ranks of ``comm``.

  Args:
    x: array (or scalar) of a supported dtype; same shape on every rank.
    op: "sum", "prod", "min", "max" (numbers), "and", "or", "xor"
      (bitwise, integers and bool), or "mean" (floating and complex dtypes:
      the sum divided by the number of ranks, in the same call, so the
      division costs no extra pass over the buffer); or an mpi4py ``MPI.Op``
      (MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX, MPI.BAND, MPI.BOR, MPI.BXOR, and
      the logical MPI.LAND, MPI.LOR, MPI.LXOR on integers and bool).
    comm: an mpi4py communicator (default: the runtime's); mpijax works on a
      private clone of it.

  Returns:
    The reduction, the same on every rank, with ``x``'s shape and dtype.

  Raises:
    ValueError: ``op`` is not an op name mpijax knows, or an ``MPI.Op`` it
      does not run (``MAXLOC``, ``MINLOC``, ``REPLACE``, user-defined).
    TypeError: ``x``'s dtype is not supported, or ``op`` is not defined for
      it (e.g. ``"xor"`` on floats; ``"mean"`` needs a floating or complex
      dtype).
    RuntimeError: ``mpijax.init()`` has not run.

  Examples:
    >>> total = mpijax.ops.allreduce(jnp.ones(3))  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.allreduce", x)
  info = communicators.resolve_comm(comm, "mpijax.ops.allreduce")
  divisor = 1
  if isinstance(op, str):  # "mean" is allreduce's own; MPI.Ops are checked by run_reduction
    if op not in dtypes.REDUCE_OPS + ("mean",):
      raise ValueError(f"mpijax.ops.allreduce got op={op!r}; expected one of "
                       f"{dtypes.REDUCE_OPS + ('mean',)}.")
    if op == "mean":
      if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(f"mpijax.ops.allreduce: op='mean' needs a floating or complex "
                        f"dtype, got {x.dtype.name}; use op='sum' and divide, or cast "
                        f"x to a float first")
      op, divisor = "sum", info.size
  return reduce_ops.run_reduction(
      "mpijax.ops.allreduce", op, x, info.size,
      lambda x, op: allreduce_p.bind(x, comm_id=info.id, op=op, divisor=divisor))


# ``divisor``: the handler divides the reduced buffer by it (1: no division).
# Only with op "sum" ("mean" of the public function).

def _abstract_eval(x, *, comm_id, op, divisor):
  return x


def _attrs(*, comm_id, op, divisor):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]),
              divisor=primitive.i64(divisor))


def _batch(args, dims, *, comm_id, op, divisor):
  (x,), (d,) = args, dims
  return allreduce_p.bind(x, comm_id=comm_id, op=op, divisor=divisor), d


def _jvp(primals, tangents, *, comm_id, op, divisor):
  (x,), (t,) = primals, tangents
  out = allreduce_p.bind(x, comm_id=comm_id, op=op, divisor=divisor)
  if type(t) is ad.Zero or not jnp.issubdtype(x.dtype, jnp.inexact):
    return out, primitive.zero_tangent(out)
  if op == "sum":  # linear, the mean too
    return out, allreduce_p.bind(t, comm_id=comm_id, op="sum", divisor=divisor)
  if op in ("min", "max"):
    # Like jnp.max: the tangent of the ranks holding the extreme, averaged
    # over ties.
    hit = (x == out).astype(x.dtype)
    count = allreduce_p.bind(hit, comm_id=comm_id, op="sum", divisor=1)
    return out, allreduce_p.bind(t * hit, comm_id=comm_id, op="sum", divisor=1) / count
  if op == "prod":
    # d(prod_r x_r) = sum_r t_r * prod_{s != r} x_s, without dividing by x.
    size, rank = _size_rank(comm_id)
    gathered = allgather_p.bind(x, comm_id=comm_id, size=size)
    mine = (jnp.arange(size) == rank).reshape((-1,) + (1,) * x.ndim)
    others = jnp.prod(jnp.where(mine, jnp.ones_like(gathered), gathered), axis=0)
    return out, allreduce_p.bind(t * others, comm_id=comm_id, op="sum", divisor=1)
  raise TypeError(f"mpijax.ops.allreduce op={op!r} is not differentiable.")


def _size_rank(comm_id: int) -> tuple[int, int]:
  info = communicators.info_of(comm_id)
  return info.size, info.rank


def _transpose(ct, x, *, comm_id, op, divisor):
  if op != "sum":
    raise TypeError(f"mpijax.ops.allreduce(op={op!r}) is not linear; only "
                    "op='sum' and op='mean' can be transposed.")
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  # The mean's transpose is the mean of the cotangents (sum / size).
  return (allreduce_p.bind(ct, comm_id=comm_id, op="sum", divisor=divisor),)


allreduce_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(allreduce_p, "mpijax_allreduce", _attrs, in_place_capable=True)
batching.primitive_batchers[allreduce_p] = _batch
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose


# --- several buffers in one call ----------------------------------------------------

allreduce_many_p = primitive.make_primitive("mpijax_allreduce_many", multiple_results=True)


def allreduce_many(xs, op: str = "sum", *, comm: Any = None) -> list[jax.Array]:
  """Reduces every array of ``xs`` over all ranks, in ONE custom call.

  What ``mpijax.train``'s fused gradient all-reduce sends its buckets with:
  one XLA custom call for the whole list (one signature check, and XLA
  cannot interleave the buckets' packing with their MPI calls). Inside it
  the arrays of one dtype share one all-reduce: by cross-memory attach when
  every rank runs on one node with one device (from ``MPIJAX_CMA_MIN_BYTES``
  in all, up to 224 arrays), else one ring from ``MPIJAX_RING_MIN_BYTES``
  per rank on; below that each array is reduced on its own, as
  :func:`allreduce` reduces it (through node-local shared memory up to
  ``MPIJAX_SHM_MAX_BYTES``, else one MPI all-reduce). Each array keeps its
  shape and dtype; intermediates and donated arrays are reduced in place.

  Args:
    xs: a non-empty list of arrays of supported dtypes; the same list of
      shapes and dtypes on every rank.
    op: "sum", "prod", "min", "max", "and", "or", "xor" or an mpi4py
      ``MPI.Op`` (as for :func:`allreduce`; every array's dtype must support it).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    The list of reductions, in order.
  """
  xs = [dtypes.as_array("mpijax.ops.allreduce_many", x) for x in xs]
  if not xs:
    raise ValueError("mpijax allreduce_many got an empty list; pass at least one array.")
  info = communicators.resolve_comm(comm, "mpijax allreduce_many")
  ops = [reduce_ops.resolve(op, x.dtype, "mpijax allreduce_many", info.size) for x in xs]
  op = ops[0].name
  dtypes_in = [x.dtype for x in xs]
  xs = [reduce_ops.as_logical(x) if r.logical else x for x, r in zip(xs, ops)]
  for x in xs:
    dtypes.check_reduce_op("mpijax allreduce_many", op, x.dtype)
  outs = allreduce_many_p.bind(*xs, comm_id=info.id, op=op)
  return [o.astype(d) if r.logical else o for o, d, r in zip(outs, dtypes_in, ops)]


def _many_abstract_eval(*xs, comm_id, op):
  return list(xs)


def _many_attrs(*, comm_id, op):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]))


def _many_batch(args, dims, **params):
  # Elementwise over ranks: a batch dimension rides along unchanged.
  return allreduce_many_p.bind(*args, **params), list(dims)


def _many_linear_part(values, zero_like, **params):
  """allreduce_many of the non-zero inexact ``values``; zeros elsewhere."""
  if params["op"] != "sum":
    raise TypeError(f"mpijax allreduce_many(op={params['op']!r}) is not differentiable; "
                    "only op='sum' is.")
  idx = [i for i, v in enumerate(values) if type(v) is not ad.Zero]
  out = [zero_like(i) for i in range(len(values))]
  if idx:
    for i, r in zip(idx, allreduce_many_p.bind(*[values[i] for i in idx], **params)):
      out[i] = r
  return out


def _many_jvp(primals, tangents, **params):
  outs = allreduce_many_p.bind(*primals, **params)
  tangents = [t if jnp.issubdtype(x.dtype, jnp.inexact) else primitive.zero_tangent(x)
              for x, t in zip(primals, tangents)]
  if all(type(t) is ad.Zero for t in tangents):
    return outs, [primitive.zero_tangent(o) for o in outs]
  return outs, _many_linear_part(tangents, lambda i: primitive.zero_tangent(outs[i]), **params)


def _many_transpose(cts, *xs, **params):
  # The sum's transpose is the sum of the cotangents (see the module docstring).
  return _many_linear_part(list(cts), lambda i: ad.Zero(xs[i].aval), **params)


allreduce_many_p.def_abstract_eval(_many_abstract_eval)
lowering.register_ffi_lowering(allreduce_many_p, "mpijax_allreduce_many", _many_attrs,
                            in_place_capable=True)
batching.primitive_batchers[allreduce_many_p] = _many_batch
ad.primitive_jvps[allreduce_many_p] = _many_jvp
ad.primitive_transposes[allreduce_many_p] = _many_transpose


# --- over every local device of every rank ------------------------------------------

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

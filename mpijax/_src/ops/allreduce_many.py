"""allreduce_many: every array of a list reduced over the ranks in one custom call.

The list's sum is linear, its transpose the sum of the cotangents, as for
``allreduce`` (see allreduce.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive
from mpijax._src.ops import reduce_ops

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



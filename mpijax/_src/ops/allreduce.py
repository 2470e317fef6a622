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

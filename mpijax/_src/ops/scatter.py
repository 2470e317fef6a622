"""scatter: rank r gets block r of root's ``x``.

Root passes every rank's block stacked, shape ``(size, *block)``; the other
ranks pass an array of the block's shape and dtype, which only gives the
result's shape (it is not read). Transpose: gather to root, and vice versa
(both registered here).
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
from mpijax._src.ops import peers
from mpijax._src.ops import primitive
from mpijax._src.ops.gather import gather_p

scatter_p = primitive.make_primitive("mpijax_scatter")


def scatter(x, root: int, *, comm: Any = None) -> jax.Array:
  """Sends block r of root's ``x`` to rank r of ``comm``.

  Args:
    x: on ``root``, the blocks stacked: shape ``(size, *block)``. On the
      other ranks, an array of shape ``block`` and root's dtype (its values
      are not read).
    root: the sending rank (a Python int).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    This rank's block, shape ``block``.

  Raises:
    ValueError: ``root`` is not a static integer rank of the communicator,
      or root's ``x`` does not hold one block per rank.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> # rank 0: x of shape (size, 3); the others: jnp.zeros(3)
    >>> mine = mpijax.ops.scatter(x, root=0)  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.scatter", x)
  dtypes.check_dtype("mpijax.ops.scatter", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.scatter")
  root = peers.check_root("mpijax.ops.scatter", root, info.size)
  if info.rank == root and (x.ndim == 0 or x.shape[0] != info.size):
    raise ValueError(
        f"mpijax.ops.scatter: root's x must have shape (nproc, ...) = ({info.size}, ...), "
        f"one block per rank, got shape {x.shape}; stack the blocks, e.g. "
        "jnp.stack(blocks).")
  return scatter_p.bind(x, comm_id=info.id, root=root, size=info.size)


def _is_root(comm_id: int, root: int) -> bool:
  return communicators.info_of(comm_id).rank == root


def _abstract_eval(x, *, comm_id, root, size):
  return x.update(shape=x.shape[1:]) if _is_root(comm_id, root) else x


def _attrs(*, comm_id, root, size):
  return dict(comm=primitive.i64(comm_id), root=primitive.i64(root))


def _signature_avals(ctx):
  return ctx.avals_out  # the block: the same on every rank


def _batch(args, dims, *, comm_id, root, size):
  (x,), (d,) = args, dims
  x = primitive.moveaxis(x, d, 1 if _is_root(comm_id, root) else 0)
  return scatter_p.bind(x, comm_id=comm_id, root=root, size=size), 0


def _transpose(ct, x, *, comm_id, root, size):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  gathered = gather_p.bind(ct, comm_id=comm_id, root=root, size=size)
  if not _is_root(comm_id, root):
    return (jnp.zeros(x.aval.shape, x.aval.dtype),)  # x was only a shape
  return (gathered,)


def _gather_transpose(ct, x, *, comm_id, root, size):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  if not _is_root(comm_id, root):
    # Not read by the scatter: a block-shaped stand-in, as its contract wants.
    ct = jnp.zeros(x.aval.shape, x.aval.dtype)
  return (scatter_p.bind(ct, comm_id=comm_id, root=root, size=size),)


scatter_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(scatter_p, "mpijax_scatter", _attrs,
                            signature_avals=_signature_avals)
batching.primitive_batchers[scatter_p] = _batch
ad.deflinear2(scatter_p, _transpose)
ad.deflinear2(gather_p, _gather_transpose)

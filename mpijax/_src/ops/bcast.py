"""bcast: every rank gets root's ``x``.

Its transpose is ``reduce``'s sum to root, and vice versa; both transposes
are registered in reduce.py, which imports this module.
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

bcast_p = primitive.make_primitive("mpijax_bcast")


def bcast(x, root: int, *, comm: Any = None) -> jax.Array:
  """Broadcasts ``x`` from rank ``root`` to every rank of ``comm``.

  Args:
    x: array of a supported dtype; same shape and dtype on every rank (only
      root's values are used).
    root: the sending rank (a Python int).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    Root's ``x`` on every rank.

  Raises:
    ValueError: ``root`` is not a static integer rank of the communicator.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> params = mpijax.ops.bcast(params_leaf, root=0)  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.bcast", x)
  dtypes.check_dtype("mpijax.ops.bcast", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.bcast")
  peers.check_root("mpijax.ops.bcast", root, info.size)
  return bcast_p.bind(x, comm_id=info.id, root=root)


def _same(x, **params):
  return x


def _bcast_attrs(*, comm_id, root):
  return dict(comm=primitive.i64(comm_id), root=primitive.i64(root))


def _elementwise_batcher(prim):
  def rule(args, dims, **params):
    return prim.bind(args[0], **params), dims[0]
  return rule


bcast_p.def_abstract_eval(_same)
lowering.register_ffi_lowering(bcast_p, "mpijax_bcast", _bcast_attrs, in_place_capable=True)
batching.primitive_batchers[bcast_p] = _elementwise_batcher(bcast_p)
# Its transpose is reduce's sum to root: registered in reduce.py, which imports this module.

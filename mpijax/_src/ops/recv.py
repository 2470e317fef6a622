"""recv: MPI's point-to-point receive (``MPI_Recv``), from one rank or any, by tag.

See send.py for how point-to-point calls pair, and what they check.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import peers
from mpijax._src.ops import primitive

recv_p = primitive.make_primitive("mpijax_recv")


def recv(x, source: int | None = None, *, tag: int | None = None, comm: Any = None,
         status: Any = None) -> jax.Array:
  """Receives an array shaped like ``x`` from rank ``source`` (``MPI_Recv``).

  Args:
    x: gives the shape and dtype of what arrives (a ``jax.ShapeDtypeStruct``
      or an array, whose values are not read).
    source: the sending rank; None or ``MPI.ANY_SOURCE``: any rank;
      ``MPI.PROC_NULL``: no message, ``x`` comes back unchanged.
    tag: the tag to match; None or ``MPI.ANY_TAG``: any tag.
    comm: an mpi4py communicator (default: the runtime's).
    status: an mpi4py ``MPI.Status`` that gets the receive's source, tag and
      size when the call has run (inside ``jax.jit``: when the result is
      ready).

  Returns:
    The received array (``x``'s shape and dtype).

  Raises:
    ValueError: ``source`` is not a rank of the communicator (or one of the
      MPI constants above), or ``tag`` is outside ``[0, MPI.TAG_UB]``.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> if rank == 1:  # doctest: +SKIP
    ...   y = mpijax.ops.recv(jnp.zeros(3), source=0, tag=7)
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    x = jnp.zeros(x.shape, x.dtype)
  x = dtypes.as_array("mpijax.ops.recv", x)
  dtypes.check_dtype("mpijax.ops.recv", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.recv")
  out = recv_p.bind(x, comm_id=info.id,
                    source=peers.peer(source, info.size, "source", "mpijax.ops.recv", any_ok=True),
                    recvtag=peers.tag(tag, "tag", "mpijax.ops.recv", any_ok=True),
                    status=peers.status_ref(status, "mpijax.ops.recv"))
  return peers.settled(out, status)


def _template(template, **params):
  return template


def _recv_batch(args, dims, **params):
  (x,), (d,) = args, dims
  return recv_p.bind(primitive.moveaxis(x, d, 0), **params), 0


recv_p.def_abstract_eval(_template)
# The template's buffer may become the result's: the message lands in it.
lowering.register_ffi_lowering(recv_p, "mpijax_recv", peers.attrs, in_place_capable=True)
batching.primitive_batchers[recv_p] = _recv_batch

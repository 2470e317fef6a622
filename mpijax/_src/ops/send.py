"""send: MPI's point-to-point send (``MPI_Send``), with a tag.

Unlike the collectives, only the ranks that exchange make the point-to-point
calls (send, recv, the tagged sendrecv), as in MPI: a send on rank 0 pairs
with a receive on rank 1, matched by (communicator, sender, tag). They run in
program order with every other mpijax call of the rank (the order token), so
a ``send`` then ``recv`` on one rank against a ``recv`` then ``send`` on
another cannot deadlock by being reordered. The messages travel on a private
clone of the communicator that carries no other point-to-point traffic, so a
receive from any source or tag only ever takes a ``send``.

There is no signature check (it would be a collective): a receive whose
buffer is smaller than the message is an MPI truncation error, which ends the
job; a receive with no matching send is a stall, reported after
``MPIJAX_TIMEOUT``. ``send`` and ``recv`` are not differentiable (the
received value depends on another rank's input, which this rank's JAX cannot
see).
"""

from __future__ import annotations

from typing import Any

from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import peers
from mpijax._src.ops import primitive

send_p = primitive.make_primitive("mpijax_send", multiple_results=True)


def send(x, dest: int, *, tag: int = 0, comm: Any = None) -> None:
  """Sends ``x`` to rank ``dest`` of ``comm`` (``MPI_Send``).

  Args:
    x: array of a supported dtype.
    dest: the receiving rank (a Python int), or ``MPI.PROC_NULL`` (no-op).
    tag: the message's tag, in [0, MPI.TAG_UB].
    comm: an mpi4py communicator (default: the runtime's).

  Only this rank and ``dest`` take part; ``dest`` must make a matching
  :func:`recv` (or tagged sendrecv). Inside ``jax.jit`` the call runs in
  program order with the rank's other mpijax calls, also though it returns
  nothing.

  Raises:
    ValueError: ``dest`` is not a rank of the communicator (or
      ``MPI.PROC_NULL``), or ``tag`` is outside ``[0, MPI.TAG_UB]``.
    TypeError: ``x``'s dtype is not one of :data:`mpijax.ops.SUPPORTED_DTYPES`.

  Examples:
    >>> if rank == 0:  # doctest: +SKIP
    ...   mpijax.ops.send(x, dest=1, tag=7)
  """
  x = dtypes.as_array("mpijax.ops.send", x)
  dtypes.check_dtype("mpijax.ops.send", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.send")
  send_p.bind(x, comm_id=info.id,
              dest=peers.peer(dest, info.size, "dest", "mpijax.ops.send", any_ok=False),
              sendtag=peers.tag(tag, "tag", "mpijax.ops.send", any_ok=False))


def _abstract_eval(x, **params):
  return []


def _send_batch(args, dims, **params):
  (x,), (d,) = args, dims
  send_p.bind(primitive.moveaxis(x, d, 0), **params)
  return [], []


send_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(send_p, "mpijax_send", peers.attrs)
batching.primitive_batchers[send_p] = _send_batch

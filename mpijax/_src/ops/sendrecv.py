"""sendrecv: send to one rank and receive from another at once.

Two forms. ``sendrecv`` (``mpijax.ops.sendrecv``) is a step every rank of
the communicator takes, a ``ppermute`` over the pairs this rank knows about,
with ppermute's transpose. ``tagged_sendrecv`` (mpi4jax's ``sendrecv``) is
``MPI_Sendrecv`` itself: only this rank and its two peers take part, matched
by tags (see send.py). It is linear in what it sends; its transpose sends the
cotangent back (to ``source``, received from ``dest``).
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
from mpijax._src.ops import ppermute
from mpijax._src.ops import primitive

sendrecv_p = primitive.make_primitive("mpijax_sendrecv")


def sendrecv(x, source: int | None, dest: int | None, *,
             comm: Any = None) -> jax.Array:
  """This rank's step of a point-to-point exchange, like ``MPI_Sendrecv``.

  Sends ``x`` to rank ``dest`` and returns what rank ``source`` sent (zeros
  when ``source`` is None; nothing is sent when ``dest`` is None). The ranks'
  arguments must match up (if r sends to d, d receives from r): a receive
  with no matching send waits until the configured timeout and is reported
  as a stall; a send that no rank receives is lost, and never taken by a later
  exchange (each exchange has its own MPI tag). Every rank of the
  communicator makes the call, also one with neither ``source`` nor ``dest``.
  It is a ``ppermute`` over the pairs this rank knows about, so it has the
  same transpose (send back to ``source``, receive from ``dest``).

  Args:
    x: the array to send, of a supported dtype; what arrives has its shape
      and dtype, so the peers' ``x`` must agree.
    source: the rank whose ``x`` this rank receives (a Python int), or None
      to receive nothing.
    dest: the rank this rank's ``x`` goes to (a Python int), or None to
      send nothing.
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    What ``source`` sent (``x``'s shape and dtype), or zeros when ``source``
    is None.

  Raises:
    ValueError: ``source`` or ``dest`` is outside the communicator.
    TypeError: ``x``'s dtype is not supported, or ``source``/``dest`` is not
      an integer.

  Examples:
    >>> right = mpijax.ops.sendrecv(x, source=(r - 1) % n, dest=(r + 1) % n)  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.sendrecv", x)
  dtypes.check_dtype("mpijax.ops.sendrecv", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.sendrecv")
  pairs = []
  if dest is not None:
    pairs.append((info.rank, dest))
  if source is not None:
    pairs.append((source, info.rank))
  pairs = ppermute.normalize_perm(list(dict.fromkeys(pairs)), info.size)
  # Bound even without pairs: every rank counts the exchange (its MPI tag).
  return ppermute.ppermute_p.bind(x, comm_id=info.id, perm=pairs, rank_view=True)


def tagged_sendrecv(sendbuf, recvbuf, source: int | None, dest: int, *, sendtag: int = 0,
                    recvtag: int | None = None, comm: Any = None,
                    status: Any = None, op_name: str = "mpijax sendrecv") -> jax.Array:
  """Sends ``sendbuf`` to ``dest`` and receives like ``recvbuf`` from ``source``.

  ``MPI_Sendrecv``: both at once, so a ring or halo exchange cannot deadlock.
  Only this rank and its two peers take part. Peers and tags as for
  :func:`send` and :func:`recv`.
  """
  sendbuf = dtypes.as_array(op_name, sendbuf)
  dtypes.check_dtype(op_name, sendbuf.dtype)
  recvbuf = dtypes.as_array(op_name, recvbuf)
  dtypes.check_dtype(op_name, recvbuf.dtype)
  info = communicators.resolve_comm(comm, op_name)
  out = sendrecv_p.bind(
      recvbuf, sendbuf, comm_id=info.id,
      dest=peers.peer(dest, info.size, "dest", op_name, any_ok=False),
      sendtag=peers.tag(sendtag, "sendtag", op_name, any_ok=False),
      source=peers.peer(source, info.size, "source", op_name, any_ok=True),
      recvtag=peers.tag(recvtag, "recvtag", op_name, any_ok=True),
      status=peers.status_ref(status, op_name))
  return peers.settled(out, status)


def _template(template, *xs, **params):
  return template


def _sendrecv_batch(args, dims, **params):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)  # None: not batched
  template, x = (batching.bdim_at_front(a, d, size) for a, d in zip(args, dims))
  return sendrecv_p.bind(template, x, **params), 0


def _sendrecv_jvp(primals, tangents, **params):
  template, x = primals
  _, t = tangents
  out = sendrecv_p.bind(template, x, **params)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return out, primitive.zero_tangent(out)
  # The peers exchange tangents whether or not this rank's is a symbolic zero.
  t = ad.instantiate_zeros(t)
  return out, sendrecv_p.bind(jnp.zeros_like(template), t, **params)


def _sendrecv_transpose(ct, template, x, *, dest, source, **params):
  if source == peers.ANY:
    raise ValueError(
        "mpijax: cannot transpose a sendrecv that received from any source "
        "(MPI.ANY_SOURCE): the cotangent must go back to one known rank. Name the "
        "source to differentiate through it.")
  ct = ad.instantiate_zeros(ct)
  back = sendrecv_p.bind(jnp.zeros(x.aval.shape, x.aval.dtype), ct, dest=source, source=dest,
                         **params)
  return None, back


sendrecv_p.def_abstract_eval(_template)
# Not in place: the template may be the very array being sent.
lowering.register_ffi_lowering(sendrecv_p, "mpijax_sendrecv", peers.attrs)
batching.primitive_batchers[sendrecv_p] = _sendrecv_batch
ad.primitive_jvps[sendrecv_p] = _sendrecv_jvp
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose

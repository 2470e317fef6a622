"""send / recv / tagged sendrecv: MPI's point-to-point messages, with tags.

Unlike the collectives (and ``mpijax.ops.sendrecv``, a ppermute every rank
joins), only the ranks that exchange make these calls, as in MPI: a send on
rank 0 pairs with a receive on rank 1, matched by (communicator, sender,
tag). They run in program order with every other mpijax call of the rank (the
order token), so a ``send`` then ``recv`` on one rank against a ``recv`` then
``send`` on another cannot deadlock by being reordered. The messages travel
on a private clone of the communicator that carries no other point-to-point
traffic, so a receive from any source or tag only ever takes a ``send``.

There is no signature check (it would be a collective): a receive whose
buffer is smaller than the message is an MPI truncation error, which ends the
job; a receive with no matching send is a stall, reported after
``MPIJAX_TIMEOUT``.

Autodiff: the tagged sendrecv is linear in what it sends; its transpose sends
the cotangent back (to ``source``, received from ``dest``). ``send`` and
``recv`` alone are not differentiable (the received value depends on another
rank's input, which this rank's JAX cannot see).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive

send_p = primitive.make_primitive("mpijax_send", multiple_results=True)
recv_p = primitive.make_primitive("mpijax_recv")
sendrecv_p = primitive.make_primitive("mpijax_sendrecv")

# Peers and tags as the C++ handler reads them (mpi4py's constants differ
# between MPI implementations: ANY_SOURCE is -1 in Open MPI, -2 in MPICH).
_ANY = -1        # MPI_ANY_SOURCE, MPI_ANY_TAG
_NO_PEER = -2    # MPI_PROC_NULL


def _mpi():
  from mpijax._src import mpi_util
  return mpi_util.import_mpi()


@functools.cache
def _tag_ub() -> int:
  MPI = _mpi()
  value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
  return int(value) if value else 32767  # the least MPI guarantees


def _peer(value: Any, size: int, what: str, op_name: str, any_ok: bool) -> int:
  """The handler's code for a peer rank given as an int, None or MPI constant."""
  MPI = _mpi()
  if value is None and any_ok:
    return _ANY
  try:
    rank = operator.index(value)  # a Python or NumPy integer, not a traced value
  except TypeError:
    rank = None
  if rank is not None and not isinstance(value, bool):
    if rank == MPI.PROC_NULL:
      return _NO_PEER
    if any_ok and rank == MPI.ANY_SOURCE:
      return _ANY
    if 0 <= rank < size:
      return rank
  extra = ", MPI.ANY_SOURCE or None (any rank)" if any_ok else ""
  raise ValueError(f"{op_name} got {what}={value!r}; expected a static integer rank in "
                   f"[0, {size}) of the communicator, MPI.PROC_NULL (no peer){extra}.")


def _tag(value: Any, what: str, op_name: str, any_ok: bool) -> int:
  MPI = _mpi()
  if value is None and any_ok:
    return _ANY
  try:
    tag = operator.index(value)
  except TypeError:
    tag = None
  if tag is not None and not isinstance(value, bool):
    if any_ok and tag == MPI.ANY_TAG:
      return _ANY
    if 0 <= tag <= _tag_ub():
      return tag
  extra = ", MPI.ANY_TAG or None (any tag)" if any_ok else ""
  raise ValueError(f"{op_name} got {what}={value!r}; expected a static integer tag in "
                   f"[0, {_tag_ub()}] (MPI.TAG_UB){extra}.")


class _StatusRef:
  """A hashable reference to an mpi4py ``MPI.Status`` (a primitive parameter).

  The compiled call writes the receive's status to the object's memory, so the
  parameter keeps the object alive as long as the compiled program is cached.
  """
  __slots__ = ("status",)

  def __init__(self, status):
    self.status = status

  def __hash__(self):
    return id(self.status)

  def __eq__(self, other):
    return isinstance(other, _StatusRef) and other.status is self.status

  def __repr__(self):
    return f"MPI.Status@{id(self.status):#x}"

  def address(self) -> int:
    return int(_mpi()._addressof(self.status))


def _status_ref(status: Any, op_name: str) -> _StatusRef | None:
  if status is None:
    return None
  MPI = _mpi()
  if not isinstance(status, MPI.Status):
    raise TypeError(f"{op_name} got status of type {type(status).__name__}; pass an "
                    "mpi4py MPI.Status() (or None).")
  return _StatusRef(status)


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
              dest=_peer(dest, info.size, "dest", "mpijax.ops.send", any_ok=False),
              sendtag=_tag(tag, "tag", "mpijax.ops.send", any_ok=False))


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
                    source=_peer(source, info.size, "source", "mpijax.ops.recv", any_ok=True),
                    recvtag=_tag(tag, "tag", "mpijax.ops.recv", any_ok=True),
                    status=_status_ref(status, "mpijax.ops.recv"))
  return _settled(out, status)


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
      dest=_peer(dest, info.size, "dest", op_name, any_ok=False),
      sendtag=_tag(sendtag, "sendtag", op_name, any_ok=False),
      source=_peer(source, info.size, "source", op_name, any_ok=True),
      recvtag=_tag(recvtag, "recvtag", op_name, any_ok=True),
      status=_status_ref(status, op_name))
  return _settled(out, status)


def _settled(out, status):
  """Eagerly, with a status to fill, waits for the call: then the status is set."""
  if status is not None and not isinstance(out, jax.core.Tracer):
    out.block_until_ready()
  return out


# --- abstract eval, lowering -------------------------------------------------------


def _send_abstract_eval(x, **params):
  return []


def _template(template, *xs, **params):
  return template


def _attrs(*, comm_id, dest=_NO_PEER, sendtag=0, source=_NO_PEER, recvtag=0, status=None):
  return dict(comm=primitive.i64(comm_id), dest=primitive.i64(dest), sendtag=primitive.i64(sendtag),
              source=primitive.i64(source), recvtag=primitive.i64(recvtag),
              status=primitive.i64(0 if status is None else status.address()))


send_p.def_abstract_eval(_send_abstract_eval)
recv_p.def_abstract_eval(_template)
sendrecv_p.def_abstract_eval(_template)
lowering.register_ffi_lowering(send_p, "mpijax_send", _attrs)
# The template's buffer may become the result's: the message lands in it.
lowering.register_ffi_lowering(recv_p, "mpijax_recv", _attrs, in_place_capable=True)
# Not in place: the template may be the very array being sent.
lowering.register_ffi_lowering(sendrecv_p, "mpijax_sendrecv", _attrs)


# --- batching ------------------------------------------------------------------------


def _send_batch(args, dims, **params):
  (x,), (d,) = args, dims
  send_p.bind(primitive.moveaxis(x, d, 0), **params)
  return [], []


def _recv_batch(args, dims, **params):
  (x,), (d,) = args, dims
  return recv_p.bind(primitive.moveaxis(x, d, 0), **params), 0


def _sendrecv_batch(args, dims, **params):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)  # None: not batched
  template, x = (batching.bdim_at_front(a, d, size) for a, d in zip(args, dims))
  return sendrecv_p.bind(template, x, **params), 0


batching.primitive_batchers[send_p] = _send_batch
batching.primitive_batchers[recv_p] = _recv_batch
batching.primitive_batchers[sendrecv_p] = _sendrecv_batch


# --- autodiff of the tagged sendrecv ---------------------------------------------------


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
  if source == _ANY:
    raise ValueError(
        "mpijax: cannot transpose a sendrecv that received from any source "
        "(MPI.ANY_SOURCE): the cotangent must go back to one known rank. Name the "
        "source to differentiate through it.")
  ct = ad.instantiate_zeros(ct)
  back = sendrecv_p.bind(jnp.zeros(x.aval.shape, x.aval.dtype), ct, dest=source, source=dest,
                         **params)
  return None, back


ad.primitive_jvps[sendrecv_p] = _sendrecv_jvp
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose

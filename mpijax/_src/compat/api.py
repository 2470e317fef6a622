"""mpi4jax's public API on mpijax's transport.

``import mpijax.compat.mpi4jax as mpi4jax`` runs a program written for
mpi4jax (the API of mpi4jax 0.8 to 0.9.1: no tokens) on mpijax's MPI
primitives: the same functions, signatures, return values and autodiff
rules, with mpi4py ``MPI.Op`` objects and communicators.

What differs from mpi4jax, and why, is listed in docs/mpi4jax.md. In short:
the calls run on private clones of the communicator (mpijax's contract), so
importing this module starts the mpijax runtime and registers the default
communicator and ``MPI.COMM_WORLD`` (collectively, on every rank); CPU only;
float16 and bfloat16 work too; ``sendrecv`` is also differentiable in
forward mode; wrong arguments fail at trace time with a message, not by
aborting the job.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

from mpijax._src.compat import autodiff
from mpijax._src.ops import allgather as _allgather
from mpijax._src.ops import alltoall as _alltoall
from mpijax._src.ops import barrier as _barrier
from mpijax._src.ops import bcast as _bcast
from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import gather as _gather
from mpijax._src.ops import recv as _recv
from mpijax._src.ops import reduce as _reduce
from mpijax._src.ops import reduce_ops
from mpijax._src.ops import scan as _scan
from mpijax._src.ops import scatter as _scatter
from mpijax._src.ops import send as _send
from mpijax._src.ops import sendrecv as _sendrecv
from mpijax._src.runtime import state as runtime

# The mpi4jax API this module matches (for programs that check the version).
__version__ = "0.9.1"

_NOTSET = object()  # mpi4jax's sentinel for the removed `token` argument


def _mpi():
  from mpijax._src import mpi_util
  return mpi_util.import_mpi()


def _no_token(token: Any) -> None:
  if token is not _NOTSET:
    raise RuntimeError(
        "Explicit token management is not supported for mpi4jax>=0.8.0. "
        "Tokens are now managed automatically and must not be passed "
        "as arguments to collective operations anymore.\n"
        "That is, please adjust your code like this:\n"
        "     # For mpi4jax<0.8.0:\n"
        "     result, token = mpi4jax.allgather(x, token=token)\n"
        "     # For mpi4jax>=0.8.0:\n"
        "     result = mpi4jax.allgather(x)\n"
        "(mpijax.compat.mpi4jax orders its calls in program order by itself.)")


def _type_error(fn: str, arg: str, expected: str, value: Any) -> TypeError:
  hint = ""
  if isinstance(value, jax.core.Tracer):
    hint = ("\n\nAn abstract tracer was passed where a concrete value is expected. "
            "Try using the static_argnums argument of jax.jit.")
  return TypeError(f'{fn} got unexpected type for argument "{arg}" '
                   f"(expected: {expected}, got: {type(value)}).{hint}")


def _int(fn: str, arg: str, value: Any) -> int:
  """A Python or NumPy integer (not bool, not traced), as mpi4jax accepts."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise _type_error(fn, arg, "integer", value)
  return operator.index(value)


def _comm(fn: str, comm: Any) -> Any:
  """The communicator (None: mpijax's default, a clone of COMM_WORLD)."""
  if comm is None:
    return None
  if not isinstance(comm, _mpi().Intracomm):
    raise _type_error(fn, "comm", "['NoneType', 'Intracomm']", comm)
  return comm


def _op(fn: str, op: Any) -> Any:
  if not isinstance(op, (_mpi().Op, str)):
    raise _type_error(fn, "op", "Op", op)
  return op


def _nd(x: Any, name: str) -> Any:
  """``x`` as the input of a function mpi4jax does not differentiate."""
  return autodiff.no_derivative(dtypes.as_array(name, x), name)


def _rank_size(comm: Any, fn: str) -> tuple[int, int]:
  info = communicators.resolve_comm(comm, fn)
  return info.rank, info.size


def allreduce(x, op, *, comm=None, token=_NOTSET):
  """Performs an allreduce: every rank gets the reduction of ``x``.

  Differentiable (``jax.grad``, ``jax.jvp``, ``jax.linear_transpose``) for
  ``op=MPI.SUM``, with mpi4jax's convention: the transpose of the sum is the
  identity (each rank keeps its own cotangent).

  Args:
    x: array or scalar input; the same shape and dtype on every rank.
    op: an mpi4py ``MPI.Op`` (e.g. ``MPI.SUM``), or an mpijax op name.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    The result of the allreduce (``x``'s shape and dtype), on every rank.

  Raises:
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    ValueError: an op mpijax does not reduce with (``MPI.MAXLOC``,
      ``MPI.MINLOC``, ``MPI.REPLACE``, a user-defined op).

  Examples:
    >>> total = mpi4jax.allreduce(x, op=MPI.SUM)  # doctest: +SKIP
  """
  _no_token(token)
  comm, op = _comm("allreduce", comm), _op("allreduce", op)
  x = dtypes.as_array("allreduce", x)
  info = communicators.resolve_comm(comm, "allreduce")
  return reduce_ops.run_reduction(
      "allreduce", op, x, info.size,
      lambda x, op: autodiff.allreduce_p.bind(x, comm_id=info.id, op=op))


def allgather(x, *, comm=None, token=_NOTSET):
  """Performs an allgather: every rank gets ``(nproc, *x.shape)``, entry r from rank r.

  Args:
    x: array or scalar input; the same shape and dtype on every rank.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    An array of shape ``(nproc, *x.shape)`` whose entry ``r`` is rank r's
    ``x``, on every rank.

  Raises:
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  return _allgather.allgather(_nd(x, "allgather"), comm=_comm("allgather", comm))


def alltoall(x, *, comm=None, token=_NOTSET):
  """Performs an alltoall: ``x[j]`` goes to rank j, ``out[j]`` comes from rank j.

  Args:
    x: array of shape ``(nproc, ...)``: entry ``j`` goes to rank j; the
      same shape and dtype on every rank.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    An array of ``x``'s shape whose entry ``j`` is rank j's ``x[rank]``.

  Raises:
    ValueError: ``x.shape[0]`` is not the communicator's size.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  comm = _comm("alltoall", comm)
  _, size = _rank_size(comm, "alltoall")
  shape = np.shape(x)
  if not shape or shape[0] != size:
    raise ValueError(f"Alltoall input must have shape (nproc, ...) = ({size}, ...), "
                     f"got shape {shape}.")
  return _alltoall.alltoall(_nd(x, "alltoall"), comm=comm)


def barrier(*, comm=None, token=_NOTSET):
  """Performs a barrier: waits until every rank of ``comm`` has reached it.

  Inside ``jax.jit`` it runs in program order with the other calls.

  Args:
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    ``[]``, as mpi4jax's barrier.

  Raises:
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
  """
  _no_token(token)
  _barrier.barrier(comm=_comm("barrier", comm))
  return []  # what mpi4jax's barrier primitive returns


def bcast(x, root, *, comm=None, token=_NOTSET):
  """Broadcasts root's ``x``: a new array on the other ranks; root gets ``x`` back.

  Args:
    x: on ``root``, the array to send; on the other ranks an array of the
      same shape and dtype (its values are not read).
    root: the sending rank (a Python or NumPy integer).
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    ``root``'s ``x``: a new array on the other ranks, ``x`` itself on
    ``root``.

  Raises:
    ValueError: ``root`` is outside the communicator.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  root, comm = _int("bcast", "root", root), _comm("bcast", comm)
  rank, _ = _rank_size(comm, "bcast")
  res = _bcast.bcast(_nd(x, "bcast"), root, comm=comm)
  return x if rank == root else res


def gather(x, root, *, comm=None, token=_NOTSET):
  """Gathers ``x`` onto root: ``(nproc, *x.shape)`` there; the others get ``x`` back.

  Args:
    x: array or scalar input; the same shape and dtype on every rank.
    root: the receiving rank (a Python or NumPy integer).
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    On ``root`` an array of shape ``(nproc, *x.shape)`` whose entry ``r`` is
    rank r's ``x``; on the other ranks ``x`` itself.

  Raises:
    ValueError: ``root`` is outside the communicator.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  root, comm = _int("gather", "root", root), _comm("gather", comm)
  rank, _ = _rank_size(comm, "gather")
  res = _gather.gather(_nd(x, "gather"), root, comm=comm)
  return res if rank == root else x


def reduce(x, op, root, *, comm=None, token=_NOTSET):
  """Reduces ``x`` onto root; the other ranks get ``x`` back unchanged.

  Args:
    x: array or scalar input; the same shape and dtype on every rank.
    op: an mpi4py ``MPI.Op`` (e.g. ``MPI.SUM``), or an mpijax op name.
    root: the receiving rank (a Python or NumPy integer).
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    On ``root`` the reduction over every rank's ``x`` (``x``'s shape and
    dtype); on the other ranks ``x`` itself.

  Raises:
    ValueError: ``root`` is outside the communicator, or an op mpijax does
      not reduce with.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  op, root = _op("reduce", op), _int("reduce", "root", root)
  comm = _comm("reduce", comm)
  rank, _ = _rank_size(comm, "reduce")
  res = _reduce.reduce(_nd(x, "reduce"), op, root, comm=comm)
  return res if rank == root else x


def scan(x, op, *, comm=None, token=_NOTSET):
  """Performs a scan: rank r gets the reduction of ranks 0..r's ``x``.

  Args:
    x: array or scalar input; the same shape and dtype on every rank.
    op: an mpi4py ``MPI.Op`` (e.g. ``MPI.SUM``), or an mpijax op name.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    The inclusive prefix reduction (``x``'s shape and dtype).

  Raises:
    ValueError: an op mpijax does not reduce with.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  return _scan.scan(_nd(x, "scan"), _op("scan", op), comm=_comm("scan", comm))


def scatter(x, root, *, comm=None, token=_NOTSET):
  """Scatters root's ``x`` (shape ``(nproc, *block)``): rank r gets block r.

  Args:
    x: on ``root``, the blocks stacked: shape ``(nproc, *block)``; on the
      other ranks an array of shape ``block`` and root's dtype (its values
      are not read).
    root: the sending rank (a Python or NumPy integer).
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    This rank's block (shape ``block``).

  Raises:
    ValueError: ``root`` is outside the communicator, or root's ``x`` does
      not have ``nproc`` blocks.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).
  """
  _no_token(token)
  root, comm = _int("scatter", "root", root), _comm("scatter", comm)
  rank, size = _rank_size(comm, "scatter")
  shape = np.shape(x)
  if rank == root and (not shape or shape[0] != size):
    raise ValueError(f"Scatter input must have shape (nproc, ...) = ({size}, ...) on the "
                     f"root, got shape {shape}.")
  return _scatter.scatter(_nd(x, "scatter"), root, comm=comm)


def send(x, dest, *, tag=0, comm=None, token=_NOTSET):
  """Sends ``x`` to rank ``dest`` (only this rank and ``dest`` take part).

  ``dest`` makes the matching :func:`recv` (or ``sendrecv``).

  Args:
    x: the array to send.
    dest: the receiving rank (a Python or NumPy integer), or
      ``MPI.PROC_NULL`` (nothing is sent).
    tag: the message's tag, in ``[0, MPI.TAG_UB]``.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    ``[]``, as mpi4jax's send.

  Raises:
    ValueError: ``dest`` is outside the communicator, or ``tag`` out of
      range.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).

  Examples:
    >>> if rank == 0:  # doctest: +SKIP
    ...   mpi4jax.send(x, dest=1, tag=7)
  """
  _no_token(token)
  dest, tag = _int("send", "dest", dest), _int("send", "tag", tag)
  _send.send(_nd(x, "send"), dest, tag=tag, comm=_comm("send", comm))
  return []  # what mpi4jax's send primitive returns


def recv(x, source=None, *, tag=None, comm=None, status=None, token=_NOTSET):
  """Receives an array shaped like ``x`` from ``source`` (default: any source, any tag).

  Args:
    x: an array with the shape and dtype of the message (its values are not
      read).
    source: the sending rank (a Python or NumPy integer); None or
      ``MPI.ANY_SOURCE``: any rank; ``MPI.PROC_NULL``: no message, ``x``
      comes back.
    tag: the tag to match; None or ``MPI.ANY_TAG``: any tag.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    status: an mpi4py ``MPI.Status`` that gets the receive's source, tag
      and count when the call has run.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    The received array (``x``'s shape and dtype).

  Raises:
    ValueError: ``source`` is outside the communicator, or ``tag`` out of
      range.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.
    NotImplementedError: when differentiated (as in mpi4jax, only
      ``allreduce`` and ``sendrecv`` are differentiable).

  Examples:
    >>> if rank == 1:  # doctest: +SKIP
    ...   y = mpi4jax.recv(jnp.zeros(3), source=0, tag=7)
  """
  _no_token(token)
  MPI = _mpi()
  source = MPI.ANY_SOURCE if source is None else _int("recv", "source", source)
  tag = MPI.ANY_TAG if tag is None else _int("recv", "tag", tag)
  return _recv.recv(_nd(x, "recv"), source, tag=tag, comm=_comm("recv", comm), status=status)


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=None, comm=None,
             status=None, token=_NOTSET):
  """Sends ``sendbuf`` to ``dest`` and receives like ``recvbuf`` from ``source``, at once.

  ``MPI_Sendrecv``: a ring or halo exchange made of them cannot deadlock.
  Only this rank and its two peers take part. Differentiable: the cotangent
  goes back along the same path (to ``source``, from ``dest``; so not from
  ``MPI.ANY_SOURCE``), and, unlike mpi4jax's, in forward mode too.

  Args:
    sendbuf: the array to send to ``dest``.
    recvbuf: an array with the shape and dtype of what arrives (its values
      are not read).
    source: the sending rank (a Python or NumPy integer), ``MPI.ANY_SOURCE``
      or ``MPI.PROC_NULL`` (nothing arrives: ``recvbuf`` comes back).
    dest: the receiving rank, or ``MPI.PROC_NULL`` (nothing is sent).
    sendtag: the tag of the message sent, in ``[0, MPI.TAG_UB]``.
    recvtag: the tag to match; None or ``MPI.ANY_TAG``: any tag.
    comm: the mpi4py ``Intracomm`` to use (default: a clone of
      ``COMM_WORLD``); mpijax works on a private clone of it.
    status: an mpi4py ``MPI.Status`` that gets the receive's source, tag
      and count when the call has run.
    token: not supported (mpi4jax >= 0.8 orders the calls itself); passing
      one raises ``RuntimeError`` with mpi4jax's message.

  Returns:
    The received array (``recvbuf``'s shape and dtype).

  Raises:
    ValueError: a peer outside the communicator, or a tag out of range.
    TypeError: an argument of another type than mpi4jax takes (with
      mpi4jax's message, naming it), or an array of a dtype mpijax cannot
      send.

  Examples:
    >>> left, right = (rank - 1) % size, (rank + 1) % size  # doctest: +SKIP
    >>> halo = mpi4jax.sendrecv(edge, edge, source=left, dest=right)  # doctest: +SKIP
  """
  _no_token(token)
  MPI = _mpi()
  source, dest = _int("sendrecv", "source", source), _int("sendrecv", "dest", dest)
  sendtag = _int("sendrecv", "sendtag", sendtag)
  recvtag = MPI.ANY_TAG if recvtag is None else _int("sendrecv", "recvtag", recvtag)
  return _sendrecv.tagged_sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag,
                             recvtag=recvtag, comm=_comm("sendrecv", comm), status=status,
                             op_name="sendrecv")


def has_cuda_support() -> bool:
  """False: mpijax's transport runs on CPU devices."""
  return False


def has_sycl_support() -> bool:
  """False: mpijax's transport runs on CPU devices."""
  return False


def start() -> None:
  """Starts the runtime and registers the communicators mpi4jax programs use.

  mpi4jax needs no setup call, and its point-to-point calls are made by some
  ranks only; mpijax's private communicator clones are made collectively at
  first use, so the default communicator and ``MPI.COMM_WORLD`` are
  registered here, at import, where every rank passes.
  """
  rt = runtime.init() if not runtime.is_initialized() else runtime.get()
  communicators.resolve_comm(None, "mpijax.compat.mpi4jax")
  if rt._world_comm is _mpi().COMM_WORLD:  # not when started on a sub-communicator
    communicators.resolve_comm(rt._world_comm, "mpijax.compat.mpi4jax")

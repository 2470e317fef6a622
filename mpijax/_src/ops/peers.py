"""The ranks and tags an operation names: roots, peers and tags checked as
MPI would, the point-to-point calls' attributes, and a receive's status."""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import numpy as np

from mpijax._src.ops import primitive

# Peers and tags as the C++ handler reads them (mpi4py's constants differ
# between MPI implementations: ANY_SOURCE is -1 in Open MPI, -2 in MPICH).
ANY = -1        # MPI_ANY_SOURCE, MPI_ANY_TAG
NO_PEER = -2    # MPI_PROC_NULL


def _mpi():
  from mpijax._src import mpi_util
  return mpi_util.import_mpi()


@functools.cache
def _tag_ub() -> int:
  MPI = _mpi()
  value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
  return int(value) if value else 32767  # the least MPI guarantees


def peer(value: Any, size: int, what: str, op_name: str, any_ok: bool) -> int:
  """The handler's code for a peer rank given as an int, None or MPI constant."""
  MPI = _mpi()
  if value is None and any_ok:
    return ANY
  try:
    rank = operator.index(value)  # a Python or NumPy integer, not a traced value
  except TypeError:
    rank = None
  if rank is not None and not isinstance(value, bool):
    if rank == MPI.PROC_NULL:
      return NO_PEER
    if any_ok and rank == MPI.ANY_SOURCE:
      return ANY
    if 0 <= rank < size:
      return rank
  extra = ", MPI.ANY_SOURCE or None (any rank)" if any_ok else ""
  raise ValueError(f"{op_name} got {what}={value!r}; expected a static integer rank in "
                   f"[0, {size}) of the communicator, MPI.PROC_NULL (no peer){extra}.")


def tag(value: Any, what: str, op_name: str, any_ok: bool) -> int:
  MPI = _mpi()
  if value is None and any_ok:
    return ANY
  try:
    number = operator.index(value)
  except TypeError:
    number = None
  if number is not None and not isinstance(value, bool):
    if any_ok and number == MPI.ANY_TAG:
      return ANY
    if 0 <= number <= _tag_ub():
      return number
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


def status_ref(status: Any, op_name: str) -> _StatusRef | None:
  if status is None:
    return None
  MPI = _mpi()
  if not isinstance(status, MPI.Status):
    raise TypeError(f"{op_name} got status of type {type(status).__name__}; pass an "
                    "mpi4py MPI.Status() (or None).")
  return _StatusRef(status)


def check_root(op_name: str, root: int, size: int) -> int:
  try:
    index = operator.index(root)  # a Python or NumPy integer, not a traced value
  except TypeError:
    index = None
  if index is None or isinstance(root, (bool, np.bool_)) or not 0 <= index < size:
    raise ValueError(f"{op_name} got root={root!r}; expected a static integer rank "
                     f"in [0, {size}) (a Python int, known at trace time).")
  return int(index)


def settled(out, status):
  """Eagerly, with a status to fill, waits for the call: then the status is set."""
  if status is not None and not isinstance(out, jax.core.Tracer):
    out.block_until_ready()
  return out


def attrs(*, comm_id, dest=NO_PEER, sendtag=0, source=NO_PEER, recvtag=0, status=None):
  return dict(comm=primitive.i64(comm_id), dest=primitive.i64(dest), sendtag=primitive.i64(sendtag),
              source=primitive.i64(source), recvtag=primitive.i64(recvtag),
              status=primitive.i64(0 if status is None else status.address()))

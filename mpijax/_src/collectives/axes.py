"""Named axes that span ranks, and the axis environment :mod:`mpijax.lax` reads.

A :class:`~mpijax.GlobalMesh` describes each of its axes by an
:class:`AxisInfo`: which ranks it spans (its *process part*) and which local
devices (its *local part*). While :func:`mpijax.shard_map` or
:func:`mpijax.pmap` runs the user's function, :func:`bind_axes` tells the
collectives which named axes are mpijax axes, and of which mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class AxisInfo:
  """How one named mesh axis maps onto processes and local devices."""
  name: str
  size: int
  proc_size: int   # how many process coordinates the axis spans
  local_size: int  # how many local devices of one process it spans
  local_name: str  # the axis name in the local jax mesh
  proc_index: int  # this rank's coordinate along the process part

  @property
  def is_local(self) -> bool:
    return self.proc_size == 1

  @property
  def is_process(self) -> bool:
    return self.local_size == 1


class Mesh(Protocol):
  """What the collectives need of a mesh: the communicator over its axes' process parts."""

  def process_comm(self, axis_names: Sequence[str]) -> Any:
    """The communicator over the process parts of ``axis_names`` (None if all local)."""


_env = threading.local()


def axis_env() -> dict[str, tuple[Mesh, AxisInfo]]:
  """The mpijax axes bound here: name -> (mesh, axis)."""
  return getattr(_env, "axes", {})


@contextlib.contextmanager
def bind_axes(mesh: Any, names: Sequence[str]):
  """Binds the axes ``names`` of ``mesh`` (a GlobalMesh) while the block runs."""
  old = axis_env()
  new = dict(old)
  for n in names:
    new[n] = (mesh, mesh.axes[n])
  _env.axes = new
  try:
    yield
  finally:
    _env.axes = old

"""Meshes over (process, local device): every device of every rank, in named axes.

A :class:`GlobalMesh` arranges all ``process_count * local_device_count``
devices (global index = process * L + local) row-major into named axes. Each
axis is factored into a *process part* (which ranks it spans, realized as an
MPI sub-communicator) and a *local part* (which of this rank's devices it
spans, realized as an axis of a ``jax.sharding.Mesh`` over the local devices).
An axis can be purely local, purely across processes, or both (the process
part is then the outer factor of the axis index).

:mod:`.shard_map` and :mod:`.pmap` run functions over a mesh (``shard_map``,
``pmap``); :mod:`mpijax._src.collectives.axes` holds the per-axis description and
:mod:`mpijax._src.sharding.geometry` what a ``PartitionSpec`` over a mesh lays out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from mpijax._src.collectives.axes import AxisInfo
from mpijax._src.runtime import state as runtime

P = PartitionSpec


def _local_axis_name(name: str, local_only: bool) -> str:
  # A purely local axis keeps its name, so jax.lax collectives work on it
  # unchanged. Axes that span ranks get a private name: jax.lax.psum(x, 'i')
  # on them would silently reduce over this rank's devices only.
  return name if local_only else f"{name}@local"


def _factor(shape: Sequence[int], names: Sequence[str], L: int) -> tuple[list[int], list[int]]:
  """Splits each axis size into (process part, local part), innermost first."""
  proc, loc = [1] * len(shape), [1] * len(shape)
  remaining = L
  for k in reversed(range(len(shape))):
    s = shape[k]
    if remaining == 1:
      proc[k] = s
    elif remaining % s == 0:
      loc[k] = s
      remaining //= s
    elif s % remaining == 0:
      loc[k], proc[k] = remaining, s // remaining
      remaining = 1
    else:
      raise ValueError(
        f"mesh axis {names[k]!r} of size {s} cannot be laid over {L} local devices per "
        f"process (mesh shape {tuple(shape)}, axes {tuple(names)}): an axis must cover "
        "whole groups of a process's local devices or divide them. Choose sizes such "
        f"that the innermost axes multiply to {L} or a divisor/multiple of it."
      )
  return proc, loc


class GlobalMesh:
  """Named axes over every device of every rank.

  Creating a mesh is collective (it splits MPI communicators): every rank must
  create the same meshes in the same order.

  Args:
    axis_shapes: size of each axis; their product must be the global device
      count (see :func:`make_mesh`).
    axis_names: the names, one per axis, as for ``jax.make_mesh``.

  Raises:
    ValueError: as :func:`make_mesh`.

  Examples:
    >>> mesh = mpijax.make_mesh((4,), ("i",))  # doctest: +SKIP
    >>> mesh = mpijax.make_mesh((2, 2), ("data", "model"))  # doctest: +SKIP
  """

  def __init__(self, axis_shapes: Sequence[int], axis_names: Sequence[str]):
    rt = runtime.get("mpijax.GlobalMesh")
    axis_shapes = tuple(int(s) for s in axis_shapes)
    axis_names = tuple(axis_names)
    if len(axis_shapes) != len(axis_names):
      raise ValueError(
        f"mesh got {len(axis_shapes)} sizes {axis_shapes} but {len(axis_names)} names {axis_names}"
      )
    if len(set(axis_names)) != len(axis_names):
      raise ValueError(f"mesh axis names must be distinct, got {axis_names}")
    Pn, L = rt.size, rt.local_device_count
    if math.prod(axis_shapes) != Pn * L:
      raise ValueError(
        f"mesh shape {axis_shapes} has {math.prod(axis_shapes)} devices, but the job has "
        f"{Pn} processes x {L} local devices = {Pn * L}. Pick sizes whose product is {Pn * L}."
      )
    proc, loc = _factor(axis_shapes, axis_names, L)
    self.axis_names = axis_names
    self.shape = dict(zip(axis_names, axis_shapes))
    self.devices = np.arange(Pn * L).reshape(axis_shapes)  # global device indices
    self.process_count, self.local_device_count = Pn, L
    proc_coords = np.unravel_index(rt.rank, proc) if Pn > 1 else (0,) * len(proc)
    self._proc_sizes = proc
    self._proc_coords = tuple(int(c) for c in proc_coords)
    self.axes = {
      n: AxisInfo(n, s, p, l, _local_axis_name(n, p == 1), int(c))
      for n, s, p, l, c in zip(axis_names, axis_shapes, proc, loc, self._proc_coords)
    }
    local_shape = tuple(loc)
    self.local_mesh = Mesh(
      np.array(rt.local_devices).reshape(local_shape),
      tuple(self.axes[n].local_name for n in axis_names),
    )
    self._comms: dict[tuple[str, ...], Any] = {}
    # Splitting is collective: make every process-group communicator now, in the
    # same order on every rank, rather than lazily at trace time.
    spanning = [n for n in axis_names if self.axes[n].proc_size > 1]
    for r in range(1, len(spanning) + 1):
      for group in itertools.combinations(spanning, r):
        self._comms[group] = self._split(rt.comm, group)

  def _split(self, comm, group: tuple[str, ...]):
    idx = [self.axis_names.index(n) for n in group]
    rest = [k for k in range(len(self.axis_names)) if k not in idx]
    color = (
      int(
        np.ravel_multi_index(
          [self._proc_coords[k] for k in rest], [self._proc_sizes[k] for k in rest]
        )
      )
      if rest
      else 0
    )
    key = int(
      np.ravel_multi_index([self._proc_coords[k] for k in idx], [self._proc_sizes[k] for k in idx])
    )
    sub = comm.Split(color, key)
    sub.Set_name("mpijax-mesh-" + "-".join(group))
    return sub

  def process_comm(self, axis_names: Sequence[str]):
    """The communicator over the process parts of ``axis_names`` (None if local)."""
    group = tuple(n for n in self.axis_names if n in axis_names and self.axes[n].proc_size > 1)
    return self._comms[group] if group else None

  @property
  def size(self) -> int:
    return self.devices.size

  def __repr__(self) -> str:
    axes = ", ".join(f"{n!r}: {self.shape[n]}" for n in self.axis_names)
    parts = ", ".join(f"{n}={a.proc_size}x{a.local_size}" for n, a in self.axes.items())
    return f"GlobalMesh({axes}; process x local: {parts})"

  def __eq__(self, other) -> bool:
    return (
      isinstance(other, GlobalMesh)
      and self.axis_names == other.axis_names
      and self.shape == other.shape
    )

  def __hash__(self) -> int:
    return hash((self.axis_names, tuple(self.shape.items())))


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str]) -> GlobalMesh:
  """A :class:`GlobalMesh` (like ``jax.make_mesh``, over every rank's devices).

  Collective: every rank makes the same meshes in the same order.

  Args:
    axis_shapes: the size of each axis; their product is the job's device
      count, ``process_count() * local_device_count()``. Devices (global
      index ``process * local_device_count + local``) fill the axes
      row-major, so the innermost axes span a rank's local devices first.
    axis_names: one distinct name per axis.

  Returns:
    The mesh.

  Raises:
    RuntimeError: ``mpijax.init()`` has not run.
    ValueError: the sizes and names differ in number, a name repeats, the
      sizes do not multiply to the device count, or an axis neither covers
      whole groups of a rank's local devices nor divides them.

  Examples:
    >>> mesh = mpijax.make_mesh((2, 2), ("data", "model"))  # doctest: +SKIP
    >>> mesh  # on 2 ranks x 2 devices: data across ranks, model inside each  # doctest: +SKIP
    GlobalMesh('data': 2, 'model': 2; process x local: data=2x1, model=1x2)
  """
  return GlobalMesh(axis_shapes, axis_names)

"""Spec geometry: which block of a global array each device and each rank holds.

An array laid out by a ``PartitionSpec`` over a :class:`~mpijax.GlobalMesh`
is cut, along each dimension, into as many blocks as the product of the
sizes of the mesh axes naming that dimension. Device ``g`` (global index
``process * L + local``) sits at ``np.unravel_index(g, mesh shape)``; along
a dimension sharded over axes ``(a, b)`` its block index is
``ravel((coord_a, coord_b), (size_a, size_b))``, exactly as in
``jax.sharding.NamedSharding``. A rank's part is the bounding box of its
devices' blocks; it is one contiguous block when the axes spanning ranks
come first in each entry.

Every function here reads the mesh and the spec only: :mod:`.global_array`,
:mod:`.mapping`, :mod:`.reshard`, :mod:`.visualize` and
:mod:`.array_checkpoint` share them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from mpijax._src.sharding.mesh import GlobalMesh

P = PartitionSpec
Index = tuple[slice, ...]


# --- specs -----------------------------------------------------------------------------


def as_spec(spec) -> PartitionSpec:
  """``spec`` as a PartitionSpec (None is ``P()``, a tuple or list ``P(*spec)``)."""
  if spec is None:
    return P()
  if isinstance(spec, PartitionSpec):
    return spec
  # A tuple/list of entries is accepted as P(*spec); a bare string would be
  # split into letters (P(*"data") names axes 'd', 'a', ...), so it is refused.
  if isinstance(spec, (tuple, list)):
    return P(*spec)
  hint = f"P({spec!r})" if isinstance(spec, str) else "P('x'), P(None, 'x') or P()"
  raise TypeError(
    f"expected a jax.sharding.PartitionSpec, got {type(spec).__name__} {spec!r}. "
    f"Pass e.g. {hint} (from jax.sharding import PartitionSpec as P)."
  )


def _check_mesh(mesh, what: str) -> None:
  if not isinstance(mesh, GlobalMesh):
    raise TypeError(
      f"{what} needs a mpijax.GlobalMesh (made by mpijax.make_mesh), got "
      f"{type(mesh).__name__}: {mesh!r}"
    )


def spec_axes(mesh: GlobalMesh, entry) -> tuple[str, ...]:
  """The mesh axes one entry of a spec names (``None``, a name or a tuple of names)."""
  if entry is None:
    return ()
  names = (entry,) if isinstance(entry, str) else tuple(entry)
  for n in names:
    if n not in mesh.axes:
      raise ValueError(f"PartitionSpec names axis {n!r}, but the mesh has axes {mesh.axis_names}")
  return names


def normalize_spec(spec, ndim: int, mesh: GlobalMesh) -> PartitionSpec:
  """``spec`` with one entry per dimension; single-axis tuples become names.

  Raises:
    ValueError: ``spec`` is longer than ``ndim``, names an unknown axis, or uses
      an axis twice.
  """
  _check_mesh(mesh, "GlobalArray")
  spec = as_spec(spec)
  if len(spec) > ndim:
    raise ValueError(
      f"PartitionSpec {spec} has {len(spec)} entries but the array has {ndim} "
      f"dimension(s); give at most {ndim} entries."
    )
  entries, used = [], []
  for e in tuple(spec) + (None,) * (ndim - len(spec)):
    names = spec_axes(mesh, e)
    used += names
    entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
  dup = sorted({n for n in used if used.count(n) > 1})
  if dup:
    raise ValueError(
      f"PartitionSpec {spec} uses mesh axis {dup[0]!r} more than once; each "
      "mesh axis may shard at most one dimension."
    )
  return P(*entries)


def local_spec(
  mesh: GlobalMesh, spec: PartitionSpec, *, keep_size_one: bool = False
) -> PartitionSpec:
  """The spec of this rank's part over the local mesh.

  ``keep_size_one`` keeps the axes of global size 1 (local axes of the local
  mesh, as in the global spec): under ``check_vma=True`` a collective over
  one types its result varying there, and JAX then needs the spec to name it.
  """
  out = []
  for entry in spec:
    local = tuple(
      mesh.axes[n].local_name
      for n in spec_axes(mesh, entry)
      if mesh.axes[n].local_size > 1 or (keep_size_one and mesh.axes[n].size == 1)
    )
    out.append(None if not local else (local[0] if len(local) == 1 else local))
  return P(*out)


def local_sharding(mesh: GlobalMesh, spec: PartitionSpec) -> NamedSharding:
  """The sharding of this rank's part over its local devices."""
  return NamedSharding(mesh.local_mesh, local_spec(mesh, spec))


def replicated_axes(mesh: GlobalMesh, spec: PartitionSpec) -> list[str]:
  """Mesh axes across processes that ``spec`` does not name: ranks along them hold copies."""
  used = {n for e in spec for n in spec_axes(mesh, e)}
  return [n for n in mesh.axis_names if n not in used and mesh.axes[n].proc_size > 1]


# --- blocks ----------------------------------------------------------------------------


def block_counts(mesh: GlobalMesh, spec: PartitionSpec) -> tuple[int, ...]:
  """How many blocks each dimension is cut into (product of its axes' sizes)."""
  return tuple(math.prod(mesh.shape[n] for n in spec_axes(mesh, e)) for e in spec)


def check_divisible(
  shape: Sequence[int], mesh: GlobalMesh, spec: PartitionSpec, what: str = "GlobalArray"
) -> None:
  for d, (n, k) in enumerate(zip(shape, block_counts(mesh, spec))):
    if n % k:
      raise ValueError(
        f"{what}: dimension {d} of the global shape {tuple(shape)} has size {n}, which is not "
        f"divisible by the {k} devices sharding it (PartitionSpec {spec} over mesh axes "
        f"{dict(mesh.shape)}). Pad dimension {d} to a multiple of {k}, or shard it over fewer "
        "devices (e.g. None in that entry of the spec)."
      )


def process_block(mesh: GlobalMesh, spec: PartitionSpec, dim: int) -> tuple[int, int]:
  """(number of process blocks, this rank's block index) along ``dim``.

  Raises if this rank's part along ``dim`` is not one contiguous block.
  """
  names = spec_axes(mesh, spec[dim]) if dim < len(spec) else ()
  if not names:
    return 1, 0
  seen_local = False
  for n in names:
    a = mesh.axes[n]
    if a.proc_size > 1 and seen_local:
      raise ValueError(
        f"PartitionSpec {spec} shards dimension {dim} over {names}: a process axis after "
        "a local one gives each rank a strided part. Put the axes that span processes "
        "first, e.g. " + repr(tuple(sorted(names, key=lambda m: mesh.axes[m].proc_size == 1)))
      )
    if a.local_size > 1:
      seen_local = True
  count = math.prod(mesh.axes[n].proc_size for n in names)
  index = int(
    np.ravel_multi_index(
      [mesh.axes[n].proc_index for n in names], [mesh.axes[n].proc_size for n in names]
    )
  )
  return count, index


def process_block_counts(mesh: GlobalMesh, spec: PartitionSpec) -> list[int]:
  """How many process blocks each dimension is cut into (a rank's part is one of them)."""
  return [process_block(mesh, spec, d)[0] for d in range(len(spec))]


def check_contiguous(mesh: GlobalMesh, spec: PartitionSpec) -> None:
  for d in range(len(spec)):
    process_block(mesh, spec, d)  # raises for a strided (non-contiguous) part


@functools.lru_cache(maxsize=256)
def _device_blocks(mesh: GlobalMesh, spec: PartitionSpec) -> np.ndarray:
  """[global device, dim] -> block index of that device along dim."""
  coords = np.stack(np.unravel_index(np.arange(mesh.size), mesh.devices.shape), axis=1)
  out = np.zeros((mesh.size, len(spec)), dtype=np.int64)
  for d, e in enumerate(spec):
    names = spec_axes(mesh, e)
    if names:
      pos = [mesh.axis_names.index(n) for n in names]
      out[:, d] = np.ravel_multi_index([coords[:, p] for p in pos], [mesh.shape[n] for n in names])
  return out


def device_indices(shape: Sequence[int], mesh: GlobalMesh, spec: PartitionSpec) -> list[Index]:
  """The index (tuple of slices into the global array) of every global device."""
  counts = block_counts(mesh, spec)
  sizes = [n // k for n, k in zip(shape, counts)]
  blocks = _device_blocks(mesh, spec)
  return [tuple(slice(int(b) * s, (int(b) + 1) * s) for b, s in zip(row, sizes)) for row in blocks]


def process_index_of(
  shape: Sequence[int], mesh: GlobalMesh, spec: PartitionSpec, process: int
) -> Index:
  """The process-local part of rank ``process``: the bounding box of its devices' blocks."""
  L = mesh.local_device_count
  idx = device_indices(shape, mesh, spec)[process * L : (process + 1) * L]
  return tuple(
    slice(min(i[d].start for i in idx), max(i[d].stop for i in idx)) for d in range(len(shape))
  )


def process_boxes(
  shape: Sequence[int], mesh: GlobalMesh, spec: PartitionSpec
) -> list[tuple[tuple[int, int], ...]]:
  """Every rank's part as ((start, stop) per dimension): equal for ranks holding copies."""
  L = mesh.local_device_count
  idx = device_indices(shape, mesh, spec)
  return [
    tuple(
      (
        min(i[d].start for i in idx[p * L : (p + 1) * L]),
        max(i[d].stop for i in idx[p * L : (p + 1) * L]),
      )
      for d in range(len(shape))
    )
    for p in range(mesh.process_count)
  ]


def index_shape(index: Index) -> tuple[int, ...]:
  """The shape of the block ``index`` selects."""
  return tuple(s.stop - s.start for s in index)


@functools.lru_cache(maxsize=1024)
def local_shape_of(
  shape: tuple[int, ...], mesh: GlobalMesh, spec: PartitionSpec, process: int
) -> tuple[int, ...]:
  """The shape of rank ``process``'s part (cached: checked on every pytree rebuild)."""
  return index_shape(process_index_of(shape, mesh, spec, process))

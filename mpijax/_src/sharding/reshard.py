"""``mpijax.reshard``: a GlobalArray laid out by another PartitionSpec."""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec

from mpijax._src.collectives import parallel as mlax
from mpijax._src.sharding.geometry import check_contiguous
from mpijax._src.sharding.geometry import check_divisible
from mpijax._src.sharding.geometry import normalize_spec
from mpijax._src.sharding.geometry import spec_axes
from mpijax._src.sharding.global_array import GlobalArray
from mpijax._src.sharding.mesh import GlobalMesh
from mpijax._src.sharding.shard_map import shard_map


def reshard(array: GlobalArray, spec) -> GlobalArray:
  """``array`` laid out by a new ``PartitionSpec`` on the same mesh (collective).

  Moves data with :mod:`mpijax.lax` collectives inside one jitted
  :func:`mpijax.shard_map`: an axis that moves from one dimension to another
  is one ``all_to_all`` (row-sharded to column-sharded); other changes
  ``all_gather`` the old blocks along the changed dimensions and keep the new
  block (sharding a replicated dimension needs no communication). Every rank
  calls it with its part of the same array.

  Args:
    array: the :class:`~mpijax.GlobalArray` to lay out anew.
    spec: the new ``PartitionSpec`` over ``array.mesh``'s axes (``None`` is
      ``P()``: replicated; a tuple is ``P(*spec)``); each dimension it shards
      must be divisible by the devices sharding it.

  Returns:
    A GlobalArray with ``array``'s global shape, dtype and mesh, laid out by
    ``spec`` (``array`` itself when the spec does not change).

  Raises:
    TypeError: ``array`` is not a GlobalArray, or ``spec`` not a spec.
    ValueError: ``spec`` has more entries than ``array`` has dimensions,
      names an axis the mesh lacks or one axis twice, shards a dimension
      not divisible by its devices, or puts an axis across ranks after a
      local one in an entry (each rank's part would not be one block).

  Examples:
    >>> cols = mpijax.reshard(rows, P(None, "x"))  # doctest: +SKIP
    >>> full = mpijax.reshard(cols, P())  # doctest: +SKIP
  """
  if not isinstance(array, GlobalArray):
    raise TypeError(f"reshard needs a GlobalArray, got {type(array).__name__}")
  mesh = array.mesh
  new = normalize_spec(spec, array.ndim, mesh)
  if new == array.spec:
    return array
  check_divisible(array.shape, mesh, new, "reshard")
  check_contiguous(mesh, new)
  fn = _reshard_fn(mesh, array.spec, new)
  return GlobalArray(fn(array.local), array.shape, array.dtype, mesh, new)


@functools.lru_cache(maxsize=64)
def _reshard_fn(mesh: GlobalMesh, old: PartitionSpec, new: PartitionSpec):
  O = [spec_axes(mesh, e) for e in old]
  N = [spec_axes(mesh, e) for e in new]

  def body(x):
    o, n = list(O), list(N)
    # One axis moving between dimensions: a single all_to_all.
    for a in range(len(o)):
      if len(o[a]) == 1 and not n[a]:
        for b in range(len(o)):
          if b != a and not o[b] and n[b] == o[a]:
            x = mlax.all_to_all(x, o[a][0], split_axis=b, concat_axis=a, tiled=True)
            o[a], o[b] = (), n[b]
            break
    changed = [d for d in range(len(o)) if o[d] != n[d]]
    for d in changed:
      if o[d]:
        x = mlax.all_gather(x, o[d], axis=d, tiled=True)
    for d in changed:
      if n[d]:
        k = math.prod(mesh.shape[m] for m in n[d])
        size = x.shape[d] // k
        x = jax.lax.dynamic_slice_in_dim(x, mlax.axis_index(n[d]) * size, size, axis=d)
    return x

  return jax.jit(shard_map(body, mesh=mesh, in_specs=old, out_specs=new))

"""What the maps take and give: GlobalArrays, global ``jax.Array``s and this
rank's plain arrays, unwrapped for the mapped function and wrapped back; and
a spec or axis prefix expanded over a pytree as ``jax.shard_map`` and
``jax.pmap`` read it. Shared by :mod:`.shard_map` and :mod:`.pmap`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mpijax._src.sharding.geometry import normalize_spec
from mpijax._src.sharding.geometry import process_block_counts
from mpijax._src.sharding.global_array import GlobalArray
from mpijax._src.sharding.mesh import GlobalMesh


def expand_prefix(prefix, tree, is_leaf):
  """``prefix`` (a pytree prefix of ``tree``) with each of its leaves repeated on every
  leaf of the subtree of ``tree`` it stands for (as jax.shard_map/jax.pmap read specs
  and axes)."""
  return jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, tree, is_leaf=is_leaf)


def _is_global_array(x) -> bool:
  return isinstance(x, GlobalArray)


def unwrap_args(args: tuple, mesh: GlobalMesh | None = None) -> tuple[tuple, list, bool]:
  """(args with GlobalArrays replaced by ``.local``, per-leaf GlobalArray or None, any?)."""
  leaves, treedef = jax.tree.flatten(args, is_leaf=_is_global_array)
  metas = [x if _is_global_array(x) else None for x in leaves]
  if not any(m is not None for m in metas):
    return args, metas, False
  plain = [x.local if _is_global_array(x) else x for x in leaves]
  return jax.tree.unflatten(treedef, plain), metas, True


def _is_global_jax_array(x) -> bool:
  """A concrete ``jax.Array`` spread over several processes (not one rank's part).

  Under a trace (``jax.jit`` around the map) the arguments are this rank's
  parts, as always: global arrays are taken at the outermost call only.
  """
  return (
    isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_addressable
  )


def take_jax_arrays(
  mesh: GlobalMesh, args: tuple, specs: list, metas: list
) -> tuple[tuple, list, bool]:
  """Global ``jax.Array`` leaves of ``args`` as this rank's parts on ``mesh`` by ``specs``.

  ``specs`` and ``metas`` (from :func:`unwrap_args`) have one entry per leaf;
  each global array's GlobalArray goes into ``metas``. Its part is made of
  its own buffers when laid out so already, else JAX reshards it first (as
  ``jax.shard_map`` does). Returns (args, metas, any found).
  """
  leaves, treedef = jax.tree.flatten(args)
  if not any(_is_global_jax_array(x) for x in leaves):
    return args, metas, False
  metas = list(metas)
  for k, (x, spec) in enumerate(zip(leaves, specs)):
    if _is_global_jax_array(x):
      metas[k] = GlobalArray.from_jax(x, mesh, spec)
      leaves[k] = metas[k].local
  return jax.tree.unflatten(treedef, leaves), metas, True


def to_jax_outputs(out: Any) -> Any:
  """Each GlobalArray of ``out`` as a global ``jax.Array`` (no copy)."""
  return jax.tree.map(
    lambda x: x.to_jax() if _is_global_array(x) else x, out, is_leaf=_is_global_array
  )


def check_arg_specs(what: str, mesh: GlobalMesh, metas: list, specs: list) -> None:
  """Each GlobalArray argument must live on ``mesh`` with the spec given for it."""
  for k, (ga, spec) in enumerate(zip(metas, specs)):
    if ga is None:
      continue
    if ga.mesh != mesh:
      raise ValueError(
        f"{what}: GlobalArray argument {k} lives on {ga.mesh}, but the map runs "
        f"over {mesh}. Reshard it or build it on the same mesh."
      )
    want = normalize_spec(spec, ga.ndim, mesh)
    if want != ga.spec:
      raise ValueError(
        f"{what}: GlobalArray argument {k} (shape {ga.shape}) has spec {ga.spec}, but the "
        f"in_specs give {want}. Pass in_specs={ga.spec} for it, or mpijax.reshard(x, {want}) "
        "first."
      )


def wrap_outputs(mesh: GlobalMesh, out: Any, specs: list) -> Any:
  """Turns each output leaf (this rank's part) into a GlobalArray with its spec."""
  leaves, treedef = jax.tree.flatten(out)
  wrapped = []
  for x, spec in zip(leaves, specs):
    nspec = normalize_spec(spec, np.ndim(x), mesh)
    counts = process_block_counts(mesh, nspec)
    shape = tuple(n * c for n, c in zip(np.shape(x), counts))
    wrapped.append(GlobalArray(x, shape, x.dtype, mesh, nspec))
  return jax.tree.unflatten(treedef, wrapped)

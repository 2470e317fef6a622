"""``mpijax.pmap``: ``jax.pmap`` whose axis spans every device of every rank.

It runs the user's function under ``jax.shard_map`` over this rank's devices
while the axis environment (:mod:`.axes`) tells :mod:`mpijax.lax` that the
axis spans ranks, and ``jax.lax``'s collectives on it run as
:mod:`mpijax.lax`'s (:mod:`.lax_routing`). It takes and returns
GlobalArrays, global ``jax.Array``s and this rank's plain arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mpijax._src.collectives import routing as lax_routing
from mpijax._src.collectives.axes import bind_axes
from mpijax._src.runtime import state as runtime
from mpijax._src.sharding import map_io
from mpijax._src.sharding.mesh import GlobalMesh

P = PartitionSpec


def pmap(
  fun: Callable,
  axis_name: str = "i",
  *,
  in_axes=0,
  out_axes=0,
  static_broadcasted_argnums: int | Sequence[int] = (),
  donate_argnums: int | Sequence[int] = (),
) -> Callable:
  """``jax.pmap`` whose axis spans every device of every rank.

  Inputs and outputs have leading dimension ``local_device_count`` (this
  rank's devices), as with ``jax.pmap`` in a multi-process JAX job;
  :func:`mpijax.lax.axis_index` is the global device index
  ``process_index * local_device_count + local_index``. Each call is jitted
  (one compile per argument signature); keyword arguments are mapped over
  their leading axis, as in ``jax.pmap``.

  Args:
    fun: the function of one device's values; it may call
      :mod:`mpijax.lax` (or ``jax.lax``) collectives over ``axis_name``.
    axis_name: the name of the mapped axis, which spans
      ``process_count() * local_device_count()`` devices.
    in_axes: which axis of each argument is mapped: an int, ``None`` (not
      mapped: the same value on every device), a tuple with one entry per
      argument, or a pytree prefix of the arguments; negative counts from
      the end.
    out_axes: the same for the outputs; ``None`` returns a replicated output
      once instead of per device.
    static_broadcasted_argnums: positions of arguments that are static
      (hashable Python values; a new value recompiles).
    donate_argnums: positions of arguments whose buffers the call may reuse
      for its outputs.

  Returns:
    The mapped function: it takes and returns arrays whose mapped axis has
    size ``local_device_count()`` (this rank's devices), or GlobalArrays or
    global ``jax.Array`` objects sharded over ``axis_name`` along it.

  Raises:
    ValueError: (when the mapped function is called) a mapped axis is not of
      size ``local_device_count()``, or ``in_axes``/``out_axes`` do not fit
      the arguments or outputs.
    TypeError: an ``in_axes``/``out_axes`` entry is not an int or None.

  Examples:
    >>> xs = jnp.ones(mpijax.local_device_count())  # doctest: +SKIP
    >>> mpijax.pmap(lambda x: mpijax.lax.psum(x, "i"), axis_name="i")(xs)  # doctest: +SKIP
    Array([4., 4., 4., 4.], dtype=float32)  # 4 devices in the whole job
  """
  if isinstance(static_broadcasted_argnums, int):
    static_broadcasted_argnums = (static_broadcasted_argnums,)
  if isinstance(donate_argnums, int):
    donate_argnums = (donate_argnums,)
  static = tuple(static_broadcasted_argnums)
  cache: dict[Any, Callable] = {}
  with_keywords: dict[Any, Callable] = {}

  def _mesh() -> GlobalMesh:
    rt = runtime.get("mpijax.pmap")
    key = (rt.size, rt.local_device_count, axis_name)
    m = _pmap_meshes.get(key)
    if m is None:
      m = _pmap_meshes[key] = GlobalMesh((rt.size * rt.local_device_count,), (axis_name,))
    return m

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(axes) != len(args):
      raise ValueError(f"mpijax.pmap got in_axes={in_axes!r} for {len(args)} arguments")
    if kwargs:
      # As jax.pmap: keyword arguments are mapped over their leading axis.
      # They become trailing positional arguments of one cached pmap per set
      # of names.
      n, names = len(args), tuple(sorted(kwargs))
      sub = with_keywords.get((n, names))
      if sub is None:
        sub = with_keywords[(n, names)] = pmap(
          lambda *a: fun(*a[:n], **dict(zip(names, a[n:]))),
          axis_name,
          in_axes=tuple(axes) + (0,) * len(names),
          out_axes=out_axes,
          static_broadcasted_argnums=static,
          donate_argnums=donate_argnums,
        )
      return sub(*args, *(kwargs[k] for k in names))
    mesh = _mesh()
    L = mesh.local_device_count
    dyn_idx = [i for i in range(len(args)) if i not in static]
    dyn, metas, any_ga = map_io.unwrap_args(tuple(args[i] for i in dyn_idx))
    treedef = jax.tree.structure(tuple(dyn))
    # One mapped axis (made non-negative) or None per leaf; in_axes may be a
    # pytree prefix of each argument, as in jax.pmap.
    leaf_axes = tuple(
      _mapped_axis(ax, leaf, L, "in_axes")
      for i, x in zip(dyn_idx, dyn)
      for ax, leaf in zip(_per_leaf(axes[i], x, "in_axes"), jax.tree.leaves(x))
    )
    # A global jax.Array (all devices' rows) in: its part goes in, global jax.Arrays come out.
    dyn, metas, jax_in = map_io.take_jax_arrays(
      mesh, tuple(dyn), [_pmap_global_spec(ax, axis_name) for ax in leaf_axes], metas
    )
    any_ga = any_ga or jax_in
    if any_ga:  # a GlobalArray must be sharded over the pmap axis along its mapped axis
      map_io.check_arg_specs(
        "mpijax.pmap", mesh, metas, [_pmap_global_spec(ax, axis_name) for ax in leaf_axes]
      )
    for ax, leaf in zip(leaf_axes, jax.tree.leaves(tuple(dyn))):
      if ax is not None and np.shape(leaf)[ax] != L:
        raise ValueError(
          f"mpijax.pmap maps axis {ax} over this rank's {L} local devices, but an "
          f"argument has shape {np.shape(leaf)}. Give each rank arrays whose axis {ax} "
          f"has size local_device_count() = {L}."
        )
    static_vals = tuple((i, args[i]) for i in static)
    key = (static_vals, treedef, leaf_axes)
    fn = cache.get(key)
    if fn is None:
      fn = cache[key] = _build_pmap(
        fun,
        mesh,
        axis_name,
        dyn_idx,
        treedef,
        leaf_axes,
        static_vals,
        out_axes,
        len(args),
        donate_argnums,
      )
    out = fn(*dyn)
    if any_ga:
      specs = [
        _pmap_global_spec(None if ax is None else ax % np.ndim(leaf), axis_name)
        for ax, leaf in zip(_per_leaf(out_axes, out, "out_axes"), jax.tree.leaves(out))
      ]
      out = map_io.wrap_outputs(mesh, out, specs)
      if jax_in:
        out = map_io.to_jax_outputs(out)
    return out

  return wrapped


_pmap_meshes: dict[Any, GlobalMesh] = {}


def _per_leaf(axes, tree, what: str) -> list:
  """``axes`` (an int, None, or a pytree prefix of ``tree``) as a list, one per leaf."""
  try:
    return jax.tree.structure(tree).flatten_up_to(
      map_io.expand_prefix(axes, tree, lambda v: v is None)
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"mpijax.pmap got {what}={axes!r}, which is not an int, None or a pytree "
      f"prefix of the {'arguments' if what == 'in_axes' else 'outputs'}: "
      f"{e}"
    ) from None


def _mapped_axis(ax, leaf, L: int, what: str) -> int | None:
  """``ax`` of ``leaf``, checked and made non-negative (None: not mapped)."""
  if ax is None:
    return None
  if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)):
    raise TypeError(f"mpijax.pmap got {what} entry {ax!r}; each must be an int or None.")
  shape = np.shape(leaf)
  if not -len(shape) <= ax < len(shape):
    raise ValueError(
      f"mpijax.pmap maps axis {ax} over this rank's {L} local devices, but an "
      f"argument has shape {shape}. Give each rank arrays whose axis {ax} "
      f"has size local_device_count() = {L}."
    )
  return int(ax) % len(shape)


def _pmap_global_spec(ax: int | None, axis_name) -> PartitionSpec:
  return P() if ax is None else P(*([None] * ax + [axis_name]))


def _build_pmap(
  fun,
  mesh: GlobalMesh,
  axis_name,
  dyn_idx,
  treedef,
  leaf_axes,
  static_vals,
  out_axes,
  nargs,
  donate_argnums,
):
  local = mesh.axes[axis_name].local_name
  statics = dict(static_vals)
  none_leaf = lambda v: v is None

  # The body maps axis 0 of every mapped leaf: the jitted wrapper moves each
  # in_axes/out_axes there and back (no copy for the usual axis 0), so the
  # specs do not depend on the outputs' shapes, which are known only inside.
  def body(*dyn):
    leaves = jax.tree.leaves(dyn)
    leaves = [a if ax is None else jnp.squeeze(a, 0) for a, ax in zip(leaves, leaf_axes)]
    full = [None] * nargs
    for i, v in statics.items():
      full[i] = v
    for i, v in zip(dyn_idx, treedef.unflatten(leaves)):
      full[i] = v
    with bind_axes(mesh, (axis_name,)), lax_routing.mesh_axes("mpijax.pmap"):
      out = fun(*full)
    # out_axes None: a replicated result, returned once, not per device.
    return jax.tree.map(
      lambda ax, sub: sub if ax is None else jax.tree.map(lambda a: jnp.expand_dims(a, 0), sub),
      out_axes,
      out,
      is_leaf=none_leaf,
    )

  in_specs = treedef.unflatten([P() if ax is None else P(local) for ax in leaf_axes])
  out_specs = jax.tree.map(lambda ax: P() if ax is None else P(local), out_axes, is_leaf=none_leaf)
  mapped = jax.shard_map(
    body, mesh=mesh.local_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
  )

  def run(*dyn):
    leaves = [
      a if not ax else jnp.moveaxis(a, ax, 0) for a, ax in zip(jax.tree.leaves(dyn), leaf_axes)
    ]
    out = mapped(*treedef.unflatten(leaves))
    return jax.tree.map(
      lambda ax, sub: jax.tree.map(lambda a: a if not ax else jnp.moveaxis(a, 0, ax), sub),
      out_axes,
      out,
      is_leaf=none_leaf,
    )

  donate = tuple(dyn_idx.index(i) for i in donate_argnums if i in dyn_idx)
  return jax.jit(run, donate_argnums=donate)

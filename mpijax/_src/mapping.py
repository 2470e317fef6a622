"""The maps that bind a mesh's axes: :func:`shard_map` and :func:`pmap`.

Both run the user's function under ``jax.shard_map`` over the mesh's local
part (this rank's devices) while the axis environment (:mod:`.axes`) tells
:mod:`mpijax.lax` which named axes span ranks, and ``jax.lax``'s collectives
on those axes run as :mod:`mpijax.lax`'s (:mod:`.lax_routing`). Both take and return
GlobalArrays, global ``jax.Array``s and this rank's plain arrays.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mpijax._src import lax_routing
from mpijax._src import replication
from mpijax._src import runtime
from mpijax._src.axes import bind_axes
from mpijax._src.geometry import local_spec
from mpijax._src.geometry import normalize_spec
from mpijax._src.geometry import process_block_counts
from mpijax._src.geometry import replicated_axes
from mpijax._src.geometry import spec_axes
from mpijax._src.global_array import GlobalArray
from mpijax._src.mesh import GlobalMesh

P = PartitionSpec


# --- shard_map ---------------------------------------------------------------------


def _as_spec(s) -> PartitionSpec:
  if s is None:
    return P()
  return s if isinstance(s, PartitionSpec) else P(*s)


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec) or x is None


def _is_pspec(x) -> bool:
  return isinstance(x, PartitionSpec)


def _expand_prefix(prefix, tree, is_leaf):
  """``prefix`` (a pytree prefix of ``tree``) with each of its leaves repeated on every
  leaf of the subtree of ``tree`` it stands for (as jax.shard_map/jax.pmap read specs
  and axes)."""
  return jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, tree, is_leaf=is_leaf)


def _broadcast_specs(specs, tree, what: str):
  """One PartitionSpec per leaf of ``tree`` from ``specs``, a spec or a pytree prefix of it.

  A spec given for a whole subtree (``out_specs=(P(), P("x"))`` for an output
  ``((a, b), c)``) applies to each of its leaves, as in ``jax.shard_map``;
  ``None`` subtrees of ``tree`` stay ``None``. Walk the result with
  ``is_leaf=_is_pspec``.
  """
  if _is_spec(specs):
    spec = _as_spec(specs)
    return jax.tree.map(lambda _: spec, tree)
  try:
    return _expand_prefix(jax.tree.map(_as_spec, specs, is_leaf=_is_spec), tree, _is_pspec)
  except ValueError as e:
    raise ValueError(f"shard_map {what} do not match the arguments' structure: {e}") from None


def shard_map(
  f: Callable, *, mesh: GlobalMesh, in_specs, out_specs, check_vma: bool = False
) -> Callable:
  """Maps ``f`` over every device of every rank, like ``jax.shard_map``.

  Specs refer to global shapes. Each rank passes (and gets back) its own part:
  the block of the global array held by its devices. ``f`` sees one device's
  block and may call :mod:`mpijax.lax` collectives over the mesh's axes (and
  ``jax.lax``'s, which run as mpijax's there). The result works under
  ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

  Args:
    f: the function of one device's blocks.
    mesh: the :class:`~mpijax.GlobalMesh` whose axes the specs name.
    in_specs: a ``PartitionSpec`` per argument (a tuple), or one for all;
      each may be a pytree prefix of its argument (one spec for a subtree).
      A ``None`` argument passes through.
    out_specs: the same for the outputs. An output whose spec leaves a mesh
      axis out is the same on every device along it (``P()``: replicated).
    check_vma: let JAX check, as in ``jax.shard_map``, that an output
      specified as replicated is typed invariant (a ``psum`` result is; use
      ``all_gather(..., to="invarying")`` for a gather).

  Returns:
    The mapped function. It takes each rank's parts as plain arrays (their
    shapes: the global shape divided by the process blocks of the spec) and
    returns this rank's parts; given :class:`~mpijax.GlobalArray` arguments it
    returns GlobalArrays, given global ``jax.Array`` arguments global
    ``jax.Array`` objects.

  Raises:
    TypeError: ``mesh`` is not a :class:`~mpijax.GlobalMesh`.
    ValueError: (when the mapped function is called) the specs do not match
      the arguments' structure or shapes (a sharded dimension not divisible
      by its devices), or a GlobalArray lives on another mesh or spec.

  Examples:
    >>> mesh = mpijax.make_mesh((mpijax.process_count(),), ("x",))  # doctest: +SKIP
    >>> part = np.arange(32)[8 * rank: 8 * rank + 8]  # this rank's block  # doctest: +SKIP
    >>> mpijax.shard_map(lambda x: mpijax.lax.psum(x.sum(), "x"), mesh=mesh,
    ...                  in_specs=P("x"), out_specs=P())(part)  # doctest: +SKIP
    Array(496, dtype=int32)
  """
  if not isinstance(mesh, GlobalMesh):
    raise TypeError(
      f"mpijax.shard_map needs a mpijax.GlobalMesh (mpijax.make_mesh), got {type(mesh).__name__}"
    )

  def local_body(*args):
    ins = _in_specs_tree(in_specs, args)
    args = jax.tree.map(
      lambda s, x: replication.mark_input(x, mesh, tuple(replicated_axes(mesh, s))),
      ins,
      tuple(args),
      is_leaf=_is_pspec,
    )
    with bind_axes(mesh, mesh.axis_names), lax_routing.mesh_axes("mpijax.shard_map"):
      out = f(*args)
    specs = _broadcast_specs(out_specs, out, "out_specs")
    return jax.tree.map(
      lambda s, y: replication.mark_output(y, _copies(mesh, s)), specs, out, is_leaf=_is_pspec
    )

  @functools.wraps(f)
  def wrapped(*args):
    args, metas, any_ga = _unwrap_args(args)
    ins = _in_specs_tree(in_specs, args)
    # Global jax.Arrays in: their parts go in, global jax.Arrays come out.
    args, metas, jax_in = _take_jax_arrays(
      mesh, args, jax.tree.leaves(ins, is_leaf=_is_pspec), metas
    )
    any_ga = any_ga or jax_in
    if any_ga:
      _check_arg_specs("mpijax.shard_map", mesh, metas, jax.tree.leaves(ins, is_leaf=_is_pspec))
    local_ins = jax.tree.map(
      lambda s: local_spec(mesh, s, keep_size_one=True), ins, is_leaf=_is_pspec
    )
    local_outs = jax.tree.map(
      lambda s: local_spec(mesh, _as_spec(s), keep_size_one=True), out_specs, is_leaf=_is_spec
    )
    _check_local_shapes(mesh, ins, args)
    mapped = jax.shard_map(
      local_body,
      mesh=mesh.local_mesh,
      in_specs=local_ins,
      out_specs=local_outs,
      check_vma=check_vma,
    )
    out = mapped(*args)
    if any_ga:
      specs = jax.tree.leaves(_broadcast_specs(out_specs, out, "out_specs"), is_leaf=_is_pspec)
      out = _wrap_outputs(mesh, out, specs)
      if jax_in:
        out = _to_jax_outputs(out)
    return out

  return wrapped


def _copies(mesh: GlobalMesh, spec: PartitionSpec) -> int:
  """How many processes hold the same block of an output with ``spec``."""
  return math.prod(mesh.axes[n].proc_size for n in replicated_axes(mesh, spec))


def _in_specs_tree(in_specs, args):
  if _is_spec(in_specs):
    return tuple(_broadcast_specs(in_specs, a, "in_specs") for a in args)
  if not isinstance(in_specs, (tuple, list)) or len(in_specs) != len(args):
    raise ValueError(
      f"shard_map got {len(args)} arguments but in_specs={in_specs!r}; give one "
      "spec per argument (a tuple), or one spec for all."
    )
  return tuple(_broadcast_specs(s, a, "in_specs") for s, a in zip(in_specs, args))


def _check_local_shapes(mesh: GlobalMesh, specs, args) -> None:
  def check(spec, x):
    shape = np.shape(x)
    for d, entry in enumerate(spec):
      names = spec_axes(mesh, entry)
      n_local = math.prod(mesh.axes[n].local_size for n in names)
      if d >= len(shape):
        raise ValueError(
          f"PartitionSpec {spec} has {len(spec)} entries but the argument has shape {shape}"
        )
      if shape[d] % n_local:
        raise ValueError(
          f"dimension {d} of this rank's part (shape {shape}) is sharded by {spec} over "
          f"{n_local} local devices, but {shape[d]} is not divisible by {n_local}. "
          "Pad the data or choose another spec."
        )

  jax.tree.map(check, specs, tuple(args), is_leaf=_is_pspec)


# --- pmap ---------------------------------------------------------------------------


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
    dyn, metas, any_ga = _unwrap_args(tuple(args[i] for i in dyn_idx))
    treedef = jax.tree.structure(tuple(dyn))
    # One mapped axis (made non-negative) or None per leaf; in_axes may be a
    # pytree prefix of each argument, as in jax.pmap.
    leaf_axes = tuple(
      _mapped_axis(ax, leaf, L, "in_axes")
      for i, x in zip(dyn_idx, dyn)
      for ax, leaf in zip(_per_leaf(axes[i], x, "in_axes"), jax.tree.leaves(x))
    )
    # A global jax.Array (all devices' rows) in: its part goes in, global jax.Arrays come out.
    dyn, metas, jax_in = _take_jax_arrays(
      mesh, tuple(dyn), [_pmap_global_spec(ax, axis_name) for ax in leaf_axes], metas
    )
    any_ga = any_ga or jax_in
    if any_ga:  # a GlobalArray must be sharded over the pmap axis along its mapped axis
      _check_arg_specs(
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
      out = _wrap_outputs(mesh, out, specs)
      if jax_in:
        out = _to_jax_outputs(out)
    return out

  return wrapped


_pmap_meshes: dict[Any, GlobalMesh] = {}


def _per_leaf(axes, tree, what: str) -> list:
  """``axes`` (an int, None, or a pytree prefix of ``tree``) as a list, one per leaf."""
  try:
    return jax.tree.structure(tree).flatten_up_to(_expand_prefix(axes, tree, lambda v: v is None))
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


# --- GlobalArrays in and out -----------------------------------------------------------


def _is_global_array(x) -> bool:
  return isinstance(x, GlobalArray)


def _unwrap_args(args: tuple, mesh: GlobalMesh | None = None) -> tuple[tuple, list, bool]:
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


def _take_jax_arrays(
  mesh: GlobalMesh, args: tuple, specs: list, metas: list
) -> tuple[tuple, list, bool]:
  """Global ``jax.Array`` leaves of ``args`` as this rank's parts on ``mesh`` by ``specs``.

  ``specs`` and ``metas`` (from :func:`_unwrap_args`) have one entry per leaf;
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


def _to_jax_outputs(out: Any) -> Any:
  """Each GlobalArray of ``out`` as a global ``jax.Array`` (no copy)."""
  return jax.tree.map(
    lambda x: x.to_jax() if _is_global_array(x) else x, out, is_leaf=_is_global_array
  )


def _check_arg_specs(what: str, mesh: GlobalMesh, metas: list, specs: list) -> None:
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


def _wrap_outputs(mesh: GlobalMesh, out: Any, specs: list) -> Any:
  """Turns each output leaf (this rank's part) into a GlobalArray with its spec."""
  leaves, treedef = jax.tree.flatten(out)
  wrapped = []
  for x, spec in zip(leaves, specs):
    nspec = normalize_spec(spec, np.ndim(x), mesh)
    counts = process_block_counts(mesh, nspec)
    shape = tuple(n * c for n, c in zip(np.shape(x), counts))
    wrapped.append(GlobalArray(x, shape, x.dtype, mesh, nspec))
  return jax.tree.unflatten(treedef, wrapped)

"""Meshes over (process, local device) and the maps that bind their axes.

A :class:`GlobalMesh` arranges all ``process_count * local_device_count``
devices (global index = process * L + local) row-major into named axes. Each
axis is factored into a *process part* (which ranks it spans, realized as an
MPI sub-communicator) and a *local part* (which of this rank's devices it
spans, realized as an axis of a ``jax.sharding.Mesh`` over the local devices).
An axis can be purely local, purely across processes, or both (the process
part is then the outer factor of the axis index).

:func:`shard_map` and :func:`pmap` run the user's function under
``jax.shard_map`` over the local mesh while an axis environment tells
:mod:`mpijax.lax` which named axes span ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from mpijax._src import replication
from mpijax._src import runtime

P = PartitionSpec


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
          f"that the innermost axes multiply to {L} or a divisor/multiple of it.")
  return proc, loc


class GlobalMesh:
  """Named axes over every device of every rank.

  Creating a mesh is collective (it splits MPI communicators): every rank must
  create the same meshes in the same order.

  Args:
    axis_shapes: size of each axis; their product must be the global device
      count.
    axis_names: the names, as for ``jax.make_mesh``.

  Examples:
    >>> mesh = mpijax.make_mesh((4,), ("i",))  # doctest: +SKIP
    >>> mesh = mpijax.make_mesh((2, 2), ("data", "model"))  # doctest: +SKIP
  """

  def __init__(self, axis_shapes: Sequence[int], axis_names: Sequence[str]):
    rt = runtime.get("mpijax.GlobalMesh")
    axis_shapes = tuple(int(s) for s in axis_shapes)
    axis_names = tuple(axis_names)
    if len(axis_shapes) != len(axis_names):
      raise ValueError(f"mesh got {len(axis_shapes)} sizes {axis_shapes} but "
                       f"{len(axis_names)} names {axis_names}")
    if len(set(axis_names)) != len(axis_names):
      raise ValueError(f"mesh axis names must be distinct, got {axis_names}")
    Pn, L = rt.size, rt.local_device_count
    if math.prod(axis_shapes) != Pn * L:
      raise ValueError(
          f"mesh shape {axis_shapes} has {math.prod(axis_shapes)} devices, but the job has "
          f"{Pn} processes x {L} local devices = {Pn * L}. Pick sizes whose product is {Pn * L}.")
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
        for n, s, p, l, c in zip(axis_names, axis_shapes, proc, loc, self._proc_coords)}
    local_shape = tuple(loc)
    self.local_mesh = Mesh(np.array(rt.local_devices).reshape(local_shape),
                           tuple(self.axes[n].local_name for n in axis_names))
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
    color = int(np.ravel_multi_index([self._proc_coords[k] for k in rest],
                                     [self._proc_sizes[k] for k in rest])) if rest else 0
    key = int(np.ravel_multi_index([self._proc_coords[k] for k in idx],
                                   [self._proc_sizes[k] for k in idx]))
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
    return (isinstance(other, GlobalMesh) and self.axis_names == other.axis_names
            and self.shape == other.shape)

  def __hash__(self) -> int:
    return hash((self.axis_names, tuple(self.shape.items())))

  # --- specs --------------------------------------------------------------------

  def spec_axes(self, entry) -> tuple[str, ...]:
    if entry is None:
      return ()
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    for n in names:
      if n not in self.axes:
        raise ValueError(f"PartitionSpec names axis {n!r}, but the mesh has axes "
                         f"{self.axis_names}")
    return names

  def local_spec(self, spec: PartitionSpec, *, keep_size_one: bool = False) -> PartitionSpec:
    """The spec of this rank's part over the local mesh.

    ``keep_size_one`` keeps the axes of global size 1 (local axes of the local
    mesh, as in the global spec): under ``check_vma=True`` a collective over
    one types its result varying there, and JAX then needs the spec to name it.
    """
    out = []
    for entry in spec:
      local = tuple(self.axes[n].local_name for n in self.spec_axes(entry)
                    if self.axes[n].local_size > 1 or (keep_size_one and self.axes[n].size == 1))
      out.append(None if not local else (local[0] if len(local) == 1 else local))
    return P(*out)

  def process_block(self, spec: PartitionSpec, dim: int) -> tuple[int, int]:
    """(number of process blocks, this rank's block index) along ``dim``.

    Raises if this rank's part along ``dim`` is not one contiguous block.
    """
    names = self.spec_axes(spec[dim]) if dim < len(spec) else ()
    if not names:
      return 1, 0
    seen_local = False
    for n in names:
      a = self.axes[n]
      if a.proc_size > 1 and seen_local:
        raise ValueError(
            f"PartitionSpec {spec} shards dimension {dim} over {names}: a process axis after "
            "a local one gives each rank a strided part. Put the axes that span processes "
            "first, e.g. " + repr(tuple(sorted(names, key=lambda m: self.axes[m].proc_size == 1))))
      if a.local_size > 1:
        seen_local = True
    count = math.prod(self.axes[n].proc_size for n in names)
    index = int(np.ravel_multi_index([self.axes[n].proc_index for n in names],
                                     [self.axes[n].proc_size for n in names]))
    return count, index


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str]) -> GlobalMesh:
  """A :class:`GlobalMesh` (like ``jax.make_mesh``, over every rank's devices)."""
  return GlobalMesh(axis_shapes, axis_names)


# --- the axis environment read by mpijax.lax ----------------------------------------

_env = threading.local()


def axis_env() -> dict[str, tuple[GlobalMesh, AxisInfo]]:
  return getattr(_env, "axes", {})


@contextlib.contextmanager
def bind_axes(mesh: GlobalMesh, names: Sequence[str]):
  old = axis_env()
  new = dict(old)
  for n in names:
    new[n] = (mesh, mesh.axes[n])
  _env.axes = new
  try:
    yield
  finally:
    _env.axes = old


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
  return jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, tree,
                      is_leaf=is_leaf)


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


def shard_map(f: Callable, *, mesh: GlobalMesh, in_specs, out_specs,
              check_vma: bool = False) -> Callable:
  """Maps ``f`` over every device of every rank, like ``jax.shard_map``.

  Specs refer to global shapes. Each rank passes (and gets back) its own part:
  the block of the global array held by its devices. ``f`` sees one device's
  block and may call :mod:`mpijax.lax` collectives over the mesh's axes.

  Examples:
    >>> mesh = mpijax.make_mesh((mpijax.process_count(),), ("x",))  # doctest: +SKIP
    >>> part = np.arange(32)[8 * rank: 8 * rank + 8]  # this rank's block  # doctest: +SKIP
    >>> mpijax.shard_map(lambda x: mpijax.lax.psum(x.sum(), "x"), mesh=mesh,
    ...                  in_specs=P("x"), out_specs=P())(part)  # doctest: +SKIP
    Array(496, dtype=int32)
  """
  if not isinstance(mesh, GlobalMesh):
    raise TypeError(f"mpijax.shard_map needs a mpijax.GlobalMesh (mpijax.make_mesh), got "
                    f"{type(mesh).__name__}")

  def local_body(*args):
    ins = _in_specs_tree(in_specs, args)
    args = jax.tree.map(lambda s, x: replication.mark_input(x, mesh, _unmentioned(mesh, s)),
                        ins, tuple(args), is_leaf=_is_pspec)
    with bind_axes(mesh, mesh.axis_names):
      out = f(*args)
    specs = _broadcast_specs(out_specs, out, "out_specs")
    return jax.tree.map(lambda s, y: replication.mark_output(y, _copies(mesh, s)),
                        specs, out, is_leaf=_is_pspec)

  @functools.wraps(f)
  def wrapped(*args):
    from mpijax._src import global_array as ga  # GlobalArray in/out; ga imports this module
    args, metas, any_ga = ga.unwrap_args(args)
    ins = _in_specs_tree(in_specs, args)
    if any_ga:
      ga.check_arg_specs("mpijax.shard_map", mesh, metas, jax.tree.leaves(ins, is_leaf=_is_pspec))
    local_ins = jax.tree.map(lambda s: mesh.local_spec(s, keep_size_one=True), ins,
                             is_leaf=_is_pspec)
    local_outs = jax.tree.map(lambda s: mesh.local_spec(_as_spec(s), keep_size_one=True),
                              out_specs, is_leaf=_is_spec)
    _check_local_shapes(mesh, ins, args)
    mapped = jax.shard_map(local_body, mesh=mesh.local_mesh, in_specs=local_ins,
                           out_specs=local_outs, check_vma=check_vma)
    out = mapped(*args)
    if any_ga:
      specs = jax.tree.leaves(_broadcast_specs(out_specs, out, "out_specs"), is_leaf=_is_pspec)
      out = ga.wrap_outputs(mesh, out, specs)
    return out

  return wrapped


def _unmentioned(mesh: GlobalMesh, spec: PartitionSpec) -> tuple[str, ...]:
  """Axes spanning processes that ``spec`` does not shard over (replicated there)."""
  used = {n for entry in spec for n in mesh.spec_axes(entry)}
  return tuple(n for n in mesh.axis_names if n not in used and mesh.axes[n].proc_size > 1)


def _copies(mesh: GlobalMesh, spec: PartitionSpec) -> int:
  """How many processes hold the same block of an output with ``spec``."""
  return math.prod(mesh.axes[n].proc_size for n in _unmentioned(mesh, spec))


def _in_specs_tree(in_specs, args):
  if _is_spec(in_specs):
    return tuple(_broadcast_specs(in_specs, a, "in_specs") for a in args)
  if not isinstance(in_specs, (tuple, list)) or len(in_specs) != len(args):
    raise ValueError(f"shard_map got {len(args)} arguments but in_specs={in_specs!r}; give one "
                     "spec per argument (a tuple), or one spec for all.")
  return tuple(_broadcast_specs(s, a, "in_specs") for s, a in zip(in_specs, args))


def _check_local_shapes(mesh: GlobalMesh, specs, args) -> None:
  def check(spec, x):
    shape = np.shape(x)
    for d, entry in enumerate(spec):
      names = mesh.spec_axes(entry)
      n_local = math.prod(mesh.axes[n].local_size for n in names)
      if d >= len(shape):
        raise ValueError(f"PartitionSpec {spec} has {len(spec)} entries but the argument "
                         f"has shape {shape}")
      if shape[d] % n_local:
        raise ValueError(
            f"dimension {d} of this rank's part (shape {shape}) is sharded by {spec} over "
            f"{n_local} local devices, but {shape[d]} is not divisible by {n_local}. "
            "Pad the data or choose another spec.")
  jax.tree.map(check, specs, tuple(args), is_leaf=_is_pspec)


# --- pmap ---------------------------------------------------------------------------


def pmap(fun: Callable, axis_name: str = "i", *, in_axes=0, out_axes=0,
         static_broadcasted_argnums: int | Sequence[int] = (),
         donate_argnums: int | Sequence[int] = ()) -> Callable:
  """``jax.pmap`` whose axis spans every device of every rank.

  Inputs and outputs have leading dimension ``local_device_count`` (this
  rank's devices), as with ``jax.pmap`` in a multi-process JAX job;
  :func:`mpijax.lax.axis_index` is the global device index
  ``process_index * local_device_count + local_index``.

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
            lambda *a: fun(*a[:n], **dict(zip(names, a[n:]))), axis_name,
            in_axes=tuple(axes) + (0,) * len(names), out_axes=out_axes,
            static_broadcasted_argnums=static, donate_argnums=donate_argnums)
      return sub(*args, *(kwargs[k] for k in names))
    from mpijax._src import global_array as ga  # GlobalArray in/out; ga imports this module
    mesh = _mesh()
    L = mesh.local_device_count
    dyn_idx = [i for i in range(len(args)) if i not in static]
    dyn, metas, any_ga = ga.unwrap_args(tuple(args[i] for i in dyn_idx))
    treedef = jax.tree.structure(tuple(dyn))
    # One mapped axis (made non-negative) or None per leaf; in_axes may be a
    # pytree prefix of each argument, as in jax.pmap.
    leaf_axes = tuple(_mapped_axis(ax, leaf, L, "in_axes")
                      for i, x in zip(dyn_idx, dyn)
                      for ax, leaf in zip(_per_leaf(axes[i], x, "in_axes"), jax.tree.leaves(x)))
    if any_ga:  # a GlobalArray must be sharded over the pmap axis along its mapped axis
      ga.check_arg_specs("mpijax.pmap", mesh, metas,
                         [_pmap_global_spec(ax, axis_name) for ax in leaf_axes])
    for ax, leaf in zip(leaf_axes, jax.tree.leaves(tuple(dyn))):
      if ax is not None and np.shape(leaf)[ax] != L:
        raise ValueError(
            f"mpijax.pmap maps axis {ax} over this rank's {L} local devices, but an "
            f"argument has shape {np.shape(leaf)}. Give each rank arrays whose axis {ax} "
            f"has size local_device_count() = {L}.")
    static_vals = tuple((i, args[i]) for i in static)
    key = (static_vals, treedef, leaf_axes)
    fn = cache.get(key)
    if fn is None:
      fn = cache[key] = _build_pmap(fun, mesh, axis_name, dyn_idx, treedef, leaf_axes,
                                    static_vals, out_axes, len(args), donate_argnums)
    out = fn(*dyn)
    if any_ga:
      specs = [_pmap_global_spec(None if ax is None else ax % np.ndim(leaf), axis_name)
               for ax, leaf in zip(_per_leaf(out_axes, out, "out_axes"), jax.tree.leaves(out))]
      out = ga.wrap_outputs(mesh, out, specs)
    return out

  return wrapped


_pmap_meshes: dict[Any, GlobalMesh] = {}


def _per_leaf(axes, tree, what: str) -> list:
  """``axes`` (an int, None, or a pytree prefix of ``tree``) as a list, one per leaf."""
  try:
    return jax.tree.structure(tree).flatten_up_to(
        _expand_prefix(axes, tree, lambda v: v is None))
  except (ValueError, TypeError) as e:
    raise ValueError(f"mpijax.pmap got {what}={axes!r}, which is not an int, None or a pytree "
                     f"prefix of the {'arguments' if what == 'in_axes' else 'outputs'}: "
                     f"{e}") from None


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
        f"has size local_device_count() = {L}.")
  return int(ax) % len(shape)


def _pmap_global_spec(ax: int | None, axis_name) -> PartitionSpec:
  return P() if ax is None else P(*([None] * ax + [axis_name]))


def _build_pmap(fun, mesh: GlobalMesh, axis_name, dyn_idx, treedef, leaf_axes, static_vals,
                out_axes, nargs, donate_argnums):
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
    with bind_axes(mesh, (axis_name,)):
      out = fun(*full)
    # out_axes None: a replicated result, returned once, not per device.
    return jax.tree.map(lambda ax, sub: sub if ax is None else jax.tree.map(
        lambda a: jnp.expand_dims(a, 0), sub), out_axes, out, is_leaf=none_leaf)

  in_specs = treedef.unflatten([P() if ax is None else P(local) for ax in leaf_axes])
  out_specs = jax.tree.map(lambda ax: P() if ax is None else P(local), out_axes,
                           is_leaf=none_leaf)
  mapped = jax.shard_map(body, mesh=mesh.local_mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  def run(*dyn):
    leaves = [a if not ax else jnp.moveaxis(a, ax, 0)
              for a, ax in zip(jax.tree.leaves(dyn), leaf_axes)]
    out = mapped(*treedef.unflatten(leaves))
    return jax.tree.map(lambda ax, sub: jax.tree.map(
        lambda a: a if not ax else jnp.moveaxis(a, 0, ax), sub), out_axes, out,
        is_leaf=none_leaf)

  donate = tuple(dyn_idx.index(i) for i in donate_argnums if i in dyn_idx)
  return jax.jit(run, donate_argnums=donate)

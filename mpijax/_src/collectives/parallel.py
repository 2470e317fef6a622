"""``jax.lax``-shaped collectives over axes that span every device of every rank.

On an axis bound by :func:`mpijax.pmap` / :func:`mpijax.shard_map` each
collective is a local XLA collective over this rank's devices plus an MPI
step between ranks (on the process-group communicator of the axis; every
local device uses its own sub-communicator). On a purely local axis it is
exactly ``jax.lax``; on an axis mpijax does not know (a ``vmap`` axis, a
plain ``jax.shard_map`` axis) the call is handed to ``jax.lax`` unchanged.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mpijax._src import config
from mpijax._src import jax_compat
from mpijax._src.collectives.axes import AxisInfo
from mpijax._src.collectives.axes import Mesh
from mpijax._src.collectives.axes import axis_env
from mpijax._src.ops.allgather import allgather as mpi_allgather
from mpijax._src.ops.allreduce import allreduce as mpi_allreduce
from mpijax._src.ops.alltoall import alltoall as mpi_alltoall
from mpijax._src.ops.bcast import bcast as mpi_bcast
from mpijax._src.ops.device_allreduce import device_allreduce as mpi_device_allreduce
from mpijax._src.ops.ppermute import ppermute as mpi_ppermute
from mpijax._src.ops.reduce_scatter import reduce_scatter as mpi_reduce_scatter
from mpijax._src.runtime import state as runtime


def _names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _resolve(fn: str, axis_name) -> tuple[Mesh | None, list[AxisInfo], tuple]:
  """Splits ``axis_name`` into mpijax-bound axes and names left to jax.lax."""
  env = axis_env()
  names = _names(axis_name)
  ours = [n for n in names if n in env]
  others = tuple(n for n in names if n not in env)
  if not ours:
    return None, [], others
  meshes = {id(env[n][0]) for n in ours}
  if len(meshes) > 1:
    raise ValueError(f"{fn} got axes {ours} from different mpijax meshes; use axes of one mesh.")
  return env[ours[0]][0], [env[n][1] for n in ours], others


def _unbound(fn: str, axis_name) -> Exception:
  # Not JAX's own advice (call it under jax.shard_map): the fix is the map's axis name.
  bound = sorted(axis_env())
  hint = (f"the enclosing mpijax.pmap/mpijax.shard_map maps {bound}" if bound else
          "no mpijax.pmap or mpijax.shard_map encloses this call")
  return NameError(f"{fn} got axis_name {axis_name!r}, but {hint}. Call it inside "
                   f"mpijax.pmap(f, axis_name=...) or mpijax.shard_map(f, mesh=...) whose mesh "
                   f"has that axis.")


def _lax(fn: str, axis_name, call):
  try:
    return call()
  except NameError:
    raise _unbound(fn, axis_name) from None


def _local_names(axes: Sequence[AxisInfo]) -> tuple[str, ...]:
  # Axes of size 1 too: shard_map's local specs name them (as JAX's do), and
  # under check_vma=True only jax.lax.psum over them types the result invariant.
  return tuple(a.local_name for a in axes if a.local_size > 1 or a.size == 1)


# --- reductions ----------------------------------------------------------------------


def _check_axis(fn: str, what: str, axis: int, ndim: int, valid: int) -> int:
  """``axis`` made non-negative; out of [-valid, valid) is an error, as in jax.lax."""
  if valid == 0:
    raise ValueError(f"{fn} with {what}={axis} needs a per-device input with at least one "
                     "dimension; got a scalar.")
  if not -valid <= axis < valid:
    raise ValueError(f"{fn} got {what}={axis} for a per-device input with {ndim} "
                     f"dimension(s); it must be in [{-valid}, {valid}).")
  return axis % valid


def _reduce_leaf(x, mesh: Mesh, axes: list[AxisInfo], op: str):
  x = jnp.asarray(x)
  if op == "sum" and x.dtype == jnp.bool_:
    x = x.astype(jnp.int32)  # as jax.lax.psum: a count (MPI has no bool sum)
  if op != "sum" and jnp.issubdtype(x.dtype, jnp.complexfloating):
    # MPI has no order on complex numbers; jax.lax compares them
    # lexicographically (real part, then imaginary), as jnp.max does here.
    full = all_gather(x, tuple(a.name for a in axes))
    return full.max(axis=0) if op == "max" else full.min(axis=0)
  if op != "sum" and jnp.issubdtype(x.dtype, jnp.inexact):
    return _extremum_leaf(x, mesh, axes, op)
  return _reduce_leaf_impl(x, mesh, axes, op)


def _extremum_leaf(x, mesh: Mesh, axes: list[AxisInfo], op: str):
  """pmax/pmin with one derivative rule for every layout of ranks and devices.

  The tangent is the mean of the tangents of every device holding the
  extremum (``jnp.max``'s rule for ties, over the whole axis); the local XLA
  step alone has no derivative rule.
  """
  @jax.custom_jvp
  def extremum(v):
    # As XLA's all-reduce (jax.pmap, jax.shard_map): NaN is skipped and an
    # all-NaN element gives the identity (-inf for max). MPI's MAX/MIN compare
    # with '>'/'<', so a NaN won or lost by the order of the operands, which
    # depends on the ranks and the path: non-extremal values came out.
    return _reduce_leaf_impl(_nan_to_identity(v, op), mesh, axes, op)

  @extremum.defjvp
  def extremum_jvp(primals, tangents):
    (v,), (t,) = primals, tangents
    out = extremum(v)
    hit = v == out
    count = _reduce_leaf_impl(hit.astype(t.dtype), mesh, axes, "sum")
    return out, _reduce_leaf_impl(jnp.where(hit, t, jnp.zeros_like(t)), mesh, axes, "sum") / count

  return extremum(x)


def _nan_to_identity(x, op: str):
  """``x`` with NaN replaced by the identity of max (-inf) or min (+inf)."""
  fill = jnp.asarray(-jnp.inf if op == "max" else jnp.inf, x.dtype)
  return jnp.where(jnp.isnan(x), fill, x)


def _reduce_leaf_impl(x, mesh: Mesh, axes: list[AxisInfo], op: str):
  local = _local_names(axes)
  comm = mesh.process_comm([a.name for a in axes])
  if comm is None:
    return {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op](x, local)
  n_local = math.prod(a.local_size for a in axes)
  if (n_local > 1 and n_local == runtime.get("mpijax.lax.psum").local_device_count
      and config.get("device_allreduce") and not jax_compat.typed_varying(x)):
    # Every device of every rank: one node-local all-reduce among all of them
    # where the ranks share a node (no local XLA collective, no MPI message).
    out = mpi_device_allreduce(x, op, comm=comm)
    if out is not None:
      return out
  if (n_local > 1 and x.size >= n_local
      and x.size * x.dtype.itemsize >= config.get("hierarchical_min_bytes")):
    # Bandwidth-aware: each local device reduces 1/n_local of the array across
    # ranks, so the MPI traffic per rank is the array's size once.
    flat = x.reshape(-1)
    pad = (-flat.size) % n_local
    if pad:
      flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    if op == "sum":
      part = jax.lax.psum_scatter(flat, local, scatter_dimension=0, tiled=True)
    else:  # no pmax_scatter in XLA: exchange the parts, then reduce them here
      parts = jax.lax.all_to_all(flat.reshape(n_local, -1), local, 0, 0, tiled=True)
      part = parts.max(axis=0) if op == "max" else parts.min(axis=0)
    part = mpi_allreduce(part, op, comm=comm)
    # Typed invariant (as psum's result) only where jax tracks it, under
    # shard_map(check_vma=True): there the invariant gather's transpose is
    # right. Unchecked (every mpijax.pmap), the cotangent differs per device and
    # only the plain gather's transpose sums it; 'invarying' lost a factor L.
    to = "invarying" if jax_compat.typed_varying(part) else "varying"
    full = jax_compat.all_gather(part, local, axis=0, tiled=True, to=to)
    return full[:x.size].reshape(x.shape)
  if local:
    x = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op](x, local)
  return mpi_allreduce(x, op, comm=comm)


_LAX_REDUCE = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _reduction(fn: str, op: str, x, axis_name, axis_index_groups=None):
  mesh, axes, others = _resolve(fn, axis_name)
  lax_fn = _LAX_REDUCE[op]
  if mesh is None:
    return _lax(fn, axis_name, lambda: lax_fn(x, others, axis_index_groups=axis_index_groups))
  if axis_index_groups is not None:
    grp = _Groups(fn, axis_name, axis_index_groups, equal=False)
    return _grouped_reduction(op, x, axis_name, grp)
  if others:
    x = _lax(fn, axis_name, lambda: lax_fn(x, others))
  return jax.tree.map(lambda leaf: _reduce_leaf(leaf, mesh, axes, op), x)


def psum(x, axis_name, *, axis_index_groups=None):
  """Sums ``x`` over the mapped axis ``axis_name`` across ranks, like ``jax.lax.psum``.

  Over an axis that spans ranks, XLA reduces over this rank's devices and
  MPI between the ranks (one node-local all-reduce among all devices where
  the ranks share a node; see docs/collectives.md). Each leaf of a pytree
  is summed.

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis. Bool leaves are counted (int32).
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    axis_index_groups: optional groups of indices along the axis that
      partition it (e.g. ``[[0, 1], [2, 3]]`` for size 4); each group is
      summed on its own. Over an axis that spans ranks this gathers the
      whole axis first: ``axis_size`` times the data of the plain sum.

  Returns:
    ``x``'s structure and shapes: the sum over every device of the axis (of
    its group), the same on each of them, in ``x``'s dtype (int32 for bool).

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: the names belong to different mpijax meshes, or
      ``axis_index_groups`` does not hold every index exactly once.
    TypeError: ``axis_index_groups`` is not groups of integer indices.

  Examples:
    On 2 ranks with 2 devices each (4 devices along ``"i"``):

    >>> xs = jnp.arange(2.) + 2 * mpijax.process_index()  # [0, 1] / [2, 3]  # doctest: +SKIP
    >>> mpijax.pmap(lambda x: mpijax.lax.psum(x, "i"), axis_name="i")(xs)  # doctest: +SKIP
    Array([6., 6.], dtype=float32)
  """
  return _reduction("psum", "sum", x, axis_name, axis_index_groups)


def pmax(x, axis_name, *, axis_index_groups=None):
  """Element-wise maximum of ``x`` over the mapped axis ``axis_name``, like ``jax.lax.pmax``.

  As XLA's all-reduce under ``jax.pmap``/``jax.shard_map``, NaN is skipped
  (an element that is NaN on every device gives -inf). Complex numbers are
  compared lexicographically (real part, then imaginary), from a gather of
  the axis. The derivative is the mean of the tangents of the devices that
  hold the maximum.

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    axis_index_groups: optional groups of indices along the axis that
      partition it; each group is reduced on its own (over an axis that
      spans ranks, from a gather of the whole axis).

  Returns:
    ``x``'s structure, shapes and dtypes: the maximum over every device of
    the axis (of its group), the same on each of them.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: the names belong to different mpijax meshes, or
      ``axis_index_groups`` does not hold every index exactly once.

  Examples:
    >>> mpijax.pmap(lambda x: mpijax.lax.pmax(x, "i"))(xs)  # doctest: +SKIP
  """
  return _reduction("pmax", "max", x, axis_name, axis_index_groups)


def pmin(x, axis_name, *, axis_index_groups=None):
  """Element-wise minimum of ``x`` over the mapped axis ``axis_name``, like ``jax.lax.pmin``.

  The mirror of :func:`pmax`: NaN is skipped (all-NaN gives +inf), complex
  numbers compare lexicographically.

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    axis_index_groups: optional groups of indices along the axis that
      partition it; each group is reduced on its own.

  Returns:
    ``x``'s structure, shapes and dtypes: the minimum over every device of
    the axis (of its group), the same on each of them.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: the names belong to different mpijax meshes, or
      ``axis_index_groups`` does not hold every index exactly once.
  """
  return _reduction("pmin", "min", x, axis_name, axis_index_groups)


def pmean(x, axis_name, *, axis_index_groups=None):
  """Mean of ``x`` over the mapped axis ``axis_name``, like ``jax.lax.pmean``.

  :func:`psum` divided by the number of devices along the axis (with
  ``axis_index_groups``: by the size of the device's own group).

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    axis_index_groups: optional groups of indices along the axis that
      partition it; each group is averaged on its own.

  Returns:
    ``x``'s structure and shapes: the mean, the same on every device of the
    axis (of its group). Integer and bool leaves give floating means, as
    ``jax.lax.pmean``'s.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: the names belong to different mpijax meshes, or
      ``axis_index_groups`` does not hold every index exactly once.

  Examples:
    >>> grads = mpijax.lax.pmean(grads, "batch")  # inside the map  # doctest: +SKIP
  """
  if axis_index_groups is None:
    n = axis_size(axis_name)
  else:  # each device divides by the size of its own group
    grp = _Groups("pmean", axis_name, axis_index_groups, equal=False)
    n = grp.sizes[0] if grp.equal else jnp.asarray(grp.sizes)[axis_index(axis_name)]
  return jax.tree.map(lambda s: s / n,
                      psum(x, axis_name, axis_index_groups=axis_index_groups))


# --- axis_index_groups -------------------------------------------------------------------
#
# jax.lax's collectives take axis_index_groups: the indices along the axis split
# into groups, each reduced (gathered, scattered, exchanged) on its own. Over an
# axis that spans ranks, mpijax builds them from a gather of the whole axis and
# a per-device selection of its group's members: one all-gather (axis_size times
# the data of the ungrouped collective), exact values, and derivatives through
# all_gather's transpose. Groups are checked the way jax.pmap checks them.


class _Groups:
  """Validated ``axis_index_groups`` over ``axis_name`` and the tables built from them."""

  def __init__(self, fn: str, axis_name, groups, *, equal: bool):
    size = axis_size(axis_name)
    try:
      gs = [[operator.index(i) for i in g] for g in groups]
    except TypeError:
      raise TypeError(f"{fn} got axis_index_groups={groups!r}; expected a sequence of groups, "
                      f"each a sequence of integer indices along {axis_name!r}.") from None
    flat = sorted(i for g in gs for i in g)
    if not gs or any(not g for g in gs) or flat != list(range(size)):
      raise ValueError(
          f"{fn} got axis_index_groups={groups!r}; the groups must be non-empty and together "
          f"hold every index along {axis_name!r} (size {size}) exactly once, e.g. "
          f"{[list(range(size))[i::2] for i in range(2)] if size > 1 else [[0]]}.")
    self.equal = len({len(g) for g in gs}) == 1
    if equal and not self.equal:
      raise ValueError(f"{fn} got axis_index_groups={groups!r}; {fn} needs groups of equal "
                       "size.")
    self.size = size
    self.group_size = len(gs[0])  # meaningful when self.equal
    group_of = [None] * size
    for g in gs:
      for i in g:
        group_of[i] = g
    self.sizes = [len(g) for g in group_of]  # the size of each index's group
    self.position = np.array([g.index(i) for i, g in enumerate(group_of)], np.int32)
    self.same = np.array([np.isin(np.arange(size), g) for g in group_of])  # [i, j]: one group
    # members[i]: the indices of i's group in order (equal sizes only).
    self.members = np.array(group_of, np.int32) if self.equal else None


def _grouped_reduction(op: str, x, axis_name, grp: _Groups):
  me = axis_index(axis_name)
  same = jnp.asarray(grp.same)[me]  # [size]: which devices share this one's group

  def leaf(v):
    v = jnp.asarray(v)
    full = all_gather(v, axis_name)  # [size, *v.shape], by index along the axis
    mask = same.reshape((grp.size,) + (1,) * v.ndim)
    if op == "sum":
      if v.dtype == jnp.bool_:  # as jax.lax.psum: a count
        return jnp.sum(jnp.where(mask, full, False), axis=0, dtype=jnp.int32)
      return jnp.sum(jnp.where(mask, full, jnp.zeros((), v.dtype)), axis=0, dtype=v.dtype)
    # Others' values become the identity of the max / min (no false ties).
    if jnp.issubdtype(v.dtype, jnp.inexact):
      fill = -jnp.inf if op == "max" else jnp.inf
      mask = mask & ~jnp.isnan(full)  # NaN skipped, as the ungrouped pmax/pmin
    elif v.dtype == jnp.bool_:
      fill = op != "max"
    else:
      info = jnp.iinfo(v.dtype)
      fill = info.min if op == "max" else info.max
    picked = jnp.where(mask, full, jnp.asarray(fill, v.dtype))
    return picked.max(axis=0) if op == "max" else picked.min(axis=0)

  return jax.tree.map(leaf, x)


# --- indices ------------------------------------------------------------------------


def axis_size(axis_name) -> int:
  """Number of devices along ``axis_name`` (every rank's devices)."""
  return _axis_size("axis_size", axis_name)


def _axis_size(fn: str, axis_name) -> int:
  """axis_size whose unbound-axis error names the collective ``fn`` the user called."""
  mesh, axes, others = _resolve(fn, axis_name)
  size = math.prod(a.size for a in axes)
  if others:
    size *= _lax(fn, axis_name, lambda: jax.lax.axis_size(others))
  return size


def _axis_index_one(a: AxisInfo):
  local = jax.lax.axis_index(a.local_name) if a.local_size > 1 else 0
  return jnp.int32(a.proc_index * a.local_size) + local


def axis_index(axis_name):
  """This device's index along ``axis_name``: global over every rank's devices."""
  env = axis_env()
  index = jnp.int32(0)
  for n in _names(axis_name):
    if n in env:
      a = env[n][1]
      index = index * a.size + _axis_index_one(a)
    else:
      size = _lax("axis_index", n, lambda: jax.lax.axis_size(n))
      index = index * size + _lax("axis_index", n, lambda: jax.lax.axis_index(n))
  return index


# --- data movement ---------------------------------------------------------------------


def _single(fn: str, axis_name) -> tuple[Mesh | None, AxisInfo | None]:
  """(mesh, axis) for one mpijax axis; (mesh, None) for several names; (None, None) for none."""
  mesh, axes, others = _resolve(fn, axis_name)
  if mesh is None:
    return None, None
  if others or len(axes) != 1:
    return mesh, None
  return mesh, axes[0]


def _gather_one(x, mesh: Mesh, a: AxisInfo, to: str = "varying"):
  """[size, *x.shape] ordered by the global index along ``a``."""
  if a.proc_size == 1:
    return jax_compat.all_gather(x, a.local_name, axis=0, to=to)
  # MPI first, on each device's own sub-communicator: every shard crosses the
  # network once; the copies for the other local devices are made locally.
  y = mpi_allgather(x, comm=mesh.process_comm([a.name]))  # [ps, ...]
  if a.local_size > 1:
    y = jax_compat.all_gather(y, a.local_name, axis=1, to=to)  # [ps, ls, ...]
  return y.reshape((a.size,) + x.shape)


_GATHER_TO = ("varying", "invarying")


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False,
               to: str = "varying"):
  """Gathers ``x`` from every device along ``axis_name``, like ``jax.lax.all_gather``.

  Over an axis that spans ranks, MPI runs first (each block crosses the
  network once) and the copies for this rank's other devices are made
  locally.

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    axis_index_groups: optional groups of equal size that partition the
      axis' indices; each device gathers from its own group only, in the
      group's order.
    axis: where the gathered dimension goes in the result (negative counts
      from the end).
    tiled: concatenate the blocks along ``axis`` instead of stacking them
      in a new dimension.
    to: ``"varying"`` (default) or ``"invarying"``: the latter types the
      result as the same on every device of the axis (``jax.lax``'s
      ``all_gather_invariant``), which an ``out_specs`` of ``P()`` needs
      under ``shard_map(..., check_vma=True)``; the values are the same.

  Returns:
    ``x``'s structure and dtypes. Untiled, each leaf has a new dimension of
    size ``axis_size(axis_name)`` (or the group size) at ``axis``, whose
    entry ``i`` is the ``x`` of the device with ``axis_index`` ``i``; tiled,
    dimension ``axis`` is that many times longer. The same on every device.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: ``axis`` is out of range, ``to`` is another value, or the
      groups do not partition the axis into groups of equal size.
    NotImplementedError: ``axis_index_groups`` with ``to="invarying"``.

  Examples:
    On 2 ranks with 1 device each:

    >>> mpijax.pmap(lambda x: mpijax.lax.all_gather(x, "i"))(jnp.ones((1, 3)))  # doctest: +SKIP
    Array([[[1., 1., 1.],
            [1., 1., 1.]]], dtype=float32)
  """
  env = axis_env()
  names = _names(axis_name)
  if not any(n in env for n in names):
    return _lax("all_gather", axis_name, lambda: jax_compat.all_gather(
        x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, to=to))
  if to not in _GATHER_TO:
    raise ValueError(f"all_gather got to={to!r} over mpijax axis {axis_name!r}; use one of "
                     f"{list(_GATHER_TO)} ('reduced' is for jax's explicit-sharding types, "
                     "which mpijax axes do not carry).")
  if axis_index_groups is not None and to != "varying":
    raise NotImplementedError(f"all_gather with axis_index_groups and to={to!r}: as in "
                              "jax.lax, groups give a result that varies over the axis; "
                              "drop one of the two.")
  if axis_index_groups is not None:
    grp = _Groups("all_gather", axis_name, axis_index_groups, equal=True)
    mine = jnp.asarray(grp.members)[axis_index(axis_name)]

    def grouped(v):
      v = jnp.asarray(v)
      ax = _check_axis("all_gather", "axis", axis, v.ndim, v.ndim if tiled else v.ndim + 1)
      g = jnp.moveaxis(jnp.take(all_gather(v, axis_name), mine, axis=0), 0, ax)
      if tiled:
        return g.reshape(v.shape[:ax] + (g.shape[ax] * v.shape[ax],) + v.shape[ax + 1:])
      return g

    return jax.tree.map(grouped, x)

  def leaf(v):
    v = jnp.asarray(v)
    ax = _check_axis("all_gather", "axis", axis, v.ndim, v.ndim if tiled else v.ndim + 1)
    g = v[None]
    # Innermost axis first: each gather stacks a new major dimension in front,
    # so the combined index is row-major over the names, as in jax.lax.
    for n in reversed(names):
      if n in env:
        m, ax_info = env[n]
        g = _gather_one(g, m, ax_info, to)
      else:
        g = _lax("all_gather", n, lambda g=g: jax_compat.all_gather(g, n, axis=0, to=to))
      # Explicit sizes: -1 cannot be inferred for a zero-size array.
      g = g.reshape((math.prod(g.shape[:g.ndim - v.ndim]),) + v.shape)
    g = jnp.moveaxis(g, 0, ax)
    if tiled:
      return g.reshape(v.shape[:ax] + (g.shape[ax] * v.shape[ax],) + v.shape[ax + 1:])
    return g

  return jax.tree.map(leaf, x)


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False):
  """Sums ``x`` over ``axis_name`` and keeps this device's block, like ``jax.lax.psum_scatter``.

  The reduce-scatter: device ``i`` of the axis gets block ``i`` (along
  ``scatter_dimension``) of the sum. The local devices reduce-scatter with
  XLA before the MPI step, so each rank sends its share once.

  Args:
    x: this device's array, or a pytree of arrays (ints or floats, not
      bool), with the same shapes and dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    scatter_dimension: the dimension of ``x`` split into one block per
      device: of size ``axis_size`` untiled, a multiple of it tiled.
    axis_index_groups: optional groups of equal size that partition the
      axis' indices; the sum is over this device's group, whose members
      split the scatter dimension.
    tiled: keep ``scatter_dimension`` (shortened to one block) instead of
      removing it.

  Returns:
    ``x``'s structure and dtypes: this device's block of the sum. Untiled,
    ``scatter_dimension`` is removed; tiled, it is ``axis_size`` (or the
    group size) times shorter.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    TypeError: a bool leaf (cast it first, e.g. ``x.astype(jnp.int32)``).
    ValueError: ``scatter_dimension`` is out of range or its size does not
      fit the axis size, or the groups do not partition the axis into
      groups of equal size.

  Examples:
    >>> mine = mpijax.lax.psum_scatter(grads, "i", tiled=True)  # doctest: +SKIP
  """
  env = axis_env()
  names = _names(axis_name)
  if not any(n in env for n in names):
    return _lax("psum_scatter", axis_name, lambda: jax.lax.psum_scatter(
        x, axis_name, scatter_dimension=scatter_dimension,
        axis_index_groups=axis_index_groups, tiled=tiled))
  # jax.lax.psum_scatter has no bool sum (unlike psum, which counts); check it
  # here, or the error would depend on the layout (none over a size-1 axis).
  if any(jnp.result_type(v) == jnp.bool_ for v in jax.tree.leaves(x)):
    raise TypeError(f"psum_scatter over {axis_name!r} got a bool array; as jax.lax.psum_scatter "
                    "it sums integers and floats only. Cast first, e.g. x.astype(jnp.int32).")
  if axis_index_groups is not None:
    grp = _Groups("psum_scatter", axis_name, axis_index_groups, equal=True)
    k, n_g = jnp.asarray(grp.position)[axis_index(axis_name)], grp.group_size
    _check_dims("psum_scatter", axis_name, "scatter_dimension", scatter_dimension, n_g,
                tiled, x)
    total_in_group = _grouped_reduction("sum", x, axis_name, grp)

    def block(v):
      d = scatter_dimension % v.ndim
      if not tiled:
        return jax.lax.dynamic_index_in_dim(v, k, d, keepdims=False)
      return jax.lax.dynamic_slice_in_dim(v, k * (v.shape[d] // n_g), v.shape[d] // n_g, d)

    return jax.tree.map(block, total_in_group)
  total = axis_size(axis_name)

  def leaf(v):
    v = jnp.asarray(v)
    d = _check_axis("psum_scatter", "scatter_dimension", scatter_dimension, v.ndim, v.ndim)
    n = v.shape[d]
    if (not tiled and n != total) or (tiled and n % total):
      raise ValueError(
          f"psum_scatter over {axis_name!r} (size {total}) got scatter_dimension {d} of size "
          f"{n}; it must be {'divisible by' if tiled else 'equal to'} {total}.")
    rest = v.shape[:d] + v.shape[d + 1:]
    y = jnp.moveaxis(v, d, 0).reshape((total, n // total) + rest)
    # Outermost axis first: its block index is the major one.
    for name in names:
      k = axis_size(name)  # explicit sizes: -1 cannot be inferred for a zero-size array
      y = y.reshape((k, y.shape[0] // k) + y.shape[1:])
      if name in env:
        m, ax_info = env[name]
        y = _scatter_one(y, m, ax_info)
      else:
        y = _lax("psum_scatter", name,
                 lambda y=y: jax.lax.psum_scatter(y, name, scatter_dimension=0))
    y = jnp.moveaxis(y.reshape((n // total,) + rest), 0, d)
    return y if tiled else jnp.squeeze(y, d)

  return jax.tree.map(leaf, x)


def _scatter_one(y, mesh: Mesh, a: AxisInfo):
  """y: [a.size, ...] blocks -> this device's block summed over ``a``."""
  blocks = y.reshape((a.proc_size, a.local_size) + y.shape[1:])
  if a.local_size > 1:
    blocks = jax.lax.psum_scatter(blocks, a.local_name, scatter_dimension=1)  # [ps, ...]
  else:
    blocks = blocks[:, 0]
  if a.proc_size > 1:
    return mpi_reduce_scatter(blocks, "sum", comm=mesh.process_comm([a.name]))
  return blocks[0]


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, axis_index_groups=None,
               tiled: bool = False):
  """Exchanges chunks between all devices of ``axis_name``, like ``jax.lax.all_to_all``.

  ``x`` is split along ``split_axis`` into one chunk per device of the
  axis; chunk ``j`` goes to device ``j``, and the chunks received are put
  together along ``concat_axis``. Over a tuple of names the chunks come
  from a gather of the whole axis (``axis_size`` times the data).

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    split_axis: the dimension of ``x`` cut into chunks: of size
      ``axis_size`` untiled, a multiple of it tiled (negative counts from
      the end).
    concat_axis: where the received chunks are put together in the result.
    axis_index_groups: optional groups of equal size that partition the
      axis' indices; chunks go between the members of a group only.
    tiled: concatenate the received chunks along ``concat_axis`` instead of
      stacking them in a new dimension there.

  Returns:
    ``x``'s structure and dtypes. Untiled, each leaf's shape is
    ``np.insert(np.delete(x.shape, split_axis), concat_axis, axis_size)``,
    and entry ``j`` along ``concat_axis`` is the chunk device ``j`` sent
    here; tiled, ``split_axis`` is ``axis_size`` times shorter and
    ``concat_axis`` as many times longer.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: ``split_axis`` or ``concat_axis`` is out of range, the size
      of ``split_axis`` does not fit the axis (or group) size, or the
      groups do not partition the axis into groups of equal size.

  Examples:
    >>> y = mpijax.lax.all_to_all(x, "i", split_axis=0, concat_axis=1, tiled=True)  # doctest: +SKIP
  """
  mesh, a = _single("all_to_all", axis_name)
  if mesh is None:
    return _lax("all_to_all", axis_name, lambda: jax.lax.all_to_all(
        x, axis_name, split_axis, concat_axis, axis_index_groups=axis_index_groups,
        tiled=tiled))
  for v in jax.tree.leaves(x):  # the same error whether the axis spans ranks or not
    _check_axis("all_to_all", "split_axis", split_axis, np.ndim(v), np.ndim(v))
    _check_axis("all_to_all", "concat_axis", concat_axis, np.ndim(v), np.ndim(v))
  if axis_index_groups is not None:
    return _grouped_all_to_all(x, axis_name, split_axis, concat_axis, axis_index_groups, tiled)
  S = axis_size(axis_name)

  def check_split(v):
    sa = split_axis % np.ndim(v)  # checked above
    if np.shape(v)[sa] % S or (not tiled and np.shape(v)[sa] != S):
      raise ValueError(
          f"all_to_all over {axis_name!r} (size {S}) got split_axis {sa} of size "
          f"{np.shape(v)[sa]}; it must be {'divisible by' if tiled else 'equal to'} {S}.")

  if a is None:
    # Several axes (their combined index is row-major over the names, as in
    # jax.lax): the whole axis as one group, from a gather of it (axis_size
    # times the data of one axis's exchange).
    jax.tree.map(check_split, x)
    return _grouped_all_to_all(x, axis_name, split_axis, concat_axis, [list(range(S))], tiled)
  if a.is_local:
    def local(v):
      # jax.lax.all_to_all does not normalize negative dimensions (verifier
      # errors, wrong shapes or a crash): pass them non-negative, checked above.
      sa, ca = split_axis % np.ndim(v), concat_axis % np.ndim(v)
      check_split(v)
      if tiled:
        return jax.lax.all_to_all(v, a.local_name, sa, ca, tiled=True)
      # Untiled as tiled within the split dimension (source j's chunk at j),
      # that dimension then moved to concat_axis: the same values, and a
      # transpose that works (JAX's untiled one fails under jax.grad when
      # split_axis != concat_axis: 'Expected cotangent type').
      return jnp.moveaxis(jax.lax.all_to_all(v, a.local_name, sa, sa, tiled=True), sa, ca)

    return jax.tree.map(local, x)

  def leaf(v):
    v = jnp.asarray(v)
    sa, ca = split_axis % v.ndim, concat_axis % v.ndim  # checked above
    check_split(v)
    # Chunks by destination: [S, ...] where chunk j goes to device j.
    chunks = jnp.moveaxis(v.reshape(v.shape[:sa] + (S, v.shape[sa] // S) + v.shape[sa + 1:]), sa, 0)
    b = chunks.reshape((a.proc_size, a.local_size) + chunks.shape[1:])
    if a.local_size > 1:
      b = jax.lax.all_to_all(b, a.local_name, 1, 1, tiled=True)  # [pd, l_src, ...]
    b = mpi_alltoall(b, comm=mesh.process_comm([a.name]))  # [p_src, l_src, ...]
    r = b.reshape((S,) + chunks.shape[1:])  # [src, ..., chunk, ...] (chunk at position sa+1)
    r = r.reshape(r.shape[:sa + 1] + r.shape[sa + 2:]) if not tiled else r
    if not tiled:
      # Drop the size-1 split dim, put the source axis at concat_axis.
      return jnp.moveaxis(r, 0, ca)
    # Tiled: chunks keep the split dim; concatenate sources along concat_axis.
    r = jnp.moveaxis(r, 0, ca)  # source axis in front of the concat dim
    shape = r.shape
    return r.reshape(shape[:ca] + (shape[ca] * shape[ca + 1],) + shape[ca + 2:])

  return jax.tree.map(leaf, x)


def _check_dims(fn: str, axis_name, what: str, dim: int, n: int, tiled: bool, x) -> None:
  for v in jax.tree.leaves(x):
    d = _check_axis(fn, what, dim, np.ndim(v), np.ndim(v))
    size = np.shape(v)[d]
    if (not tiled and size != n) or (tiled and size % n):
      raise ValueError(
          f"{fn} over {axis_name!r} with axis_index_groups of size {n} got {what} {d} of "
          f"size {size}; it must be {'divisible by' if tiled else 'equal to'} {n}.")


def _grouped_all_to_all(x, axis_name, split_axis: int, concat_axis: int, groups, tiled: bool):
  grp = _Groups("all_to_all", axis_name, groups, equal=True)
  n_g = grp.group_size
  _check_dims("all_to_all", axis_name, "split_axis", split_axis, n_g, tiled, x)
  me = axis_index(axis_name)
  mine, k = jnp.asarray(grp.members)[me], jnp.asarray(grp.position)[me]

  def leaf(v):
    v = jnp.asarray(v)
    sa, ca = split_axis % v.ndim, concat_axis % v.ndim
    sel = jnp.take(all_gather(v, axis_name), mine, axis=0)  # [n_g, *v.shape]: the members'
    if not tiled:  # chunk k of each member, the source axis at concat_axis
      return jnp.moveaxis(jax.lax.dynamic_index_in_dim(sel, k, sa + 1, keepdims=False), 0, ca)
    c = v.shape[sa] // n_g
    r = jnp.moveaxis(jax.lax.dynamic_slice_in_dim(sel, k * c, c, sa + 1), 0, ca)
    return r.reshape(r.shape[:ca] + (r.shape[ca] * r.shape[ca + 1],) + r.shape[ca + 2:])

  return jax.tree.map(leaf, x)


def ppermute(x, axis_name, perm: Sequence[tuple[int, int]]):
  """Sends ``x`` from device ``src`` to device ``dst`` for each pair, like ``jax.lax.ppermute``.

  Over an axis that spans ranks and local devices, each distance in ranks
  that a pair moves takes one MPI exchange (a ring shift: at most two).
  Over a tuple of names each device picks its value from a gather of the
  whole axis.

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis.
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    perm: ``(source, destination)`` pairs of indices along the axis; each
      index appears at most once as a source and once as a destination
      (cycles and partial maps are fine).

  Returns:
    ``x``'s structure, shapes and dtypes: on device ``d`` the ``x`` of the
    device ``s`` with ``(s, d)`` in ``perm``, zeros where no pair ends at
    ``d``.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    TypeError: ``perm`` is not a sequence of pairs of integers.
    ValueError: an index is outside ``[0, axis_size)`` or used twice as a
      source or as a destination.

  Examples:
    A ring shift, device ``i`` to ``i + 1``:

    >>> n = mpijax.lax.axis_size("i")  # doctest: +SKIP
    >>> y = mpijax.lax.ppermute(x, "i", [(i, (i + 1) % n) for i in range(n)])  # doctest: +SKIP
  """
  mesh, a = _single("ppermute", axis_name)
  if mesh is None:
    return _lax("ppermute", axis_name, lambda: jax.lax.ppermute(x, axis_name, perm))
  try:
    perm = tuple((operator.index(s), operator.index(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise TypeError(f"ppermute over {axis_name!r} got perm={perm!r}; expected a sequence of "
                    "(source, destination) pairs of integer indices along the axis.") from None
  srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
  size = axis_size(axis_name)
  bad = [i for i in srcs + dsts if not 0 <= i < size]
  if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise ValueError(
        f"ppermute over {axis_name!r} (size {size}) got perm={list(perm)}, which is not a "
        "permutation: every source and every destination must be distinct indices in "
        f"[0, {size}).")
  if a is None:
    # Several axes (combined index row-major over the names, as in jax.lax):
    # each device picks its source's value from a gather of the whole axis
    # (axis_size times the data of one axis's ppermute).
    source = np.full(size, -1, np.int32)
    for s, d in perm:
      source[d] = s
    mine = jnp.asarray(source)[axis_index(axis_name)]

    def picked(v):
      v = jnp.asarray(v)
      return _take_source(all_gather(v, axis_name), mine, jnp.zeros_like(v))

    return jax.tree.map(picked, x)
  if a.is_local:
    return jax.lax.ppermute(x, a.local_name, perm)
  if a.is_process:
    return jax.tree.map(lambda v: mpi_ppermute(v, perm, comm=mesh.process_comm([a.name])), x)
  # An axis spanning ranks and local devices. Pairs are grouped by how many
  # ranks they move along the axis (k = destination rank - source rank, mod
  # P). For each k, every device sends its value k ranks on, on its own
  # sub-communicator (one MPI ppermute, none for k = 0), the rank's devices
  # share what arrived (a local all_gather), and each device keeps the value
  # its source sent, if its source moved k ranks. A ring shift takes at most
  # two such rounds: far less traffic than gathering the whole axis.
  P, L, r = a.proc_size, a.local_size, a.proc_index
  rounds: dict[int, np.ndarray] = {}  # k -> source local index of each local device here
  for s, d in perm:
    if d // L == r:
      k = (r - s // L) % P
      rounds.setdefault(k, np.full(L, -1, np.int32))[d % L] = s % L
  # Every rank makes the same MPI calls: the shifts any pair uses, ascending.
  shifts = sorted({(d // L - s // L) % P for s, d in perm})
  comm = mesh.process_comm([a.name])
  me = jax.lax.axis_index(a.local_name)

  def leaf(v):
    v = jnp.asarray(v)
    out = jnp.zeros_like(v)
    for k in shifts:
      moved = v if k == 0 else mpi_ppermute(v, [(q, (q + k) % P) for q in range(P)], comm=comm)
      src = rounds.get(k)
      if src is None:  # nothing for this rank's devices (the MPI call still runs:
        continue       # every mpijax primitive is kept by JAX's dead-code rule)
      here = jax_compat.all_gather(moved, a.local_name, axis=0)  # [L, ...]: by local index
      mine = jnp.asarray(src)[me]
      out = _take_source(here, mine, out)
    return out

  return jax.tree.map(leaf, x)


def _take_source(gathered, source, otherwise):
  """``gathered[source]`` (``source`` this device's index into it), or ``otherwise`` if -1."""
  return jnp.where(source >= 0, jnp.take(gathered, jnp.maximum(source, 0), axis=0), otherwise)


def pbroadcast(x, axis_name, source: int):
  """Every device along ``axis_name`` gets device ``source``'s ``x``, like ``jax.lax.pbroadcast``.

  Over an axis that spans only ranks it is one MPI broadcast; otherwise a
  :func:`psum` in which every other device contributes zeros.

  Args:
    x: this device's array, or a pytree of arrays, with the same shapes and
      dtypes on every device of the axis (only ``source``'s values are used).
    axis_name: the name of an axis bound by :func:`mpijax.pmap` (every
      device of every rank) or :func:`mpijax.shard_map` (a mesh axis: it
      may span ranks, each rank's local devices, or both), or a tuple of
      names, indexed row-major over the names. A name mpijax does not bind
      (a ``jax.vmap`` axis) is handed to ``jax.lax``.
    source: the index along the axis (``axis_index``) of the device whose
      value everyone gets, in ``[0, axis_size)``.

  Returns:
    ``x``'s structure, shapes and dtypes, holding ``source``'s values on
    every device of the axis.

  Raises:
    NameError: ``axis_name`` is not an axis of an enclosing map.
    ValueError: ``source`` is outside ``[0, axis_size)``.

  Examples:
    >>> params = mpijax.lax.pbroadcast(params, "i", 0)  # doctest: +SKIP
  """
  size = _axis_size("pbroadcast", axis_name)
  if not 0 <= int(source) < size:
    raise ValueError(f"pbroadcast got source={source} for axis {axis_name!r} of size {size}; "
                     f"it must be in [0, {size}).")
  mesh, axes, others = _resolve("pbroadcast", axis_name)
  if mesh is not None and not others and len(axes) == 1 and axes[0].is_process:
    comm = mesh.process_comm([axes[0].name])
    return jax.tree.map(lambda v: mpi_bcast(jnp.asarray(v), int(source), comm=comm), x)
  me = axis_index(axis_name)
  x = jax.tree.map(jnp.asarray, x)
  summed = psum(jax.tree.map(lambda v: jnp.where(me == source, v, jnp.zeros_like(v)), x),
                axis_name)
  # psum counts bools in int32; one nonzero term gives back the value exactly.
  return jax.tree.map(lambda s, v: s.astype(v.dtype), summed, x)

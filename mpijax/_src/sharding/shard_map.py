"""``mpijax.shard_map``: ``jax.shard_map`` over a mesh whose axes may span ranks.

The user's function runs under ``jax.shard_map`` over the mesh's local part
(this rank's devices) while the axis environment (:mod:`.axes`) tells
:mod:`mpijax.lax` which named axes span ranks, and ``jax.lax``'s collectives
on those axes run as :mod:`mpijax.lax`'s (:mod:`.lax_routing`). It takes and
returns GlobalArrays, global ``jax.Array``s and this rank's plain arrays.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec

from mpijax._src.collectives import routing as lax_routing
from mpijax._src.collectives.axes import bind_axes
from mpijax._src.sharding import map_io
from mpijax._src.sharding import replication
from mpijax._src.sharding.geometry import local_spec
from mpijax._src.sharding.geometry import replicated_axes
from mpijax._src.sharding.geometry import spec_axes
from mpijax._src.sharding.mesh import GlobalMesh

P = PartitionSpec


def _as_spec(s) -> PartitionSpec:
  if s is None:
    return P()
  return s if isinstance(s, PartitionSpec) else P(*s)


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec) or x is None


def _is_pspec(x) -> bool:
  return isinstance(x, PartitionSpec)


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
    return map_io.expand_prefix(jax.tree.map(_as_spec, specs, is_leaf=_is_spec), tree, _is_pspec)
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
    args, metas, any_ga = map_io.unwrap_args(args)
    ins = _in_specs_tree(in_specs, args)
    # Global jax.Arrays in: their parts go in, global jax.Arrays come out.
    args, metas, jax_in = map_io.take_jax_arrays(
      mesh, args, jax.tree.leaves(ins, is_leaf=_is_pspec), metas
    )
    any_ga = any_ga or jax_in
    if any_ga:
      map_io.check_arg_specs(
        "mpijax.shard_map", mesh, metas, jax.tree.leaves(ins, is_leaf=_is_pspec)
      )
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
      out = map_io.wrap_outputs(mesh, out, specs)
      if jax_in:
        out = map_io.to_jax_outputs(out)
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

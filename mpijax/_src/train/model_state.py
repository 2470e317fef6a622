"""Mutable model state (BatchNorm statistics, ...) in data-parallel training.

Two ways to keep a collection of model state equal on every rank:

* ``"sync"``: the statistics are computed over the GLOBAL batch inside the
  forward pass (SyncBatchNorm). :func:`bind_data_axis` makes ``jax.lax``'s
  collectives on the step's ``axis_name`` reduce over every rank, so Flax's
  ``BatchNorm(axis_name=...)`` normalizes with global statistics and its
  running averages come out equal everywhere without any further exchange.
* ``"mean"``: each rank normalizes with its own batch's statistics; after the
  step the new running averages are averaged over ranks, in the gradients'
  fused all-reduce.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mpijax._src.collectives import routing as lax_routing
from mpijax._src.ops.allgather import allgather
from mpijax._src.ops.allreduce import allreduce

SYNC = "sync"
MEAN = "mean"
POLICIES = (SYNC, MEAN)


# --- which leaves are averaged -------------------------------------------------------


def check_policy(state_sync: Any, axis_name: Any) -> None:
  """Raises a ValueError for a policy that is not "sync"/"mean" (or a dict of them)."""
  values = state_sync.values() if isinstance(state_sync, collections.abc.Mapping) else [state_sync]
  for v in values:
    if v not in POLICIES:
      raise ValueError(
        f"DataParallel(state_sync={state_sync!r}): {v!r} is not a policy; use "
        f"'sync' (statistics over the global batch, needs axis_name) or 'mean' "
        "(each rank's own statistics, running averages averaged over ranks), or "
        "a dict from collection name to one of them"
      )
  if SYNC in values and axis_name is None:
    raise ValueError(
      f"DataParallel(state_sync={state_sync!r}) needs axis_name: 'sync' state is computed from "
      "statistics over the global batch, which the model reduces over a named axis. Pass "
      "DataParallel(axis_name='batch') and BatchNorm(axis_name='batch') in the model "
      "(Flax linen and NNX), or use state_sync='mean'."
    )


def _collection(path: tuple) -> Any:
  key = path[0]
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return key


def averaged_leaves(model_state: Any, state_sync: Any) -> list[bool]:
  """For every leaf of ``model_state`` (in flatten order), whether it is averaged over ranks."""
  with_paths = jax.tree_util.tree_flatten_with_path(model_state)[0]
  if not isinstance(state_sync, collections.abc.Mapping):
    return [state_sync == MEAN] * len(with_paths)
  out, missing = [], []
  for path, _ in with_paths:
    name = _collection(path) if path else None
    if name not in state_sync:
      missing.append(name)
      out.append(False)
    else:
      out.append(state_sync[name] == MEAN)
  if missing:
    known = sorted({str(_collection(p)) for p, _ in with_paths if p})
    raise ValueError(
      f"DataParallel(state_sync={dict(state_sync)!r}) has no policy for the model "
      f"state collection(s) {sorted(set(map(str, missing)))}; the model state has "
      f"{known}. Give every top-level collection 'sync' or 'mean' (or one string "
      "for all)."
    )
  return out


def check_new_state(old: Any, new: Any) -> None:
  """Raises a TypeError when ``loss_fn``'s new model state does not have the old one's structure."""
  old_leaves, old_def = jax.tree_util.tree_flatten(old)
  new_leaves, new_def = jax.tree_util.tree_flatten(new)
  if old_def != new_def:
    raise TypeError(
      "DataParallel: loss_fn returned a new model state of another structure than the one it "
      f"was given:\n  given:    {old_def}\n  returned: {new_def}\nReturn the updated "
      "collections themselves (e.g. flax linen: the `mutable` output of model.apply; NNX: "
      "nnx.state(model, nnx.BatchStat))."
    )
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0], new_leaves):
    if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
      raise TypeError(
        f"DataParallel: model state leaf {jax.tree_util.keystr(path)} was "
        f"{jnp.result_type(a)}{list(jnp.shape(a))} but loss_fn returned "
        f"{jnp.result_type(b)}{list(jnp.shape(b))}; keep every leaf's shape and dtype"
      )


# --- the data axis: jax.lax collectives over every rank -------------------------------


@dataclasses.dataclass
class _Axis:
  name: Any
  comm: Any
  size: int
  rank: int
  calls: int = 0  # collectives traced over this axis (checks that 'sync' state is synced)


_tls = threading.local()
_REDUCTIONS = ("psum", "pmean", "pmax", "pmin")


def _bound() -> dict[Any, _Axis]:
  return getattr(_tls, "axes", {})


def _split_names(axis_name: Any) -> tuple[list[_Axis], tuple]:
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  bound = _bound()
  ours = [bound[n] for n in names if lax_routing.hashable(n) and n in bound]
  others = tuple(n for n in names if not (lax_routing.hashable(n) and n in bound))
  return ours, others


def _allreduce(x: Any, op: str, axis: _Axis) -> Any:
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.int32)  # as jax.lax.psum: a count
  if axis.size == 1:
    return x
  return allreduce(x, op, comm=axis.comm)


def _reduction(fn: str, x: Any, axis_name: Any, *args: Any, **kwargs: Any) -> Any:
  ours, others = _split_names(axis_name)
  if not ours:
    return lax_routing.original(fn)(x, axis_name, *args, **kwargs)
  axis = ours[0]
  if len(ours) > 1 or args or kwargs.get("axis_index_groups") is not None:
    raise NotImplementedError(
      f"jax.lax.{fn} over DataParallel's axis_name {axis.name!r} supports neither "
      "axis_index_groups nor several data axes; reduce over the axis as a whole"
    )
  axis.calls += 1
  if others:  # the other axes first, with JAX (a sum for pmean: divided below)
    x = lax_routing.original("psum" if fn == "pmean" else fn)(x, others)
  op = {"psum": "sum", "pmean": "sum", "pmax": "max", "pmin": "min"}[fn]
  out = jax.tree_util.tree_map(lambda v: _allreduce(v, op, axis), x)
  if fn == "pmean":
    n = axis.size * (lax_routing.original("psum")(1, others) if others else 1)
    out = jax.tree_util.tree_map(lambda v: v / n, out)
  return out


def _all_gather(x: Any, axis_name: Any, *args: Any, **kwargs: Any) -> Any:
  ours, others = _split_names(axis_name)
  if not ours:
    return lax_routing.original("all_gather")(x, axis_name, *args, **kwargs)
  axis = ours[0]
  if others or len(ours) > 1 or args or kwargs.get("axis_index_groups") is not None:
    raise NotImplementedError(
      f"jax.lax.all_gather over DataParallel's axis_name {axis.name!r} gathers over that axis "
      "alone, without axis_index_groups"
    )
  axis.calls += 1
  where, tiled = kwargs.get("axis", 0), kwargs.get("tiled", False)

  def leaf(v):
    v = jnp.asarray(v)
    full = v[None] if axis.size == 1 else allgather(v, comm=axis.comm)  # (size, *v.shape)
    pos = where % (v.ndim + 1) if not tiled else where % max(v.ndim, 1)
    if tiled:
      full = jnp.moveaxis(full, 0, pos)
      shape = list(v.shape)
      shape[pos] *= axis.size
      return full.reshape(shape)
    return jnp.moveaxis(full, 0, pos)

  return jax.tree_util.tree_map(leaf, x)


def _axis_index(axis_name: Any, *args: Any, **kwargs: Any) -> Any:
  ours, others = _split_names(axis_name)
  if not ours:
    return lax_routing.original("axis_index")(axis_name, *args, **kwargs)
  if others or len(ours) > 1:
    raise NotImplementedError(
      f"jax.lax.axis_index over DataParallel's axis_name {ours[0].name!r} takes that axis alone"
    )
  return jnp.asarray(ours[0].rank, jnp.int32)


def _axis_size(axis_name: Any, *args: Any, **kwargs: Any) -> Any:
  ours, others = _split_names(axis_name)
  size = lax_routing.original("axis_size")(others, *args, **kwargs) if others else 1
  for a in ours:
    size *= a.size
  return size


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
  **{fn: functools.partial(_reduction, fn) for fn in _REDUCTIONS},
  "all_gather": _all_gather,
  "axis_index": _axis_index,
  "axis_size": _axis_size,
}


class _DataAxes:
  """Routes ``jax.lax`` calls over the bound data axes (lax_routing.Router)."""

  def owns(self, fn: str, name: Any) -> bool:
    return name in _bound()

  def call(self, fn: str, args: tuple, kwargs: dict) -> Any:
    replacement = _REPLACEMENTS.get(fn)
    if replacement is None:
      name = next(n for n in lax_routing.axis_names(fn, args, kwargs) if self.owns(fn, n))
      raise NotImplementedError(
        f"jax.lax.{fn} over DataParallel's axis_name {name!r} is not supported; the data "
        "axis offers psum, pmean, pmax, pmin, all_gather, axis_index and axis_size"
      )
    return replacement(*args, **kwargs)


@contextlib.contextmanager
def bind_data_axis(name: Any, comm: Any):
  """While tracing: ``jax.lax`` collectives on ``name`` reduce over every rank of ``comm``.

  ``jax.lax.psum/pmean/pmax/pmin/all_gather/axis_index/axis_size`` look the
  name up in a per-thread table first (:mod:`mpijax._src.collectives.routing`) and
  hand every other name to JAX unchanged, so code that names the axis (Flax's ``BatchNorm(axis_name=...)``,
  a hand-written ``jax.lax.pmean(x, name)``) sees one axis spanning the ranks,
  each rank one position along it, as under ``jax.pmap`` over one device per
  rank. Reductions are mpijax all-reduces (differentiable: the transpose of
  the sum is the sum of the cotangents, so gradients through the global
  statistics are exact). Yields the binding (``.calls`` counts the traced
  collectives); ``name=None`` binds nothing.
  """
  if name is None:
    yield None
    return
  axis = _Axis(name, comm, comm.Get_size(), comm.Get_rank())
  old = _bound()
  _tls.axes = {**old, name: axis}
  try:
    with lax_routing.routed(_DataAxes()):
      yield axis
  finally:
    _tls.axes = old

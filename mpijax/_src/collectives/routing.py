"""``jax.lax``'s collectives on the axis names mpijax binds across ranks.

JAX's own ``jax.lax.psum(x, "i")`` knows only the axes of JAX's traces, but
inside ``mpijax.pmap(f, axis_name="i")`` the axis ``"i"`` spans every device
of every rank, and a ``jax.pmap`` program should port by changing one word.
While mpijax traces a function that binds such names (its maps, and
``DataParallel``'s data axis), the collectives of the ``jax.lax`` module are
dispatchers: a call that names a bound axis goes to its binder (for the
maps, :mod:`mpijax.lax`), every other call to JAX unchanged. Outside those
traces ``jax.lax`` is JAX's own.

A function taken from ``jax.lax`` before the dispatchers were installed
(``from jax.lax import psum`` at import) bypasses them; JAX's unbound-axis
error is then rewritten by :func:`mesh_axes` to name the fix.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

import jax

from mpijax._src.collectives import parallel as collectives
from mpijax._src.collectives.axes import axis_env

# jax.lax functions that take axis names -> where the name is: a position, or a keyword.
_AXIS_ARG: dict[str, int | str] = {
  "psum": 1,
  "pmean": 1,
  "pmax": 1,
  "pmin": 1,
  "all_gather": 1,
  "psum_scatter": 1,
  "all_to_all": 1,
  "ppermute": 1,
  "pshuffle": 1,
  "pswapaxes": 1,
  "pbroadcast": 1,
  "pcast": 1,
  "pvary": 1,
  "psend": 1,
  "precv": 2,
  "ragged_all_to_all": "axis_name",
  "axis_index": 0,
  "axis_size": 0,
}


class Router(Protocol):
  """Who answers ``jax.lax`` calls over some axis names."""

  def owns(self, fn: str, name: Hashable) -> bool:
    """True if this router runs ``jax.lax.<fn>`` over the axis ``name``."""

  def call(self, fn: str, args: tuple, kwargs: dict) -> Any:
    """Runs ``jax.lax.<fn>(*args, **kwargs)`` over an axis it owns."""


_tls = threading.local()
_lock = threading.Lock()
_installs = 0
_originals: dict[str, Callable[..., Any]] = {}


def original(fn: str) -> Callable[..., Any]:
  """JAX's own ``jax.lax.<fn>``, also while the dispatchers are installed."""
  return _originals.get(fn) or getattr(jax.lax, fn)


def _routers() -> tuple[Router, ...]:
  return getattr(_tls, "routers", ())


def hashable(x: Any) -> bool:
  try:
    hash(x)
  except TypeError:
    return False
  return True


def axis_names(fn: str, args: tuple, kwargs: dict) -> list:
  """The hashable axis names of a ``jax.lax.<fn>(*args, **kwargs)`` call."""
  where = _AXIS_ARG[fn]
  if isinstance(where, str) or len(args) <= where:
    name = kwargs.get("axis_name")
  else:
    name = args[where]
  names = tuple(name) if isinstance(name, (tuple, list)) else (name,)
  return [n for n in names if hashable(n)]


def _dispatcher(fn: str) -> Callable[..., Any]:
  jax_fn = _originals[fn]

  @functools.wraps(jax_fn)
  def dispatch(*args, **kwargs):
    routers = _routers()
    if routers:
      names = axis_names(fn, args, kwargs)
      for router in reversed(routers):  # the innermost binding first
        if any(router.owns(fn, n) for n in names):
          return router.call(fn, args, kwargs)
    return jax_fn(*args, **kwargs)

  return dispatch


def _install() -> None:
  global _installs
  with _lock:
    if _installs == 0:
      for fn in _AXIS_ARG:
        if hasattr(jax.lax, fn):
          _originals.setdefault(fn, getattr(jax.lax, fn))
          setattr(jax.lax, fn, _dispatcher(fn))
    _installs += 1


def _uninstall() -> None:
  global _installs
  with _lock:
    _installs -= 1
    if _installs == 0:
      for fn, jax_fn in _originals.items():
        setattr(jax.lax, fn, jax_fn)


@contextlib.contextmanager
def routed(router: Router) -> Iterator[None]:
  """While the block runs (in this thread), ``jax.lax`` calls over ``router``'s names go to it."""
  old = _routers()
  _tls.routers = old + (router,)
  _install()
  try:
    yield
  finally:
    _uninstall()
    _tls.routers = old


# --- the maps' axes: jax.lax -> mpijax.lax ----------------------------------------------


def _spanning(name: Hashable) -> bool:
  """An axis of an enclosing mpijax map that spans ranks (a purely local one is JAX's own)."""
  bound = axis_env().get(name)
  return bound is not None and not bound[1].is_local


def _local_part(names: tuple) -> tuple:
  """``names`` with each mpijax axis replaced by its local part's name (if it has one)."""
  env, out = axis_env(), []
  for n in names:
    if hashable(n) and n in env:
      a = env[n][1]
      if a.local_size > 1 or a.size == 1:
        out.append(a.local_name)
    else:
      out.append(n)
  return tuple(out)


def _pcast(x, axis_name, *, to: str, jax_fn: str = "pcast"):
  # Types of the local part only: JAX has none for the ranks' part (see collectives).
  names = _local_part(axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,))
  if not names:
    return x
  if jax_fn == "pvary":
    return original("pvary")(x, names)
  return original("pcast")(x, names, to=to)


def _pshuffle(x, axis_name, perm):
  return collectives.ppermute(x, axis_name, list(zip(perm, range(len(perm)))))


def _pswapaxes(x, axis_name, axis, *, axis_index_groups=None):
  return collectives.all_to_all(x, axis_name, axis, axis, axis_index_groups=axis_index_groups)


_MESH_ROUTES: dict[str, Callable[..., Any]] = {
  "psum": collectives.psum,
  "pmean": collectives.pmean,
  "pmax": collectives.pmax,
  "pmin": collectives.pmin,
  "all_gather": collectives.all_gather,
  "psum_scatter": collectives.psum_scatter,
  "all_to_all": collectives.all_to_all,
  "ppermute": collectives.ppermute,
  "pbroadcast": collectives.pbroadcast,
  "axis_index": collectives.axis_index,
  "axis_size": collectives.axis_size,
  "pshuffle": _pshuffle,
  "pswapaxes": _pswapaxes,
  "pcast": _pcast,
  "pvary": lambda x, axis_name: _pcast(x, axis_name, to="varying", jax_fn="pvary"),
}


class _MeshAxes:
  """Routes ``jax.lax`` calls over the axes of the enclosing mpijax maps to :mod:`mpijax.lax`."""

  def owns(self, fn: str, name: Hashable) -> bool:
    # A purely local axis is JAX's own, except for pbroadcast, which JAX does not
    # lower on CPU (mpijax's is a masked psum).
    return _spanning(name) or (fn == "pbroadcast" and name in axis_env())

  def call(self, fn: str, args: tuple, kwargs: dict) -> Any:
    route = _MESH_ROUTES.get(fn)
    if route is None:
      names = [n for n in axis_names(fn, args, kwargs) if self.owns(fn, n)]
      raise NotImplementedError(
        f"jax.lax.{fn} over axis {names[0]!r}, which spans ranks, is not supported by "
        "mpijax's maps; use mpijax.lax.ppermute (or mpijax.ops.send/recv between ranks)."
      )
    return route(*args, **kwargs)


_UNBOUND = re.compile(
  r"unbound axis name: (.+?)(?:\. To fix this, please call (\w+) under|$)", re.S
)


@contextlib.contextmanager
def mesh_axes(what: str) -> Iterator[None]:
  """``jax.lax`` on the enclosing maps' axes while ``what`` (the map) runs the user's function.

  JAX's unbound-axis error, whose advice (``jax.shard_map``) is wrong here,
  is replaced by one that names the bound axes and ``mpijax.lax``.
  """
  try:
    with routed(_MeshAxes()):
      yield
  except NameError as e:
    m = _UNBOUND.search(str(e))
    if m is None:
      raise
    name, fn = m[1], m[2] or "the collective"
    env = axis_env()
    bound = sorted(str(n) for n in env)
    if any(str(n) == name for n in env):
      raise NameError(
        f"jax.lax.{fn} over axis {name!r} did not reach mpijax: {what} binds {name!r} across "
        f"every rank and runs jax.lax.{fn}(...) calls over it as mpijax.lax.{fn}, but this "
        f"call went to JAX directly (a function taken from jax.lax before the map ran, e.g. "
        f"`from jax.lax import {fn}`). Call mpijax.lax.{fn}(x, {name!r}) instead."
      ) from None
    raise NameError(
      f"{fn} got axis_name {name!r}, but the enclosing {what} maps {bound}. Use one of "
      "those names (or bind the axis with an enclosing map whose mesh has it)."
    ) from None

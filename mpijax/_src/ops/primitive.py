"""The primitive factory: what every mpijax primitive shares.

A primitive made by :func:`make_primitive` runs eagerly through a cached
``jax.jit`` per parameter set and is never dropped by JAX's dead-code
elimination. It carries no JAX effect: its custom call is marked
``has_side_effect`` (an HLO attribute, so XLA neither removes nor duplicates
it), which keeps jitted calls on JAX's C++ fast dispatch path. Each primitive
module adds its abstract evaluation, lowering (:mod:`.lowering`), batching
and autodiff rules; the helpers for the last two are here too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import partial_eval as pe

PRIMITIVES: set[Primitive] = set()  # every mpijax primitive (see ordering.calls_mpi)


def make_primitive(name: str, multiple_results: bool = False) -> Primitive:
  """A new mpijax primitive called ``name``, with its eager and dead-code rules."""
  p = Primitive(name)
  p.multiple_results = multiple_results
  p.def_impl(functools.partial(_eager_impl, p))
  pe.dce_rules[p] = _keep_call
  PRIMITIVES.add(p)
  return p


def _keep_call(used_outputs, eqn):
  """JAX's dead-code elimination keeps every mpijax call, used or not.

  The primitives carry no JAX effect (see the module docstring), so JAX
  would drop a call whose result is unused, and code that uses a result on
  some ranks only (``y if rank == 0 else x``) would make the MPI call on
  those ranks only: the others would wait forever. Kept, every rank makes it.
  """
  del used_outputs
  return [True] * len(eqn.invars), eqn


@functools.lru_cache(maxsize=4096)
def _jitted(prim: Primitive, params: tuple[tuple[str, Any], ...]) -> Callable:
  kwargs = dict(params)
  return jax.jit(lambda *args: prim.bind(*args, **kwargs))


def _eager_impl(prim: Primitive, *args, **params):
  return _jitted(prim, tuple(sorted(params.items())))(*args)


# --- rule helpers ---------------------------------------------------------------------


def zero_tangent(value) -> ad.Zero:
  """The symbolic zero tangent of ``value`` (float0 for integer and bool values)."""
  return ad.Zero(jax.typeof(value).to_tangent_aval())


def def_sum_linear_ad(prim: Primitive, public_name: str,
                      transpose_sum: Callable[..., Any]) -> None:
  """JVP and transpose rules of a reduction collective that is linear for op="sum".

  The tangent of a sum is the same collective applied to the tangents;
  integer and bool results get zero tangents; other ops are not
  differentiable. ``transpose_sum(ct, **params)`` gives the operand's
  cotangent of an op="sum" call.
  """
  def jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    out = prim.bind(x, **params)
    if type(t) is ad.Zero or not jnp.issubdtype(x.dtype, jnp.inexact):
      return out, zero_tangent(out)
    if params["op"] != "sum":
      raise TypeError(f"{public_name}(op={params['op']!r}) is not differentiable; "
                      "only op='sum' is.")
    return out, prim.bind(t, **params)

  def transpose(ct, x, **params):
    if params["op"] != "sum":
      raise TypeError(f"{public_name}(op={params['op']!r}) is not linear; only op='sum' is.")
    if type(ct) is ad.Zero:
      return (ad.Zero(x.aval),)
    return (transpose_sum(ct, **params),)

  ad.primitive_jvps[prim] = jvp
  ad.primitive_transposes[prim] = transpose


def i64(v: int) -> np.int64:
  """An int64 custom-call attribute."""
  return np.int64(v)


def moveaxis(x, src: int, dst: int):
  return x if src == dst else jnp.moveaxis(x, src, dst)

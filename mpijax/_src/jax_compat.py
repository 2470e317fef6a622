"""Every difference between the JAX versions mpijax supports, and every JAX
internal it uses, in one place.

mpijax lowers its calls with a few JAX internals, and some of them changed
between JAX 0.7.2 (the oldest supported) and today's JAX. The rest of mpijax
imports the internals and the version-dependent pieces from here instead of
importing ``jax._src`` or testing versions itself
(``tests/unit/test_jax_internals.py`` checks it):

* :func:`check_jax`: the oldest jax and jaxlib mpijax runs on; run when this
  module is imported, before the internals below.
* the ``jax._src`` modules mpijax uses, each with what it is used for.
* :func:`guarded`: runs one replacement of a JAX lowering rule and, where a
  JAX lacks the internals it needs, says what is lost instead of failing.
* ``jaxprs_in_params``, :func:`subcomp_kwargs`, :func:`newly_manual_axes`:
  what the lowering of nested calls and ``shard_map`` bodies needs.
* :func:`typed_varying`, :func:`all_gather`: ``shard_map``'s varying-axes
  types and ``jax.lax.all_gather(..., to=...)``.
* :func:`backends_started`: whether JAX's backends are up.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import jax

from mpijax._src import log

# The oldest jax and jaxlib mpijax runs on; pyproject.toml declares the same.
# Older JAX lacks internals mpijax lowers with: JAX 0.7.0 and 0.7.1 the
# public-enough mlir.ir_consts and jaxpr_subcomp's const_lowering (nested jits
# lowered inline), JAX 0.6 also uncached lowering rules (register_lowering's
# `cacheable`), lowering-rule tracebacks (call sites in mismatch reports) and
# MLIR's Operation.block (the order token's chain).
MIN_JAX = (0, 7, 2)


def _version_tuple(version: str) -> tuple[int, ...]:
  """(0, 10, 2) from '0.10.2' (also from '0.10.2.dev20260101' or '0.10.2rc1')."""
  return tuple(
    int(re.match(r"\d+", part).group()) for part in version.split(".")[:3] if re.match(r"\d+", part)
  )


def check_jax() -> None:
  """Raises ImportError naming the installed and the required version if jax
  or jaxlib is older than :data:`MIN_JAX` (e.g. installed with --no-deps)."""
  import jaxlib

  need = ".".join(map(str, MIN_JAX))
  for module in (jax, jaxlib):
    if _version_tuple(module.__version__) < MIN_JAX:
      raise ImportError(
        f"mpijax needs {module.__name__}>={need}, but {module.__name__} "
        f"{module.__version__} is installed ({os.path.dirname(module.__file__)}). "
        f"Upgrade both: pip install -U 'jax>={need}' 'jaxlib>={need}'"
      )


# A too old JAX stops here, naming both versions, before an internal below is missing.
check_jax()

# --- JAX internals ---------------------------------------------------------------------
#
# Every jax._src module mpijax uses, and what for. Most serve the lowering-rule
# replacements of ops/jax_rules.py, which keep every MPI call in the order-token
# chain; those read the modules' attributes inside guarded(), so a JAX that lacks
# one loses that replacement with a warning.

# remat_p: a checkpointed body that makes MPI calls is kept whole and lowered inline.
from jax._src import ad_checkpoint as ad_checkpoint

# JAX's persistent-cache key's parts, which the compile cache's key is made of
# (hash_program, compile_hook.py).
from jax._src import cache_key as cache_key

# compile_or_get_cached: wrapped once (compile_hook.py) for the compile cache and what
# mpijax reads from each program; backend_compile_and_load: a compile the cache missed.
from jax._src import compiler as compiler

# call_p, closed_call_p, Jaxpr, ClosedJaxpr, Var, new_jaxpr_eqn: nested calls, token threading.
from jax._src import core as core

# custom_jvp_call_p, custom_vjp_call_p: as remat_p.
from jax._src import custom_derivatives as custom_derivatives

# global_state: whether jax.distributed is up, and whether mpijax started it;
# its client's key-value store compares the ranks' compiled programs at exit.
from jax._src import distributed as distributed

# jit_p, _pjit_lowering: nested jax.jit bodies that make MPI calls are lowered inline.
from jax._src import pjit as pjit

# shard_map_p, _shard_map_lowering: the order token threaded through shard_map bodies.
from jax._src import shard_map as shard_map

# ShardingContext, SPMDAxisContext, UnspecifiedValue: which devices a lowering spans.
from jax._src import sharding_impls as sharding_impls

# _backends: whether JAX's backends have started (see backends_started).
from jax._src import xla_bridge as xla_bridge

# lower_jaxpr_to_module, jaxpr_subcomp, custom_call, the lowering tables: the order-token chain.
from jax._src.interpreters import mlir as mlir

# dce_rules, _default_dce_rule: calls and control flow that make MPI calls are never dead code.
from jax._src.interpreters import partial_eval as partial_eval

# XLA's collective primitives (psum_p, all_gather_p, ...), ordered against MPI calls.
from jax._src.lax import parallel as parallel

# cond_p: branches that make MPI calls are kept whole and lowered inline.
from jax._src.lax.control_flow import conditionals as conditionals

# while_p, scan_p: loop bodies that make MPI calls are kept whole and lowered inline.
from jax._src.lax.control_flow import loops as loops

# DeviceAssignment: a per-rank program's devices numbered by their place on the rank.
from jax._src.lib import xla_client as xla_client

# MLIR's Python API: blocks, insertion points and types of the custom calls.
from jax._src.lib.mlir import ir as ir


def hash_program(hash_obj: Any, module: Any, compile_options: Any, backend: Any) -> None:
  """Feeds ``hash_obj`` what JAX's persistent-cache key (``cache_key.get``) holds of a
  program -- its canonical IR, jaxlib, platform, XLA flags, compile options --
  but the accelerator topology, whose fingerprint differs from process to process
  on CPU (so no other rank would ever share the key)."""
  cache_key._hash_computation(hash_obj, module, cache_key.IgnoreCallbacks.NO)
  hash_obj.update(jaxlib_version().encode())
  cache_key._hash_platform(hash_obj, backend)
  cache_key._hash_xla_flags(hash_obj, cache_key.get_flag_prefixes())
  cache_key._hash_serialized_compile_options(hash_obj, compile_options)


def jaxlib_version() -> str:
  """The running jaxlib's version (the compile cache's entries name theirs)."""
  import jaxlib

  return jaxlib.__version__


def backends_started() -> bool:
  """Whether JAX's backends have started (its CPU device count is then fixed)."""
  return bool(getattr(xla_bridge, "_backends", {}))


def no_context_mesh():
  """A context without the caller's mesh (``jax.set_mesh(None)``), for a
  program of mpijax's own run while the user's mesh is set; a JAX without
  ``jax.set_mesh`` has none to clear, and inside a trace it cannot be cleared."""
  set_mesh = getattr(jax, "set_mesh", None)
  if set_mesh is None or not core.trace_state_clean():
    return contextlib.nullcontext()
  return set_mesh(None)


def guarded(install: Callable[[], None], lost: str) -> bool:
  """Runs ``install()``; on a JAX without the internals it uses, warns that ``lost``.

  Returns:
    Whether ``install()`` ran to the end.
  """
  try:
    install()
  except (ImportError, AttributeError) as e:  # a JAX without these internals
    log.warning(f"{lost} ({e!r})")
    return False
  return True


# --- lowering -------------------------------------------------------------------------

try:
  from jax.extend.core import jaxprs_in_params as jaxprs_in_params
except ImportError:  # JAX < 0.10 exports it only from its internals
  jaxprs_in_params = core.jaxprs_in_params


def subcomp_kwargs(jaxpr_subcomp: Callable, ctx: Any) -> dict[str, Any]:
  """The version-dependent keyword arguments of ``mlir.jaxpr_subcomp`` for ``ctx``.

  JAX < 0.9 has no ``outer_traceback`` (the caller's frames, appended to the
  inlined equations' tracebacks).
  """
  if _takes_outer_traceback(jaxpr_subcomp):
    return {"outer_traceback": ctx.traceback}
  return {}


_outer_tb: dict[Any, bool] = {}


def _takes_outer_traceback(fn: Callable) -> bool:
  hit = _outer_tb.get(fn)
  if hit is None:
    hit = _outer_tb[fn] = "outer_traceback" in inspect.signature(fn).parameters
  return hit


def newly_manual_axes(params: dict[str, Any]) -> Any:
  """The mesh axes a ``shard_map`` equation makes manual (from its ``params``).

  ``newly_manual_axes`` since JAX 0.10, ``manual_axes`` before.
  """
  return params.get("newly_manual_axes", params.get("manual_axes"))


# --- shard_map types and jax.lax ------------------------------------------------------


def typed_varying(x: Any) -> bool:
  """Whether JAX types ``x`` as varying over manual axes (only under check_vma=True)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is None:  # JAX < 0.10: the varying manual axes are the aval's `vma`
    return bool(getattr(aval, "vma", None))
  return bool(getattr(mat, "varying", None))


def all_gather(
  x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False, to: str = "varying"
):
  """``jax.lax.all_gather(..., to=to)``, also on JAX < 0.10.

  JAX 0.10 added ``to='invarying'``; before, the same gather is
  ``all_gather_invariant`` (which takes no groups, as 'invarying' does not).
  JAX 0.7's all_gather has no ``to`` at all: its gather is the 'varying' one.
  """
  if to == "invarying" and jax.__version_info__ < (0, 10):
    if axis_index_groups is not None:
      raise NotImplementedError("all_gather with axis_index_groups and to='invarying'")
    return parallel.all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)
  kw = {} if to == "varying" else {"to": to}
  return jax.lax.all_gather(
    x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, **kw
  )

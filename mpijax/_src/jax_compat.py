"""Every difference between the JAX versions mpijax supports, in one place.

mpijax lowers its calls with a few JAX internals, and some of them changed
between JAX 0.7.2 (the oldest supported) and today's JAX. The rest of mpijax
imports the version-dependent pieces from here instead of testing versions
itself:

* :func:`check_jax`: the oldest jax and jaxlib mpijax runs on.
* :func:`guarded`: runs one replacement of a JAX lowering rule and, where a
  JAX lacks the internals it needs, says what is lost instead of failing.
* ``jaxprs_in_params``, :func:`subcomp_kwargs`, :func:`newly_manual_axes`:
  what the lowering of nested calls and ``shard_map`` bodies needs.
* :func:`typed_varying`, :func:`all_gather`: ``shard_map``'s varying-axes
  types and ``jax.lax.all_gather(..., to=...)``.
"""

from __future__ import annotations

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
  return tuple(int(re.match(r"\d+", part).group()) for part in version.split(".")[:3]
               if re.match(r"\d+", part))


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
          f"Upgrade both: pip install -U 'jax>={need}' 'jaxlib>={need}'")


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
  from jax._src.core import jaxprs_in_params as jaxprs_in_params


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


def all_gather(x, axis_name, *, axis_index_groups=None, axis: int = 0, tiled: bool = False,
               to: str = "varying"):
  """``jax.lax.all_gather(..., to=to)``, also on JAX < 0.10.

  JAX 0.10 added ``to='invarying'``; before, the same gather is
  ``all_gather_invariant`` (which takes no groups, as 'invarying' does not).
  JAX 0.7's all_gather has no ``to`` at all: its gather is the 'varying' one.
  """
  if to == "invarying" and jax.__version_info__ < (0, 10):
    if axis_index_groups is not None:
      raise NotImplementedError("all_gather with axis_index_groups and to='invarying'")
    from jax._src.lax.parallel import all_gather_invariant
    return all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)
  kw = {} if to == "varying" else {"to": to}
  return jax.lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                            tiled=tiled, **kw)


def compiler_module() -> Any:
  """``jax._src.compiler``: mpijax wraps its ``compile_or_get_cached`` to name
  the collectives of each compiled program (xla_labels.py)."""
  from jax._src import compiler
  return compiler

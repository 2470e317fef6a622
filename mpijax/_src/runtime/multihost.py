"""A fix to JAX's ``multihost_utils`` that plain multi-process JAX code needs.

``jax.device_put(x, sharding)`` of a host value onto a sharding that spans
several processes first checks, with ``multihost_utils.assert_equal``, that
every process passed the same value. That check compares the all-gathered
copy, whose dtype JAX has canonicalized (float64 -> float32 without
``jax_enable_x64``), with the original host value, so a float64 NumPy array
(``np.random.default_rng(0).normal(size=32)``: the sharded-computation guide's
``layer`` example) or a Python float like 0.1 never compares equal, and
``device_put`` raises "not the same on each process" although every process
passed the same array (JAX 0.10.2). :func:`install` makes ``assert_equal``
compare the values as JAX stores them on the devices. Values that differ as
stored still raise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_installed = False


def _as_stored(x: Any) -> Any:
  """``x`` in the dtype JAX keeps it in on a device (unchanged if not a number)."""
  import jax
  if isinstance(x, jax.Array):
    return x
  try:
    a = np.asarray(x)
    if a.dtype.kind not in "biufc":
      return x
    want = jax.dtypes.canonicalize_dtype(a.dtype)
  except (TypeError, ValueError):
    return x
  return a if a.dtype == want else a.astype(want)


def install() -> None:
  """Wraps ``jax.experimental.multihost_utils.assert_equal`` (once per process)."""
  global _installed
  if _installed:
    return
  import jax
  from jax.experimental import multihost_utils
  original = multihost_utils.assert_equal

  def assert_equal(in_tree, fail_message: str = ""):
    return original(jax.tree.map(_as_stored, in_tree), fail_message)

  assert_equal.__doc__ = original.__doc__
  assert_equal.__wrapped__ = original
  # device_put and sync_global_devices look it up on the module at call time.
  multihost_utils.assert_equal = assert_equal
  _installed = True

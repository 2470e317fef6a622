"""mpijax's fix to multihost_utils.assert_equal (the comparison; the collective runs in tests/mpi)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from mpijax._src.runtime import multihost


def test_host_values_are_compared_as_jax_stores_them():
  x = np.random.default_rng(0).normal(size=5)  # float64
  stored = multihost._as_stored(x)
  assert stored.dtype == np.float32 and np.array_equal(stored, x.astype(np.float32))
  assert multihost._as_stored(0.1).dtype == np.float32
  assert multihost._as_stored(np.arange(3)).dtype == np.int32
  same = np.arange(3, dtype=np.float32)
  assert multihost._as_stored(same) is same
  a = jnp.ones(2)
  assert multihost._as_stored(a) is a
  assert multihost._as_stored("name") == "name"


def test_install_wraps_once_and_one_process_passes():
  multihost.install()
  wrapped = multihost_utils.assert_equal
  multihost.install()
  assert multihost_utils.assert_equal is wrapped and wrapped.__wrapped__ is not wrapped
  # One process compares with itself; the cross-rank case is in tests/mpi.
  multihost_utils.assert_equal({"x": np.linspace(0, 1, 7), "s": 0.1}, "differs")
  multihost_utils.sync_global_devices("unit")

"""XLA's CPU thread pools found in the process and kept from spinning (xla_pools)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpijax._src import config
from mpijax._src import xla_pools

# A fresh process with 2 CPU devices: the pools before, quiet() twice, the
# pools after, and a jitted sum over both devices (on XLA's pools) after.
_PROBE = r"""
import json, jax, jax.numpy as jnp, numpy as np
from mpijax._src import xla_pools
jax.devices()
before = xla_pools.pools()
first, second = xla_pools.quiet(), xla_pools.quiet()
after = xla_pools.pools()
x = jax.device_put(np.arange(8, dtype=np.float32).reshape(2, 4),
                   jax.sharding.NamedSharding(jax.make_mesh((2,), ("d",)),
                                              jax.sharding.PartitionSpec("d")))
total = [float(v) for v in jax.jit(lambda a: a.sum(0))(x)]
print(json.dumps({"before": before, "after": after, "total": total,
                  "first": [first.pools, first.quieted, first.reason],
                  "second": [second.pools, second.quieted, second.reason]}))
"""


def _probe() -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_quiet_turns_off_the_spinning_of_every_pool_and_jax_still_computes():
  import jaxlib

  r = _probe()
  if not jaxlib.__version__.startswith("0.10."):
    # The pool's layout was read from jaxlib 0.10: elsewhere quiet() either
    # finds the same layout and quiets every pool, or says why it did not.
    pools, quieted, reason = r["first"]
    assert reason or quieted == pools >= 1, r
    assert r["total"] == [4.0, 6.0, 8.0, 10.0]
    return
  # jaxlib's CPU client has at least its intra-op and its client pool, and
  # builds them spinning: spin_count_ = 5000 / num_threads_.
  assert len(r["before"]) >= 2
  assert all(allow == 1 and spin == 5000 // n for n, allow, spin in r["before"])
  assert r["first"] == [len(r["before"]), len(r["before"]), ""]
  assert r["second"] == [len(r["before"]), 0, ""]  # found again, nothing left to do
  assert sorted(r["after"]) == sorted([n, 0, 0] for n, _, _ in r["before"])
  assert r["total"] == [4.0, 6.0, 8.0, 10.0]


def _fake_pool(threads: int, allow: int, spin: int) -> np.ndarray:
  """The bytes of a pool object whose fields say so, in memory of this process."""
  obj = np.zeros(0x60, np.uint8)
  obj[0x48:0x4C] = np.frombuffer(np.int32(threads).tobytes(), np.uint8)
  obj[0x4C] = allow
  obj[0x50:0x54] = np.frombuffer(np.int32(spin).tobytes(), np.uint8)
  return obj


@pytest.mark.parametrize(
  "fields, valid",
  [
    ((4, 1, 1250), True),
    ((3, 1, 1666), True),
    ((4, 0, 0), True),  # already quiet
    ((4, 1, 1249), False),  # not Eigen's budget
    ((4, 0, 1250), False),
    ((4, 2, 1250), False),  # not a bool
    ((0, 1, 0), False),
    ((-4, 1, 0), False),
  ],
)
def test_fields_accept_only_what_eigens_constructor_stores(fields, valid):
  obj = _fake_pool(*fields)
  mem = xla_pools._Memory(writable=False)
  try:
    got = xla_pools._fields(mem, obj.ctypes.data)
  finally:
    mem.close()
  assert (got == fields) if valid else got is None


def test_settle_leaves_the_pools_where_the_cores_suffice_or_the_setting_says_on():
  cores = len(os.sched_getaffinity(0))
  assert xla_pools.settle("auto", local_ranks=1, local_devices=cores, platform="cpu") is None
  assert xla_pools.settle("on", local_ranks=cores + 1, local_devices=2, platform="cpu") is None
  assert xla_pools.settle("off", local_ranks=1, local_devices=1, platform="gpu") is None


def test_the_setting_names_its_values():
  with pytest.raises(
    ValueError, match="MPIJAX_XLA_SPIN='sometimes' is not valid: expected auto, on or off"
  ):
    config.parse("xla_spin", "sometimes")
  assert config.parse("xla_spin", " OFF ") == "off"

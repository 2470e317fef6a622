"""mpijax.ops under shard_map over several local CPU devices per rank.

Each local device d calls MPI on its own sub-communicator (clone number d), so
device d of every rank talks to device d of the others. Runs in the
2 ranks x 2 devices configuration of tests/test_multirank.py (XLA_FLAGS=
--xla_force_host_platform_device_count=2); with one local device it checks the
same with L = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpijax
from mpijax import ops


def test_each_local_device_uses_its_own_subcommunicator():
  rt = mpijax.init()
  r, n = rt.rank, rt.size
  devs = rt.local_devices
  L = len(devs)
  mesh = Mesh(np.array(devs), ("d",))

  def body(x):  # (1, 3) per device
    ring = [(i, (i + 1) % n) for i in range(n)]
    return ops.allreduce(x), ops.allgather(x[0])[None], ops.ppermute(x, ring)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                            out_specs=(P("d"), P("d"), P("d")), check_vma=False))
  x = jnp.stack([jnp.full((3,), 100.0 * d + r) for d in range(L)])
  x = jax.device_put(x, NamedSharding(mesh, P("d")))
  for _ in range(20):  # devices call MPI concurrently, repeatedly
    s, g, p = f(x)
  s, g, p = np.asarray(s), np.asarray(g), np.asarray(p)
  for d in range(L):
    np.testing.assert_array_equal(s[d], n * 100.0 * d + sum(range(n)))
    np.testing.assert_array_equal(g[d][:, 0], 100.0 * d + np.arange(n))
    np.testing.assert_array_equal(p[d], 100.0 * d + (r - 1) % n)

"""All-reduces on the node-local paths, checked against NumPy; prints which
paths the world communicator took.

usage: cma_paths.py
Each rank prints "rank R paths [P...]" (see node_paths in the extension:
1 shared memory only, 2 also cross-memory attach).
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpijax
import mpijax.ops
from mpijax._src import ffi
from mpijax._src.ops import communicators

rt = mpijax.init()
r, p = rt.rank, rt.size
for n in [1 << 14, (1 << 18) + 3]:  # 64 KiB; 1 MiB + 12 B: the CMA path by default
  x = jnp.arange(n, dtype=jnp.float32) % 977 + r
  want = p * (np.arange(n, dtype=np.float32) % 977) + p * (p - 1) / 2
  out_of_place = jax.jit(lambda v: mpijax.ops.allreduce(v))(x)
  in_place = jax.jit(lambda v: mpijax.ops.allreduce(v * 1))(x)
  for got in (out_of_place, in_place):
    np.testing.assert_array_equal(np.asarray(got), want)
paths = ffi.load().node_paths(communicators.resolve_comm(None, "allreduce").id)
print(f"rank {r} paths {paths}", flush=True)

"""Fast-path cost of the stall inspector and the signature checks.

Times a jitted 4-byte allreduce per call (median of several rounds). Run it
with MPIJAX_TIMEOUT=0 (no polling deadline) and with the default, and with
MPIJAX_CHECK=1 (a signature allreduce before every call):

  for t in 0 300; do MPIJAX_TIMEOUT=$t mpijax-run -n 2 -- python tests/scripts/fastpath_cost.py; done
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import mpijax
import mpijax.ops

rt = mpijax.init()
# The mean of equal values: x stays 1 (a sum fed back would reach inf).
f = jax.jit(lambda x: mpijax.ops.allreduce(x, "mean"))
x = jnp.ones(1, jnp.float32)
for _ in range(500):
  x = f(x)
x.block_until_ready()
rounds = []
for _ in range(7):
  rt.comm.Barrier()
  t = time.perf_counter()
  for _ in range(3000):
    x = f(x)
    x.block_until_ready()
  rounds.append((time.perf_counter() - t) / 3000)
if float(x[0]) != 1.0:
  raise SystemExit(f"rank {rt.rank}: wrong result {float(x[0])}, expected 1.0")
if rt.rank == 0:
  print(f"FASTPATH ranks={rt.size} MPIJAX_TIMEOUT={os.environ.get('MPIJAX_TIMEOUT', 'default')} "
        f"MPIJAX_CHECK={os.environ.get('MPIJAX_CHECK', '0')} "
        f"median {1e6 * float(np.median(rounds)):.1f} us/call, best {1e6 * min(rounds):.1f} us/call",
        flush=True)

"""The script ends while jitted collectives are still in flight: no deadlock at exit."""

import jax
import jax.numpy as jnp

import mpijax
from mpijax import ops

rt = mpijax.init()
f = jax.jit(lambda x: ops.allreduce(x @ x))
x = jnp.ones((300, 300)) * (rt.rank + 1)
outs = [f(x) for _ in range(20)]   # dispatched, not awaited: the script ends with work in flight
print(rt.rank, "dispatched", flush=True)

"""Messages over 2**31 bytes (element counts past INT_MAX for int8): allreduce,
bcast and allgather move every byte. 2 ranks; ~7 GB of memory per rank."""

import jax
import jax.numpy as jnp

import mpijax
from mpijax import ops

rt = mpijax.init()
n = 2**31 + 4099  # int8 elements: past INT_MAX, and not a multiple of the chunk size
x = jnp.full((n,), rt.rank + 1, jnp.int8)
y = jax.jit(lambda v: ops.allreduce(v, "sum"))(x)
want = sum(r + 1 for r in range(rt.size))
assert y.shape == (n,) and bool(jnp.all(y == want)), "allreduce lost bytes"
del y
z = jax.jit(lambda v: ops.bcast(v, rt.size - 1))(x)
assert bool(jnp.all(z == rt.size)), "bcast lost bytes"
del z, x
g = jax.jit(ops.allgather)(jnp.full((2**30 + 7,), rt.rank + 1, jnp.int16))  # 2 GiB per rank
assert g.shape == (rt.size, 2**30 + 7)
assert all(bool(jnp.all(g[r] == r + 1)) for r in range(rt.size)), "allgather lost bytes"
print(f"LARGE ok rank {rt.rank}", flush=True)

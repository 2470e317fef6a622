"""Every kind of collective XLA itself inserts, across ranks, checked against NumPy.

Usage: xla_collectives.py [--jax-first | --no-hook] [--expect mpi|gloo]
Prints "XLA_COLLECTIVES rank <r> <transport> ok" per rank. With one device
per rank they must travel through mpijax's MPI bridge (its call counters
move). mpijax is imported before jax, unless --jax-first imports jax first,
as isort orders them (then the interpreter-start hook or mpijax-run must
have named the bridge). --no-hook drops what the launcher or the hook named,
so that importing mpijax first must name the bridge itself.
"""

import os
import sys

if "--jax-first" in sys.argv:
  import jax

  import mpijax
else:
  if "--no-hook" in sys.argv:
    os.environ.pop("MPITRAMPOLINE_LIB", None)
  import mpijax

  # isort: split
  import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpijax._src.xla import distributed as jax_runtime

rt = mpijax.init()
expect = sys.argv[sys.argv.index("--expect") + 1] if "--expect" in sys.argv else None
assert expect is None or rt.xla_collectives == expect, (rt.xla_collectives, expect)
assert (jax.process_index(), jax.process_count()) == (rt.rank, rt.size)
n = jax.device_count()
L = jax.local_device_count()
mesh = jax.make_mesh((n,), ("x",))


def put(a, spec, m=mesh):
  return jax.make_array_from_callback(a.shape, NamedSharding(m, spec), lambda idx: a[idx])


def mine(y):
  """This rank's first shard."""
  return np.asarray(y.addressable_shards[0].data)


def check(y, expected):
  """Every shard of ``y`` on this rank against its block of ``expected``."""
  for shard in y.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


rep = NamedSharding(mesh, P())
# Reductions over a sharded axis (all-reduce), every dtype XLA's MPI path carries.
for dtype in (np.float32, np.float64, np.int8, np.int32, np.uint64, np.complex64, np.bool_,
              jnp.bfloat16):
  a = (np.arange(n * 4 * 3).reshape(n * 4, 3) % 7).astype(dtype)
  x = put(a, P("x", None))
  if dtype != np.bool_:
    got = mine(jax.jit(lambda x: x.sum(0), out_shardings=rep)(x))
    np.testing.assert_allclose(got.astype(np.complex128), a.astype(np.complex128).sum(0))
  if dtype != np.complex64:
    np.testing.assert_array_equal(mine(jax.jit(lambda x: x.max(0), out_shardings=rep)(x)), a.max(0))
    np.testing.assert_array_equal(mine(jax.jit(lambda x: x.min(0), out_shardings=rep)(x)), a.min(0))
  if dtype in (np.float64, np.int32):
    small = (a % 2 + 1).astype(dtype)
    np.testing.assert_array_equal(
        mine(jax.jit(lambda x: x.prod(0), out_shardings=rep)(put(small, P("x", None)))),
        small.prod(0))

# All-gather (resharding to replicated) and all-to-all (P('x', None) -> P(None, 'x')).
a = np.random.default_rng(0).standard_normal((n * 2, 5)).astype(np.float32)
np.testing.assert_array_equal(mine(jax.jit(lambda x: x, out_shardings=rep)(put(a, P("x", None)))), a)
b = np.arange(n * n * 6, dtype=np.float32).reshape(n * 2, n * 3)
check(jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P(None, "x")))(put(b, P("x", None))), b)

# jax.lax collectives in a shard_map over the global mesh (XLA's own collectives).
def body(v):
  return (jax.lax.psum(v, "x"), jax.lax.all_gather(v, "x", tiled=True),
          jax.lax.psum_scatter(jnp.tile(v, (n, 1)), "x", scatter_dimension=0, tiled=True),
          jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)]),
          jax.lax.all_to_all(jnp.tile(v, (n, 1)), "x", 0, 0, tiled=True))


c = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)
blocks = c.reshape(n, 2, 3)
outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                             out_specs=(P(), P(), P("x"), P("x"), P("x")), check_vma=False))(
                                 put(c, P("x")))
s, g, r, p, t = outs
check(s, blocks.sum(0))
check(g, c)
check(r, np.tile(blocks.sum(0), (n, 1)))  # every block of the scatter is the sum
check(p, np.roll(c, 2, axis=0))  # block i came from device i - 1
check(t, np.tile(c, (n, 1)))

# A 2-D mesh: one communicator per row, per column and one for all (XLA
# creates each at its group's first collective, in program order everywhere).
if n % 2 == 0 and n >= 4:
  mesh2 = jax.make_mesh((2, n // 2), ("a", "b"))
  d = np.arange(2 * (n // 2) * 3, dtype=np.float32).reshape(2, n // 2, 3)
  x2 = put(d, P("a", "b"), mesh2)
  for _ in range(3):
    check(jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh2, P("b")))(x2), d.sum(0))
    check(jax.jit(lambda x: x.sum(1), out_shardings=NamedSharding(mesh2, P("a")))(x2), d.sum(1))
    check(jax.jit(lambda x: x.sum((0, 1)), out_shardings=NamedSharding(mesh2, P()))(x2),
          d.sum((0, 1)))

# From 256 KiB per rank, the bridge hands XLA's all-reduces to mpijax's
# node-local path (shared memory, cross-memory attach): 2 MiB per rank here,
# integer-valued, so every summation order gives these bits.
big = (np.arange(n * 2 * 262144).reshape(n, 2 * 262144) % 13).astype(np.float32)
xb = put(big, P("x", None))
for _ in range(3):
  np.testing.assert_array_equal(mine(jax.jit(lambda x: x.sum(0), out_shardings=rep)(xb)),
                                big.sum(0))
  np.testing.assert_array_equal(mine(jax.jit(lambda x: x.max(0), out_shardings=rep)(xb)),
                                big.max(0))

stats = jax_runtime.bridge_stats()
if rt.xla_collectives == "mpi":
  for kind in ("init", "split", "allreduce", "allgather", "reduce_scatter"):
    assert stats[kind] > 0, (kind, stats)
  assert stats["sendrecv"] + stats["isend"] > 0, stats
else:
  assert not any(stats.get(k, 0) for k in ("allreduce", "allgather")), stats
print(f"XLA_COLLECTIVES rank {rt.rank} {rt.xla_collectives} ok", flush=True)

"""mpijax's MPI calls and XLA's own cross-process collectives in one jitted program.

With JAX's distributed runtime on, a jitted function over global jax.Arrays
can hold both: collectives XLA's partitioner inserts (and jax.lax ones over
the global mesh), which run over MPI through mpijax's bridge (or gloo), and
mpijax calls inside a shard_map body. They use different communicators, and
each kind keeps its own order on every rank (XLA's collectives in program
order, mpijax's through its order-token chain), so they can neither pair
with each other nor wait for each other in different orders. Without JAX's
distributed runtime there are no global arrays, and these tests check nothing.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpijax import ops


def _global(mesh, a, spec):
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def test_mixed_transports_in_one_program_keep_a_consistent_order(rt):
  """Independent collectives of both kinds, of mixed sizes, 60 programs back to back.

  Per call: 3 partitioner all-reduces and an all-gather (resharding) outside
  the body; inside it a jax.lax psum and all_gather over the global mesh and
  3 mpijax all-reduces, none depending on another. Any two ranks running
  them in different orders would swap results (same shapes) or stall.
  """
  if not rt.jax_distributed:
    return
  n, L = jax.device_count(), jax.local_device_count()
  mesh = jax.make_mesh((n,), ("x",))
  small, big = 4, 64 * 1024  # floats per device block: 16 B and 256 KiB

  def body(u, v, w):  # this device's blocks
    return (jax.lax.psum(u, "x"), ops.allreduce(v), ops.allreduce(2 * u),
            jax.lax.all_gather(w, "x", tiled=True), ops.allreduce(3 * v))

  mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x"), P("x")),
                         out_specs=(P("x"), P("x"), P("x"), P(), P("x")), check_vma=False)
  rep = NamedSharding(mesh, P())

  row = NamedSharding(mesh, P("x"))

  @functools.partial(jax.jit, out_shardings=((row, row, row, rep, row), (rep,) * 4))
  def step(a, b, c, y, z):
    return mapped(a, b, c), (y.sum(0), z.sum(0), (2 * y).max(0), z)

  rng = np.random.default_rng(0)
  A = rng.integers(0, 9, (n, small)).astype(np.float32)
  B = rng.integers(0, 9, (n, big)).astype(np.float32)
  C = rng.integers(0, 9, (n, 3)).astype(np.float32)
  Y = rng.integers(0, 9, (n * 2, small)).astype(np.float32)
  Z = rng.integers(0, 9, (n * 2, 256)).astype(np.float32)
  args = [_global(mesh, a, P("x")) for a in (A, B, C)] + [
      _global(mesh, Y, P("x", None)), _global(mesh, Z, P("x", None))]
  # mpijax's all-reduce spans the ranks: each rank's L device blocks in its
  # own communicator per local index, so block i sums the blocks j with
  # j % L == i % L.
  def ranks_sum(M):
    return np.stack([M[[j for j in range(n) if j % L == i % L]].sum(0) for i in range(n)])

  want_inside = (np.broadcast_to(A.sum(0), A.shape), ranks_sum(B), ranks_sum(2 * A), C,
                 ranks_sum(3 * B))
  want_outside = (Y.sum(0), Z.sum(0), (2 * Y).max(0), Z)
  results = [step(*args) for _ in range(60)]  # dispatched back to back
  for inside, outside in results[::15] + results[-1:]:
    for got, want in zip(inside, want_inside):
      for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data),
                                      want[shard.index] if want.ndim else want)
    for got, want in zip(outside, want_outside):
      np.testing.assert_array_equal(np.asarray(got.addressable_shards[0].data), want)
  jax.block_until_ready(results)
  if rt.xla_collectives == "mpi":
    from mpijax._src.xla import distributed as jax_runtime
    assert jax_runtime.bridge_stats()["allreduce"] >= 60 * 4  # 3 outside + psum inside

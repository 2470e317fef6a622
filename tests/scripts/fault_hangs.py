"""The three hangs of JAX's multi-process guide, each of which mpijax turns
into an error on every rank within MPIJAX_TIMEOUT.

usage: fault_hangs.py MODE [CKPT_DIR]
  shapes            rank 1's batch has another shape -> mismatch error
  last_batch        rank 3 has fewer batches and leaves the loop early -> the
                    others' stall report names rank 3
  last_batch_fixed  the same data through mpijax.train.shard_batches -> equal
                    step counts, the run completes
  late              rank 3 arrives 3.5 s late (run with MPIJAX_STALL_ACTION=warn
                    and MPIJAX_TIMEOUT=2: the others warn, then finish)
  late_mixed        the same in a jitted program over global jax.Arrays whose
                    mpijax all-reduce (in a shard_map) feeds a collective XLA's
                    partitioner inserts (over MPI through mpijax's bridge)
  late_large        the same with 512 KiB messages (cross-memory attach; with
                    MPIJAX_CMA_MIN_BYTES=0 mpijax's ring, or with
                    MPIJAX_RING_MIN_BYTES=0 too a blocking MPI_Allreduce)
  set_order         every rank iterates a collection of differently shaped
                    parameters in its own order (what iterating a `set` of
                    names does under different hash seeds) -> mismatch error
  seen_shapes N     both shapes of a jitted all-reduce pass their first-run
                    check, then rank 1 calls it with the other one: MPI's
                    truncation error ends the job with a report (no garbage,
                    no heap corruption); N elements (large N: mpijax's ring,
                    or by default cross-memory attach, whose own check makes
                    it a collective mismatch error on every rank)
"""

import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mpijax
import mpijax.ops
import mpijax.train as mt

rt = mpijax.init()
mode = sys.argv[1]


@jax.jit
def grad_sum(x):
  return mpijax.ops.allreduce(jnp.sum(x, axis=0))



def report_then_raise(fn):
  """Runs fn; on error prints it on this rank, lets every rank do the same
  (an mpi4py barrier), then re-raises (the abort hook ends the job)."""
  try:
    fn()
  except Exception as e:
    print(f"rank {rt.rank} raised: {str(e).splitlines()[0][:400]}", flush=True)
    rt.comm.Barrier()
    raise


if mode == "shapes":
  batch = jnp.ones((6 if rt.rank == 1 else 8, 4))  # rank 1's batch differs
  report_then_raise(lambda: print(mpijax.ops.allreduce(batch * 1.0).shape))

elif mode in ("last_batch", "last_batch_fixed"):
  samples = 24 if rt.rank == 3 else 40  # rank 3 has less data
  data = np.ones((samples, 4), np.float32) * (rt.rank + 1)
  if mode == "last_batch":
    batches = [data[i:i + 8] for i in range(0, samples, 8)]  # 3 vs 5 steps
  else:
    batches = [b.data for b in mt.shard_batches(data, 8 * rt.size, seed=0, epoch=0,
                                                replicated=False)]
  for b in batches:
    g = grad_sum(jnp.asarray(b))
  g.block_until_ready()
  print(f"rank {rt.rank}: {len(batches)} steps done", flush=True)
  # The end-of-epoch checkpoint is an mpi4py collective: a rank that left
  # the loop early waits there, outside mpijax.
  mt.save_checkpoint(os.path.join(sys.argv[2], "epoch.ckpt"), {"g": g},
                     check_replicated=False)
  print(f"rank {rt.rank}: epoch finished", flush=True)

elif mode == "set_order":
  params = {"kernel": jnp.ones((8, 4)), "bias": jnp.ones(4), "scale": jnp.ones(2),
            "embed": jnp.ones((16,))}
  order = sorted(params)
  random.Random(rt.rank).shuffle(order)  # a per-rank iteration order
  print(f"rank {rt.rank} order {order}", flush=True)

  @jax.jit
  def sync(p):
    return {k: mpijax.ops.allreduce(p[k]) for k in order}  # dicts keep this order

  report_then_raise(lambda: print(jax.tree.map(jnp.shape, sync(params))))

elif mode in ("late", "late_large"):
  import time
  shape = (2, 3) if mode == "late" else (2, 65536)  # the large one: 512 KiB
  grad_sum(jnp.ones(shape)).block_until_ready()
  if rt.rank == 3:
    time.sleep(3.5)  # MPIJAX_TIMEOUT=2 s: the report, then rank 3
  print(f"rank {rt.rank}: {np.asarray(grad_sum(jnp.ones(shape)))[:3]}", flush=True)

elif mode == "late_mixed":
  import time

  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  summed = jax.shard_map(lambda v: mpijax.ops.allreduce(2 * v), mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"))
  step = jax.jit(lambda x: summed(x).max(0), out_shardings=NamedSharding(mesh, P()))
  x = jax.make_array_from_callback((n, 3), rows, lambda i: np.ones((n, 3), np.float32)[i])
  step(x).block_until_ready()
  if rt.rank == 3:
    time.sleep(3.5)  # MPIJAX_TIMEOUT=2 s: the report, then rank 3
  print(f"rank {rt.rank} ({rt.xla_collectives}): "
        f"{np.asarray(step(x).addressable_shards[0].data)[:3]}", flush=True)

elif mode == "seen_shapes":
  n = int(sys.argv[2])
  grad_sum(jnp.ones((1, n)))  # each shape's first run is checked on every rank
  grad_sum(jnp.ones((1, 2 * n))).block_until_ready()
  y = grad_sum(jnp.ones((1, 2 * n if rt.rank == 1 else n)))
  print(f"rank {rt.rank} finished with {np.asarray(y)[-2:]}", flush=True)

else:
  sys.exit(f"unknown mode {mode!r}")

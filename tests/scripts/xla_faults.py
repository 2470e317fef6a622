"""Faults in plain-JAX code, whose collectives XLA runs over MPI through mpijax's bridge.

usage: xla_faults.py MODE

The job all-reduces a global array sharded over the ranks with a jitted
``x.sum(0)`` (XLA's partitioner inserts the all-reduce), once for warm-up,
then the fault:

  stall          the last rank never reaches the second all-reduce (it sleeps)
  stall_mpijax   the last rank is inside one of mpijax's own collectives
                 (an mpijax.ops.allreduce the others never make) instead
  count          the last rank all-reduces 4,096 floats, the others 1,024
  count_large    the same with 131,072 and 65,536 floats
  dtype          the last rank all-reduces int32, the others float32
  op             the last rank's jax.lax.pmax meets the others' jax.lax.psum
  permute        a jax.lax.ppermute whose blocks differ in size on the last rank
  all_to_all     a jax.lax.all_to_all whose blocks (over 64 KiB, sent after
                 their header) differ in size on the last rank
  kill           the last rank kills itself (SIGKILL) before the all-reduce
  ok             no fault: every rank prints the all-reduce's result
  timeline       3 steps of an XLA all-reduce and an mpijax psum (run with
                 MPIJAX_TIMELINE); the last rank sleeps 0.3 s before each
  reduce_scatter no fault: a jax.lax.psum_scatter over every device, checked;
                 every rank prints "scatter ok"
  gather         no fault: jax.lax.all_gather of 4 KiB and of 256 KiB per
                 device, checked; every rank prints "gather ok"
  gather_count   the last rank all-gathers 131,072 floats per device, the
                 others 65,536
  label          no fault: 2 all-reduces of one float32 per device (run with
                 MPIJAX_TIMELINE), the shape of the all-reduce init()'s
                 warm-up of XLA's communicators runs
  shapes         the last rank's rows have another shape, and each rank's
                 global array gets its shape from its own rows (no
                 global_shape): a jitted mean over the rows, whose all-reduce
                 has one size on every rank; every rank prints its mean

Each rank prints "entering" (with time.time()) right before the faulty call.
"""

import os
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpijax
import mpijax.ops

mpijax.init()
mode = sys.argv[1]
rank, size = jax.process_index(), jax.process_count()
last = rank == size - 1
mesh = jax.make_mesh((jax.device_count(),), ("x",))
row = NamedSharding(mesh, P("x"))


def rows(n, dtype=np.float32):
  local = np.full((jax.local_device_count(), n), rank + 1, dtype)
  return jax.make_array_from_process_local_data(row, local, (jax.device_count(), n))


def total(x):
  return jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))(x)


def mapped(fn, x):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)


def entering():
  print(f"rank {rank} entering {time.time():.3f}", flush=True)


warm = total(rows(1024))
print(f"rank {rank} warm {float(np.asarray(warm.addressable_data(0))[0])}", flush=True)

if mode == "stall":
  entering()
  if last:
    time.sleep(600)
  total(rows(1024)).block_until_ready()
elif mode == "stall_mpijax":
  mpijax.ops.allreduce(np.ones(4, np.float32)).block_until_ready()  # registers its communicator
  entering()
  if last:
    mpijax.ops.allreduce(np.ones(4, np.float32)).block_until_ready()
  else:
    total(rows(1024)).block_until_ready()
elif mode == "count":
  x = rows(4096 if last else 1024)
  entering()
  total(x).block_until_ready()
elif mode == "count_large":
  x = rows(131072 if last else 65536)
  entering()
  total(x).block_until_ready()
elif mode == "dtype":
  x = rows(1024, np.int32 if last else np.float32)
  entering()
  total(x).block_until_ready()
elif mode == "op":
  x = rows(1024)
  entering()
  fn = (lambda b: jax.lax.pmax(b, "x")) if last else (lambda b: jax.lax.psum(b, "x"))
  mapped(fn, x).block_until_ready()
elif mode == "permute":
  x = rows(4096 if last else 1024)
  entering()
  ring = [(i, (i + 1) % jax.device_count()) for i in range(jax.device_count())]
  mapped(lambda b: jax.lax.ppermute(b, "x", ring), x).block_until_ready()
elif mode == "all_to_all":
  d = jax.device_count()
  x = rows(d * (65536 if last else 32768))
  entering()
  mapped(lambda b: jax.lax.all_to_all(b.reshape(d, -1), "x", 0, 0, tiled=True), x).block_until_ready()
elif mode == "kill":
  entering()
  if last:
    os.kill(os.getpid(), signal.SIGKILL)
  total(rows(1024)).block_until_ready()
elif mode == "timeline":
  import mpijax.lax as mlax
  import mpijax.timeline

  psum = jax.jit(
    mpijax.shard_map(
      lambda v: mlax.psum(v, "x"),
      mesh=mpijax.make_mesh((jax.device_count(),), ("x",)),
      in_specs=P("x"),
      out_specs=P(),
    )
  )
  x = rows(1024)
  for _ in range(3):
    with mpijax.timeline.span("step", step=True):
      if last:
        time.sleep(0.3)
      total(x).block_until_ready()
      psum(np.ones((jax.local_device_count(), 256), np.float32)).block_until_ready()
elif mode == "reduce_scatter":
  n = jax.device_count()
  full = np.arange(n * n * 8, dtype=np.float32).reshape(n, n * 8)
  x = jax.make_array_from_callback(full.shape, row, lambda i: full[i])
  y = mapped(lambda b: jax.lax.psum_scatter(b, "x", scatter_dimension=1, tiled=True), x)
  want = full.sum(0).reshape(n, 8)
  for s in y.addressable_shards:
    g = list(mesh.devices.flat).index(s.device)
    assert np.array_equal(np.asarray(s.data)[0], want[g]), (g, np.asarray(s.data), want[g])
  print(f"rank {rank} scatter ok", flush=True)
elif mode == "gather":
  n = jax.device_count()
  gather = jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b, "x", tiled=True), mesh=mesh,
                                 in_specs=P("x"), out_specs=P(), check_vma=False))
  for m in (1024, 65536):
    full = (np.arange(n * m) % 1009).astype(np.float32).reshape(n, m)
    x = jax.make_array_from_callback(full.shape, row, lambda i: full[i])
    for _ in range(2):
      y = gather(x)
      for s in y.addressable_shards:
        assert np.array_equal(np.asarray(s.data), full), (m, rank)
  print(f"rank {rank} gather ok", flush=True)
elif mode == "gather_count":
  x = rows(131072 if last else 65536)
  entering()
  jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b, "x", tiled=True), mesh=mesh,
                        in_specs=P("x"), out_specs=P(), check_vma=False))(x).block_until_ready()
elif mode == "label":
  for _ in range(2):
    total(rows(1)).block_until_ready()
elif mode == "shapes":
  local = np.ones((jax.local_device_count() * (3 if last else 2), 4), np.float32)
  x = jax.make_array_from_process_local_data(row, local)
  y = jax.jit(lambda a: a.mean(0), out_shardings=NamedSharding(mesh, P()))(x)
  print(f"rank {rank} shape {x.shape} mean {float(np.asarray(y.addressable_data(0))[0])}",
        flush=True)
elif mode == "ok":
  y = total(rows(1024))
  print(f"rank {rank} total {float(np.asarray(y.addressable_data(0))[0])}", flush=True)
else:
  raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {rank} done", flush=True)

"""How mpijax.init() meets JAX set up in other ways; one case per run.

Usage: jax_setups.py CASE, with CASE one of
  backend-first       JAX's backend started before init(): refused on every rank
  user-dist           the user's own jax.distributed.initialize(), agreeing with MPI: adopted
  user-dist-mismatch  ... with process ids that disagree with MPI's ranks: refused
  mpi-required        MPIJAX_XLA_COLLECTIVES=mpi where XLA's MPI path cannot serve (jax
                      imported first, nothing naming the bridge): refused
  no-bridge           jax imported first with nothing naming the bridge: gloo, one warning
  f16                 a float16 all-gather under XLA's MPI collectives: the job stops, with the fix
  split-stall         only rank 0 runs a cross-process jit: stopped after MPIJAX_TIMEOUT, saying why
A refusal prints "rank R refused: <message>" and exits 3; a run that works
prints "SETUP rank R <transport> ok".
"""

import os
import sys
import time

case = sys.argv[1]
if case in ("no-bridge", "mpi-required"):
  os.environ.pop("MPITRAMPOLINE_LIB", None)  # as if no launcher or hook had named it
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpijax  # noqa: E402

rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
if case == "backend-first":
  jax.devices()
elif case in ("user-dist", "user-dist-mismatch"):
  port = MPI.COMM_WORLD.bcast(int(np.random.default_rng().integers(20000, 40000)))
  pid = (size - 1 - rank) if case == "user-dist-mismatch" else rank
  jax.distributed.initialize(f"127.0.0.1:{port}", size, pid)
try:
  rt = mpijax.init()
except RuntimeError as e:
  print(f"rank {rank} refused: {e}", flush=True)
  raise SystemExit(3)  # noqa: B904

n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",))
dtype = np.float16 if case == "f16" else np.float32
a = np.arange(n * 2 * 3).reshape(n * 2, 3).astype(dtype)
x = jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("x", None)), lambda i: a[i])
if case == "split-stall" and rank != 0:
  time.sleep(120)  # never joins: rank 0 must not wait for it forever
f = (lambda x: x) if case == "f16" else (lambda x: x.sum(0))
y = jax.jit(f, out_shardings=NamedSharding(mesh, P()))(x)
np.testing.assert_array_equal(np.asarray(y.addressable_shards[0].data), f(a))
print(f"SETUP rank {rank} {rt.xla_collectives} ok", flush=True)

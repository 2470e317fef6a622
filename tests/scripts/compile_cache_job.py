"""A job for tests/test_compile_cache.py: programs compiled through mpijax's compile
cache, each rank printing one JSON line of what it computed and how each program
came to it (compile_hook.outcomes()).

Modes:
  share     a program each rank jits on its own device with mpijax's all-reduce
            (per-rank), and a global program whose all-reduce XLA inserts
  differ    rank 0 runs a program the others do not, and every rank jits one of
            its own shape: nobody waits for them
  wait      3 ranks: ranks 0 and 1 compile a slow program (rank 1 a little later,
            so it waits for rank 0's compile), rank 2 waits for both in an
            all-reduce; MPIJAX_TIMEOUT is short
  mismatch  the ranks call one all-reduce site with other shapes (an error that
            names them), after a program that makes rank 1 stall at another
            site when --stall is given
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mpijax

rt = mpijax.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mpijax._src.xla import compile_hook  # noqa: E402


def layers(x, n):
  for i in range(n):
    x = jnp.tanh(x @ jnp.full((x.shape[-1], x.shape[-1]), 0.01, x.dtype)) + i
  return x


def per_rank(n):
  @jax.jit
  def rank_program(x):
    return mpijax.ops.allreduce(layers(x, n), op="sum")

  return rank_program


def global_sum(n):
  mesh = Mesh(np.array(jax.devices()), ("x",))
  rows = 2 * jax.local_device_count()
  x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("x")), np.full((rows, 32), rt.rank + 1.0, np.float32)
  )

  @jax.jit
  def global_program(v):
    return layers(v, n).sum(0)

  return np.asarray(global_program(x)).tolist()


def report(**values) -> None:
  out = dict(rank=rt.rank, outcomes=compile_hook.outcomes(), **values)
  print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("mode", choices=("share", "differ", "wait", "mismatch"))
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--stall", action="store_true")
  args = ap.parse_args()
  n = args.layers

  if args.mode == "share":
    local = per_rank(n)(jnp.full((4, 32), float(rt.rank)))
    report(local=np.asarray(local).tolist(), glob=global_sum(n))
  elif args.mode == "differ":
    def only_rank_0(v):
      return layers(v, n) * 3

    def own_shape(v):
      return layers(v, n)

    if rt.rank == 0:
      np.asarray(jax.jit(only_rank_0)(jnp.ones((4, 32))))
    own = jax.jit(own_shape)(jnp.ones((4 + rt.rank, 32)))  # a shape of its own
    total = mpijax.ops.allreduce(jnp.asarray(float(own.shape[0])), op="sum")
    report(total=float(total))
  elif args.mode == "wait":

    @jax.jit
    def slow_program(v):
      return layers(v, n)

    slow = slow_program
    mpijax.ops.allreduce(jnp.ones(3), op="sum").block_until_ready()  # compiled everywhere
    if rt.rank == 2:
      total = mpijax.ops.allreduce(jnp.ones(3), op="sum")  # waits for ranks 0 and 1
    else:
      if rt.rank == 1:
        time.sleep(0.5)  # rank 0 claims the compile first
      np.asarray(slow(jnp.ones((4, 32))))
      total = mpijax.ops.allreduce(jnp.ones(3), op="sum")
    report(total=np.asarray(total).tolist())
  elif args.mode == "mismatch":
    if args.stall:

      @jax.jit
      def stall_site(v):
        return mpijax.ops.allreduce(v, op="sum")  # the call site the report names

      np.asarray(stall_site(jnp.ones(2)))  # compiled (or loaded) everywhere
      if rt.rank == 1:
        time.sleep(float(os.environ.get("STALL_S", "3")))
      np.asarray(stall_site(jnp.ones(2)))  # rank 0 waits here for rank 1
      report()
      return
    shape = (3,) if rt.rank == 0 else (5,)

    @jax.jit
    def mismatched(v):
      return mpijax.ops.allreduce(v, op="sum")

    try:
      np.asarray(mismatched(jnp.ones(shape)))
      report(error="")
    except Exception as e:  # noqa: BLE001 -- the error is the result
      report(error=str(e).splitlines()[0])
  sys.stdout.flush()


if __name__ == "__main__":
  main()

"""A job whose ranks are equal or have one straggler, for the straggler report's tests.

usage: straggler_job.py MODE STEPS [LATE_RANK]

MODE:
  compute  mpijax.train.DataParallel steps; LATE_RANK (if given) runs 40 % more
           iterations of the step's extra computation (a loop inside the jitted
           step whose trip count comes with the batch, so every rank runs the
           same program).
  input    the same steps, every rank equal in compute; LATE_RANK's batches come
           late: its loop sleeps 0.4 x the step's time before each step.
  xla      plain JAX: a jitted sum over a global array sharded over the ranks (XLA's
           all-reduce over MPI through the bridge, no mpijax collective) after some
           computation; LATE_RANK sleeps 30 ms more before each call.

Rank 0 prints "first straggler line at step N" when the first periodic straggler
line (MPIJAX_STRAGGLER_INTERVAL) is logged, N being the steps done by then, and
"job line at T" (wall clock) when it logs the job's line. With STRAGGLER_TEST_HOLD=S
in the environment, LATE_RANK holds its exit S seconds after the steps (a rank that
does not come to the end) and prints "hold ended at T", and every rank's report
waits at most 2 s for the others at the end (instead of 30).
"""

import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
from mpijax import train
from mpijax._src.timeline import straggler_watch

mode, steps = sys.argv[1], int(sys.argv[2])
late = int(sys.argv[3]) if len(sys.argv) > 3 else -1
hold = float(os.environ.get("STRAGGLER_TEST_HOLD", "0"))
if hold:
  straggler_watch.FINISH_TIMEOUT_S = 2.0
rt = mpijax.init()
done = 0


class _FirstLine(logging.Handler):
  """Notes the steps done when the first periodic straggler line comes, and prints every line."""

  def __init__(self) -> None:
    super().__init__()
    self.seen = False

  def emit(self, record: logging.LogRecord) -> None:
    text = record.getMessage()
    print(text, file=sys.stderr, flush=True)
    if not self.seen and "straggler in the last" in text:
      self.seen = True
      print(f"first straggler line at step {done}", flush=True)
    if "over the job" in text:
      print(f"job line at {time.time():.3f}", flush=True)


logging.getLogger("mpijax").addHandler(_FirstLine())

BASE_REPS, EXTRA = 10, 0.4
reps = round(BASE_REPS * (1 + EXTRA)) if rt.rank == late and mode == "compute" else BASE_REPS
burn_m = jnp.asarray(np.random.default_rng(1).normal(size=(160, 160)) / 16, jnp.float32)


def burn(n, x0):
  """n rounds of a 160 x 160 matrix chain: the step's work, scaled per rank by n."""
  return jax.lax.fori_loop(0, n, lambda i, m: jnp.tanh(m @ burn_m), x0)


if mode in ("compute", "input"):
  B = 16
  rng = np.random.default_rng(rt.rank)
  x = rng.normal(size=(B, 8)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  # The work per step: larger for the 40 % case, whose lateness (0.4 x the step's work)
  # must stand out of the time slices of a loaded machine.
  rows = 256 if mode == "compute" else 128
  batch = (x, y, np.full((B,), reps, np.int32), np.ones((B, rows, 160), np.float32))

  def loss_fn(params, data):
    xb, yb, n, x0 = data
    losses = optax.softmax_cross_entropy_with_integer_labels(
      jnp.tanh(xb @ params["w1"]) @ params["w2"], yb
    )
    return losses, {"burn": jnp.mean(burn(n[0], x0))}

  key1, key2 = jax.random.split(jax.random.key(0))
  params = {
    "w1": jax.random.normal(key1, (8, 16)) * 0.3,
    "w2": jax.random.normal(key2, (16, 2)) * 0.3,
  }
  dp = train.DataParallel(loss_fn, optax.sgd(0.01), has_aux=True)
  state = dp.init(params)
  state, _ = dp.step(state, batch)  # compiled before the steps that count
  jax.block_until_ready(state)
  step_s = None
  for i in range(steps):
    if mode == "input" and rt.rank == late and step_s is not None:
      time.sleep(EXTRA * step_s)  # the batch is late: the loop waits for it
    t0 = time.perf_counter()
    state, metrics = dp.step(state, batch)
    jax.block_until_ready(metrics)
    step_s = time.perf_counter() - t0 if step_s is None else min(step_s, time.perf_counter() - t0)
    done = i + 1
  print(
    f"rank {rt.rank}: {done} steps, loss {float(metrics['loss']):.4f}, fastest step {step_s * 1e3:.1f} ms",
    flush=True,
  )
elif mode == "xla":
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  f = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))
  g = jax.jit(lambda m, n: jnp.sum(burn(n, m)))
  rows = np.full((2, 4), float(rt.rank), np.float32)
  x0 = jnp.ones((128, 160), jnp.float32)
  want = 2 * sum(range(rt.size))
  for i in range(steps + 1):
    jax.block_until_ready(g(x0, reps))  # the work before the collective
    if rt.rank == late:
      time.sleep(0.03)
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), rows)
    total = np.asarray(f(arr).addressable_data(0))
    assert (total == want).all(), total
    done = i
  print(f"rank {rt.rank}: {done} steps, sum {total.tolist()}", flush=True)
else:
  raise SystemExit(f"unknown mode {mode!r}")
if hold and rt.rank == late:
  time.sleep(hold)
  print(f"hold ended at {time.time():.3f}", flush=True)

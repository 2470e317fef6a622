"""Soak: many small collectives and jitted training steps in one job.

Prints one JSON line per rank: resident memory and open file descriptors
before and after, and the mean time per call over the first and the last 10 %.
usage: soak.py [N_COLLECTIVES] [N_STEPS]
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
import mpijax.ops
import mpijax.train as mt

rt = mpijax.init()
n_calls = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
n_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def fds() -> int:
  return len(os.listdir("/proc/self/fd"))


small = jax.jit(lambda x: mpijax.ops.allreduce(x) * 0.5)
x = jnp.ones(1, jnp.float32)
for _ in range(200):  # warm up: compile, first-run checks, allocator pools
  x = small(x)
x.block_until_ready()
rss0, fd0 = rss_mb(), fds()

times = np.empty(n_calls)
for i in range(n_calls):
  t = time.perf_counter()
  x = small(x)
  x.block_until_ready()
  times[i] = time.perf_counter() - t
k = n_calls // 10
rss1, fd1 = rss_mb(), fds()  # after the collectives

opt = optax.chain(mt.allreduce_gradients(), optax.adam(1e-3))
params = {"w1": jnp.ones((32, 64)) * 0.01, "w2": jnp.ones((64, 1)) * 0.01}
opt_state = opt.init(params)
xb = jnp.ones((16, 32)) * (rt.rank + 1)


@jax.jit
def step(params, opt_state):
  loss, g = jax.value_and_grad(
      lambda p: jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"]) ** 2))(params)
  updates, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


for _ in range(10):  # warm up: compile the step, optimizer state buffers
  params, opt_state, loss = step(params, opt_state)
loss.block_until_ready()
rss2, fd2 = rss_mb(), fds()
step_times = np.empty(n_steps)
for i in range(n_steps):
  t = time.perf_counter()
  params, opt_state, loss = step(params, opt_state)
  loss.block_until_ready()
  step_times[i] = time.perf_counter() - t
ks = max(n_steps // 10, 1)

print("SOAK " + json.dumps({
    "rank": rt.rank, "collectives": n_calls, "steps": n_steps,
    # Growth over each loop, measured from after its warm-up.
    "calls_rss_growth_mb": round(rss1 - rss0, 1), "calls_fd_growth": fd1 - fd0,
    "steps_rss_growth_mb": round(rss_mb() - rss2, 1), "steps_fd_growth": fds() - fd2,
    "rss_end_mb": round(rss_mb(), 1),
    "call_us_first10": round(1e6 * float(np.median(times[:k])), 1),
    "call_us_last10": round(1e6 * float(np.median(times[-k:])), 1),
    "step_us_first10": round(1e6 * float(np.median(step_times[:ks])), 1),
    "step_us_last10": round(1e6 * float(np.median(step_times[-ks:])), 1),
}), flush=True)

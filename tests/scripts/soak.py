"""Soak: many small collectives and jitted training steps in one job.

Prints one JSON line per rank: how much resident memory (KiB), malloc's
bytes in use, Python's allocated blocks and open file descriptors grew over
each loop, the time per call in the first and
in the second half of each loop (:func:`halves`; state that grows with
every call makes the later calls slower), and whether the results were right: the
collectives' values stay finite and exact (a wrong sum anywhere on the way
shows in the last value), and the training run ends with the parameters of
the same steps computed in one process, the same on every rank.
usage: soak.py [N_COLLECTIVES] [N_STEPS]
"""

import ctypes
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


def rss_kib() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1])
  raise RuntimeError("no VmRSS in /proc/self/status")


class _Mallinfo2(ctypes.Structure):
  _fields_ = [
    (name, ctypes.c_size_t)
    for name in (
      "arena",
      "ordblks",
      "smblks",
      "hblks",
      "hblkhd",
      "usmblks",
      "fsmblks",
      "uordblks",
      "fordblks",
      "keepcost",
    )
  ]


_mallinfo2 = ctypes.CDLL(None).mallinfo2
_mallinfo2.restype = _Mallinfo2


def heap_bytes() -> int:
  """Bytes malloc has handed out and not had back, in every arena (glibc's mallinfo2):
  a leak shows here even where it reuses memory that is resident already."""
  m = _mallinfo2()
  return m.uordblks + m.hblkhd


def usage() -> tuple[int, int, int, int]:
  """(resident KiB, malloc's bytes in use, Python's allocated blocks, open files)."""
  return rss_kib(), heap_bytes(), sys.getallocatedblocks(), fds()


def fds() -> int:
  return len(os.listdir("/proc/self/fd"))


# Rank r holds k + r after k calls: the sum over ranks is n*k + n(n-1)/2, and
# each call turns it back into k + 1 + r. Every value is an integer below
# 2**24, so float32 holds each one exactly, and an error in any call
# carries through to the end.
n, offsets = rt.size, rt.size * (rt.size - 1) / 2
small = jax.jit(lambda x: (mpijax.ops.allreduce(x) - offsets) / n + 1 + rt.rank)
warmup = 200
x = jnp.full(1, float(rt.rank), jnp.float32)
for _ in range(warmup):  # warm up: compile, first-run checks, allocator pools
  x = small(x)
x.block_until_ready()
times = np.empty(n_calls)  # before the count: its own bytes are no leak
before_calls = usage()
for i in range(n_calls):
  t = time.perf_counter()
  x = small(x)
  x.block_until_ready()
  times[i] = time.perf_counter() - t
after_calls = usage()
calls_value = float(np.asarray(x)[0])
calls_ok = calls_value == warmup + n_calls + rt.rank

# SGD with momentum (optimizer state, as Adam has), not Adam: Adam's update
# hardly changes when every gradient is scaled, so a sum where a mean belongs
# would pass the reference check below.
opt = optax.chain(mt.allreduce_gradients(), optax.sgd(1e-2, momentum=0.9))
params = {"w1": jnp.ones((32, 64)) * 0.01, "w2": jnp.ones((64, 1)) * 0.01}
opt_state = opt.init(params)
params0 = params
xb = jnp.ones((16, 32)) * (rt.rank + 1)


def loss_fn(p, xb):
  return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"]) ** 2)


@jax.jit
def step(params, opt_state):
  loss, g = jax.value_and_grad(loss_fn)(params, xb)
  updates, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


for _ in range(10):  # warm up: compile the step, optimizer state buffers
  params, opt_state, loss = step(params, opt_state)
loss.block_until_ready()
step_times = np.empty(n_steps)
before_steps = usage()
for i in range(n_steps):
  t = time.perf_counter()
  params, opt_state, loss = step(params, opt_state)
  loss.block_until_ready()
  step_times[i] = time.perf_counter() - t
after_steps = usage()

# The same steps in this process: every rank's batch is known here, and the
# fused all-reduce gives the mean of the ranks' gradients.
ref_opt = optax.sgd(1e-2, momentum=0.9)


@jax.jit
def ref_step(p, s):
  grads = [jax.grad(loss_fn)(p, jnp.ones((16, 32)) * (r + 1)) for r in range(rt.size)]
  g = jax.tree.map(lambda *gs: sum(gs) / rt.size, *grads)
  updates, s = ref_opt.update(g, s, p)
  return optax.apply_updates(p, updates), s


ref, ref_state = params0, ref_opt.init(params0)
for _ in range(10 + n_steps):
  ref, ref_state = ref_step(ref, ref_state)
leaves = [np.asarray(v) for v in jax.tree.leaves(params)]
finite = all(np.isfinite(v).all() for v in leaves) and bool(np.isfinite(np.asarray(loss)))
matches = all(
  np.allclose(a, np.asarray(b), rtol=1e-4, atol=1e-6) for a, b in zip(leaves, jax.tree.leaves(ref))
)
digest = b"".join(v.tobytes() for v in leaves)
same_everywhere = all(d == digest for d in rt.comm.allgather(digest))


def halves(t: np.ndarray, blocks: int = 5) -> list[float]:
  """µs per call in the first and in the second half: the median of the half's quietest
  stretch (the least of the medians of its ``blocks`` blocks). Other work on the machine
  slows some stretches; state that grows with every call slows every later one."""
  k = len(t) // (2 * blocks)
  medians = np.median(t[: 2 * blocks * k].reshape(2, blocks, k), axis=2)
  return [round(1e6 * float(v), 2) for v in medians.min(axis=1)]


print(
  "SOAK "
  + json.dumps(
    {
      "rank": rt.rank,
      "collectives": n_calls,
      "steps": n_steps,
      # Growth over each loop, measured from after its warm-up.
      **{
        f"{loop}_{what}_growth": b - a
        for loop, before, after in (
          ("calls", before_calls, after_calls),
          ("steps", before_steps, after_steps),
        )
        for what, a, b in zip(("rss_kib", "heap_bytes", "py_blocks", "fd"), before, after)
      },
      "rss_end_mb": round(rss_kib() / 1024, 1),
      "call_us": halves(times),
      "step_us": halves(step_times),
      "calls_value": calls_value,
      "calls_ok": bool(calls_ok),
      "steps_finite": bool(finite),
      "steps_match_reference": bool(matches),
      "steps_same_on_every_rank": bool(same_everywhere),
    }
  ),
  flush=True,
)

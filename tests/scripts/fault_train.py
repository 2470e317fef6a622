"""A small data-parallel training run with checkpoints, for fault injection.

usage: fault_train.py CKPT_DIR OUT.npy
env: FAULT=kill (rank 2 SIGKILLs itself at step 12), FAULT=raise (rank 1
raises inside the jitted step at step 3), unset: train to the end.
Batches depend only on the step number, so a run resumed from a checkpoint
ends with exactly the parameters of an uninterrupted run.
"""

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
import mpijax.train as mt

STEPS, EVERY, GLOBAL_BATCH = 30, 5, 32

rt = mpijax.init()
ckpt_dir, out_path = sys.argv[1], sys.argv[2]
ckpt = os.path.join(ckpt_dir, "state.ckpt")
fault = os.environ.get("FAULT", "")

rng = np.random.default_rng(0)
X = rng.normal(size=(256, 8)).astype(np.float32)
y = X @ np.arange(1, 9, dtype=np.float32) + 0.1 * rng.normal(size=256).astype(np.float32)

opt = optax.chain(mt.allreduce_gradients(), optax.sgd(0.05))
state = {"w": jnp.zeros(8, jnp.float32), "step": 0}
state["opt"] = opt.init(state["w"])
if os.path.exists(ckpt):
  state = mt.restore_checkpoint(ckpt, state)
  print(f"rank {rt.rank}: resumed at step {state['step']}", flush=True)


def _boom(step):
  if rt.rank == 1 and fault == "raise" and int(step) == 3:
    raise RuntimeError("deliberate failure inside the jitted step on rank 1")


@jax.jit
def train_step(w, opt_state, xb, yb, step):
  jax.debug.callback(_boom, step)
  loss, g = jax.value_and_grad(lambda w: jnp.mean((xb @ w - yb) ** 2))(w)
  updates, opt_state = opt.update(g, opt_state, w)
  return optax.apply_updates(w, updates), opt_state, loss


local = GLOBAL_BATCH // rt.size
for step in range(int(state["step"]), STEPS):
  if fault == "kill" and rt.rank == 2 and step == 12:
    print(f"rank 2: SIGKILL at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
  idx = (step * GLOBAL_BATCH + rt.rank * local + np.arange(local)) % len(X)
  w, opt_state, loss = train_step(state["w"], state["opt"], X[idx], y[idx], step)
  state = {"w": w, "step": step + 1, "opt": opt_state}
  if (step + 1) % EVERY == 0:
    mt.save_checkpoint(ckpt, state)
if rt.rank == 0:
  np.save(out_path, np.asarray(state["w"]))
  print(f"finished: loss {float(loss):.5f}", flush=True)

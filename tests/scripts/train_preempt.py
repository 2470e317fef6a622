"""A small restartable DataParallel run for the preemption and resume tests.

usage: train_preempt.py DIR STEPS [PACE_SECONDS]

Resumes from DIR/checkpoints when it has a checkpoint, trains to STEPS steps
(sleeping PACE_SECONDS after each, so a test can signal it mid-run), and
prints on every rank the digest of the final state. Each rank writes its pid
to DIR/pids/<rank> once the preemption handler is installed; rank 0 writes
the number of steps done to DIR/progress after each step.
"""

import hashlib
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
from mpijax import train

directory, steps = sys.argv[1], int(sys.argv[2])
pace = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
rt = mpijax.init()

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype(np.float32)
y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)


def loss_fn(params, batch):
  h = jnp.tanh(batch[0] @ params["w1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], batch[1])


key1, key2 = jax.random.split(jax.random.key(rt.rank))
params = {"w1": jax.random.normal(key1, (8, 16)) * 0.3, "w2": jax.random.normal(key2, (16, 2)) * 0.3}
dp = train.DataParallel(loss_fn, optax.adam(0.01), checkpoint_dir=os.path.join(directory, "checkpoints"),
                        checkpoint_every=1000)
os.makedirs(os.path.join(directory, "pids"), exist_ok=True)
with open(os.path.join(directory, "pids", str(rt.rank)), "w") as f:
  f.write(str(os.getpid()))
state = dp.resume_or_init(params, rng=jax.random.key(1))
if int(state.step):
  print(f"rank {rt.rank}: resumed at step {int(state.step)} (attempt {train.restart_attempt()})", flush=True)

global_batch = 24  # divisible by 1, 2, 3 and 4 ranks
per_epoch = len(train.shard_batches((x, y), global_batch, seed=0, epoch=0))
try:
  while int(state.step) < steps:
    epoch, first = divmod(int(state.step), per_epoch)
    for batch in train.shard_batches((x, y), global_batch, seed=0, epoch=epoch, start_step=first):
      state, _ = dp.step(state, batch)
      done = int(state.step)
      if rt.rank == 0:
        with open(os.path.join(directory, "progress.tmp"), "w") as f:
          f.write(str(done))
        os.replace(os.path.join(directory, "progress.tmp"), os.path.join(directory, "progress"))
      time.sleep(pace)
      if done == steps:
        break
except train.Preempted as e:
  print(f"rank {rt.rank}: preempted after step {e.step}, checkpoint {os.path.basename(e.path)}, "
        f"exit status {e.code}", flush=True)
  raise
leaves = jax.tree_util.tree_leaves((state.step, state.params, state.opt_state))
digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in leaves)).hexdigest()
print(f"rank {rt.rank}: finished at step {int(state.step)}, state sha256 {digest}", flush=True)

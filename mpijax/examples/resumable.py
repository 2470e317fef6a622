"""A restartable data-parallel run: the resume loop of docs/training.md and docs/long-jobs.md, complete.

    mpijax-run -n 4 -- python -m mpijax.examples.resumable                  # starts, or resumes
    mpijax-run -n 4 -- python -m mpijax.examples.resumable --preempt-at 30  # stops after step 30

``DataParallel(checkpoint_dir="ckpt")`` checkpoints every 100 steps and at
every epoch's end; started again, the same program continues from the newest
complete checkpoint at its step, over the same epoch order. ``--preempt-at
STEP`` has the last rank send itself SIGTERM while step STEP runs, as a
scheduler would: every rank finishes that step, the checkpoint of step STEP
is written and the program exits with status 75; run it again without the
option and it resumes at step STEP and finishes the run.
"""

import argparse
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
from mpijax import train

parser = argparse.ArgumentParser(prog="python -m mpijax.examples.resumable")
parser.add_argument("--epochs", type=int, default=5, help="epochs to train (default 5)")
parser.add_argument("--preempt-at", type=int, default=None, metavar="STEP",
                    help="the last rank sends itself SIGTERM during this step: every rank "
                    "stops after it")
args = parser.parse_args()
epochs = args.epochs

rt = mpijax.init()
# What the docs leave to the reader: data (the same on every rank), a model, its loss.
rng = np.random.default_rng(0)
features = rng.normal(size=(4096, 8)).astype(np.float32)
data = (features, (features @ np.arange(1.0, 9.0) > 0).astype(np.int32))
params = {"w": jnp.zeros(8), "b": jnp.zeros(())}


def loss_fn(params, batch):
  xb, yb = batch
  logits = xb @ params["w"] + params["b"]
  return jnp.logaddexp(0.0, logits) - yb * logits  # per-example logistic losses


dp = train.DataParallel(loss_fn, optax.adamw(1e-3), checkpoint_dir="ckpt", checkpoint_every=100)
state = dp.resume_or_init(params, rng=jax.random.key(0))    # newest complete checkpoint, else init
train.log(f"starting at step {int(state.step)}")
steps_per_epoch = len(train.shard_batches(data, 256, seed=0, epoch=0))
start_epoch, start = divmod(int(state.step), steps_per_epoch)  # the data position
for epoch in range(start_epoch, epochs):
  for batch in train.shard_batches(data, 256, seed=0, epoch=epoch,
                                   start_step=start if epoch == start_epoch else 0):
    if int(state.step) + 1 == args.preempt_at and rt.rank == rt.size - 1:
      os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, to one rank: during this step
    state, metrics = dp.step(state, batch)   # checkpoints every 100 steps; stops on preemption
  dp.save(state)
train.log(f"finished at step {int(state.step)}: loss {float(metrics['loss']):.4f}")

"""Data-parallel training with ``mpijax.train.DataParallel``: the README's loop, complete.

    mpijax-run -n 4 -- python -m mpijax.examples.data_parallel [--epochs N]

The loop of the README and docs/training.md with its placeholders filled in:
``loss_fn`` is a logistic regression with an accuracy metric, ``params`` its
zero weights, ``x``/``y`` a linearly separable two-class problem (512 samples,
8 features, the same on every rank). Every epoch rank 0 logs the test
metrics and every rank saves the state to ``ckpt`` (rank 0 writes it). Then
the same model again with the gradients' all-reduce overlapped with the
backward pass (docs/training.md, "Overlapping"). It also stands for the
``train.py`` of docs/launching.md.
"""

import argparse

import jax, optax, mpijax
import jax.numpy as jnp
import numpy as np
from mpijax import train

parser = argparse.ArgumentParser(prog="python -m mpijax.examples.data_parallel")
parser.add_argument("--epochs", type=int, default=10, help="epochs to train (default 10)")
epochs = parser.parse_args().epochs

mpijax.init()

# The README leaves these to the reader: a separable problem, a linear model.
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype(np.float32)
y = (x @ np.arange(1.0, 9.0) > 0).astype(np.int32)
x_test, y_test = x[:256], y[:256]
params = {"w": jnp.zeros(8), "b": jnp.zeros(())}


def logistic(params, batch):
  """Per-example logistic losses of this rank's batch, and per-example accuracy."""
  xb, yb = batch
  logits = xb @ params["w"] + params["b"]
  losses = jnp.logaddexp(0.0, logits) - yb * logits
  return losses, {"accuracy": ((logits > 0) == (yb == 1)).astype(jnp.float32)}


loss_fn = logistic


dp = train.DataParallel(loss_fn, optax.adamw(1e-3), has_aux=True)   # loss_fn(params, batch) -> per-example losses[, aux]
state = dp.init(params, rng=jax.random.key(0))                      # broadcasts rank 0's params
for epoch in range(epochs):
  for batch in train.progress(train.shard_batches((x, y), 256, seed=0, epoch=epoch)):
    state, metrics = dp.step(state, batch)                          # one jitted step, one fused all-reduce
  train.log(epoch, dp.evaluate(state, (x_test, y_test), batch_size=512))
  train.save_checkpoint("train.ckpt", {"state": state, "epoch": epoch + 1})

# The same model with the gradients' all-reduce overlapped with the backward
# pass: in an optax chain of your own jitted step, and in DataParallel.
def loss_fn(params, batch):  # the per-example losses only (has_aux=False)
  return logistic(params, batch)[0]


tx = optax.chain(train.allreduce_gradients(overlap=True), optax.adam(1e-3))
dp = train.DataParallel(loss_fn, optax.adam(1e-3), overlap=True, bucket_bytes=8 << 20)


@jax.jit
def own_step(params, opt_state, batch):
  grads = jax.grad(lambda p: jnp.mean(batch.weight * loss_fn(p, batch.data)))(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


own, opt_state = train.broadcast(params), tx.init(params)
state = dp.init(params, rng=jax.random.key(0))
for batch in train.shard_batches((x, y), 256, seed=0, epoch=0):
  own, opt_state = own_step(own, opt_state, batch)
  state, metrics = dp.step(state, batch)
train.log("overlapped:", dp.evaluate(state, (x_test, y_test), batch_size=512))

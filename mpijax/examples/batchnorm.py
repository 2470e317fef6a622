"""BatchNorm in data-parallel training, Flax linen and NNX: docs/training.md's code, complete.

    mpijax-run -n 4 -- python -m mpijax.examples.batchnorm

Both of docs/training.md's model-state examples with their ``...`` filled
in: a linen CNN whose BatchNorm statistics are those of the global batch
(SyncBatchNorm through ``DataParallel(axis_name="batch")``), then an NNX
model the same way, each trained for one epoch on scikit-learn's 8x8 digits;
rank 0 logs the test metrics of each.
"""

import jax
import jax.numpy as jnp
import optax

import mpijax
from mpijax import train
from mpijax.examples.digits import load_data

mpijax.init()
x, y, x_test, y_test = load_data()  # (N, 8, 8, 1) images in [0, 1], labels 0..9
eval_batch = 360  # the 359 test images in one padded batch, divisible by 1 to 4 ranks

import flax.linen as nn

class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(32, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)   # SyncBatchNorm
    x = nn.relu(x).reshape((x.shape[0], -1))
    return nn.Dense(10)(x)


model = CNN()

def loss_fn(params, model_state, batch):
  x, y = batch
  logits, new_state = model.apply({"params": params, **model_state}, x, train=True,
                                  mutable=["batch_stats"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, y), new_state

def eval_fn(params, model_state, batch):                # running averages, no new state
  x, y = batch
  logits = model.apply({"params": params, **model_state}, x, train=False)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)

dp = train.DataParallel(loss_fn, optax.adamw(1e-3), axis_name="batch", eval_fn=eval_fn)
variables = model.init(jax.random.key(0), x[:1], train=False)
state = dp.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})

for batch in train.shard_batches((x, y), 64, seed=0, epoch=0):
  state, metrics = dp.step(state, batch)
train.log("linen, SyncBatchNorm:", dp.evaluate(state, (x_test, y_test), batch_size=eval_batch))

from flax import nnx


class NNXCNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 32, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(32, axis_name="batch", rngs=rngs)
    self.out = nnx.Linear(8 * 8 * 32, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    return self.out(x.reshape((x.shape[0], -1)))


model = NNXCNN(nnx.Rngs(0))
graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

def loss_fn(params, stats, batch):
  x, y = batch
  m = nnx.merge(graphdef, params, stats, copy=True)
  losses = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
  return losses, nnx.state(m, nnx.BatchStat)

dp = train.DataParallel(loss_fn, optax.sgd(0.1), axis_name="batch")
state = dp.init(params, model_state=stats)

for batch in train.shard_batches((x, y), 64, seed=0, epoch=0):
  state, metrics = dp.step(state, batch)
train.log("NNX, SyncBatchNorm: train loss of the last step", float(jnp.mean(metrics["loss"])))

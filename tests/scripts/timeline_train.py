"""A few DataParallel steps; prints the digest of the final state on every rank.

usage: timeline_train.py STEPS   (MPIJAX_TIMELINE decides whether a timeline is written)
"""

import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
from mpijax import train

steps = int(sys.argv[1])
rt = mpijax.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype(np.float32)
y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)


def loss_fn(params, batch):
  h = jnp.tanh(batch[0] @ params["w1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], batch[1])


key1, key2 = jax.random.split(jax.random.key(0))
params = {"w1": jax.random.normal(key1, (8, 16)) * 0.3, "w2": jax.random.normal(key2, (16, 2)) * 0.3}
dp = train.DataParallel(loss_fn, optax.adam(0.01))
state = dp.init(params)
batches = list(train.shard_batches((x, y), 24, seed=0, epoch=0))
for i in range(steps):
  state, _ = dp.step(state, batches[i % len(batches)])
leaves = jax.tree_util.tree_leaves((state.step, state.params, state.opt_state))
digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in leaves)).hexdigest()
print(f"rank {rt.rank}: state sha256 {digest}", flush=True)

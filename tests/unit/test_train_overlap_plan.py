"""The overlapped all-reduce's buckets and the order the backward pass completes gradients (no MPI)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpijax._src.train.gradients import gradient_ready_order
from mpijax._src.train.gradients import plan_overlap


def test_buckets_are_runs_of_the_ready_order_up_to_bucket_bytes():
  leaves = [((100,), np.float32), ((10,), np.float32), ((0,), np.float32), ((300,), np.float32),
            ((20,), np.int32), ((50,), np.float32)]
  # 400 + 40 fit 500; the empty leaf is skipped; 1200 B is a bucket of its own.
  assert plan_overlap(leaves, [0, 1, 2, 3, 4, 5], bucket_bytes=500) == [[0, 1], [3], [4, 5]]
  assert plan_overlap(leaves, [5, 4, 3, 2, 1, 0], bucket_bytes=500) == [[5, 4], [3], [1, 0]]
  assert plan_overlap(leaves, [5, 4, 3, 2, 1, 0], bucket_bytes=1 << 20) == [[5, 4, 3, 1, 0]]


def _paths(tree, order):
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(leaves[i][0]) for i in order]


def test_ready_order_is_the_reverse_of_first_reads_not_of_the_tree():
  params = {f"layer{i}": {"w": jnp.ones((3, 3)), "b": jnp.ones(3)} for i in (0, 1, 2, 10)}
  params["unused"] = jnp.ones(2)

  def loss(p):
    h = jnp.ones((2, 3))
    for i in (0, 1, 2, 10):
      h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return h.sum()

  want = ["['unused']"] + [f"['layer{i}']['{k}']" for i in (10, 2, 1, 0) for k in ("b", "w")]
  assert _paths(params, gradient_ready_order(loss, params)) == want

  # Layers in nested jits and under jax.checkpoint: the order inside them counts.
  @jax.jit
  def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])

  def loss2(p):
    h = jnp.ones((2, 3))
    for i in (0, 1, 2, 10):
      h = jax.checkpoint(layer)(p[f"layer{i}"], h)
    return h.sum()

  assert _paths(params, gradient_ready_order(loss2, params)) == want


def test_a_weight_read_first_and_last_is_ready_last():
  # Tied embedding: read by the first layer and again by the output layer.
  params = {"emb": jnp.ones((4, 3)), "mid": jnp.ones((3, 3))}

  def loss(p):
    h = p["emb"][jnp.array([0, 1])] @ p["mid"]
    return (h @ p["emb"].T).sum()

  assert _paths(params, gradient_ready_order(loss, params)) == ["['mid']", "['emb']"]

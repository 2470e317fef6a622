"""The overlapped gradient all-reduce: one call per bucket, in backward order, same bits.

Every assertion holds at any rank count (4 x 1 device, 2 x 2 devices, 3 ranks, 1 rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

try:
  from jax.extend.core import jaxprs_in_params
except ImportError:  # JAX < 0.10 exports it only from its internals
  from jax._src.core import jaxprs_in_params

import flax.linen as nn

from mpijax import train
from mpijax._src import mpi_util

D, LAYERS = 24, 6  # 24 x 24 float32 weights: 2304 B each


def mlp_params(seed=0):
  rng = np.random.default_rng(seed)
  # Keys that sort out of layer order ("l10" < "l2"), as Flax's "Dense_10" do.
  return {f"l{i}": {"w": jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.float32),
                    "b": jnp.asarray(rng.normal(size=(D,)) * 0.1, jnp.float32)}
          for i in (0, 1, 2, 10, 11, 12)[:LAYERS]}


ORDER = (0, 1, 2, 10, 11, 12)[:LAYERS]


def mlp_loss(params, x, y):
  h = x
  for i in ORDER:
    h = jnp.tanh(h @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"])
  return jnp.mean((h - y) ** 2)


def data(rank, n=8):
  rng = np.random.default_rng(100 + rank)
  return (rng.normal(size=(n, D)).astype(np.float32), rng.normal(size=(n, D)).astype(np.float32))


def assert_bits_equal(a, b):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def _allreduce_eqns(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "mpijax_allreduce_many":
      found.append(eqn)
    for sub in jaxprs_in_params(eqn.params):
      found += _allreduce_eqns(sub)
  return found


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_overlapped_steps_equal_one_call_bit_for_bit(rt, compression):
  x, y = data(rt.rank)
  results = {}
  for overlap in (False, True):
    # ~2 layers per bucket when overlapped; one call for all of them otherwise.
    tx = optax.chain(train.allreduce_gradients(overlap=overlap, bucket_bytes=5000,
                                               compression=compression), optax.adam(1e-2))
    params = train.broadcast(mlp_params())
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
      grads = jax.grad(mlp_loss)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    for _ in range(3):
      params, opt_state = step(params, opt_state)
    results[overlap] = params
  assert_bits_equal(results[True], results[False])
  assert not np.array_equal(np.asarray(results[True]["l0"]["w"]), np.asarray(mlp_params()["l0"]["w"]))


def test_overlapped_buckets_follow_the_reverse_tree_order(rt):
  grads = mlp_params()
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  # Weights (2304 B) alone, biases (96 B) packed; buckets of at most 5000 B.
  closed = jax.make_jaxpr(lambda g: train.fused_allreduce(
      g, overlap=True, bucket_bytes=5000, fuse_leaf_bytes=1000))(grads)
  eqns = _allreduce_eqns(closed.jaxpr)
  if rt.size == 1:
    assert eqns == []  # nothing to send
    return
  # A weight travels as it is: the call's operand is the function's input.
  name = dict(zip(closed.jaxpr.invars, paths))
  calls = [[name[v] for v in e.invars if v in name] for e in eqns]
  # Tree order sorts "l10" before "l2"; the buckets go the other way round.
  assert calls == [["['l2']['w']", "['l12']['w']"], ["['l11']['w']", "['l10']['w']"],
                   ["['l1']['w']", "['l0']['w']"]]
  assert [len(e.invars) for e in eqns] == [3, 3, 3]  # and the two biases, packed into one


def test_overlap_under_local_devices_equals_one_call_bit_for_bit(rt):
  """P ranks x L local devices (shard_map over the local devices): the same bits both ways."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P
  local = rt.local_devices
  mesh = Mesh(np.array(local), ("local",))
  x, y = data(rt.rank, n=4 * len(local))
  results = {}
  for overlap in (False, True):
    tx = optax.chain(train.allreduce_gradients(local_axis_name="local", overlap=overlap,
                                               bucket_bytes=5000), optax.sgd(0.1, momentum=0.9))

    def local_step(params, opt_state, x, y):
      grads = jax.grad(mlp_loss)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("local"), P("local")),
                                 out_specs=(P(), P()), check_vma=False))
    params = train.broadcast(mlp_params())
    opt_state = tx.init(params)
    for _ in range(3):
      params, opt_state = step(params, opt_state, x, y)
    results[overlap] = params
  assert_bits_equal(results[True], results[False])


# --- DataParallel: model state and the stop flag ride in the first bucket --------------

class BNNet(nn.Module):
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    for _ in range(3):
      x = nn.Dense(D, use_bias=False)(x)
      x = nn.tanh(nn.BatchNorm(use_running_average=not train, momentum=0.8,
                               axis_name=self.axis_name)(x))
    return nn.Dense(4)(x)


def bn_loss(model):
  def loss_fn(params, model_state, batch):
    x, y = batch
    logits, new = model.apply({"params": params, **model_state}, x, train=True,
                              mutable=["batch_stats"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return (losses, {"acc": (jnp.argmax(logits, -1) == y).astype(jnp.float32)}), new
  return loss_fn


def bn_batches(rank, size, steps=4):
  rng = np.random.default_rng(7)
  x = rng.normal(size=(16 * size * steps, D)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
  return list(train.shard_batches((x, y), 16 * size, seed=1, epoch=0))[:steps]


@pytest.fixture
def shared_dir(rt, tmp_path):
  return mpi_util.bcast_str(rt.comm, str(tmp_path) if rt.rank == 0 else None, 0)


@pytest.mark.parametrize("axis_name", [None, "batch"], ids=["mean-state", "sync-state"])
def test_data_parallel_overlap_equals_one_call_bit_for_bit(rt, shared_dir, axis_name):
  model = BNNet(axis_name)
  v = model.init(jax.random.key(0), jnp.zeros((1, D)), train=False)
  got = {}
  for overlap in (False, True):
    dp = train.DataParallel(bn_loss(model), optax.adam(1e-2), has_aux=True, axis_name=axis_name,
                            overlap=overlap, bucket_bytes=3000,
                            checkpoint_dir=f"{shared_dir}/{overlap}", handle_preemption=True)
    state = dp.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
    history = []
    try:
      for batch in bn_batches(rt.rank, rt.size):
        state, metrics = dp.step(state, batch)
        history.append(jax.tree_util.tree_map(np.asarray, metrics))
    finally:
      train.uninstall_preemption_handler()
    got[overlap] = (state.params, state.model_state, history)
  assert_bits_equal(got[True], got[False])
  assert len(got[True][2]) == 4


def test_data_parallel_overlap_stops_every_rank_at_the_same_step(rt, shared_dir):
  model = BNNet()
  v = model.init(jax.random.key(0), jnp.zeros((1, D)), train=False)
  dp = train.DataParallel(bn_loss(model), optax.sgd(0.1), has_aux=True, overlap=True,
                          bucket_bytes=3000, checkpoint_dir=shared_dir)
  state = dp.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  stopped = None
  try:
    for i, batch in enumerate(bn_batches(rt.rank, rt.size)):
      if i == 1 and rt.rank == rt.size - 1:
        train.request_preemption()  # on one rank only: its flag rides in the first bucket
      state, _ = dp.step(state, batch)
  except train.Preempted as e:
    stopped = e
  finally:
    train.uninstall_preemption_handler()
  assert stopped is not None
  assert mpi_util.allgather_int(rt.comm, stopped.step) == [2] * rt.size

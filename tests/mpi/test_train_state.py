"""Model state (BatchNorm), aux pytrees, checkpoint directories and preemption in mpijax.train.

Every value is checked against a single-process reference computed on the
global batch; every assertion holds at any rank count.
"""

from __future__ import annotations

import hashlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpijax
from mpijax import train
from mpijax._src import mpi_util

N, D, H, C = 44, 5, 6, 3  # 44 samples: the last global batch is padded at every rank count
STEPS = 4


def dataset():
  rng = np.random.default_rng(5)
  x = (rng.normal(size=(N, D)) * 2 + 1).astype(np.float32)
  y = ((x[:, 0] > 1).astype(np.int32) + (x[:, 1] > 2)).astype(np.int32)
  return x, y


def global_batch(ranks):
  return -(-12 // ranks) * ranks


def batches(ranks, rank=None, epochs=1):
  """(epoch, Batch) of this rank (or of `rank` of `ranks`), STEPS of them at most per epoch."""
  out = []
  for epoch in range(epochs):
    kw = {} if rank is None else dict(process_index=rank, process_count=ranks)
    out += list(train.shard_batches(dataset(), global_batch(ranks), seed=3, epoch=epoch, **kw))[:STEPS]
  return out


class Net(nn.Module):
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Dense(H, use_bias=False)(x)  # BatchNorm takes out any bias: its gradient is noise
    h = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(h)
    return nn.Dense(C)(nn.tanh(h))


def linen_loss(model):
  def loss_fn(params, model_state, batch):
    x, y = batch
    logits, new = model.apply({"params": params, **model_state}, x, train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), new
  return loss_fn


def fresh_variables():
  return Net().init(jax.random.key(0), jnp.zeros((1, D)), train=False)


def weighted_step(apply_fn, tx):
  """One plain (no MPI) step on one batch: returns (params, opt_state, model_state, loss)."""
  def step(params, opt_state, model_state, x, y, w):
    def objective(p):
      losses, new = apply_fn(p, model_state, (x, y))
      return jnp.mean(w * losses), new
    (loss, new), grads = jax.value_and_grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, new, loss
  return jax.jit(step)


def assert_close(a, b, **tol):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path), **tol)


def _bytes(x):
  if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x).tobytes()


def digest(tree):
  return hashlib.sha256(b"".join(_bytes(x) for x in jax.tree_util.tree_leaves(tree))).hexdigest()


def assert_same_on_all_ranks(comm, tree):
  assert len(set(mpi_util.allgather_str(comm, digest(tree)))) == 1


@pytest.fixture
def shared_dir(rt, tmp_path):
  return mpi_util.bcast_str(rt.comm, str(tmp_path) if rt.rank == 0 else None, 0)


# --- 'sync': statistics of the global batch ---------------------------------------------

def test_sync_batchnorm_equals_one_process_on_the_global_batch(rt):
  tx = optax.sgd(0.1, momentum=0.9)
  v = fresh_variables()
  dp = train.DataParallel(linen_loss(Net("batch")), tx, axis_name="batch")  # state_sync="sync"
  state = dp.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  losses = []
  for batch in batches(rt.size, epochs=2):
    state, metrics = dp.step(state, batch)
    losses.append(float(metrics["loss"]))
  # The reference: one process, the whole global batch, no axis, no MPI.
  step = weighted_step(linen_loss(Net()), tx)
  params, opt_state, ms = v["params"], tx.init(v["params"]), {"batch_stats": v["batch_stats"]}
  ref_losses = []
  for batch in _global_batches(rt.size):
    params, opt_state, ms, loss = step(params, opt_state, ms, *batch.data, batch.weight)
    ref_losses.append(float(loss))
  assert_close(state.params, params, rtol=2e-5, atol=2e-6)
  assert_close(state.model_state, ms, rtol=2e-5, atol=2e-6)  # the running averages too
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  assert_same_on_all_ranks(rt.comm, (state.params, state.model_state))
  # evaluate() with the running averages (eval_fn) equals the reference model's.
  x, y = dataset()
  model = Net("batch")
  ev_fn = lambda p, s, b: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({"params": p, **s}, b[0], train=False), b[1])
  dp_eval = train.DataParallel(linen_loss(model), tx, axis_name="batch", eval_fn=ev_fn)
  got = dp_eval.evaluate(state, (x, y), batch_size=-(-N // rt.size) * rt.size)
  want = optax.softmax_cross_entropy_with_integer_labels(
      Net().apply({"params": params, **ms}, x, train=False), y).mean()
  np.testing.assert_allclose(got["loss"], float(want), rtol=2e-5)


def _global_batches(ranks):
  """The global batches (one process' view) that `ranks` ranks train on, in order."""
  out = []
  for epoch in range(2):
    it = train.shard_batches(dataset(), global_batch(ranks), seed=3, epoch=epoch,
                             process_index=0, process_count=1)
    out += list(it)[:STEPS]
  return out


class NnxNet(nnx.Module):
  def __init__(self, axis_name, rngs):
    self.l1 = nnx.Linear(D, H, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(H, momentum=0.8, axis_name=axis_name, rngs=rngs)
    self.l2 = nnx.Linear(H, C, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.bn(self.l1(x))))


def nnx_loss(graphdef):
  def loss_fn(params, stats, batch):
    x, y = batch
    model = nnx.merge(graphdef, params, stats, copy=True)  # fresh Variables at this trace level
    losses = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
    return losses, nnx.state(model, nnx.BatchStat)
  return loss_fn


def test_nnx_batch_stats_sync_equals_one_process(rt):
  tx = optax.sgd(0.2)
  graphdef, params, stats = nnx.split(NnxNet("batch", nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
  dp = train.DataParallel(nnx_loss(graphdef), tx, axis_name="batch")
  state = dp.init(params, model_state=stats)
  for batch in batches(rt.size, epochs=2):
    state, _ = dp.step(state, batch)
  ref_def, ref_params, ref_stats = nnx.split(NnxNet(None, nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
  step = weighted_step(nnx_loss(ref_def), tx)
  opt_state = tx.init(ref_params)
  for batch in _global_batches(rt.size):
    ref_params, opt_state, ref_stats, _ = step(ref_params, opt_state, ref_stats, *batch.data, batch.weight)
  assert_close(state.params, ref_params, rtol=2e-5, atol=2e-6)
  assert_close(state.model_state, ref_stats, rtol=2e-5, atol=2e-6)
  assert_same_on_all_ranks(rt.comm, state.model_state)


# --- 'mean': local statistics, running averages averaged ---------------------------------

def test_mean_policy_local_statistics_and_averaged_running_averages(rt):
  tx = optax.sgd(0.3)
  v = fresh_variables()
  dp = train.DataParallel(linen_loss(Net()), tx, state_sync={"batch_stats": "mean"})
  state = dp.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  for batch in batches(rt.size):
    state, _ = dp.step(state, batch)
  # The reference, in one process: every rank's slice of each global batch
  # normalized with its own statistics; gradients and new running averages
  # averaged over the ranks.
  loss_fn = linen_loss(Net())

  def rank_grad(p, ms, x, y, w):
    def objective(p):
      losses, new = loss_fn(p, ms, (x, y))
      return jnp.mean(w * losses), new
    return jax.grad(objective, has_aux=True)(p)

  rank_grad = jax.jit(rank_grad)
  params, opt_state, ms = v["params"], tx.init(v["params"]), {"batch_stats": v["batch_stats"]}
  per_rank = [batches(rt.size, rank=r) for r in range(rt.size)]
  for s in range(len(per_rank[0])):
    outs = [rank_grad(params, ms, *per_rank[r][s].data, per_rank[r][s].weight) for r in range(rt.size)]
    grads = jax.tree.map(lambda *g: sum(g) / rt.size, *[o[0] for o in outs])
    ms = jax.tree.map(lambda *m: sum(m) / rt.size, *[o[1] for o in outs])
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  assert_close(state.params, params, rtol=2e-5, atol=2e-6)
  assert_close(state.model_state, ms, rtol=2e-5, atol=2e-6)
  assert_same_on_all_ranks(rt.comm, state.model_state)


def test_state_policies_are_checked(rt):
  v = fresh_variables()
  with pytest.raises(ValueError, match=r"state_sync='sync'\) needs axis_name"):
    train.DataParallel(linen_loss(Net()), optax.sgd(0.1), state_sync="sync")
  with pytest.raises(ValueError, match=r"'local' is not a policy"):
    train.DataParallel(linen_loss(Net()), optax.sgd(0.1), state_sync={"batch_stats": "local"})
  # A 'sync' model whose BatchNorm does not name the axis would drift apart: every rank raises.
  dp = train.DataParallel(linen_loss(Net()), optax.sgd(0.1), axis_name="batch")
  state = dp.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  with pytest.raises(Exception, match=r"made no collective over axis 'batch'"):
    dp.step(state, batches(rt.size)[0])
  dp = train.DataParallel(linen_loss(Net()), optax.sgd(0.1), state_sync={"other": "mean"})
  state = dp.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  with pytest.raises(Exception, match=r"no policy for the model state collection\(s\) \['batch_stats'\]"):
    dp.step(state, batches(rt.size)[0])


# --- aux: any pytree -----------------------------------------------------------------

def test_aux_pytree_per_example_and_per_batch(rt):
  w = {"w": jnp.zeros((D, C))}

  def loss_fn(params, batch):
    x, y = batch
    losses = optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y)
    # per example: x0 of every sample; per batch: this rank's batch max of x0 and a vector
    return losses, ({"x0": x[:, 0]}, jnp.max(x[:, 0]), jnp.arange(2.0) + jnp.sum(x[:, 1] > 2))

  dp = train.DataParallel(loss_fn, optax.sgd(0.0), has_aux=True)
  state = dp.init(w)
  last = batches(rt.size)[-1]
  _, metrics = dp.step(state, last)
  per_example, batch_max, vec = metrics["aux"]
  # Weighted mean over the real samples of the global batch.
  everything = [batches(rt.size, rank=r)[-1] for r in range(rt.size)]
  x0 = np.concatenate([b.data[0][:, 0] for b in everything])
  mask = np.concatenate([b.mask for b in everything])
  np.testing.assert_allclose(float(per_example["x0"]), x0[mask > 0].mean(), rtol=1e-5)
  # Per-batch values: the mean over ranks.
  np.testing.assert_allclose(float(batch_max), np.mean([b.data[0][:, 0].max() for b in everything]),
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(vec), np.arange(2.0) + np.mean(
      [np.sum(b.data[0][:, 1] > 2) for b in everything]), rtol=1e-5)
  x, y = dataset()
  ev = dp.evaluate(state, (x, y), batch_size=4 * rt.size)
  np.testing.assert_allclose(ev["aux"][0]["x0"], x[:, 0].mean(), rtol=1e-5)


# --- checkpoint directories, resume ---------------------------------------------------------

def _run(dp, state, start, stop):
  """Steps start..stop-1 of the epoch schedule (position = state.step)."""
  per_epoch = len(train.shard_batches(dataset(), global_batch(mpijax.process_count()), seed=3, epoch=0))
  while start < stop:
    epoch, first = divmod(start, per_epoch)
    for batch in train.shard_batches(dataset(), global_batch(mpijax.process_count()), seed=3,
                                     epoch=epoch, start_step=first):
      state, _ = dp.step(state, batch)
      start += 1
      if start == stop:
        break
  return state


def test_resume_from_checkpoint_directory_is_bit_for_bit_with_model_state(rt, shared_dir):
  v = fresh_variables()
  ms = {"batch_stats": v["batch_stats"]}

  def make(directory, every):
    return train.DataParallel(linen_loss(Net("batch")), optax.adamw(0.02), axis_name="batch",
                              checkpoint_dir=directory, checkpoint_every=every, keep_checkpoints=2,
                              checkpoint_metadata=lambda: {"note": "x"})

  full_dir, part_dir = os.path.join(shared_dir, "full"), os.path.join(shared_dir, "part")
  dp = make(full_dir, 100)
  full = _run(dp, dp.resume_or_init(v["params"], model_state=ms), 0, 7)
  # A run that dies after step 5 (checkpoints at steps 2 and 4), then a new process resumes.
  dp = make(part_dir, 2)
  _run(dp, dp.resume_or_init(v["params"], model_state=ms), 0, 5)
  assert [s for s, _ in train.list_checkpoints(part_dir)] == [2, 4]
  dp = make(part_dir, 2)
  resumed = dp.resume_or_init(v["params"], model_state=ms)
  assert int(resumed.step) == 4
  assert train.checkpoint_metadata(train.latest_checkpoint(part_dir)) == {"step": 4, "note": "x"}
  resumed = _run(dp, resumed, 4, 7)
  assert digest(full) == digest(resumed)  # step, params, adam state, key, batch_stats
  assert [s for s, _ in train.list_checkpoints(part_dir)] == [4, 6]
  uninstall()


def test_resume_skips_a_corrupt_newest_checkpoint_on_every_rank(rt, shared_dir):
  tree = lambda v: {"w": jnp.full(3, float(v)), "step": v}
  train.save_step_checkpoint(shared_dir, tree(1), 1)
  train.save_step_checkpoint(shared_dir, tree(2), 2)
  if rt.rank == 0:
    with open(train.checkpoint_path(shared_dir, 2), "r+b") as f:
      f.truncate(40)
  rt.comm.Barrier()
  assert train.resume_or_init(shared_dir, lambda: tree(0))["step"] == 1
  # Another model's checkpoint is an error, not skipped.
  with pytest.raises(train.CheckpointMismatch, match="does not fit the target tree"):
    train.resume_or_init(shared_dir, lambda: {"v": jnp.zeros(2)})
  assert train.resume_or_init(os.path.join(shared_dir, "none"), lambda: tree(0))["step"] == 0


# --- preemption: every rank stops after the same step --------------------------------------

def uninstall():
  train.uninstall_preemption_handler()  # also forgets requests: the next test starts clean


def test_one_rank_requesting_preemption_stops_every_rank_at_the_same_step(rt, shared_dir):
  v = fresh_variables()
  dp = train.DataParallel(linen_loss(Net("batch")), optax.sgd(0.1), axis_name="batch",
                          checkpoint_dir=shared_dir)
  state = dp.resume_or_init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  stopped = None
  try:
    for i, batch in enumerate(batches(rt.size, epochs=2)):
      if i == 2 and rt.rank == rt.size - 1:
        train.request_preemption()  # as SIGUSR1 does, on one rank only
      state, _ = dp.step(state, batch)
  except train.Preempted as e:
    stopped = e
  finally:
    uninstall()
  assert stopped is not None and stopped.code == train.PREEMPTED_EXIT_CODE == 75
  # The flag of the step taken with it (step 3) stops every rank before step 4.
  assert mpi_util.allgather_int(rt.comm, stopped.step) == [3] * rt.size
  assert train.list_checkpoints(shared_dir) == [(3, stopped.path)]
  restored = train.resume_or_init(shared_dir, lambda: state)
  assert int(restored.step) == 3 and digest(restored) == digest(state)


def test_stop_requested_is_collective(rt):
  try:
    assert not train.stop_requested()
    if rt.rank == 0:
      train.request_preemption()
    assert train.stop_requested()  # on every rank
  finally:
    uninstall()

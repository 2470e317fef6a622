"""mpijax.train across ranks: broadcast, fused all-reduce, equivalence, uneven data, checkpoints.

Every assertion holds at any rank count (4 x 1 device, 2 x 2 devices, 3 ranks, 1 rank).
"""

from __future__ import annotations

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

try:
  from jax.extend.core import jaxprs_in_params
except ImportError:  # JAX < 0.10 exports it only from its internals
  from jax._src.core import jaxprs_in_params

import mpijax
from mpijax import train
from mpijax._src import mpi_util

# --- a tiny model and dataset shared by the tests -----------------------------

N, D, H, C = 48, 6, 8, 3


def dataset():
  rng = np.random.default_rng(123)
  x = rng.normal(size=(N, D)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
  return x, y


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {"l1": {"w": jax.random.normal(k1, (D, H)) * 0.5, "b": jnp.zeros(H)},
          "l2": {"w": jax.random.normal(k2, (H, C)) * 0.5, "b": jnp.zeros(C)}}


def per_example_loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["l2"]["w"] + params["l2"]["b"], y)


def weighted_loss(params, batch, weight):
  return jnp.mean(weight * per_example_loss(params, batch))


def reference_params(steps, global_batch, optimizer, seed=0):
  """The same training on one process over the whole global batch, no MPI."""
  params = init_params(jax.random.key(seed))
  opt_state = optimizer.init(params)
  step = jax.jit(lambda p, s, b, w: _sgd_step(p, s, b, w, optimizer))
  done, epoch = 0, 0
  while done < steps:
    for batch in train.shard_batches(dataset(), global_batch, seed=7, epoch=epoch,
                                     process_index=0, process_count=1):
      if done == steps:
        break
      params, opt_state = step(params, opt_state, batch.data, batch.weight)
      done += 1
    epoch += 1
  return params


def _sgd_step(params, opt_state, batch, weight, tx):
  grads = jax.grad(weighted_loss)(params, batch, weight)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def batch_size(at_least, ranks):
  """The smallest global batch of at least `at_least` that `ranks` divide
  (shard_batches requires it), so the tests run at any rank count."""
  return -(-at_least // ranks) * ranks


def assert_trees_close(a, b, **tol):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path), **tol)


def assert_same_on_all_ranks(comm, tree):
  digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree))).hexdigest()
  assert len(set(mpi_util.allgather_str(comm, digest))) == 1


@pytest.fixture
def shared_dir(rt, tmp_path):
  """A directory every rank sees (rank 0's tmp_path; one machine)."""
  return mpi_util.bcast_str(rt.comm, str(tmp_path) if rt.rank == 0 else None, 0)


# --- broadcast ----------------------------------------------------------------

def _tree(value):
  return {"f32": jnp.full((3, 2), value, jnp.float32), "bf16": jnp.full(4, value, jnp.bfloat16),
          "i8": np.full(2, value, np.int8), "key": jax.random.key(value), "n": int(value),
          "empty": jnp.zeros((0, 3)), "np_scalar": np.int16(value)}


def test_broadcast_any_pytree_and_dtypes(rt):
  root = rt.size - 1
  out = train.broadcast(_tree(rt.rank + 1), root=root)
  want = _tree(root + 1)
  assert out["n"] == want["n"] and type(out["n"]) is int
  assert out["bf16"].dtype == jnp.bfloat16 and isinstance(out["i8"], np.ndarray)
  assert type(out["np_scalar"]) is np.int16 and out["np_scalar"] == root + 1
  np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(want["key"]))
  for k in ("f32", "bf16", "i8", "empty"):
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(want[k]))


def test_broadcast_structure_mismatch_raises_everywhere(rt):
  tree = _tree(0)
  if rt.rank == rt.size - 1 and rt.size > 1:
    tree["f32"] = jnp.zeros((3, 3))
  if rt.size == 1:
    assert train.broadcast(tree)["n"] == 0
    return
  with pytest.raises(ValueError, match=r"\['f32'\].*float32\[3, 3\].*float32\[3, 2\]"):
    train.broadcast(tree, root=0)


def test_unsendable_leaf_on_one_rank_raises_everywhere(rt):
  # The bad rank used to raise alone, before the Bcast the others waited in.
  bad = rt.size - 1
  tree = {"w": jnp.ones(2), "name": "adam" if rt.rank == bad else 0}
  with pytest.raises(ValueError, match=rf"rank {bad}: leaf \['name'\]: cannot store a leaf of type str"):
    train.broadcast(tree)


# --- fused all-reduce ---------------------------------------------------------

def _allreduce_eqns(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    if "allreduce" in eqn.primitive.name:
      found.append(eqn)
    for sub in jaxprs_in_params(eqn.params):
      found += _allreduce_eqns(sub)
  return found


def test_one_allreduce_per_bucket_not_per_leaf(rt):
  grads = {f"w{i}": jnp.full((10,), float(rt.rank + i), jnp.float32) for i in range(12)}
  grads["int"] = jnp.full(3, rt.rank, jnp.int32)
  tx = train.allreduce_gradients(bucket_bytes=200)  # 5 float leaves (200 bytes) per bucket
  jaxpr = jax.make_jaxpr(lambda g: tx.update(g, tx.init(g))[0])(grads).jaxpr
  # ceil(12 / 5) float32 buckets + one int32 bucket, all in one call (one MPI
  # all-reduce per operand); one rank sends nothing.
  eqns = _allreduce_eqns(jaxpr)
  if rt.size == 1:
    assert eqns == []
  else:
    assert [e.primitive.name for e in eqns] == ["mpijax_allreduce_many"]
    assert sorted(v.aval.size for v in eqns[0].invars) == [3, 20, 50, 50]
  out = jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads)
  mean_rank = (rt.size - 1) / 2
  for i in range(12):
    np.testing.assert_allclose(out[f"w{i}"], mean_rank + i, rtol=1e-6)
  assert out["w0"].dtype == jnp.float32


@pytest.mark.parametrize("compression,rtol", [("bf16", 1e-2), ("fp16", 2e-3)])
def test_compression_restores_dtype_and_is_close(rt, compression, rtol):
  rng = np.random.default_rng(rt.rank)
  grads = {"a": jnp.asarray(rng.normal(size=(50,)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=(4, 5)) * 100, jnp.float32)}
  tx = optax.chain(train.allreduce_gradients(compression=compression), optax.sgd(1.0))
  out = jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads)
  exact = jax.tree_util.tree_map(
      lambda *xs: -np.mean(xs, axis=0),
      *[{"a": np.random.default_rng(r).normal(size=(50,)),
         "b": np.random.default_rng(r).normal(size=(50 + 20,))[50:].reshape(4, 5) * 100}
        for r in range(rt.size)])
  assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.float32
  np.testing.assert_allclose(out["a"], exact["a"], rtol=rtol, atol=rtol)
  np.testing.assert_allclose(out["b"], exact["b"], rtol=rtol, atol=100 * rtol)
  jaxpr = jax.make_jaxpr(lambda g: tx.update(g, tx.init(g))[0])(grads).jaxpr
  wire = jnp.bfloat16 if compression == "bf16" else jnp.float16
  sent = [e.invars[0].aval.dtype for e in jaxpr.eqns if "allreduce" in e.primitive.name]
  if rt.size > 1:
    assert sent and all(d == wire for d in sent)
  else:
    assert sent == []  # one rank: nothing travels, so nothing is rounded


def test_fp16_sum_does_not_overflow(rt):
  # 60000 fits float16 but a sum of them over 2+ ranks does not: the sum used to be inf.
  g = {"w": jnp.full(3, 60000.0, jnp.float32), "v": jnp.full(2, 1.5, jnp.float32)}
  out = jax.jit(lambda g: train.fused_allreduce(g, average=False, compression="fp16"))(g)
  np.testing.assert_allclose(out["w"], 60000.0 * rt.size, rtol=2e-3)
  np.testing.assert_allclose(out["v"], 1.5 * rt.size, rtol=2e-3)


def test_mean_metrics_eager_and_jitted(rt):
  got = train.mean_metrics({"r": float(rt.rank), "v": np.full(2, rt.rank, np.float32)})
  assert got["r"] == pytest.approx((rt.size - 1) / 2)
  np.testing.assert_allclose(got["v"], (rt.size - 1) / 2)
  jitted = jax.jit(train.mean_metrics)({"r": jnp.float32(rt.rank), "n": jnp.int32(rt.rank),
                                        "ok": jnp.bool_(rt.rank == 0)})
  assert float(jitted["r"]) == pytest.approx((rt.size - 1) / 2)
  # Counts and flags average to fractions (they used to be floored / refused).
  assert jitted["n"].dtype == jnp.float32 and float(jitted["n"]) == pytest.approx((rt.size - 1) / 2)
  assert float(jitted["ok"]) == pytest.approx(1 / rt.size)


def test_mean_metrics_non_number_on_one_rank_raises_everywhere(rt):
  bad = rt.size - 1
  with pytest.raises((ValueError, TypeError), match=r"leaf \['acc'\] = 'n/a' is not a number"):
    train.mean_metrics({"acc": "n/a" if rt.rank == bad else 0.5})


def test_mean_of_narrow_integer_leaves_does_not_wrap_around(rt):
  # The same value on every rank: its mean is that value. The sum used to be made in
  # the leaf's own dtype, so 200 + 200 wrapped around in uint8 (mean 72, not 200).
  g = {"u8": jnp.full(3, 200, jnp.uint8), "i8": jnp.full(2, -100, jnp.int8),
       "i16": jnp.full(2, 30000, jnp.int16), "f": jnp.ones(2)}
  out = jax.jit(train.fused_allreduce)(g)
  for k in g:
    assert out[k].dtype == g[k].dtype
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(g[k]), err_msg=k)
  # A sum (average=False) keeps the dtype's own arithmetic, as jax.lax.psum does.
  summed = jax.jit(lambda t: train.fused_allreduce(t, average=False))({"u8": jnp.full(2, 200, jnp.uint8)})
  np.testing.assert_array_equal(np.asarray(summed["u8"]), np.full(2, 200 * rt.size % 256, np.uint8))


def test_bool_gradient_leaf_is_refused_naming_it(rt):
  with pytest.raises(TypeError, match=r"leaf \['mask'\] is bool\[2\]"):
    jax.eval_shape(train.fused_allreduce, {"w": jnp.ones(2), "mask": jnp.ones(2, bool)})


def test_mpijax_pmap_axis_as_local_axis_name(rt):
  """Under mpijax.pmap the user's axis spans every device of every rank (JAX only
  knows its local part); floats and integers are averaged over all devices."""
  L = mpijax.local_device_count()
  gid = jnp.arange(L, dtype=jnp.float32) + rt.rank * L  # the global device index
  tx = train.allreduce_gradients(local_axis_name="i")
  out = mpijax.pmap(lambda g: tx.update(g, optax.EmptyState())[0], axis_name="i")(
      {"f": gid, "i": gid.astype(jnp.int32)})
  devices = rt.size * L
  np.testing.assert_allclose(np.asarray(out["f"]), (devices - 1) / 2)
  np.testing.assert_array_equal(np.asarray(out["i"]), (devices - 1) // 2)  # floor of the mean


# --- equivalence: P ranks == 1 process on the global batch ---------------------

STEPS = 5


def test_equivalence_allreduce_gradients_vs_single_process(rt):
  global_batch = batch_size(16, rt.size)
  opt = optax.adam(0.05)
  tx = optax.chain(train.allreduce_gradients(), opt)
  params = train.broadcast(init_params(jax.random.key(0)))
  opt_state = tx.init(params)
  step = jax.jit(lambda p, s, b, w: _sgd_step(p, s, b, w, tx))
  done, epoch = 0, 0
  while done < STEPS:
    for batch in train.shard_batches(dataset(), global_batch, seed=7, epoch=epoch):
      if done == STEPS:
        break
      params, opt_state = step(params, opt_state, batch.data, batch.weight)
      done += 1
    epoch += 1
  assert_trees_close(params, reference_params(STEPS, global_batch, opt), rtol=1e-5, atol=1e-6)
  assert_same_on_all_ranks(rt.comm, params)


def test_equivalence_with_padded_last_batch_via_data_parallel(rt):
  # 48 samples, global batch 20 (21 at 3 ranks): two full steps and a padded one.
  global_batch = batch_size(20, rt.size)
  opt = optax.sgd(0.3)
  dp = train.DataParallel(per_example_loss, opt)
  state = dp.init(init_params(jax.random.key(rt.rank)) if rt.rank else init_params(jax.random.key(0)))
  for batch in train.shard_batches(dataset(), global_batch, seed=7, epoch=0):
    state, metrics = dp.step(state, batch)
  ref = reference_params(3, global_batch, opt)
  assert_trees_close(state.params, ref, rtol=1e-5, atol=1e-6)
  assert int(state.step) == 3
  # The metric is the exact mean loss of the last (padded) batch, before the update.
  assert np.isfinite(float(metrics["loss"]))
  ev = dp.evaluate(state, dataset(), batch_size=2 * rt.size)
  x, y = dataset()
  np.testing.assert_allclose(ev["loss"], float(jnp.mean(per_example_loss(ref, (x, y)))), rtol=1e-5)


def test_equivalence_with_local_devices(rt):
  """P ranks x L local devices (shard_map over the local devices) == one process."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P
  local = rt.local_devices
  mesh = Mesh(np.array(local), ("local",))
  opt = optax.adam(0.05)
  tx = optax.chain(train.allreduce_gradients(local_axis_name="local"), opt)
  global_batch = 8 * rt.size * len(local)

  def local_step(params, opt_state, x, y, w):
    grads = jax.grad(weighted_loss)(params, (x, y), w)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("local"), P("local"), P("local")),
                               out_specs=(P(), P()), check_vma=False))
  params = train.broadcast(init_params(jax.random.key(0)))
  opt_state = tx.init(params)
  batches = list(train.shard_batches(dataset(), global_batch, seed=7, epoch=0, drop_remainder=True))
  for batch in batches:
    params, opt_state = step(params, opt_state, *batch.data, batch.weight)
  assert_trees_close(params, reference_params(len(batches), global_batch, opt), rtol=1e-5, atol=1e-6)


# --- accumulation ---------------------------------------------------------------

def test_accumulate_gradients_communicates_on_kth_step(rt):
  opt = optax.sgd(0.5)
  tx = train.accumulate_gradients(optax.chain(train.allreduce_gradients(), opt), every_k=2)
  params = train.broadcast(init_params(jax.random.key(0)))
  opt_state = tx.init(params)
  step = jax.jit(lambda p, s, b, w: _sgd_step(p, s, b, w, tx))
  micro = batch_size(8, rt.size)
  batches = list(train.shard_batches(dataset(), micro, seed=7, epoch=0))[:4]
  history = []
  for batch in batches:
    params, opt_state = step(params, opt_state, batch.data, batch.weight)
    history.append(params)
  # Micro-step 1 does not move the parameters; 2 micro-batches == one batch of twice the size.
  assert_trees_close(history[0], init_params(jax.random.key(0)), rtol=0, atol=0)
  assert_trees_close(params, reference_params(2, 2 * micro, opt), rtol=1e-5, atol=1e-6)
  assert int(opt_state.micro_step) == 0


# --- uneven data ------------------------------------------------------------------

def test_uneven_data_every_sample_once_and_no_hang(rt):
  counts = [3 + 5 * r for r in range(rt.size)]  # rank r holds 3 + 5r samples
  first = sum(counts[:rt.rank])
  ids = np.arange(first, first + counts[rt.rank])
  batches = train.shard_batches({"id": ids}, 2 * rt.size, seed=1, epoch=0, replicated=False)
  steps = len(batches)
  assert mpi_util.allgather_int(rt.comm, steps) == [steps] * rt.size
  assert steps == max(-(-c // 2) for c in counts)
  used, total = [], 0.0
  for batch in batches:
    used.extend(batch.data["id"][batch.mask > 0].tolist())
    # A collective every step: a rank with fewer steps would hang here.
    total += train.mean_metrics(float(batch.mask.sum()))
  everything = sorted(int(v) for s in mpi_util.allgather_str(rt.comm, ",".join(map(str, used)))
                      for v in s.split(",") if v)
  assert everything == list(range(sum(counts)))
  assert total * rt.size == pytest.approx(sum(counts))


def test_uneven_data_bad_leaves_on_one_rank_raise_everywhere(rt):
  # The bad rank used to raise alone while the others waited in the allgather of the counts.
  bad = rt.size - 1
  data = {"x": np.zeros(4), "y": np.zeros(5 if rt.rank == bad else 4)}
  match = r"different numbers of samples" if rt.rank == bad else \
      rf"failed on other ranks.*\n  rank {bad}: ValueError: .*different numbers of samples"
  with pytest.raises(ValueError, match=match):
    train.shard_batches(data, 2 * rt.size, seed=0, epoch=0, replicated=False)


# --- checkpoints --------------------------------------------------------------------

def _run(dp, state, epochs_steps):
  """Runs (epoch, start_step, n_steps) chunks; returns the state."""
  global_batch = batch_size(16, mpijax.process_count())
  for epoch, start, n in epochs_steps:
    it = train.shard_batches(dataset(), global_batch, seed=3, epoch=epoch, start_step=start)
    for _ in range(n):
      state, _ = dp.step(state, next(it))
  return state


def test_checkpoint_resume_is_bit_for_bit(rt, shared_dir):
  dp = train.DataParallel(per_example_loss, optax.adamw(0.03), with_rng=False)
  fresh = lambda seed: dp.init(init_params(jax.random.key(seed)), rng=jax.random.key(9))
  # Uninterrupted: epoch 0 (3 steps) + 2 steps of epoch 1.
  full = _run(dp, fresh(0), [(0, 0, 3), (1, 0, 2)])
  # Interrupted after epoch 0 step 2 (mid-epoch), saved, restored into a different state.
  part = _run(dp, fresh(0), [(0, 0, 2)])
  path = os.path.join(shared_dir, "ckpt")
  train.save_checkpoint(path, {"state": part, "epoch": 0, "step_in_epoch": 2}, metadata={"note": "mid"})
  restored = train.restore_checkpoint(path, like={"state": fresh(1), "epoch": 0, "step_in_epoch": 0})
  assert restored["step_in_epoch"] == 2 and train.checkpoint_metadata(path) == {"note": "mid"}
  resumed = _run(dp, restored["state"], [(0, restored["step_in_epoch"], 1), (1, 0, 2)])
  assert jax.tree_util.tree_structure(full) == jax.tree_util.tree_structure(resumed)
  for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(resumed)):
    a, b = np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a), \
        np.asarray(jax.random.key_data(b) if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key) else b)
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
  # The file holds nothing rank-specific: a single-rank communicator restores it too.
  alone = train.restore_checkpoint(path, like={"state": fresh(1), "epoch": 0, "step_in_epoch": 0},
                                   comm=mpi_util.import_mpi().COMM_SELF)
  assert_trees_close(alone["state"].params, part.params, rtol=0, atol=0)


def test_corrupt_checkpoint_refused_on_every_rank(rt, shared_dir):
  path = os.path.join(shared_dir, "bad")
  train.save_checkpoint(path, {"w": jnp.ones(100)})
  if rt.rank == 0:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) - 10)
  rt.comm.Barrier()
  # Every rank reports the same problem: one line for all of them, not one per rank.
  one_line = rf"failed:\n  ranks 0-{rt.size - 1}: checkpoint .*" if rt.size > 1 else ""
  with pytest.raises(train.CheckpointError, match=rf"{one_line}corrupt or truncated[^\n]*$"):
    train.restore_checkpoint(path, like={"w": jnp.zeros(100)})


def test_unstorable_state_on_one_rank_raises_everywhere_and_writes_nothing(rt, shared_dir):
  path = os.path.join(shared_dir, "never")
  bad = rt.size - 1
  with pytest.raises(TypeError, match=rf"wrote nothing:\n  rank {bad}: leaf \['tag'\]"):
    train.save_checkpoint(path, {"w": jnp.ones(2), "tag": np.array(["x"]) if rt.rank == bad else 0})
  assert not os.path.exists(path)


def test_data_parallel_bad_batch_on_one_rank_raises_everywhere(rt):
  # The bad rank used to raise alone while the others waited for it.
  dp = train.DataParallel(per_example_loss, optax.sgd(0.1))
  state = dp.init(init_params(jax.random.key(0)))
  x, y = dataset()
  bad = rt.size - 1
  x = x[:4, :D - 1] if rt.rank == bad else x[:4]  # one feature short on one rank
  with pytest.raises(Exception, match="dot_general") as info:
    dp.step(state, (x, y[:4]))
  if rt.rank != bad:
    assert isinstance(info.value, RuntimeError) and f"rank {bad}: TypeError" in str(info.value)
  # Leaves with different sample counts on one rank, in a plain first step and in
  # evaluate: the bad rank used to raise before the collectives the others waited in.
  y_short = y[:3] if rt.rank == bad else y[:4]
  for call, what in ((lambda: dp.step(state, (dataset()[0][:4], y_short)), "DataParallel.step"),
                     (lambda: dp.evaluate(state, (dataset()[0][:4], y_short), rt.size), "shard_batches")):
    with pytest.raises(Exception, match=rf"{what}: leaves have different numbers of samples") as info:
      call()
    if rt.rank != bad:  # the others name the bad rank
      assert f"rank {bad}: ValueError" in str(info.value)
  with pytest.raises(TypeError, match=r"DataParallel.step was called under a JAX transformation.*outside jax.jit"):
    jax.jit(dp.step)(state, (dataset()[0][:4], y[:4]))
  with pytest.raises(ValueError, match=r"DataParallel\(compression='int8'\) is not supported; use None, 'bf16' or 'fp16'"):  # noqa: E501
    train.DataParallel(per_example_loss, optax.sgd(0.1), compression="int8")
  scalar_losses = lambda p, b: jnp.mean(per_example_loss(p, b))
  with pytest.raises(ValueError, match=r"per-example losses of shape \[batch\], got shape \(\)"):
    train.DataParallel(scalar_losses, optax.sgd(0.1)).step(state, (dataset()[0][:4], y[:4]))


def test_digits_resume_when_ranks_see_different_files_raises_everywhere(rt, shared_dir):
  # One --out per rank, as on node-local disks; only rank 0 has a (bad) checkpoint.
  # Rank 0 used to restore (a collective) while the others started training: a hang.
  from mpijax.examples import digits
  out = os.path.join(shared_dir, f"digits-rank{rt.rank}")
  argv = ["--out", out, "--epochs", "1", "--no-progress",
          "--batch-size", str(batch_size(64, rt.size))]
  n = rt.local_device_count
  if n > 1:
    # The job trains on one device per rank: every rank refuses before touching a file.
    with pytest.raises(SystemExit, match=f"this rank has {n} local devices.* -n {rt.size * n} "):
      digits.main(argv)
    assert not os.path.exists(out)
    return
  if rt.rank == 0:
    os.makedirs(os.path.join(out, "checkpoints"))
    with open(train.checkpoint_path(os.path.join(out, "checkpoints"), 5), "wb") as f:
      f.write(b"not a checkpoint")
  with pytest.raises(train.CheckpointError, match=("rank 0: " if rt.size > 1 else "") + ".* is not an mpijax checkpoint"):  # noqa: E501
    digits.main(argv)

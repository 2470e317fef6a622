"""Bad input and cross-rank checks give clear errors, at any rank count."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mpijax
import mpijax.lax
import mpijax.ops
import mpijax.train as mt
from mpijax._src import config
from mpijax._src import ffi as _ffi
from mpijax._src.ffi import settings


@pytest.fixture()
def rt():
  return mpijax.init()


def test_shapes_differing_across_ranks_raise_on_every_rank(rt):
  # A communicator of its own: a signature is compared once per communicator,
  # so an allreduce(float32[3]) of an earlier test on the world would let the
  # even ranks skip the check (a divergence then is a stall report, tested in
  # tests/test_faults.py).
  comm = rt.comm.Dup()
  f = jax.jit(lambda x: mpijax.ops.allreduce(x, comm=comm))
  x = jnp.ones(3 + (rt.rank % 2))  # odd ranks send 4 elements, even ranks 3
  if rt.size == 1:
    assert f(x).shape == (3,)
    return
  with pytest.raises(
    Exception,
    match=r"collective mismatch on communicator \d+ \(call #\d+\): "
    r"ranks? [\d,]+ runs? allreduce\(float32\[3\], sum\) at test_checks.py:\d+"
    r".* but ranks? [\d,]+ runs? allreduce\(float32\[4\], sum\).*same shapes and dtypes",
  ):
    f(x).block_until_ready()
  # The job goes on: nothing is left half-done on any rank.
  assert float(mpijax.ops.allreduce(jnp.ones(())).block_until_ready()) == rt.size


def test_check_every_call_catches_a_divergence_after_the_first_run(rt):
  a = jax.jit(lambda x: mpijax.ops.allreduce(x, op="max"))
  b = jax.jit(lambda x: mpijax.ops.allreduce(x, op="min"))
  x = jnp.ones(5)
  a(x).block_until_ready()  # both programs pass their first-run check
  b(x).block_until_ready()
  if rt.size == 1:
    return
  config.update("check", True)
  settings.push_settings()
  try:
    prog = a if rt.rank == 0 else b  # rank 0 runs max, the others min
    with pytest.raises(
      Exception,
      match=r"rank 0 runs allreduce\(float32\[5\], max\).*"
      r"ranks? [\d,]+ runs? allreduce\(float32\[5\], min\)",
    ):
      prog(x).block_until_ready()
  finally:
    config.reset("check")
    settings.push_settings()


def test_shared_memory_catches_a_divergence_without_the_check(rt):
  """Small all-reduces go through node-local shared memory (one device per
  rank), which compares every call's signature across ranks for free: a
  divergence after the first-run check is an error, not MPI's undefined
  result. (With several devices per rank the MPI path runs; see the test
  above for MPIJAX_CHECK=1 there.)"""
  a = jax.jit(lambda x: mpijax.ops.allreduce(x, op="max"))
  b = jax.jit(lambda x: mpijax.ops.allreduce(x, op="min"))
  x = jnp.ones(5)
  a(x).block_until_ready()
  b(x).block_until_ready()
  if rt.size == 1 or len(rt.local_devices) > 1:
    return
  prog = a if rt.rank == 0 else b
  with pytest.raises(
    Exception,
    match=r"rank 0 runs allreduce\(float32\[5\], max\).*"
    r"ranks? [\d,]+ runs? allreduce\(float32\[5\], min\)",
  ):
    prog(x).block_until_ready()
  # The job goes on.
  np.testing.assert_array_equal(a(jnp.full(5, float(rt.rank))), np.full(5, rt.size - 1.0))


def test_status_table_records_calls(rt):
  mpijax.ops.allreduce(jnp.ones(2)).block_until_ready()
  ext = _ffi.load()
  calls, phase, activity, text = ext.status(0, 0).split(" ", 3)  # key 0: the runtime's
  assert int(calls) >= 1 and phase == "0" and activity == "0", text
  assert text.startswith("idle since") and "call #" in text, text


def test_status_says_what_the_compile_hook_does(rt):
  mpijax.ops.allreduce(jnp.ones(2)).block_until_ready()
  ext = _ffi.load()
  ext.set_activity(1, "compiling jit_step")
  try:
    _, _, activity, text = ext.status(0, 0).split(" ", 3)
    assert activity == "1" and "; compiling jit_step for " in text, text
  finally:
    ext.set_activity(0, "")
  _, _, activity, text = ext.status(0, 0).split(" ", 3)
  assert activity == "0" and "compiling" not in text, text


def test_invalid_stall_action_is_refused(rt, monkeypatch):
  monkeypatch.setenv("MPIJAX_STALL_ACTION", "explode")
  with pytest.raises(ValueError, match=r"MPIJAX_STALL_ACTION='explode'.*'abort'.*'warn'"):
    settings.push_settings()
  monkeypatch.delenv("MPIJAX_STALL_ACTION")
  settings.push_settings()


def test_bad_arguments_name_the_value_and_the_fix(rt):
  with pytest.raises(TypeError, match=r"dtype float8_e4m3fn.*supported dtypes.*astype"):
    mpijax.ops.allreduce(jnp.ones(2, jnp.float8_e4m3fn))
  with pytest.raises(ValueError, match="permutation"):
    mpijax.ops.ppermute(jnp.ones(2), [(0, 0), (0, 0)] if rt.size == 1 else [(0, 1), (1, 1)])
  with pytest.raises(ValueError, match=f"root.*{rt.size}"):
    mpijax.ops.bcast(jnp.ones(2), root=rt.size)
  with pytest.raises(NameError, match="axis_name"):
    jax.jit(lambda x: mpijax.lax.psum(x, "nope"))(jnp.ones(2))


def test_truncated_checkpoint_is_refused_never_half_loaded(rt, tmp_path_factory):
  path = rt.comm.bcast(str(tmp_path_factory.mktemp("ck") / "s.ckpt") if rt.rank == 0 else None)
  state = {"w": np.arange(1000, dtype=np.float32), "step": 3}
  mt.save_checkpoint(path, state)
  rt.comm.Barrier()
  if rt.rank == 0:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)  # a partial write
  rt.comm.Barrier()
  like = {"w": np.zeros(1000, np.float32), "step": 0}
  with pytest.raises(mt.CheckpointError, match="corrupt or truncated.*refusing to load any of it"):
    mt.restore_checkpoint(path, like)
  assert not like["w"].any() and like["step"] == 0


# --- found by the bad-input audit -------------------------------------------------


def test_ppermute_permutations_differing_across_ranks_raise_on_every_rank(rt):
  if rt.size == 1:
    return
  swap = [(0, 1), (1, 0)]
  perm = swap if rt.rank == 0 else [(1, 0)]  # rank 0 also sends to rank 1
  with pytest.raises(
    Exception,
    match=r"collective mismatch.*ppermute\(float32\[4\], perm=\[\(0, 1\), "
    r"\(1, 0\)\]\).*ppermute\(float32\[4\], perm=\[\(1, 0\)\]\)",
  ):
    mpijax.ops.ppermute(jnp.full(4, 100.0 + rt.rank), perm).block_until_ready()


def test_an_unmatched_send_never_reaches_a_later_exchange(rt):
  if rt.size == 1:
    return
  r, n = rt.rank, rt.size
  # Rank 0 sends to rank 1, which does not receive from it ...
  mpijax.ops.sendrecv(jnp.full(4, 100.0), None, 1 if r == 0 else None).block_until_ready()
  # ... so that message is lost, not taken by the next exchange.
  right = mpijax.ops.sendrecv(jnp.full(4, 200.0 + r), (r - 1) % n, (r + 1) % n)
  np.testing.assert_array_equal(right, np.full(4, 200.0 + (r - 1) % n))


def test_mean_metrics_of_different_trees_raise_on_every_rank(rt):
  if rt.size == 1:
    return
  tree = {"loss": 1.0} if rt.rank == 0 else {"loss": 1.0, "acc": 0.5}
  with pytest.raises(
    ValueError,
    match=r"same tree on every rank.*rank 0 passed.*'loss'.*rank 1 "
    r"passed.*'acc'",
  ):
    mt.mean_metrics(tree)
  assert mt.mean_metrics({"loss": float(rt.rank)})["loss"] == (rt.size - 1) / 2


def test_broadcast_of_a_string_leaf_raises_on_every_rank(rt):
  with pytest.raises(
    ValueError, match=r"leaf \['meta'\] has dtype str.*cannot send.*np.frombuffer"
  ):
    mt.broadcast({"w": np.ones(2), "meta": np.array(["ab", "cd"])})
  assert mt.broadcast({"w": np.full(2, float(rt.rank))})["w"][0] == 0.0  # nothing left pending


def test_replicated_batches_of_different_sizes_raise_on_every_rank(rt):
  xs = np.arange(100 + 40 * rt.rank, dtype=np.float32)
  batches = mt.shard_batches(xs, 4 * rt.size, seed=0, epoch=0)
  if rt.size == 1:
    assert len(list(batches)) == 25
    return
  with pytest.raises(
    ValueError, match=r"same full dataset on every rank.*\[100, 140.*replicated=False"
  ):
    next(iter(batches))


def test_replicated_batches_unusable_on_one_rank_raise_on_every_rank(rt):
  # The bad rank used to raise alone at construction while the others waited
  # forever in the size check of their first batch.
  bad = rt.size - 1
  data = {"x": np.zeros(8), "y": np.zeros(7 if rt.rank == bad else 8)}
  match = (
    r"different numbers of samples"
    if rt.rank == bad
    else rf"failed on other ranks.*\n  rank {bad}: ValueError: .*different numbers of samples"
  )
  with pytest.raises(ValueError, match=match):  # alone: at construction, else at the first batch
    next(iter(mt.shard_batches(data, 2 * rt.size, seed=0, epoch=0)))
  assert mt.broadcast({"n": np.array(rt.rank)})["n"] == 0  # nothing left pending


def test_a_problem_found_on_one_rank_raises_on_every_rank(rt):
  from mpijax._src.runtime import state as runtime

  problem = "mpijax.init(): something is off here" if rt.rank == rt.size - 1 else ""
  with pytest.raises(RuntimeError, match=rf"something is off here \(found on rank {rt.size - 1}\)"):
    runtime._raise_on_every_rank(rt.comm, [problem])


def test_out_of_range_axes_are_errors(rt):
  f = lambda g: mpijax.pmap(g, axis_name="i")(jnp.ones((mpijax.local_device_count(), 3)))
  with pytest.raises(ValueError, match=r"all_gather got axis=2 .* 1 dimension.*\[-2, 2\)"):
    f(lambda v: mpijax.lax.all_gather(v, "i", axis=2))
  with pytest.raises(ValueError, match=r"psum_scatter got scatter_dimension=7"):
    f(lambda v: mpijax.lax.psum_scatter(v, "i", scatter_dimension=7, tiled=True))
  with pytest.raises(ValueError, match=r"all_to_all got split_axis=4"):
    f(lambda v: mpijax.lax.all_to_all(v, "i", 4, 0, tiled=True))
  with pytest.raises(TypeError, match=r"ppermute over 'i' got perm=\[0, 1\]; expected .*pairs"):
    f(lambda v: mpijax.lax.ppermute(v, "i", [0, 1]))
  assert float(mpijax.ops.bcast(jnp.ones(()), np.int64(0))) == 1.0  # NumPy integers are ranks


def test_global_array_from_global_with_different_arrays_raises_on_every_rank(rt):
  mesh = mpijax.make_mesh((rt.size * mpijax.local_device_count(),), ("x",))
  n = 2 * rt.size * mpijax.local_device_count()
  whole = np.arange(n + (0 if rt.rank == 0 else n), dtype=np.float32)  # rank 0's is shorter
  if rt.size == 1:
    assert mpijax.GlobalArray.from_global(whole, mesh, P("x")).shape == (n,)
    return
  with pytest.raises(
    ValueError,
    match=rf"same whole array on every rank, but rank 0 passed "
    rf"float32\[{n}\] and rank 1 passed float32\[{2 * n}\]",
  ):
    mpijax.GlobalArray.from_global(whole, mesh, P("x"))


def test_data_parallel_has_aux_without_aux_says_so(rt):
  import optax

  dp = mt.DataParallel(lambda p, d: (d[0] @ p) ** 2, optax.sgd(0.1), has_aux=True)
  state = dp.init(jnp.ones(3))
  batch = next(
    iter(mt.shard_batches((np.ones((4 * rt.size, 3), np.float32),), 4 * rt.size, seed=0, epoch=0))
  )
  with pytest.raises(TypeError, match=r"has_aux=True.*must return \(losses, aux\).*has_aux=False"):
    dp.step(state, batch)


# --- GlobalArray: copies that must be equal ------------------------------------------


@pytest.fixture(params=[True])
def value_check(request):
  """Sets MPIJAX_CHECK (every rank alike) for one test, whatever the environment says."""
  config.update("check", request.param)
  try:
    yield
  finally:
    config.reset("check")


def _x_mesh(rt):
  return mpijax.make_mesh((rt.size * mpijax.local_device_count(),), ("x",))


def test_sampled_positions_and_grouping_of_copies():
  from mpijax._src import mpi_util

  assert mpi_util.sample_positions(5).tolist() == [0, 1, 2, 3, 4]
  pos = mpi_util.sample_positions(1000)
  assert len(pos) == 64 and pos[0] == 0 and pos[-1] == 999 and 1 not in pos
  a = np.full((3, 4), np.nan, np.float32)
  b = a.copy()
  b.view(np.uint32)[0, 0] ^= 1  # another NaN payload: other bytes
  assert (
    mpi_util.value_digest(a)
    == mpi_util.value_digest(np.asfortranarray(a))
    != mpi_util.value_digest(b)
  )
  assert mpi_util.sample_digest(a) != mpi_util.sample_digest(b)
  assert mpi_util.sample_digest(np.float32(2)) == mpi_util.sample_digest(np.array(2, np.float32))
  assert mpi_util.differing_copies(["a", "b", "a", "a"], ["1", "2", "1", "3"]) == [
    ("a", [[0, 2], [3]])
  ]
  assert mpi_util.differing_copies(["a", "a"], ["1", None]) == []


def test_global_array_equal_copies_pass_the_value_check(rt, value_check):
  mesh, L = _x_mesh(rt), mpijax.local_device_count()
  g = np.arange(6 * rt.size * L, dtype=np.float32).reshape(-1, 3)
  g[0, 0] = np.nan  # equal NaNs are equal bytes
  for spec in (P(), P("x"), P(None)):
    a = mpijax.GlobalArray.from_global(g, mesh, spec)
    np.testing.assert_array_equal(a.gather(), g)
  # Replicated over the ranks: equal copies (NumPy and jax.Array) pass.
  for part in (g[:2], jnp.asarray(g[:2])):
    b = mpijax.GlobalArray.from_process_local(part, mesh, P())
    np.testing.assert_array_equal(b.gather(), g[:2])
  # Each rank's own block: nothing to compare, different values are fine.
  own = np.full((2 * L, 3), float(rt.rank), np.float32)
  c = mpijax.GlobalArray.from_process_local(own, mesh, P("x"))
  np.testing.assert_array_equal(
    c.gather(), np.repeat(np.arange(rt.size), 2 * L)[:, None] * np.ones(3, np.float32)
  )


def _one_rank_differs(rt):
  """840 equal elements (divisible by up to 8 devices); the last rank's copy differs in
  element 1 (never sampled)."""
  x = np.arange(840, dtype=np.float32)
  if rt.rank == rt.size - 1:
    x[1] = -1.0
  return x


def _copies(rt):
  same = ", ".join(map(str, range(rt.size - 1)))
  return rf"ranks? {same} vs rank {rt.size - 1}"


def test_global_array_different_copies_raise_on_every_rank_with_the_check(rt, value_check):
  mesh = _x_mesh(rt)
  x = _one_rank_differs(rt)
  if rt.size == 1:  # one rank: no other copy to compare with
    assert mpijax.GlobalArray.from_process_local(x, mesh, P()).shape == (840,)
    pytest.skip("comparing copies needs at least 2 ranks")
  with pytest.raises(
    ValueError,
    match=r"from_process_local: ranks that hold the same block of "
    r"the global \(840,\) float32 array .*differ only along mesh axes \['x'\].*"
    r"passed different values \(every byte compared, MPIJAX_CHECK=1\): block "
    rf"\[0:840\]: {_copies(rt)}\. Pass equal copies.*name 'x' in the spec",
  ):
    mpijax.GlobalArray.from_process_local(x, mesh, P())
  with pytest.raises(ValueError, match=r"from_process_local: .*block \[0:840\]: " + _copies(rt)):
    mpijax.GlobalArray.from_process_local(jnp.asarray(x), mesh, P())
  # from_global compares the whole array, also where each rank keeps only its own part.
  for spec in (P(), P("x")):
    with pytest.raises(
      ValueError,
      match=r"from_global needs the same whole array on every rank, "
      r"but the ranks passed float32\[840\] arrays with different values "
      rf"\(every byte compared, MPIJAX_CHECK=1\): {_copies(rt)}\. Pass the same",
    ):
      mpijax.GlobalArray.from_global(x, mesh, spec)
  # Nothing is left pending: the next collective works.
  np.testing.assert_array_equal(
    mpijax.GlobalArray.from_global(np.ones(4), mesh, P()).gather(), np.ones(4)
  )


@pytest.mark.parametrize("value_check", [False], indirect=True)
def test_global_array_copies_without_the_check(rt, value_check):
  mesh = _x_mesh(rt)
  x = _one_rank_differs(rt)
  # A difference between the sampled elements passes silently without MPIJAX_CHECK ...
  a = mpijax.GlobalArray.from_process_local(x, mesh, P())
  b = mpijax.GlobalArray.from_global(x, mesh, P())
  np.testing.assert_array_equal(np.asarray(a.local), x)  # each rank keeps its own copy
  np.testing.assert_array_equal(np.asarray(b.local), x)
  # ... and so do jax.Array parts (not sampled) and parts only one rank keeps.
  mine = np.full(840, float(rt.rank), np.float32)
  mpijax.GlobalArray.from_process_local(jnp.asarray(mine), mesh, P())
  mpijax.GlobalArray.from_global(
    np.full(rt.size * mpijax.local_device_count(), float(rt.rank)), mesh, P("x")
  )
  if rt.size == 1:
    mpijax.GlobalArray.from_process_local(mine, mesh, P())
    pytest.skip("comparing copies needs at least 2 ranks")
  # Each rank's own data where the spec says copies: caught by the sample.
  ranks = ", ".join(map(str, range(rt.size)))
  sample = r"found by comparing up to 64 sampled elements; MPIJAX_CHECK=1 compares every byte"
  with pytest.raises(
    ValueError,
    match=rf"from_process_local: .*passed different values \({sample}"
    rf"\): block \[0:840\]: rank {' vs rank '.join(ranks.split(', '))}\.",
  ):
    mpijax.GlobalArray.from_process_local(mine, mesh, P())
  with pytest.raises(
    ValueError,
    match=rf"from_global needs .*different values \({sample}\): "
    r"block \[0:840\]: rank 0 vs rank 1",
  ):
    mpijax.GlobalArray.from_global(mine, mesh, P())


def test_global_array_check_on_some_ranks_only_raises_on_every_rank(rt):
  if rt.size == 1:
    pytest.skip("needs at least 2 ranks")
  mesh = _x_mesh(rt)
  config.update("check", rt.rank == 0)
  try:
    for make in (mpijax.GlobalArray.from_process_local, mpijax.GlobalArray.from_global):
      with pytest.raises(
        ValueError,
        match=r"MPIJAX_CHECK is on for rank 0 but off for ranks? 1"
        r".*the same way on every rank",
      ):
        make(np.ones(4, np.float32), mesh, P())
  finally:
    config.reset("check")

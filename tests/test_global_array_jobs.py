"""GlobalArray across separate MPI jobs: a 4-rank checkpoint loaded by 2 ranks x 2 devices
(and by 1 rank), and ``to_jax``/``from_jax`` under ``jax.distributed``.

These tests start their own small MPI jobs (bounded by timeouts) running this
file as a script, because the two sides need different rank counts, and
``jax.distributed`` must be initialized before JAX's backends start (it
cannot share the tests/mpi session).
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.abspath(__file__)


def _expected():
  """The saved tree's global values (the same on every rank and in every job)."""
  return {"w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6),
          "m": (np.arange(4 * 8) % 7).astype(np.int32).reshape(4, 8),
          "b": np.linspace(0, 1, 5).astype(np.float32),
          "step": 17}


# --- the job side (run as a script inside mpijax-run) -----------------------------------


def _job_save(path: str) -> None:
  from jax.sharding import PartitionSpec as P

  import mpijax
  mpijax.init()
  n = mpijax.process_count() * mpijax.local_device_count()
  x = mpijax.make_mesh((n,), ("x",))
  grid = mpijax.make_mesh((2, n // 2), ("a", "b"))
  e = _expected()
  tree = {"w": mpijax.GlobalArray.from_global(e["w"], x, P("x")),
          "m": mpijax.GlobalArray.from_global(e["m"], grid, P("a", "b")),
          "b": mpijax.GlobalArray.from_global(e["b"], x, P()),
          "step": e["step"]}
  mpijax.visualize_sharding(tree["m"])
  mpijax.save(path, tree)
  print(f"SAVED rank {mpijax.process_index()} of {mpijax.process_count()}", flush=True)


def _job_load(path: str) -> None:
  from jax.sharding import PartitionSpec as P

  import mpijax
  mpijax.init()
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  x = mpijax.make_mesh((Pn * L,), ("x",))
  grid = mpijax.make_mesh((Pn, L), ("data", "model"))
  e = _expected()
  # Other meshes and specs than the saving job's.
  like = {"w": mpijax.GlobalArray.zeros((8, 6), mesh=grid, spec=P("model", "data") if 6 % Pn == 0
                                        else P("model")),
          "m": mpijax.GlobalArray.zeros((4, 8), "int32", mesh=x, spec=P(None, "x")),
          "b": mpijax.GlobalArray.zeros((5,), mesh=grid, spec=P()),
          "step": 0}
  out = mpijax.load(path, like=like)
  for k in ("w", "m", "b"):
    assert out[k].spec == like[k].spec and out[k].mesh == like[k].mesh, k
    np.testing.assert_array_equal(out[k].gather(), e[k], err_msg=k)
  assert out["step"] == e["step"]
  mpijax.visualize_sharding(out["w"])
  print(f"LOADED rank {mpijax.process_index()} of {Pn} x {L} devices", flush=True)


def _job_to_jax() -> None:
  import mpijax
  mpijax.init(jax_distributed=True)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax.lax
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  assert jax.process_count() == Pn and jax.device_count() == Pn * L
  grid = mpijax.make_mesh((Pn, L), ("data", "model"))
  g = np.arange(4 * Pn * 2 * L, dtype=np.float32).reshape(4 * Pn, 2 * L)
  ga = mpijax.GlobalArray.from_global(g, grid, P("data", "model"))
  arr = ga.to_jax()
  assert isinstance(arr, jax.Array) and arr.shape == g.shape and not arr.is_fully_addressable
  assert isinstance(arr.sharding, NamedSharding) and arr.sharding.spec == P("data", "model")
  for s in arr.addressable_shards:  # same blocks on the same devices, no data moved
    np.testing.assert_array_equal(np.asarray(s.data), g[s.index])
  shards = {s.device: s.index for s in ga.addressable_shards}
  assert all(shards[s.device] == s.index for s in arr.addressable_shards)
  # JAX's own partitioner on it: a cross-process reduction and an element-wise op.
  total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(arr.sharding.mesh, P()))(arr)
  assert float(np.asarray(total.addressable_data(0))) == g.sum()
  doubled = jax.jit(lambda a: jax.lax.with_sharding_constraint(
      a * 2, NamedSharding(arr.sharding.mesh, P(None, "model"))))(arr)
  back = mpijax.GlobalArray.from_jax(doubled, grid)
  assert back.spec == P(None, "model")
  np.testing.assert_array_equal(back.gather(), g * 2)
  back2 = mpijax.GlobalArray.from_jax(arr)  # a new GlobalMesh from the array's mesh
  np.testing.assert_array_equal(back2.gather(), g)
  print(f"TO_JAX OK rank {mpijax.process_index()}", flush=True)
  # mpijax's own collectives in the same job. Under jax.distributed XLA names
  # a device by its global id (2048, 2049 on the second process), not by its
  # local index; each must still reach its own sub-communicator.
  import mpijax.ops
  ids = [d.id for d in jax.local_devices()]
  mine = np.full(3, mpijax.process_index() + 1, np.float32)
  want = Pn * (Pn + 1) / 2
  for d in jax.local_devices():  # eager and jitted, on each local device
    x = jax.device_put(mine, d)
    np.testing.assert_array_equal(mpijax.ops.allreduce(x, "sum"), want)
    y = jax.jit(lambda v: mpijax.ops.allreduce(v, "sum") * 2)(x)
    assert y.devices() == {d}
    np.testing.assert_array_equal(y, 2 * want)
  xs = jnp.arange(L, dtype=jnp.float32) + mpijax.process_index() * L  # global device index
  np.testing.assert_array_equal(
      mpijax.pmap(lambda v: mpijax.lax.psum(v, "i"), axis_name="i")(xs),
      np.full(L, (Pn * L) * (Pn * L - 1) / 2))
  print(f"OPS OK rank {mpijax.process_index()} devices {ids}", flush=True)


def _job_save_crash(path: str) -> None:
  """Rank 1 dies after writing its first shard file, in the middle of mpijax.save."""
  import mpijax
  from mpijax._src.sharding import sharded_checkpoint as array_checkpoint
  mpijax.init()
  if mpijax.process_index() == 1:
    real = array_checkpoint._write_atomic

    def write_then_die(file, parts):
      real(file, parts)
      print("CRASHING rank 1 mid-save", flush=True)
      os._exit(3)

    array_checkpoint._write_atomic = write_then_die
  _job_save(path)


def _job_refuse(path: str) -> None:
  import glob

  from jax.sharding import PartitionSpec as P

  import mpijax
  from mpijax._src.train.replicated_checkpoint import CheckpointError
  mpijax.init()
  mesh = mpijax.make_mesh((mpijax.process_count() * mpijax.local_device_count(),), ("x",))
  like = {"w": mpijax.GlobalArray.zeros((8, 6), mesh=mesh, spec=P()),
          "m": mpijax.GlobalArray.zeros((4, 8), "int32", mesh=mesh, spec=P()),
          "b": mpijax.GlobalArray.zeros((5,), mesh=mesh, spec=P()), "step": 0}
  leftovers = glob.glob(path + ".tmp-*")
  assert len(leftovers) == 1, leftovers
  for target, why in [(path, "no checkpoint directory"), (leftovers[0], "no metadata.json")]:
    try:
      mpijax.load(target, like=like)
    except CheckpointError as e:
      assert why in str(e), e
      print(f"REFUSED {why}", flush=True)
    else:
      raise AssertionError(f"loaded {target}")


if __name__ == "__main__":
  {"save": lambda: _job_save(sys.argv[2]), "load": lambda: _job_load(sys.argv[2]),
   "save_crash": lambda: _job_save_crash(sys.argv[2]),
   "refuse": lambda: _job_refuse(sys.argv[2]), "to_jax": _job_to_jax}[sys.argv[1]]()
  sys.exit(0)


# --- the test side (plain pytest, starts the jobs) ---------------------------------------

from tests._launch import assert_failed_without_hanging  # noqa: E402
from tests._launch import run_mpi  # noqa: E402
from tests._launch import tail  # noqa: E402


def _run(n, devices, *args, env=None, expect_ok=True):
  result, seconds = run_mpi(n, [sys.executable, HERE, *args], devices_per_process=devices,
                            timeout=240, env={"MPIJAX_TIMEOUT": "120", **(env or {})})
  if not expect_ok:
    assert_failed_without_hanging(result.returncode, result.stdout)
    return result.stdout
  assert result.returncode == 0, (f"{args[0]} on {n} ranks x {devices} devices failed "
                                  f"(exit {result.returncode}, {seconds:.0f}s):\n"
                                  f"{tail(result.stdout)}")
  return result.stdout


def test_checkpoint_from_4_ranks_loads_on_2_ranks_x_2_devices_and_on_1_rank(tmp_path):
  path = str(tmp_path / "ckpt")
  out = _run(4, 1, "save", path)
  assert out.count("SAVED rank") == 4, tail(out)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .tmp- directory left behind
  # w: 4 row blocks, m: 4 grid blocks, b: 1 (replicated, written once), step, metadata.
  assert len(os.listdir(path)) == 4 + 4 + 1 + 1 + 1
  out = _run(2, 2, "load", path)
  assert out.count("LOADED rank") == 2 and "P1:D1" in out, tail(out)
  out = _run(1, 1, "load", path)
  assert out.count("LOADED rank") == 1, tail(out)


def test_to_jax_and_back_under_jax_distributed():
  out = _run(2, 2, "to_jax")
  assert out.count("TO_JAX OK") == 2 and out.count("OPS OK") == 2, tail(out)


def test_a_crash_mid_save_publishes_nothing_loadable(tmp_path):
  path = str(tmp_path / "ckpt")
  out = _run(2, 1, "save_crash", path, expect_ok=False)
  assert "CRASHING rank 1 mid-save" in out and "SAVED" not in out, tail(out)
  assert not os.path.exists(path)
  out = _run(1, 1, "refuse", path)
  assert out.count("REFUSED") == 2, tail(out)

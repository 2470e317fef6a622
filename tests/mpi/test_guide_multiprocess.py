"""The multi-process guide and the pmap guide across the ranks, as plain JAX code.

After ``mpijax.init()`` (which starts JAX's distributed runtime in place of
the guide's ``jax.distributed.initialize()``), JAX sees every rank: process
index and count, local and global devices, ``jax.pmap`` over every device of
every rank, ``multihost_utils``. The guide's session is run as printed (tests/
guides.py holds it verbatim); its printed numbers are for 4 hosts x 8
devices, ours are the job's. The guide's pitfalls are shown the way it
says to avoid them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpijax
from tests import guides

pytestmark = pytest.mark.usefixtures("jax_multiprocess")


def test_the_guides_session_across_the_ranks(rt):
  # mpijax.init() has started JAX's distributed runtime with the job's
  # coordinator, process count and index: the guide's initialize() line is its.
  source = guides.adapt(guides.doctest_source(guides.MULTI_PROCESS_PMAP),
                        "jax.distributed.initialize()  # On GPU, see above for the necessary "
                        "arguments.\n", "")
  values, _ = guides.run(source, {})
  L = rt.local_device_count
  assert guides.value(values, "jax.device_count()") == rt.size * L  # the guide's 32
  assert guides.value(values, "jax.local_device_count()") == L  # the guide's 8
  out = guides.value(values, "jax.pmap(")
  # The guide's [32., 32., ...]: one entry per local device, each the global device count.
  np.testing.assert_array_equal(np.asarray(out), np.full(L, float(rt.size * L), np.float32))


def test_process_index_and_count(rt):
  assert jax.process_index() == rt.rank == mpijax.process_index()
  assert jax.process_count() == rt.size == mpijax.process_count()


def test_local_and_global_devices(rt):
  local, every = jax.local_devices(), jax.devices()
  assert local == rt.local_devices and len(every) == rt.size * len(local)
  assert set(local) <= set(every)  # a process's local devices are a subset of the global ones
  assert all(d.process_index == rt.rank for d in local)
  # JAX's global order is mpijax's: process, then local index.
  for info, d in zip(mpijax.devices(), every):
    assert d.process_index == info.process_index
  assert [d for d in every if d.process_index == rt.rank] == local


def test_process_allgather_and_sync_global_devices(rt):
  mine = np.array([rt.rank, 10 * rt.rank], np.int32)
  stacked = multihost_utils.process_allgather(mine)
  np.testing.assert_array_equal(stacked, [[p, 10 * p] for p in range(rt.size)])
  tiled = multihost_utils.process_allgather(mine, tiled=True)
  np.testing.assert_array_equal(tiled, np.ravel([[p, 10 * p] for p in range(rt.size)]))
  # A global array comes back whole, on every rank (JAX: tiled=True for those).
  mesh = Mesh(jax.devices(), ("x",))
  L = rt.local_device_count
  part = np.arange(2 * L, dtype=np.float32) + 2 * L * rt.rank
  whole = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), part)
  np.testing.assert_array_equal(multihost_utils.process_allgather(whole, tiled=True),
                                np.arange(2 * L * rt.size, dtype=np.float32))
  multihost_utils.sync_global_devices("guide: everybody here")
  if rt.size > 1:
    # Ranks at different barriers (the guide's "different order" pitfall) are
    # told so, every one of them, instead of passing each other.
    with pytest.raises(AssertionError, match="sync_global_devices name mismatch"):
      multihost_utils.sync_global_devices(f"barrier of rank {rt.rank}")


def test_pitfall_different_shapes_per_process(rt):
  # "Different input shapes are safe as long as each device gets a shard of
  # the same shape": each rank's own data (its own values), same shape per
  # device, assembled into one global batch with JAX's own helper.
  mesh = Mesh(jax.devices(), ("batch",))
  n, L = jax.device_count(), rt.local_device_count
  rows = np.arange(3 * n * 2, dtype=np.float32).reshape(3 * n, 2)
  mine = rows[3 * L * rt.rank:3 * L * (rt.rank + 1)]
  batch = jax.make_array_from_process_local_data(NamedSharding(mesh, P("batch")), mine)
  assert batch.shape == rows.shape
  total = jax.jit(lambda b: b.sum(0), out_shardings=NamedSharding(mesh, P()))(batch)
  np.testing.assert_array_equal(np.asarray(total.addressable_data(0)), rows.sum(0))


def test_pitfall_the_last_batch(rt):
  # Ranks with different amounts of data must still run the same number of
  # steps; agree on it first (each rank has 5 + rank examples, batches of 2).
  mine = 5 + rt.rank
  steps = int(multihost_utils.process_allgather(np.int32(mine // 2)).min())
  mesh = Mesh(jax.devices(), ("batch",))
  step = jax.jit(lambda b: b.sum(), out_shardings=NamedSharding(mesh, P()))
  L = rt.local_device_count
  seen = 0.0
  for i in range(steps):  # every rank the same count: nobody waits for a missing rank
    part = np.full((2 * L,), float(i), np.float32)
    batch = jax.make_array_from_process_local_data(NamedSharding(mesh, P("batch")), part)
    seen += float(step(batch).addressable_data(0))
  assert steps == 5 // 2
  assert seen == sum(2 * L * rt.size * i for i in range(steps))


def test_pitfall_iteration_order(rt):
  # A set's order can differ between processes (string hashes are seeded per
  # process); sorted() is the same everywhere.
  names = {"kernel", "bias", "scale", "embedding"}
  order = np.frombuffer(" ".join(sorted(names)).encode(), np.uint8)
  multihost_utils.assert_equal(order, "iteration order differs between processes")


def test_device_put_of_host_values_onto_every_rank(rt):
  # The guide's layer example puts a float64 NumPy array onto a sharding over
  # every device; JAX first checks that every process passed the same value.
  mesh = Mesh(jax.devices(), ("x",))
  n = jax.device_count()
  x = np.random.default_rng(0).normal(size=(4 * n,))  # float64; stored as float32
  put = jax.device_put(x, NamedSharding(mesh, P("x")))
  for s in put.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), x[s.index].astype(np.float32))
  rep = jax.device_put(0.1, NamedSharding(mesh, P()))  # a Python float: float64 too
  assert float(rep.addressable_data(0)) == np.float32(0.1)
  if rt.size > 1:
    # Values that differ between processes still fail, on every rank.
    with pytest.raises(AssertionError, match="not the same on each process"):
      jax.device_put(x + rt.rank, NamedSharding(mesh, P("x")))


@pytest.mark.parametrize("pmap", ["jax.pmap", "mpijax.pmap"])
def test_the_pmap_guides_functions(rt, pmap):
  ns: dict = {}
  # Unchanged under both: inside mpijax.pmap jax.lax's collectives on its axis
  # are mpijax.lax's, over every device of every rank.
  for block in (guides.PMAP_PSUM, guides.PMAP_PMEAN, guides.PMAP_PMAX):
    guides.run(block, ns)
  mapped = jax.pmap if pmap == "jax.pmap" else mpijax.pmap
  n, L, r = jax.device_count(), rt.local_device_count, rt.rank
  # The guide's values on its 4 devices; the same formulas on other counts.
  values = jnp.arange(float(n))  # [0., 1., 2., 3.] -> one per device
  mine = values[r * L:(r + 1) * L]  # each rank passes its devices' entries
  out = mapped(ns["sum_across_devices"], axis_name="batch_axis")(mine)
  np.testing.assert_array_equal(np.asarray(out), np.full(L, n * (n - 1) / 2))  # 6 on 4
  out = mapped(ns["average_across_devices"], axis_name="batch_axis")(mine)
  np.testing.assert_allclose(np.asarray(out), np.full(L, (n - 1) / 2))  # 1.5 on 4
  values = jnp.array([2., 5., 1., 4.]) if n == 4 else (jnp.arange(float(n)) * 7) % n
  out = mapped(ns["get_max_value"], axis_name="data_split")(values[r * L:(r + 1) * L])
  np.testing.assert_array_equal(np.asarray(out), np.full(L, float(values.max())))  # 5 on 4

"""The runtime seen from inside a real MPI job (any rank count).

mpi4py.MPI is imported in the tests, not at module level: importing it starts
MPI, and the module is also imported (and its tests skipped) without MPI.
"""

from __future__ import annotations

import os

import jax
import numpy as np

import mpijax
from mpijax._src import mpi_util


def test_init_is_idempotent(rt):
  assert mpijax.init() is rt


def test_topology_matches_mpi(rt):
  from mpi4py import MPI

  world = MPI.COMM_WORLD
  t = rt.topology
  assert (t.rank, t.size) == (world.rank, world.size)
  assert mpijax.process_index() == world.rank
  assert mpijax.process_count() == world.size
  assert len(t.hostnames) == t.size
  assert 0 <= t.local_rank < t.local_size <= t.size
  assert 0 <= t.node_index < t.node_count
  # Consistent across ranks: everybody agrees on the hostnames and the coordinator.
  assert mpi_util.allgather_str(rt.comm, "|".join(t.hostnames)) == ["|".join(t.hostnames)] * t.size
  assert mpi_util.allgather_str(rt.comm, t.coordinator_address) == [t.coordinator_address] * t.size
  host, port = t.coordinator_address.rsplit(":", 1)
  assert host and 0 < int(port) < 65536
  # Local ranks on a node are 0..local_size-1, exactly once.
  same_node = [r for r, h in enumerate(t.hostnames) if h == t.hostname]
  assert len(same_node) == t.local_size
  assert sorted(mpi_util.allgather_int(rt.comm, t.local_rank)[r] for r in same_node) == list(
    range(t.local_size)
  )


def test_private_communicator(rt):
  from mpi4py import MPI

  assert rt.comm != MPI.COMM_WORLD
  assert MPI.Comm.Compare(rt.comm, MPI.COMM_WORLD) == MPI.CONGRUENT


def test_device_table(rt):
  L = mpijax.local_device_count()
  assert L == len(jax.local_devices()) == len(mpijax.local_devices())
  table = mpijax.devices()
  assert len(table) == L * mpijax.process_count()
  for g, d in enumerate(table):
    assert d.global_index == g == d.process_index * L + d.local_index
    assert d.platform == "cpu"
    assert d.host == rt.topology.hostnames[d.process_index]
  mine = [d for d in table if d.process_index == mpijax.process_index()]
  assert [d.local_index for d in mine] == list(range(L))


def test_mpi_thread_multiple(rt):
  from mpi4py import MPI

  assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_str_names_rank_and_coordinator(rt):
  text = str(rt)
  assert f"rank {rt.rank}/{rt.size}" in text
  assert rt.topology.coordinator_address in text


def test_jax_knows_the_job(rt):
  # JAX's distributed runtime is on by default in a multi-rank job; the suite
  # also runs with MPIJAX_JAX_DISTRIBUTED=0 (tests/test_multirank.py).
  L = mpijax.local_device_count()
  expected = rt.size > 1 and os.environ.get("MPIJAX_JAX_DISTRIBUTED", "1") != "0"
  assert rt.jax_distributed == expected
  if not rt.jax_distributed:
    assert jax.process_count() == 1 and rt.xla_collectives == ""
    return
  assert (jax.process_index(), jax.process_count()) == (rt.rank, rt.size)
  assert len(jax.devices()) == rt.size * L
  assert list(jax.local_devices()) == list(mpijax.local_devices())
  assert sorted(d.process_index for d in jax.devices()) == sorted(
    d.process_index for d in mpijax.devices()
  )
  # XLA's own cross-process collectives: over MPI (mpijax's bridge), with any
  # number of devices per rank.
  assert rt.xla_collectives == "mpi"


def test_partitioner_collectives_cross_ranks(rt):
  if not rt.jax_distributed:
    return
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from mpijax._src.xla import distributed as jax_runtime

  before = jax_runtime.bridge_stats().get("allreduce", 0)
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  a = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)
  x = jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("x", None)), lambda i: a[i])
  total = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))(x)
  for shard in total.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), a.sum(0))
  gathered = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))(x)
  np.testing.assert_array_equal(np.asarray(gathered.addressable_shards[0].data), a * 2)
  if rt.xla_collectives == "mpi":
    assert jax_runtime.bridge_stats()["allreduce"] > before


def test_xla_pools_are_as_inits_report_says(rt):
  """MPIJAX_XLA_SPIN: init() settled XLA's pools alike on every rank of a node,
  and left them as its report says (which jobs need it, and a jaxlib off the
  allow-list: tests/test_xla_pools_jobs.py)."""
  from mpijax._src import config
  from mpijax._src.xla import pools as xla_pools

  report = xla_pools.last
  assert report is not None, "init() did not settle XLA's pools"
  pools = xla_pools.pools()
  assert pools, "XLA's CPU client pools not found"
  t = rt.topology
  # One decision per node: every rank of it quieted its pools, or none did.
  decisions = mpi_util.allgather_str(rt.comm, f"{report.wanted} {report.changed > 0}")
  mine = {decisions[r] for r, h in enumerate(t.hostnames) if h == t.hostname}
  assert len(mine) == 1, (t.hostname, decisions)
  if config.get("xla_spin") == "on":
    assert (report.wanted, report.reason) == (False, "MPIJAX_XLA_SPIN=on")
  if report.changed:
    assert report.reason == "" and report.changed == report.pools >= 2, report
    # Pools made after init() (a compile pool, say) may spin; those init() found may not.
    assert sum(1 for _, allow, spin in pools if allow == 0 and spin == 0) >= report.changed
  else:
    assert report.reason, report  # the DEBUG line's why
    assert all(allow == 1 and spin == 5000 // n for n, allow, spin in pools), pools
